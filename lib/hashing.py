"""Content hashes: files, trees of files, and one digest over a {path: sha256} map.

Used by sync, compare, export, plan, provision, train, calibrate, model, make_tiny_model,
lib.launch, lib.checkpoint and lib.dataset."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def iter_files(root: os.PathLike | str, parts: Iterable[str]) -> list[str]:
    """Sorted relative paths of the regular files under root/part for each part
    (a part may be a file or a folder); caches and hidden files are skipped."""
    root = Path(root)
    out = []
    for part in parts:
        p = root / part
        if p.is_file():
            out.append(part)
        elif p.is_dir():
            for f in p.rglob("*"):
                r = f.relative_to(root)
                if any(s.startswith(".") or s == "__pycache__" for s in r.parts):
                    continue
                if f.is_file():
                    out.append(r.as_posix())
    return sorted(set(out))


def tree_hashes(root: os.PathLike | str, parts: Iterable[str]) -> dict[str, str]:
    """{relative path: sha256} for every file under the given parts."""
    root = Path(root)
    return {r: sha256_file(root / r) for r in iter_files(root, parts)}


def digest_of(hashes: dict[str, str]) -> str:
    """One sha256 over a {path: sha256} map, independent of dict order."""
    h = hashlib.sha256()
    for path in sorted(hashes):
        h.update(f"{hashes[path]}  {path}\n".encode())
    return h.hexdigest()

