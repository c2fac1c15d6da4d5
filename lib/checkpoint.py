"""Crash-safe training checkpoints (bin/train.py writes them, bin/smoke.py verifies them).

    checkpoints/step-0000300/  adapters.safetensors, adapter_config.json (an mlx-lm adapter
                               folder as it is), optimizer.safetensors, state.json (step, RNG,
                               hashes, val loss), manifest.json ({"files": {name: {sha256, bytes}}})
    checkpoints/latest         `step-0000300`, written last

Built in a hidden temporary folder, fsync'd file by file (F_FULLFSYNC on macOS), renamed into
place, then `latest` replaced: a kill leaves a complete folder or a swept temporary. Resume takes
the newest folder that verifies. No mlx here: the trainer passes callables that write the files.

    path = checkpoint.save(root, 300, {"adapters.safetensors": write_fn, ...}, state)
    chosen, skipped, notes = checkpoint.find_resume(root)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lib.atomic import dumps_json, fsync_path, write_text
from lib.hashing import sha256_file

FORMAT_VERSION = 1
MANIFEST, STATE, LATEST = "manifest.json", "state.json", "latest"
REQUIRED = ("adapters.safetensors", "optimizer.safetensors", STATE)
NAME_RE = re.compile(r"^step-(\d{7,})$")


def name_of(step: int) -> str:
    return f"step-{step:07d}"


def _remove(root: Path, path: Path, tag: str) -> None:
    """Rename a folder to a hidden name, then delete it: never a partial folder under a checkpoint name."""
    aside = root / f".{tag}-{path.name}.{os.getpid()}.{time.time_ns()}"
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def save(root: os.PathLike | str, step: int, writers: dict[str, Callable[[Path], None]], state: dict) -> Path:
    """Write checkpoint `step` under root: each writers[name](path) writes one file, state.json
    and the manifest are added, the folder renamed into place, `latest` updated. Returns the folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name_of(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        for name, write in writers.items():
            write(tmp / name)
        (tmp / STATE).write_text(dumps_json(dict(state, step=step, format_version=FORMAT_VERSION)), encoding="utf-8")
        names = sorted(p.name for p in tmp.iterdir())
        for n in names:
            fsync_path(tmp / n)
        files = {n: {"sha256": sha256_file(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names}
        write_text(tmp / MANIFEST, dumps_json({"files": files, "step": step, "format_version": FORMAT_VERSION}))
        if final.exists():  # a damaged or superseded folder of the same step
            _remove(root, final, "deleting")
        os.replace(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text(root / LATEST, final.name + "\n")
    return final


def verify(path: os.PathLike | str) -> tuple[bool, str]:
    """(True, "ok") when every required and listed file has its manifest sha256; else (False, why)."""
    path = Path(path)
    if not (m := NAME_RE.match(path.name)):
        return False, f"{path.name} is not a checkpoint folder name"
    if not (path / MANIFEST).is_file():
        return False, f"{MANIFEST} is missing"
    try:
        listed = {name: meta.get("sha256") for name, meta in json.loads((path / MANIFEST).read_text("utf-8"))["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"{MANIFEST} is unreadable or malformed ({type(e).__name__})"
    if bad := [n for n, d in listed.items() if not isinstance(d, str) or not re.fullmatch(r"[0-9a-f]{64}", d) or "/" in n]:
        return False, f"{MANIFEST} entry {bad[0]!r} is malformed"
    if missing := [n for n in REQUIRED if n not in listed]:
        return False, f"{missing[0]} is not in {MANIFEST}"
    for name, digest in listed.items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            return False, f"{name} is missing" if not (path / name).is_file() else f"sha256 mismatch in {name}"
    if not (state := _state(path)):
        return False, f"{STATE} does not parse"
    if state.get("format_version") != FORMAT_VERSION:
        return False, f"format_version {state.get('format_version')!r} is not {FORMAT_VERSION}"
    if state.get("step") != int(m.group(1)):
        return False, f"{STATE} says step {state.get('step')!r}, the folder says {int(m.group(1))}"
    return True, "ok"


def read_state(path: os.PathLike | str) -> dict:
    return json.loads((Path(path) / STATE).read_text(encoding="utf-8"))


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
    skipped, chosen = [], None
    for p in listing(root):
        ok, why = verify(p)
        if ok:
            chosen = p
            break
        skipped.append((p.name, why))
    pointer, notes = latest_pointer(root), []
    if chosen is not None and pointer != chosen.name:
        notes.append(f"`{LATEST}` is missing or unreadable; using {chosen.name}" if pointer is None
                     else f"`{LATEST}` says {pointer}; the newest verified checkpoint is {chosen.name}")
    return chosen, skipped, notes


def quarantine(root: os.PathLike | str, name: str) -> Path:
    """Move a checkpoint that failed verification out of the way (kept for forensics)."""
    dest = Path(root) / f"quarantine-{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.replace(Path(root) / name, dest)
    fsync_path(root)
    return dest


def sweep_temporaries(root: os.PathLike | str) -> list[str]:
    """Remove hidden temporaries left by a killed writer (only the single writer calls this)."""
    root, removed = Path(root), []
    for p in (root.iterdir() if root.is_dir() else []):
        if p.name.startswith((".step-", ".deleting-")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def _state(path: Path) -> dict:
    """A listed folder's state, {} when it does not read (verify says why)."""
    try:
        return read_state(path)
    except (OSError, ValueError):
        return {}


def best(root: os.PathLike | str) -> tuple[str, float] | None:
    """(name, val_loss) of the checkpoint with the lowest validation loss (the newest on a tie)."""
    scored = [(p.name, float(v)) for p in listing(root) if isinstance(v := _state(p).get("val_loss"), (int, float))]
    return min(scored, key=lambda x: x[1]) if scored else None


def prune(root: os.PathLike | str, keep_last_k: int) -> list[str]:
    """Delete checkpoints beyond the newest keep_last_k, keeping the best by validation loss,
    every final one and the `latest` target. Returns the names deleted."""
    if keep_last_k < 2:
        raise ValueError("keep_last_k must be at least 2")
    root, folders = Path(root), listing(root)
    keep = {p.name for p in folders[:keep_last_k]} | {latest_pointer(root), (best(root) or (None,))[0]}
    deleted = [p.name for p in folders if p.name not in keep and not _state(p).get("final")]
    for name in deleted:
        _remove(root, root / name, "deleting")
    if deleted:
        fsync_path(root)
    return deleted


# ---- the trainer's start: a fresh run or a resume ----------------------------------------------------
RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.superseded.jsonl", "adapters")


def archive_run(run_dir: os.PathLike | str) -> Path | None:
    """A fresh start moves an earlier run's checkpoints, metrics and adapter to superseded-<time>-<pid>/."""
    run_dir = Path(run_dir)
    if not (names := [n for n in RUN_FILES if (run_dir / n).exists()]):
        return None
    dest = run_dir / f"superseded-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    dest.mkdir()
    for n in names:
        os.replace(run_dir / n, dest / n)
    return dest


def pick(root: Path, cfg: dict, files_sha: str, n_batches: int, say: Callable[..., None]) -> tuple[Path, dict]:
    """The newest verified checkpoint (damaged newer ones quarantined) and its state; refused when
    the config's maths or the dataset changed since. say(name, **fields) reports each decision."""
    from lib.config import diff_keys
    from lib.log import DATA, RunbookError, failure

    chosen, skipped, notes = find_resume(root)
    for name, why in skipped:
        say("checkpoint-skip", name=name, reason=json.dumps(why))
        quarantine(root, name)
    for note in notes:
        say("warning", message=json.dumps(note))
    if chosen is None:
        raise RunbookError(f"--resume but no verified checkpoint under {root}" + "".join(
            f"; skipped {n}: {w}" for n, w in skipped) + "; start fresh without --resume (RESUME unset)", "resume")
    st = read_state(chosen)
    if changed := diff_keys(st["config"], cfg):
        was = ", ".join(f"{k}: {st['config'].get(k)!r} -> {cfg.get(k)!r}" for k in changed)
        raise RunbookError(f"the config changed since {chosen.name} ({was}); restore it or start a new RUN", "resume")
    if st["files_sha256"] != files_sha or st["data"]["n_batches"] != n_batches:
        raise failure(DATA, f"the dataset bytes changed since {chosen.name} (files sha256 {st['files_sha256'][:12]} "
                            f"-> {files_sha[:12]}); restore the dataset or start a new RUN")
    say("resume", checkpoint=chosen, step=st["step"], fell_back=len(skipped) > 0)
    return chosen, st


def supersede_metrics(run_dir: os.PathLike | str, step: int) -> int:
    """A resume at `step` moves later metrics events (and `done`) to metrics.superseded.jsonl."""
    from lib import atomic, jsonl

    path, keep, moved = Path(run_dir) / "metrics.jsonl", [], []
    for e in jsonl.read(path) if path.is_file() else []:
        (moved if e.get("kind") == "done" or isinstance(e.get("step"), int) and e["step"] > step else keep).append(e)
    if moved:
        with open(Path(run_dir) / "metrics.superseded.jsonl", "a", encoding="utf-8") as f:
            jsonl.write(f, moved)
        with atomic.atomic_open(path, "w", encoding="utf-8") as f:
            jsonl.write(f, keep)
    return len(moved)


def read_fitting(load: Callable[[str], dict], path: Path | None, own: dict, name: str) -> dict | None:
    """Rank 0: a checkpoint's tensors (load = mx.load), refused unless names, shapes and dtypes fit `own`."""
    from lib.log import RunbookError

    if path is None:
        return None
    have = load(str(path / f"{name}.safetensors"))
    if bad := sorted(set(have) ^ set(own)) or [k for k in own if (have[k].shape, have[k].dtype) != (own[k].shape, own[k].dtype)]:
        raise RunbookError(f"{path.name}/{name}.safetensors does not fit this model ({bad[:3]} ...)", "resume")
    return have


def shards_for(st: dict, size: int, allow_change: bool, grad_average: str) -> tuple[int, dict | None]:
    """(shares each global batch is cut into: the world size that began the run, the world change or
    None). Another world size needs --allow-world-change and grad_average: tokens: each new rank then
    accumulates the old ranks' shares, so the maths is the uninterrupted run's."""
    from lib.log import RunbookError

    shards = st.get("shards", st.get("world_size", size))
    if shards == size:
        return shards, None
    if not allow_change or grad_average != "tokens" or shards % size:
        raise RunbookError(f"the checkpoint's run began on {shards} ranks, this launch has {size}: resume with the "
                           "same hostfile, or pass --allow-world-change (needs grad_average: tokens and a world size "
                           f"dividing {shards}), or start a new RUN", "resume")
    return shards, {"shards": shards, "world_size_from": st["world_size"], "world_size": size, "micro_batches": shards // size}
