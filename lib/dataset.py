"""The one reader of an exported dataset's manifest.json (written by bin/export.py).

    from lib.dataset import binding, describe, read_manifest
    m = read_manifest("datasets/domain_sft_v1_high_signal_thunder")
    m["dataset_sha256"], m["counts"]["train"], m["files"]["train.jsonl"]["sha256"]
    binding(m)   # {"files": [[path, sha256], ...], "settings": {...}}: what the dataset is bound to
    describe(m)  # "datasets/sample/corpus.jsonl (corpus_sha256 0b6f...) -> train 1883 / valid 105 / test 98 records"

A missing, unreadable or malformed manifest raises RunbookError naming the file and the fix
(export the dataset again with `make export`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lib.hashing import digest_of
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



def binding(m: dict) -> dict:
    """What a dataset is bound to (bin/export.py changes it only on --replace): each corpus file
    (path, sha256) and the export settings that change its bytes (all but max_reject_ratio)."""
    return {"files": [[x.get("path"), x.get("sha256")] for x in m.get("sources") or []],
            "settings": {k: v for k, v in (m.get("settings") or {}).items() if k != "max_reject_ratio"}}


def describe(m: dict) -> str:
    """What a dataset (or an export request) holds, in one line: corpus files, corpus_sha256, records."""
    files, c = binding(m)["files"], m.get("counts")
    names = ", ".join(str(p) for p, _ in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    counts = f" -> train {c.get('train')} / valid {c.get('valid')} / test {c.get('test')} records" if c else ""
    return f"{names} (corpus_sha256 {digest_of(dict(files))[:12]}){counts}"
