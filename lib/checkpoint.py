"""Crash-safe training checkpoints: write, verify, pick for resume, prune.

Layout, under RUN_DIR/checkpoints/:

    step-0000300/
        adapters.safetensors    trainable weights (safetensors, flattened names)
        optimizer.safetensors   optimizer state, flattened tree (+ pending grads)
        state.json              step, RNG state, data position, hashes, val loss
        manifest.json           {"files": {name: {"sha256", "bytes"}}, "step", "format_version"}
    latest                      `step-0000300`, written last

A checkpoint is built in a hidden temporary folder, every file and the folder
fsync'd (F_FULLFSYNC on macOS), then renamed into place and the parent fsync'd;
only then is `latest` replaced (atomically). A kill at any moment leaves either
a complete, verifiable folder or a hidden temporary one that is ignored and
swept. Resume takes the newest folder whose manifest verifies and says why it
skipped any newer one. Nothing here imports mlx: the files are written by
callables the trainer passes in.
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

from lib.atomic import dumps_json, fsync_dir, fsync_fd, write_text
from lib.hashing import sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
REQUIRED = ("adapters.safetensors", "optimizer.safetensors", STATE)
LATEST = "latest"
NAME_RE = re.compile(r"^step-(\d{7,})$")


def name_of(step: int) -> str:
    return f"step-{step:07d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def save(
    root: os.PathLike | str,
    step: int,
    writers: dict[str, Callable[[Path], None]],
    state: dict,
) -> Path:
    """Write checkpoint `step` under root: each writers[name](path) writes one file,
    state.json and the manifest are added, then the folder is renamed into place
    and `latest` updated. Returns the final folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name_of(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        for name, write in writers.items():
            write(tmp / name)
        state = dict(state, step=step, format_version=FORMAT_VERSION)
        (tmp / STATE).write_text(dumps_json(state), encoding="utf-8")
        names = sorted(p.name for p in tmp.iterdir())
        for n in names:
            _fsync_file(tmp / n)
        files = {n: {"sha256": sha256_file(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names}
        manifest = {"files": files, "step": step, "format_version": FORMAT_VERSION}
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(dumps_json(manifest))
            f.flush()
            fsync_fd(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # a damaged or superseded folder of the same step
            aside = root / f".{final.name}.replaced.{os.getpid()}.{time.time_ns()}"
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text(root / LATEST, final.name + "\n")
    return final


def verify(path: os.PathLike | str) -> tuple[bool, str]:
    """(True, "ok") when the folder's manifest lists every required file and every
    listed file has its sha256; else (False, the reason)."""
    path = Path(path)
    m = NAME_RE.match(path.name)
    if not m:
        return False, f"{path.name} is not a checkpoint folder name"
    man = path / MANIFEST
    if not man.is_file():
        return False, f"{MANIFEST} is missing"
    listed: dict[str, str] = {}
    try:
        files = json.loads(man.read_text(encoding="utf-8"))["files"]
        for name, meta in files.items():
            digest = meta.get("sha256") if isinstance(meta, dict) else None
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest) or "/" in name:
                return False, f"{MANIFEST} entry {name!r} is malformed"
            listed[name] = digest
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"{MANIFEST} is unreadable or malformed ({type(e).__name__})"
    for name in REQUIRED:
        if name not in listed:
            return False, f"{name} is not in {MANIFEST}"
    for name, digest in listed.items():
        f = path / name
        if not f.is_file():
            return False, f"{name} is missing"
        if sha256_file(f) != digest:
            return False, f"sha256 mismatch in {name}"
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return False, f"{STATE} does not parse ({e})"
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
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := NAME_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_pointer(root: os.PathLike | str) -> str | None:
    try:
        text = (Path(root) / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if NAME_RE.match(text) else None


def find_resume(root: os.PathLike | str) -> tuple[Path | None, list[tuple[str, str]], list[str]]:
    """The newest verified checkpoint, the (name, reason) of each newer one skipped,
    and notes (e.g. the `latest` pointer disagreeing with what was found)."""
    root = Path(root)
    skipped: list[tuple[str, str]] = []
    notes: list[str] = []
    chosen = None
    for p in listing(root):
        ok, why = verify(p)
        if ok:
            chosen = p
            break
        skipped.append((p.name, why))
    pointer = latest_pointer(root)
    if chosen is not None and pointer != chosen.name:
        if pointer is None:
            notes.append(f"`{LATEST}` is missing or unreadable; using {chosen.name}")
        else:
            notes.append(f"`{LATEST}` says {pointer}; the newest verified checkpoint is {chosen.name}")
    return chosen, skipped, notes


def quarantine(root: os.PathLike | str, name: str) -> Path:
    """Move a checkpoint that failed verification out of the way (kept for forensics)."""
    root = Path(root)
    dest = root / f"quarantine-{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.replace(root / name, dest)
    fsync_dir(root)
    return dest


def sweep_temporaries(root: os.PathLike | str) -> list[str]:
    """Remove hidden temporaries left by a killed writer (only the single writer calls this)."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") or p.name.startswith(".deleting-"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p.name)
    return removed


def prune(root: os.PathLike | str, keep_last_k: int) -> list[str]:
    """Delete checkpoints beyond the newest keep_last_k, keeping the best by
    validation loss, every final one and the `latest` target. Returns the names
    deleted. A folder is renamed to a hidden name before it is removed, so a kill
    mid-delete never leaves a partial folder under a checkpoint name."""
    root = Path(root)
    if keep_last_k < 2:
        raise ValueError("keep_last_k must be at least 2")
    folders = listing(root)
    keep = {p.name for p in folders[:keep_last_k]}
    pointer = latest_pointer(root)
    if pointer:
        keep.add(pointer)
    best, best_loss = None, None
    for p in folders:
        try:
            st = read_state(p)
        except (OSError, ValueError):
            continue
        if st.get("final"):
            keep.add(p.name)
        loss = st.get("val_loss")
        if isinstance(loss, (int, float)) and (best_loss is None or loss < best_loss):
            best, best_loss = p.name, loss
    if best:
        keep.add(best)
    deleted = []
    for p in folders:
        if p.name in keep:
            continue
        aside = root / f".deleting-{p.name}.{os.getpid()}"
        os.replace(p, aside)
        shutil.rmtree(aside, ignore_errors=True)
        deleted.append(p.name)
    if deleted:
        fsync_dir(root)
    return deleted


def best(root: os.PathLike | str) -> tuple[str, float] | None:
    """(name, val_loss) of the verified-looking checkpoint with the lowest val loss."""
    out = None
    for p in listing(root):
        try:
            loss = read_state(p).get("val_loss")
        except (OSError, ValueError):
            continue
        if isinstance(loss, (int, float)) and (out is None or loss < out[1]):
            out = (p.name, float(loss))
    return out
