"""The one reader of an exported dataset's manifest.json (written by bin/export.py).

    from lib.dataset import read_manifest
    m = read_manifest("datasets/domain_sft_v1_high_signal_thunder")
    m["dataset_sha256"], m["counts"]["train"], m["files"]["train.jsonl"]["sha256"]

A missing, unreadable or malformed manifest raises RunbookError naming the file and the fix
(export the dataset again with `make export`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lib.log import DATA, failure

SHA256 = re.compile(r"[0-9a-f]{64}")


def read_manifest(dataset_dir: os.PathLike | str) -> dict:
    """The manifest of the dataset in `dataset_dir`; its `files` table maps plain file names
    to {sha256, bytes, records}."""
    d = Path(dataset_dir)
    path = d / "manifest.json"
    fix = f"export it again: make export CORPUS=<files> DATASET={d.name} (REPLACE=1 replaces a dataset)"
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise failure(DATA, f"{path} is missing (not an exported dataset): {fix}") from None
    except (OSError, ValueError) as e:
        raise failure(DATA, f"{path} is unreadable ({e}): {fix}") from None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and "/" not in k and k not in ("", ".", "..", "manifest.json")
            and SHA256.fullmatch(str(v.get("sha256", ""))) for k, v in files.items()):
        raise failure(DATA, f"{path} has no valid 'files' table (plain names with a sha256): {fix}")
    return m

