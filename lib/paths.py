"""Repo paths, run folders and safe names. Example: `paths.run_dir("stage1-2026-11-21")` is
runs/stage1-2026-11-21/, created with its logs/ folder; `paths.rel(paths.RUNS / "x")` is "runs/x"."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from lib.log import RunbookError

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs"
DATASETS = ROOT / "datasets"
# a run id or dataset name: a folder on every host
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def read_json(path: Path) -> dict:
    """A JSON object file, or {} when it is missing, unreadable or not an object."""
    with contextlib.suppress(OSError, ValueError):
        if isinstance(data := json.loads(path.read_text(encoding="utf-8")), dict):
            return data
    return {}


def calibrations():
    """(path, document) of each runs/calibration-*.json, newest first; an unreadable one reads as {}."""
    for path in sorted(RUNS.glob("calibration-*.json"), reverse=True):
        yield path, read_json(path)


def is_safe_name(name: str) -> bool:
    return bool(NAME_RE.match(name)) and ".." not in name


def check_run_id(run: str) -> str:
    if not is_safe_name(run):
        raise ValueError(f"run id {run!r} is not a safe folder name: use letters, digits, '.', '_', '-' "
                         "(e.g. RUN=stage1-2026-11-21); see RUNBOOK.md#run-folders")
    return run


def run_dir(run: str) -> Path:  # runs/<RUN>/, created with its logs/ folder
    path = RUNS / check_run_id(run)
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path


def rel(path: os.PathLike | str) -> str:
    """A path relative to the repo root when it is inside it (for reports), else absolute."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)


def missing_shards(model: Path) -> list[str]:
    """The weight files model.safetensors.index.json names that are not in the folder ([]: complete)."""
    index = model / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return ["model.safetensors.index.json (unreadable: no weight_map)"]
    return sorted(n for n in names if not (model / n).is_file())


def require_complete(model: Path, name: str, anchor: str) -> None:
    """Refuse a sharded model folder with a shard missing (sync and check-parity, before any host)."""
    if gone := missing_shards(model):
        raise RunbookError(f"MODEL {name} is incomplete here: model.safetensors.index.json names "
                           f"{', '.join(gone)}, not in the folder; fetch it again (make model ... REPLACE=1)",
                           anchor)
