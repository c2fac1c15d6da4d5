"""A run outlives its terminal and never runs twice (issue #27), on the 2-host fabric through make: a closed
terminal (SIGHUP to the `make train` job) leaves the run supervised; Ctrl-C (SIGINT) and `make stop` stop
every rank within 10 s and RESUME=1 reproduces the uninterrupted adapter; a SIGKILLed supervisor takes its
launch with it within 60 s; a second `make train RESUME=1` while ranks live is refused; Mac1 dying (every
process of the run on it killed at once) still stops the ranks in about 2 s.

Each run's smoke stamp is written by hand (runs/<RUN>/smoke.json ok, .stamps/smoke.<RUN>): the smoke
itself is tests/test_stages_fabric.py's and tests/test_long_run.py's, and each run here saves its time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MAKE, ROOT, make
from safetensors.numpy import load_file

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

DATASET, MODEL, HOSTS = "domain_sft_v1_high_signal_thunder", "models/tiny-gemma4", ["fab1", "fab2"]
RANK = r"bin/train\.py"


@pytest.fixture(scope="module")
def cfg(fabric):
    """A tiny config with room to interrupt after a checkpoint (step 4) and before the end (step 12)."""
    for d in (ROOT / "runs").glob("sup-*"):
        shutil.rmtree(d, ignore_errors=True)
    for st in (ROOT / ".stamps").glob("*.sup-*"):
        st.unlink()
    path = ROOT / "runs" / "sup.yaml"
    path.write_text((ROOT / "configs/smoke.yaml").read_text().replace("iters: 6", "iters: 12")
                    .replace("save_every: 3", "save_every: 4").replace("steps_per_eval: 3", "steps_per_eval: 12"))
    return path


def fab_vars(fabric, run, cfg, **extra):
    v = {"RUN": run, "HOSTFILE": str(fabric.hostfile(HOSTS)), "REMOTE_ROOT": fabric.remote_root,
         "PYTHON": fabric.python, "MODEL": MODEL, "DATASET": DATASET, "CONFIG": str(cfg), "WATCHDOG": "60", **extra}
    return [f"{k}={val}" for k, val in v.items()]


def start(fabric, run, cfg, *extra):
    """`make train` as a terminal's job: its own process group (a shell's job), output to a file."""
    (ROOT / "runs" / run).mkdir(parents=True, exist_ok=True)
    smoke = ROOT / "runs" / run / "smoke.json"
    if not smoke.exists():
        smoke.write_text('{\n  "ok": true\n}\n')
        (ROOT / ".stamps").mkdir(exist_ok=True)
        (ROOT / ".stamps" / f"smoke.{run}").touch()
    out, log = open(ROOT / "runs" / run / f"make-{time.monotonic_ns()}.out", "w+"), launch_log(run)
    offset = log.stat().st_size if log.is_file() else 0
    p = subprocess.Popen([MAKE, "--no-print-directory", "train", *fab_vars(fabric, run, cfg), *extra,
                          "SETTINGS=/dev/null"], cwd=ROOT, env=fabric.env(), stdin=subprocess.DEVNULL,
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    p.out, p.run, p.offset = out, run, offset
    return p


def launch_log(run):
    return ROOT / f"runs/{run}/logs/launch-train.log"


def output(p) -> str:
    p.out.seek(0)
    return p.out.read()


def wait_step(p, step, timeout=300):
    """Wait until p's launch (its lines in the launch log) has rank 1 at `step`."""
    log, deadline = launch_log(p.run), time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        text = log.read_bytes()[p.offset:].decode(errors="replace") if log.is_file() else ""
        if any(int(n) >= step for n in re.findall(r"iter (\d+) rank 1 ", text)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{p.run} never reached step {step}: {output(p)[-3000:]}")


def ranks(fabric, run):
    return [p for h in HOSTS for p in fabric.procs(h, RANK + f".*--run-dir runs/{run}( |$)")]


def gone_after(fabric, run, t0, limit):
    """Seconds from t0 until no rank of run is left on any host (at most limit)."""
    while ranks(fabric, run) and time.monotonic() - t0 < limit:
        time.sleep(0.05)
    assert not ranks(fabric, run), f"ranks of {run} still alive {limit} s later"
    return time.monotonic() - t0


def status(fabric, run, cfg):
    p = make("status", *fab_vars(fabric, run, cfg), "JSON=1", env=fabric.env(), check=False, timeout=60)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.returncode


def held(run, timeout=120):
    """Wait until run's supervisor has let go of its lock."""
    lock, deadline = ROOT / f"runs/{run}/supervisor.lock", time.time() + timeout
    while time.time() < deadline and (not lock.is_file() or lock.read_text().strip()):
        time.sleep(0.2)
    return json.loads((ROOT / f"runs/{run}/train.json").read_text())


def adapter(run):
    return load_file(str(ROOT / f"runs/{run}/adapters/adapters.safetensors"))


def same_adapter(a, b):
    ref, got = adapter(a), adapter(b)
    assert ref.keys() == got.keys()
    return max(float(np.max(np.abs(ref[k].astype(np.float64) - got[k].astype(np.float64)))) for k in ref)


def mac1_pids(run):
    """This machine's (Mac1's: the root network namespace's) processes of run's launch: mlx.launch, its ssh
    clients, its guard."""
    own, cmds = os.stat("/proc/self/ns/net").st_ino, {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.stat(d / "ns/net").st_ino == own:
                cmds[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    launch = [pid for pid, c in cmds.items() if f"--run-dir runs/{run} " in " ".join(c) + " "]
    ids = {str(pid) for pid in launch}  # the guard's last argument: the launch's process group
    return launch + [pid for pid, c in cmds.items() if "os.killpg" in " ".join(c) and c[-2:-1] and c[-2] in ids]


@pytest.fixture(scope="module")
def reference(fabric, cfg):
    """SIGHUP to the make train job mid-run, as a closed terminal sends it: the supervisor goes on, detached
    (make status says so, its output goes to logs/supervisor.log); a second `make train RESUME=1` meanwhile is
    refused naming host, pid, launch id and make stop; the run ends PASS with its stamp, never run twice."""
    run = "sup-hup"
    p = start(fabric, run, cfg)
    wait_step(p, 2)
    os.killpg(p.pid, signal.SIGHUP)
    time.sleep(1)
    st, code = status(fabric, run, cfg)
    second = make("train", *fab_vars(fabric, run, cfg), "RESUME=1", env=fabric.env(), check=False, timeout=120)
    alive = ranks(fabric, run)
    summary = held(run)
    return {"status": (st, code), "second": second, "alive": alive, "summary": summary, "make": p}


def test_a_closed_terminal_leaves_the_run_supervised(fabric, cfg, reference):
    run, (st, code) = "sup-hup", reference["status"]
    assert code == 0 and st["running"] and st["supervisor"]["detached"] == f"runs/{run}/logs/supervisor.log", st
    second = reference["second"]
    text = second.stdout + second.stderr
    assert second.returncode != 0, text[-3000:]
    assert re.search(rf"FAIL\s+run\s+fab1\s+RUN {run}'s ranks alive here: pid \d+ \(launch \S+-train\)", text), text
    assert re.search(rf"RUN {run} is held by supervisor pid \d+ on \S+ \(train, launch \S+-train", text), text
    assert f"make stop RUN={run}" in text and "RUNBOOK.md#one-launch-per-run" in text
    assert len(reference["alive"]) == 2, reference["alive"]  # one pair: the refused launch started none
    assert reference["summary"]["ok"], reference["summary"]
    log = (ROOT / f"runs/{run}/logs/supervisor.log").read_text()
    assert re.search(r"^step 12/12 loss ", log, re.M) and re.search(rf"^train run {run} status PASS", log, re.M), log
    assert (ROOT / f".stamps/train.{run}").is_file()  # touched by the supervisor: make had died
    again = make("train", *fab_vars(fabric, run, cfg), env=fabric.env(), timeout=120)  # nothing to do
    assert "bin/run.py" not in again.stdout, again.stdout
    assert not ranks(fabric, run)


def test_ctrl_c_stops_every_rank_within_10_s_and_resume_matches(fabric, cfg, reference):
    run = "sup-int"
    p = start(fabric, run, cfg)
    wait_step(p, 6)
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)  # what the terminal sends its foreground job
    secs = gone_after(fabric, run, t0, 10)
    print(f"SIGINT: every rank stopped {secs:.2f} s later")
    p.wait(timeout=120)
    text, summary = output(p), json.loads((ROOT / f"runs/{run}/train.json").read_text())
    assert p.returncode != 0 and summary["category"] == "stopped on request", (summary, text[-3000:])
    assert "FAILED category: stopped on request: SIGINT after step " in text and "RUNBOOK.md#stopped-on-request" in text
    assert (ROOT / f"runs/{run}/checkpoints/step-0000004").is_dir()
    p = start(fabric, run, cfg, "RESUME=1")
    p.wait(timeout=300)
    assert p.returncode == 0, output(p)[-3000:]
    assert "took over" not in output(p)
    assert same_adapter("sup-hup", run) <= 1e-5


def test_a_killed_supervisor_takes_its_ranks_within_60_s_then_make_stop(fabric, cfg, reference):
    run = "sup-kill"
    p = start(fabric, run, cfg)
    wait_step(p, 6)
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGKILL)  # make, its shell and bin/run.py
    secs = gone_after(fabric, run, t0, 60)
    print(f"SIGKILL of the supervisor: every rank stopped {secs:.2f} s later")
    assert not mac1_pids(run), "the launch outlived its supervisor"
    st, code = status(fabric, run, cfg)
    assert code == 2 and "has no supervisor" in st["why"] and st["supervisor"] is None, st
    # RESUME=1 takes the dead supervisor's lock over, and says so; `make stop` from another terminal stops it.
    p = start(fabric, run, cfg, "RESUME=1")
    wait_step(p, 6)
    assert re.search(rf"^supervisor: took over runs/{run}/supervisor.lock from .*: it is gone", output(p), re.M)
    t0 = time.monotonic()  # `make stop` from another terminal: it ends when the supervisor has
    stop = subprocess.Popen([MAKE, "--no-print-directory", "stop", f"RUN={run}", "SETTINGS=/dev/null"], cwd=ROOT,
                            env=fabric.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = gone_after(fabric, run, t0, 10)
    said = stop.communicate(timeout=120)[0]
    print(f"make stop: every rank stopped {secs:.2f} s later; make stop took {time.monotonic() - t0:.2f} s")
    assert stop.returncode == 0 and re.search(rf"^stop run {run} supervisor \d+ fab1 ", said, re.M), said
    p.wait(timeout=60)
    assert json.loads((ROOT / f"runs/{run}/train.json").read_text())["why"].startswith("SIGTERM after step ")


def test_mac1_dying_still_stops_the_ranks_in_about_2_s(fabric, cfg, reference):
    run = "sup-kill"  # on from its last checkpoint
    p = start(fabric, run, cfg, "RESUME=1")
    wait_step(p, 10)
    pids = mac1_pids(run)
    t0 = time.monotonic()
    for pid in [p.pid, *pids]:  # every process of the run on Mac1 at once, ssh clients included
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL) if pid == p.pid else os.kill(pid, signal.SIGKILL)
    secs = gone_after(fabric, run, t0, 10)
    print(f"Mac1 dying: every rank stopped {secs:.2f} s later")
    assert secs < 4.0, secs
