"""Crash-safe training checkpoints (bin/train.py writes and resumes them, bin/smoke.py verifies them).

checkpoints/step-0000300/ (an mlx-lm adapter folder, plus optimizer.safetensors, state.json and a sha256
manifest.json) is built hidden and swapped in whole, then checkpoints/latest names it: a kill leaves a
complete folder or a swept temporary; resume takes the newest that verifies. No mlx here.

    path = checkpoint.save(root, 300, {"adapters.safetensors": write_fn, ...}, state)
    chosen, skipped, notes = checkpoint.find_resume(root)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from lib import atomic, jsonl, paths
from lib.config import diff_keys
from lib.hashing import sha256_file
from lib.log import DATA, RunbookError, failure

FORMAT = 1  # format_version in state.json and manifest.json
MANIFEST, STATE, LATEST = "manifest.json", "state.json", "latest"
REQUIRED = ("adapters.safetensors", "optimizer.safetensors", STATE)
NAME_RE = re.compile(r"^step-(\d{7,})$")


def name_of(step: int) -> str:
    return f"step-{step:07d}"


def save(root: os.PathLike | str, step: int, writers: dict[str, Callable[[Path], None]], state: dict) -> Path:
    """Checkpoint `step`: writers[name](path) writes each file, then state.json, the manifest, `latest`."""
    final, meta = Path(root) / name_of(step), {"step": step, "format_version": FORMAT}
    with atomic.atomic_dir(final) as tmp:
        for name, write in writers.items():
            write(tmp / name)
        (tmp / STATE).write_text(atomic.dumps_json({**state, **meta}), encoding="utf-8")
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(atomic.dumps_json({"files": files, **meta}), encoding="utf-8")
    atomic.write_text(Path(root) / LATEST, final.name + "\n")
    return final


def verify(path: os.PathLike | str) -> tuple[bool, str]:
    """(True, "ok") when every required and listed file has its manifest sha256; else (False, why)."""
    path = Path(path)
    if not (m := NAME_RE.match(path.name)):
        return False, f"{path.name} is not a checkpoint folder name"
    if not (path / MANIFEST).is_file():
        return False, f"{MANIFEST} is missing"
    try:
        listed = {n: d["sha256"] for n, d in json.loads((path / MANIFEST).read_text())["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"{MANIFEST} is unreadable or malformed ({type(e).__name__})"
    if missing := [n for n in REQUIRED if n not in listed]:
        return False, f"{missing[0]} is not in {MANIFEST}"
    for name, digest in listed.items():
        if "/" in name or not (path / name).is_file() or sha256_file(path / name) != digest:
            return False, f"sha256 mismatch in {name}" if (path / name).is_file() else f"{name} is missing"
    if (got := read_state(path)).get("step") != int(m.group(1)) or got.get("format_version") != FORMAT:
        return False, f"{STATE} says step {got.get('step')!r} (format {got.get('format_version')!r})"
    return True, "ok"


def read_state(path: os.PathLike | str) -> dict:
    """A checkpoint's state.json, {} when it does not read (verify says why)."""
    return paths.read_json(Path(path) / STATE)


def listing(root: os.PathLike | str) -> list[Path]:
    """Checkpoint folders under root, newest step first (hidden temporaries excluded)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
             if p.is_dir() and (m := NAME_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_pointer(root: os.PathLike | str) -> str | None:
    path = Path(root) / LATEST
    text = path.read_text(encoding="utf-8", errors="replace").strip() if path.is_file() else ""
    return text if NAME_RE.match(text) else None


def find_resume(root: os.PathLike | str) -> tuple[Path | None, list[tuple[str, str]], list[str]]:
    """The newest verified checkpoint, (name, reason) of each newer one skipped, notes on `latest`."""
    skipped = []
    for p in listing(root):
        if (why := verify(p)[1]) == "ok":
            break
        skipped.append((p.name, why))
    else:
        return None, skipped, []
    if (pointer := latest_pointer(root)) == p.name:
        return p, skipped, []
    return p, skipped, [f"`{LATEST}` is missing or unreadable; using {p.name}" if pointer is None
                        else f"`{LATEST}` says {pointer}; the newest verified checkpoint is {p.name}"]


def sweep_temporaries(root: os.PathLike | str) -> list[str]:
    """Remove hidden temporaries left by a killed writer (only the single writer calls this)."""
    found = [p for p in (Path(root).iterdir() if Path(root).is_dir() else [])
             if p.name.startswith((".step-", ".deleting-"))]  # folders: atomic_dir's and prune's
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in found]


def best(root: os.PathLike | str) -> tuple[str, float] | None:
    """(name, val_loss) of the checkpoint with the lowest validation loss (the newest on a tie)."""
    scored = [(p.name, float(v)) for p in listing(root)
              if isinstance(v := read_state(p).get("val_loss"), (int, float))]
    return min(scored, key=lambda x: x[1]) if scored else None


def prune(root: os.PathLike | str, keep_last_k: int) -> list[str]:
    """Delete (hidden first) checkpoints past the newest keep_last_k but the best, finals and `latest`."""
    if keep_last_k < 2:
        raise ValueError("keep_last_k must be at least 2")
    root, folders = Path(root), listing(root)
    keep = {p.name for p in folders[:keep_last_k]} | {latest_pointer(root), (best(root) or (None,))[0]}
    deleted = [p.name for p in folders if p.name not in keep and not read_state(p).get("final")]
    for name in deleted:
        aside = root / f".deleting-{name}.{os.getpid()}.{time.time_ns()}"
        os.replace(root / name, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if deleted:  # save() has already made the new checkpoint's name durable
        atomic.fsync_path(root)
    return deleted


# ---- the trainer's start: a fresh run or a resume ----------------------------------------------------
def archive_run(run_dir: os.PathLike | str) -> Path | None:
    """A fresh start moves an earlier run's checkpoints, metrics, adapter to superseded-<time>-<pid>/."""
    run_dir, names = Path(run_dir), ("checkpoints", "metrics.jsonl", "metrics.superseded.jsonl", "adapters")
    if not (names := [n for n in names if (run_dir / n).exists()]):
        return None
    dest = run_dir / f"superseded-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    dest.mkdir()
    for n in names:
        os.replace(run_dir / n, dest / n)
    return dest


def pick(root: Path, cfg: dict, files_sha: str, n_batches: int, say: Callable) -> tuple[Path, dict]:
    """The newest verified checkpoint and its state (newer damaged ones moved to quarantine-NAME-*), refused
    if the config's maths or the dataset changed since; say(name, **fields) reports each decision."""
    chosen, skipped, notes = find_resume(root)
    for name, why in skipped:
        say("checkpoint-skip", name=name, reason=json.dumps(why))
        os.replace(root / name, root / f"quarantine-{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    for note in notes:
        say("warning", message=json.dumps(note))
    if chosen is None:
        why = "".join(f"; skipped {n}: {w}" for n, w in skipped)
        raise RunbookError(f"--resume but no verified checkpoint under {root}{why}; start fresh without "
                           "--resume (RESUME unset)", "resume")
    st = read_state(chosen)
    if changed := diff_keys(st["config"], cfg):
        was = ", ".join(f"{k}: {st['config'].get(k)!r} -> {cfg.get(k)!r}" for k in changed)
        raise RunbookError(f"the config changed since {chosen.name} ({was}); restore it or start a new RUN",
                           "resume")
    if st["files_sha256"] != files_sha or st["data"]["n_batches"] != n_batches:
        was = f"files sha256 {st['files_sha256'][:12]} -> {files_sha[:12]}"
        raise failure(DATA, f"the dataset bytes changed since {chosen.name} ({was}); restore the dataset or "
                            "start a new RUN")
    if isinstance((w := st.get("window") or {}).get("loss"), list):  # written before 2026-11-24: one per rank
        w["loss"], w["tokens"] = sum(w["loss"]) / len(w["loss"]), sum(w["tokens"])
    say("resume", checkpoint=chosen, step=st["step"], fell_back=len(skipped) > 0)
    return chosen, st


def supersede_metrics(run_dir: os.PathLike | str, step: int) -> int:
    """A resume at `step` moves later metrics events (and `done`) to metrics.superseded.jsonl."""
    path, keep, moved = Path(run_dir) / "metrics.jsonl", [], []
    for e in jsonl.read(path) if path.is_file() else []:
        (moved if e.get("kind") == "done" or (e.get("step") or 0) > step else keep).append(e)
    if moved:
        with open(Path(run_dir) / "metrics.superseded.jsonl", "a", encoding="utf-8") as f:
            jsonl.write(f, moved)
        with atomic.atomic_open(path, "w", encoding="utf-8") as f:
            jsonl.write(f, keep)
    return len(moved)


def read_fitting(load: Callable[[str], dict], path: Path | None, own: dict, name: str) -> dict | None:
    """Rank 0: a checkpoint's tensors (load = mx.load), refused unless names, shapes, dtypes fit `own`."""
    if path is None:
        return None
    have, kind = load(str(path / f"{name}.safetensors")), lambda x: (x.shape, x.dtype)
    if bad := sorted(set(have) ^ set(own)) or [k for k in own if kind(have[k]) != kind(own[k])]:
        raise RunbookError(f"{path.name}/{name}.safetensors does not fit this model ({bad[:3]})", "resume")
    return have


def shards_for(st: dict, size: int, allow_change: bool, grad_average: str) -> tuple[int, dict | None]:
    """(shares of each global batch: the run's first world size; the world change or None). Another world
    size needs --allow-world-change and grad_average: tokens (each rank accumulates the old ranks' shares)."""
    shards = st.get("shards", st.get("world_size", size))
    if shards == size:
        return shards, None
    if not allow_change or grad_average != "tokens" or shards % size:
        raise RunbookError(f"the checkpoint's run began on {shards} ranks, this launch has {size}: resume "
                           "with the same hostfile, or pass --allow-world-change (needs grad_average: tokens "
                           f"and a world size dividing {shards}), or start a new RUN", "resume")
    return shards, {"shards": shards, "world_size_from": st["world_size"], "world_size": size,
                    "micro_batches": shards // size}
