"""Pinned fabric hosts (issue #19 section 2): `tests/fabric.py up --pin` runs each host's sshd, and
so everything started over ssh (mlx.launch's ranks), on its own core; without it nothing is pinned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, require_fabric

PY = sys.executable


def allowed_cpus(d: Path, host: str) -> str:
    env = dict(os.environ, PATH=f"{d / 'bin'}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["ssh", host, "grep", "Cpus_allowed_list", "/proc/self/status"], env=env,
                         capture_output=True, text=True, timeout=30, check=True, stdin=subprocess.DEVNULL).stdout
    return out.split()[-1]


def test_pin_gives_each_host_its_own_core_and_default_pins_nothing():
    require_fabric()
    ncpu = os.cpu_count() or 1
    for pin in (True, False):
        d = ROOT / "runs" / f"fabric-test-pin{int(pin)}-{os.getpid()}"
        fab = [PY, "tests/fabric.py", "--dir", str(d), "--prefix", f"tp{int(pin)}{os.getpid() % 10**5}",
               "--subnet", "auto"]
        subprocess.run([*fab, "up", "--hosts", "2", *(["--pin"] if pin else [])], cwd=ROOT, check=True,
                       capture_output=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "FABRIC_PIN"})
        try:
            got = [allowed_cpus(d, h) for h in ("fab1", "fab2")]
        finally:
            subprocess.run([*fab, "down"], cwd=ROOT, capture_output=True, timeout=120)
        want = [str(0 % ncpu), str(1 % ncpu)] if pin else [f"0-{ncpu - 1}" if ncpu > 1 else "0"] * 2
        assert got == want, f"pin={pin}: hosts' allowed CPUs {got}, expected {want}"
