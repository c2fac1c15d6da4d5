"""macOS's own tools: GNU make 3.81 (/usr/bin/make on every Mac) beside this machine's make.

`.ci/macos-tools.sh` builds make 3.81, rsync 2.6.9 and Apple's openrsync from Apple's source
tarballs (cached by their sha256). conftest.MAKE is 3.81 wherever it is built, so every
make-driven test (demo, smoke and train on the fabric, the RUNBOOK's real run) runs under it;
here the make-only behaviour runs under both makes. The rsyncs are tested in
tests/test_sync_macos_rsync.py. Where the tools are not built these tests skip, saying why;
CI sets REQUIRE_MACOS_TOOLS=1 and builds them, so there a skip is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import ROOT, macos_tools, make

TOOLS = macos_tools()
MAKES = {"make-3.81": str(TOOLS / "make") if TOOLS else None, "make-host": "make"}


@pytest.fixture(params=list(MAKES))
def make_bin(request):
    if MAKES[request.param] is None:
        pytest.skip("macOS's make 3.81 is not built here: bash .ci/macos-tools.sh (needs clang, libbsd-dev)")
    return MAKES[request.param]


def test_the_tools_are_the_versions_macos_ships():
    if TOOLS is None:
        pytest.skip("macOS's tools are not built here: bash .ci/macos-tools.sh")
    out = lambda *a: subprocess.run(a, capture_output=True, text=True).stdout  # noqa: E731
    assert out(str(TOOLS / "make"), "--version").startswith("GNU Make 3.81")
    assert "version 2.6.9" in out(str(TOOLS / "rsync269"), "--version")
    assert "openrsync" in out(str(TOOLS / "openrsync"), "--version")


def probe(make_bin, tmp_path, recipe: str):
    """Run one recipe line under the project Makefile's own prologue (its SHELL)."""
    extra = tmp_path / "probe.mk"
    extra.write_text(f"probe:\n\t{recipe}\n\techo reached-the-next-line\n")
    return subprocess.run([make_bin, "--no-print-directory", "-f", "Makefile", "-f", str(extra), "probe"],
                          cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("recipe, why", [
    ("false | cat", "pipefail: a failing command inside a pipe fails the recipe"),
    ("echo $$THUNDER_SURELY_UNSET_VAR", "-u: an unset variable fails the recipe"),
    ("false; echo after-false", "-e: a failing command stops the recipe line"),
])
def test_strict_shell_holds_under_both_makes(make_bin, tmp_path, recipe, why):
    p = probe(make_bin, tmp_path, recipe)
    assert p.returncode != 0, f"{why}: {make_bin} ran it to the end:\n{p.stdout}{p.stderr}"
    printed = p.stdout.splitlines()  # make echoes the recipe line itself, then what it printed
    assert "reached-the-next-line" not in printed and "after-false" not in printed, why


def test_a_good_recipe_still_runs_under_both_makes(make_bin, tmp_path):
    p = probe(make_bin, tmp_path, "true | cat")
    assert p.returncode == 0 and "reached-the-next-line" in p.stdout.splitlines(), p.stderr


def test_help_is_the_same_under_both_makes(make_bin):
    out = make("help", make_bin=make_bin).stdout
    assert re.search(r"^\s+smoke\s+\S", out, re.M), out
    assert out == make("help", make_bin="make").stdout


STAGE_VARS = ["RUN=mk", "HOSTFILE=hostfile.local.json", "MODEL=models/tiny-gemma4",
              "DATASET=domain_sft_v1_high_signal_thunder", "CORPUS=datasets/sample/corpus.jsonl",
              f"REMOTE_ROOT={ROOT}", f"PYTHON={ROOT}/.venv/bin/python"]


@pytest.mark.parametrize("target", ["export", "check-parity", "provision", "sync", "smoke", "train",
                                    "control", "compare", "calibrate", "plan"])
def test_make_n_is_the_same_under_both_makes(make_bin, target):
    """`make -n <stage>` is the reproduction command: 3.81 must print what 4.x prints."""
    args = [*STAGE_VARS, *(["-o", ".stamps/smoke.mk"] if target in ("train", "control") else [])]
    out = make("-n", target, *args, make_bin=make_bin).stdout
    assert out == make("-n", target, *args, make_bin="make").stdout
    assert "bin/" in out, out


def test_compare_never_retrains_a_run_it_has(make_bin, tmp_path):
    """`make compare` after a finished run only evaluates, under both makes, even when the config
    and the hostfile are newer than the run's stamps (an edited comment, a fresh checkout); it
    builds train and control only when their stamps are missing."""
    run = f"cmpnoretrain-{os.getpid()}"
    cfg, hf = tmp_path / "c.yaml", tmp_path / "h.json"
    cfg.write_text((ROOT / "configs/smoke.yaml").read_text())
    hf.write_text((ROOT / "hostfile.local.json").read_text())
    stamps = [ROOT / ".stamps" / f"{stage}.{run}" for stage in ("smoke", "train", "control")]
    args = [f"RUN={run}", f"CONFIG={cfg}", f"HOSTFILE={hf}", *STAGE_VARS[2:]]
    try:
        for st in stamps:
            st.touch()
            os.utime(st, (1, 1))  # 1970: older than every input
        out = make("-n", "compare", *args, make_bin=make_bin).stdout
        assert out.splitlines() == [f".venv/bin/python bin/compare.py --run {run}"], out
        stamps[1].unlink()
        out = make("-n", "compare", *args, make_bin=make_bin).stdout
        assert "bin/run.py --stage train" in out and "--stage control" not in out, out
    finally:
        for st in stamps:
            st.unlink(missing_ok=True)


@pytest.mark.parametrize("target", ["train", "control"])
def test_mac1_orchestrator_runs_under_caffeinate_where_it_exists(target, tmp_path):
    """On macOS /usr/bin/caffeinate -i keeps Mac1 from idle sleep for the whole run (issue #20);
    where it does not exist (Linux) the same recipe runs bare. CAFFEINATE_BIN stands in for it."""
    args = ["-n", target, *STAGE_VARS, "-o", ".stamps/smoke.mk"]
    fake = tmp_path / "caffeinate"
    fake.write_text("#!/bin/sh\nexec \"$@\"\n")
    out = make(*args, f"CAFFEINATE_BIN={fake}").stdout
    assert f"{fake} -i .venv/bin/python bin/run.py --stage {target}" in out, out
    out = make(*args, f"CAFFEINATE_BIN={tmp_path}/absent").stdout
    assert "\n.venv/bin/python bin/run.py --stage" in "\n" + out and "caffeinate" not in out, out
