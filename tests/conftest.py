"""Shared pytest fixtures. Tests run through the same entry points an operator uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PY = sys.executable


def run(cmd, check=True, **kw):
    """Run a command (argument list) from the repo root, capturing text output."""
    kw.setdefault("cwd", ROOT)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    p = subprocess.run(cmd, **kw)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
        )
    return p


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def make(*args, check=True, **kw):
    """`make <args>` from the repo root with the venv's python first on PATH."""
    env = dict(os.environ, **kw.pop("env", {}))
    return run(["make", "--no-print-directory", *args], check=check, env=env, **kw)
