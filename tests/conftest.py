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


def kill_sync_mid_transfer(argv: list[str], staging: Path, env: dict | None = None, wait_s: float = 20) -> None:
    """Start a (bandwidth-limited) `bin/sync.py` argv, wait until its transfer has created the
    staging folder, let it run half a second more, then SIGKILL its whole process group."""
    import signal
    import time

    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    deadline = time.time() + wait_s
    while time.time() < deadline and not staging.exists():
        time.sleep(0.05)
    assert staging.exists(), "the transfer never started"
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def make(*args, check=True, **kw):
    """`make <args>` from the repo root with the venv's python first on PATH."""
    env = dict(os.environ, **kw.pop("env", {}))
    return run(["make", "--no-print-directory", *args], check=check, env=env, **kw)


# ---- the multi-host test fabric (tests/fabric.py; issue #3) --------------------------------
def require_fabric():
    """tests/fabric.py as a module, or skip (fail under REQUIRE_FABRIC=1) saying why a fabric
    cannot exist on this machine."""
    import fabric as fabric_mod

    why = fabric_mod.unavailable()
    if why:
        if os.environ.get("REQUIRE_FABRIC") == "1":
            pytest.fail(f"REQUIRE_FABRIC=1 but the multi-host fabric cannot exist here: {why}")
        pytest.skip(f"multi-host fabric unavailable: {why}")
    return fabric_mod


@pytest.fixture(scope="session")
def fabric():
    """A 3-host fabric (fab1..fab3) of this pytest session, up once and down at the session's end.

    It is this session's own instance (runs/fabric-test-<pid>, its own link names and a free
    10.213.X.0/24), so it neither disturbs nor is disturbed by a fabric brought up by hand.
    Where a fabric cannot exist (not root, no ip/unshare/sshd) the tests skip saying why;
    with REQUIRE_FABRIC=1 (CI) that is a failure. Use `fabric.hostfile(2)` for a 2-host subset.
    """
    fabric_mod = require_fabric()
    pid = os.getpid()
    env = {"FABRIC_DIR": str(ROOT / "runs" / f"fabric-test-{pid}"), "FABRIC_PREFIX": f"ts{pid}",
           "FABRIC_SUBNET": "auto", "FABRIC_OWNER_PID": str(pid)}
    run([PY, "tests/fabric.py", "sweep"])  # fabrics left by crashed sessions
    make("fabric-up", "HOSTS=3", env=env)
    fab = fabric_mod.Fabric(env["FABRIC_DIR"])
    yield fab
    make("fabric-down", env=env)


@pytest.fixture
def fabric_faults(fabric):
    """The session fabric, with every fault a test injected undone afterwards (pass or fail)."""
    yield fabric
    fabric.restore_all()
