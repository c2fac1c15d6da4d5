"""Small builders the tests share with the benchmarks. bench/ never imports tests/, so the one
copy lives in bench/fabric_cli.py (which imports nothing but lib/ at import time) and is
re-exported here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from fabric_cli import SPLITS, copy_code, write_manifest  # noqa: E402

__all__ = ["SPLITS", "copy_code", "write_manifest"]
