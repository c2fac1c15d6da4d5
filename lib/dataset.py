"""The one reader of an exported dataset's manifest.json (bin/export.py writes it; export, sync,
check_parity and compare read it); a missing or malformed one raises RunbookError naming the fix.
    m = read_manifest("datasets/sample")  # m["dataset_sha256"], m["files"]["train.jsonl"]["sha256"]
    binding(m)   # {"files": [[path, sha256], ...], "settings": {...}}: what the dataset is bound to
    split_by(m)  # "source": a document in one split; "record": test may share documents with train
    describe(m)
    # "datasets/sample/corpus.jsonl (corpus_sha256 0b6f...) -> train 1883 / valid 105 / test 98 records"
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lib.hashing import digest_of
from lib.log import DATA, failure


def read_manifest(dataset_dir: Path | str) -> dict:
    """The manifest of the dataset in `dataset_dir`: `files` maps plain names to {sha256, bytes, records}."""
    path = Path(dataset_dir) / "manifest.json"
    fix = (f"export it again: make export CORPUS=<files> DATASET={path.parent.name} "
           "(REPLACE=1 replaces a dataset)")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise failure(DATA, f"{path} is missing (not an exported dataset): {fix}") from None
    except (OSError, ValueError) as e:
        raise failure(DATA, f"{path} is unreadable ({e}): {fix}") from None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and "/" not in k and k not in ("", ".", "..", "manifest.json")
            and re.fullmatch(r"[0-9a-f]{64}", str(v.get("sha256", ""))) for k, v in files.items()):
        raise failure(DATA, f"{path} has no valid 'files' table (plain names with a sha256): {fix}")
    return m


def binding(m: dict) -> dict:
    """What a dataset is bound to (changed only by export --replace): its corpus files and byte-changing
    settings. A manifest without split_by (exporter 2.0) was split by record."""
    settings = {k: v for k, v in (m.get("settings") or {}).items() if k != "max_reject_ratio"}
    if settings and "split_by" not in settings:
        settings["split_by"] = "record"
    return {"files": [[x.get("path"), x.get("sha256")] for x in m.get("sources") or []],
            "settings": settings}


def split_by(m: dict) -> str | None:
    """How the dataset's splits were drawn: a record field's name (its groups kept whole),
    "record" (by record_id: test may share documents with train), or None when not recorded."""
    split = m.get("split") or {}
    if "split_by" in split:
        return split["split_by"]
    if split.get("key") == "record_id":
        return "record"
    return None


def describe(m: dict) -> str:
    """What a dataset (or an export request) holds, in one line: corpus files, corpus_sha256, records."""
    files, c = binding(m)["files"], m.get("counts")
    names = ", ".join(str(p) for p, _ in files[:3]) + (f" and {len(files) - 3} more"
                                                       if len(files) > 3 else "")
    counts = (f" -> train {c.get('train')} / valid {c.get('valid')} / test {c.get('test')} records"
              if c else "")
    return f"{names} (corpus_sha256 {digest_of(dict(files))[:12]}){counts}"
