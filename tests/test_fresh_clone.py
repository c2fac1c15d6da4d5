"""What README.md, tests/README.md and bench/README.md tell a reader to type, typed as written in a
fresh clone of HEAD (issue #25), so that an untracked or hand-made file in this checkout (a
dataset exported by hand, a model, a venv) cannot hide a missing step. RUNBOOK.md's block is
tests/test_real_run.py's.

The clone is made once for the module and typed in order, as a new user would: README's blocks
(`make demo`, then `make help` and `make plan`), tests/README's fabric block (after the demo),
bench/README's quick `make bench`. Every line runs through bash from the clone's root; `make` is
macOS's make 3.81 where it is built (conftest.MAKE), as in the other make-driven tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import MAKE, ROOT, require_fabric, run
from support import path_without
from test_demo import check_report, check_run_folder

pytestmark = [pytest.mark.slow, pytest.mark.beside]  # beside the rest (tests/conftest.py)


def sh_blocks(doc: str) -> list[str]:
    """The ```sh blocks of a document, one string each."""
    blocks = re.findall(r"^```sh\n(.*?)^```", (ROOT / doc).read_text(), re.S | re.M)
    assert blocks, f"{doc} has no ```sh block"
    return blocks


def type_lines(clone: Path, lines: list[str], env: dict | None = None, timeout: float = 900):
    """Type `lines` into one bash (so a sourced env.sh holds for the lines after it), stopping at
    the first that fails. Returns the CompletedProcess; its stdout interleaves `+ line` traces."""
    script = "\n".join(["set -euo pipefail", f'make() {{ command {MAKE} "$@"; }}', "set -x", *lines, ""])
    return subprocess.run(["bash", "-c", script], cwd=clone, env=dict(os.environ, **(env or {})),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone of this checkout's HEAD: what is committed, nothing else."""
    d = tmp_path_factory.mktemp("fresh") / "thunder-runbook"
    run(["git", "clone", "-q", str(ROOT), str(d)])
    assert not (d / ".venv").exists() and not any((d / "datasets").glob("*/manifest.json"))
    yield d
    if (d / ".venv/bin/python").exists():  # a fabric the typed block left up (it ends with fabric-down)
        subprocess.run([str(d / ".venv/bin/python"), "tests/fabric.py", "down"], cwd=d, capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def test_demo_without_rsync_stops_before_the_venv(clone, tmp_path):
    """Observation 1: the demo failed at sync, after a minute on the venv, for want of rsync."""
    t0 = time.monotonic()
    p = type_lines(clone, ["make demo"], env={"PATH": path_without("rsync", tmp_path / "bin")}, timeout=60)
    assert p.returncode != 0 and time.monotonic() - t0 < 10, p.stderr
    assert "missing: rsync" in p.stderr and "apt-get install -y rsync" in p.stderr, p.stderr
    assert "README.md#requirements" in p.stderr and not (clone / ".venv").exists(), p.stderr


def test_readme_as_typed(clone):
    """README.md's blocks: `make demo` on a fresh clone, then `make help` and the demo's `make plan`."""
    lines = [ln for b in sh_blocks("README.md") for ln in b.splitlines()
             if ln.strip() and not ln.lstrip().startswith("#") and ln.split()[:2] != ["make", "test"]]
    assert [ln.split()[:2] for ln in lines] == [["make", "demo"], ["make", "help"], ["make", "plan"]], lines
    p = type_lines(clone, lines, timeout=1200)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "demo: report at runs/demo/compare/report.md" in p.stdout
    check_report("demo", clone)
    check_run_folder("demo", clone)
    assert re.search(r"^  demo +the whole chain", p.stdout, re.M), "make help lists no demo target"
    plan = re.search(r"^plan file (runs/plan-\S+\.json) overall_status (\w+)", p.stdout, re.M)
    assert plan, p.stdout[-3000:]
    doc = json.loads((clone / plan.group(1)).read_text())
    assert doc["version"] == "2.0.0" and doc["sources"]["parity"], doc["sources"]
    # After the demo, the plan reads what the demo made: its launch gate's check-parity, its dataset,
    # its sync and smoke; only a calibration (never run by the demo) is left unknown.
    unknown = " ".join(u["reason"] for u in doc["unknowns"])
    for made in ("check-parity result", "datasets/demo/manifest.json", "sync.json missing", "no passing smoke"):
        assert made not in unknown, f"the plan after the demo says: {unknown}"


def test_tests_readme_fabric_block_as_typed(clone):
    """tests/README.md's by-hand fabric block, after the demo, on this clone's own fabric."""
    require_fabric()
    [block] = [b for b in sh_blocks("tests/README.md") if "fabric-up" in b]
    lines = [ln.split("  #")[0] for ln in block.splitlines() if ln.strip()]
    pid = os.getpid()
    env = {"FABRIC_PREFIX": f"fc{pid}", "FABRIC_SUBNET": "auto", "FABRIC_OWNER_PID": str(pid)}
    p = type_lines(clone, lines, env=env, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    out = p.stdout
    assert re.search(r"^fab1$", out, re.M) and re.search(r"^check-parity status (OK|WARNING)", out, re.M), out[-3000:]
    assert sorted(re.findall(r"^(fab\d) (\d) 3$", out, re.M)) == [("fab1", "0"), ("fab2", "1"), ("fab3", "2")], out
    assert not (clone / "runs" / "fabric").exists(), "make fabric-down left runs/fabric"


def test_bench_readme_quick_as_typed(clone):
    """bench/README.md's quick `make bench`: the preparation through make targets, then every row once."""
    require_fabric()  # check_parity, sync, scaling, shares and smoke run on fabrics of their own
    [line] = [ln.split(" #")[0].strip() for b in sh_blocks("bench/README.md") for ln in b.splitlines()
              if "--quick" in ln]
    shutil.rmtree(clone / "datasets" / "bench", ignore_errors=True)
    p = type_lines(clone, [line], timeout=900)
    assert p.returncode == 0, f"{p.stdout[-5000:]}\n{p.stderr[-3000:]}"
    assert "make --no-print-directory export CORPUS=datasets/sample/corpus.jsonl DATASET=bench" in p.stdout
    doc = json.loads((clone / "bench" / "results-quick.json").read_text())
    rows = {b["name"]: b for b in doc["benchmarks"]}
    names = ["export", "check_parity", "sync", "trainer", "loss", "scaling", "shares", "smoke"]
    assert list(rows) == names, list(rows)
    bad = {n: (b["status"], b["error"][-300:]) for n, b in rows.items() if b["status"] not in ("ok", "target missed")}
    assert not bad, bad
    assert all(b["metrics"] for b in rows.values()), {n: b["metrics"] for n, b in rows.items()}
    assert (clone / "datasets" / "bench" / "manifest.json").is_file()
    assert run(["git", "status", "--porcelain", "--", "bench/README.md"], cwd=clone).stdout == "", \
        "a quick run rewrote bench/README.md's summary"
