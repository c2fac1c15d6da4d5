"""Small builders shared by the tests and the benchmarks (bench/ puts tests/ on sys.path):
no pytest here, so a benchmark can import it."""

from __future__ import annotations

import shutil
from pathlib import Path

from lib import atomic, parity
from lib.hashing import digest_of, sha256_file

SPLITS = ("train.jsonl", "valid.jsonl", "test.jsonl")


def write_manifest(d: Path) -> None:
    """An exporter-shaped manifest.json for the splits and rejects.jsonl already in folder d
    (files: name -> sha256, bytes; dataset_sha256 over the splits)."""
    files = {n: {"sha256": sha256_file(d / n), "bytes": (d / n).stat().st_size} for n in (*SPLITS, "rejects.jsonl")}
    atomic.write_json(d / "manifest.json", {"files": files,
                                            "dataset_sha256": digest_of({n: files[n]["sha256"] for n in SPLITS})})


def copy_code(dest: Path, root: Path) -> None:
    """The code parts check-parity compares (lib.parity.CODE_PARTS) from root into dest."""
    for part in parity.CODE_PARTS:
        src = root / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", ".*"))
        else:
            shutil.copy2(src, dest / part)
