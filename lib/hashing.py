"""Content hashes: files, trees of files, and one digest over a {path: sha256} map (most scripts).
Example: `digest_of(tree_hashes(paths.ROOT, ["bin", "lib"]))` -> one sha256 of the code."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def sha256_file(path: os.PathLike | str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def iter_files(root: os.PathLike | str, parts: Iterable[str]) -> list[str]:
    """Sorted relative paths of the regular files under root/part for each part (a file or a folder);
    hidden files and __pycache__ are skipped (lib/parity_probe.py has the same rule)."""
    root, out = Path(root), set()
    for part in parts:
        if (root / part).is_file():
            out.add(part)
        for f in (root / part).rglob("*") if (root / part).is_dir() else []:
            r = f.relative_to(root)
            if f.is_file() and not any(s.startswith(".") or s == "__pycache__" for s in r.parts):
                out.add(r.as_posix())
    return sorted(out)


def tree_hashes(root: os.PathLike | str, parts: Iterable[str]) -> dict[str, str]:
    """{relative path: sha256} for every file under the given parts."""
    return {r: sha256_file(Path(root) / r) for r in iter_files(root, parts)}


def digest_of(hashes: dict[str, str]) -> str:
    """One sha256 over a {path: sha256} map, independent of dict order."""
    h = hashlib.sha256()
    for path in sorted(hashes):
        h.update(f"{hashes[path]}  {path}\n".encode())
    return h.hexdigest()
