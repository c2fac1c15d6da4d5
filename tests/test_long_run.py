"""The long run as the operator lives it (issue #16), on the 2-host fabric through make:
`make status` during and after a run, automatic resume after rank 1 is SIGKILLed
(RESTARTS=1), and carrying on without a host whose link is cut for good (FALLBACK=1).
The model is the tiny model in Gemma 4's released layout, in float (issue #18: the `gemma4`
wrapper with its vision and audio towers; the real-run test covers its 4-bit form).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import MAKE, ROOT, losses, make, wait_step
from safetensors.numpy import load_file

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

DATASET, MODEL, SMOKED = "domain_sft_v1_high_signal_thunder", "models/tiny-gemma4-released", "fab-long-smoke"
HOSTS = ["fab1", "fab2"]
STATUS_KEYS = {"run", "stage", "running", "reachable", "step", "iters", "eta_s", "train_loss", "loss_trend",
               "last_val", "ranks", "latest_checkpoint", "failures", "verdict", "status", "why", "supervisor",
               "tracking"}


def fmake(fabric, *args, **kw):
    kw.setdefault("timeout", 600)
    return make(*args, env=fabric.env(), **kw)


def fab_vars(fabric, run, **extra):
    v = {"RUN": run, "HOSTFILE": str(fabric.hostfile(HOSTS)), "REMOTE_ROOT": fabric.remote_root,
         "PYTHON": fabric.python, "MODEL": MODEL, "DATASET": DATASET, **extra}
    return [f"{k}={val}" for k, val in v.items()]


@pytest.fixture(scope="module")
def long_cfg(fabric):
    """A tiny config long enough to be interrupted after a checkpoint, and one passing smoke
    (a real `make smoke`) that each run's stamp points at."""
    for d in (ROOT / "runs").glob("fab-long-*"):
        shutil.rmtree(d, ignore_errors=True)
    for st in (ROOT / ".stamps").glob("*.fab-long-*"):
        st.unlink()
    make("tiny-model", "ARCH=gemma4", "LAYOUT=released")
    cfg = ROOT / "runs" / "fab-long.yaml"
    # Every token a target (mask_prompt false): at smoke's learning rate, 8 steps move the all-token loss
    # below the base model's, which the verdict's quality gate needs before it judges the link.
    cfg.write_text((ROOT / "configs/smoke.yaml").read_text().replace("iters: 6", "iters: 8")
                   .replace("save_every: 3", "save_every: 4").replace("steps_per_eval: 3", "steps_per_eval: 8")
                   .replace("mask_prompt: true", "mask_prompt: false"))
    fmake(fabric, "smoke", *fab_vars(fabric, SMOKED), timeout=900)
    return cfg


def train(fabric, cfg, run, **extra):
    """`make train` for run (its smoke stamp copied from the one real smoke), in a thread."""
    shutil.copytree(ROOT / "runs" / SMOKED, ROOT / "runs" / run, ignore=shutil.ignore_patterns("smoke"), dirs_exist_ok=True)
    shutil.copy(ROOT / ".stamps" / f"smoke.{SMOKED}", ROOT / ".stamps" / f"smoke.{run}")
    out = {}
    t = threading.Thread(target=lambda: out.__setitem__("p", fmake(
        fabric, "train", *fab_vars(fabric, run, CONFIG=str(cfg), **{"WATCHDOG": "20", **extra}), check=False)))
    t.start()
    return t, out


def status(fabric, run):
    t0 = time.monotonic()
    p = fmake(fabric, "status", *fab_vars(fabric, run), "JSON=1", check=False, timeout=30)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.returncode, time.monotonic() - t0


def finish(t, out, run):
    t.join(timeout=600)
    assert not t.is_alive(), f"make train {run} did not end"
    return out["p"], json.loads((ROOT / f"runs/{run}/train.json").read_text())


def adapter(run):
    return load_file(str(ROOT / f"runs/{run}/adapters/adapters.safetensors"))


def no_rank_left(fabric):
    return {h: fabric.procs(h, r"bin/train\.py") for h in HOSTS}


@pytest.fixture(scope="module")
def reference(fabric, long_cfg):
    """The uninterrupted run; `make status JSON=1` during it (each call timed) and after."""
    t, out = train(fabric, long_cfg, "fab-long-ref")
    wait_step("fab-long-ref", 2)
    watch = subprocess.Popen([MAKE, "--no-print-directory", "status", *fab_vars(fabric, "fab-long-ref"), "WATCH=1",
                              "SETTINGS=/dev/null"], cwd=ROOT, env=fabric.env(), stdout=subprocess.PIPE, text=True)
    during = [status(fabric, "fab-long-ref") for _ in range(3)]
    human = fmake(fabric, "status", *fab_vars(fabric, "fab-long-ref"), check=False, timeout=30).stdout
    p, summary = finish(t, out, "fab-long-ref")
    assert p.returncode == 0 and summary["ok"] and summary["attempts"] == [], (p.stderr[-2000:], summary)
    watched = watch.communicate(timeout=60)[0]  # WATCH=N ends with the run
    after = fmake(fabric, "status", *fab_vars(fabric, "fab-long-ref"), check=False, timeout=30).stdout
    return during, status(fabric, "fab-long-ref"), p, {"during": human, "watched": watched, "after": after}


PLUGIN = re.compile(r"^STATUS (OK|WARNING|CRITICAL|UNKNOWN) - [^|]+ \| step=(\d+|U) loss=(\S+) tok_per_s=(\S+) eta_s=(\S+)$")


def test_make_status_speaks_to_a_person(fabric, reference):
    """#28: `make status` is human lines with rounded numbers (JSON=1 is for machines); its first line is a
    monitoring plugin's, with perfdata. WATCH=1 redrew it until the run ended, then stopped."""
    text = reference[3]
    for when, out in text.items():
        assert PLUGIN.match(out.splitlines()[0]), (when, out)
        assert not re.search(r"[{}\[\]]|'\w+':|\d\.\d{5}", out), (when, out)  # no repr, JSON or long float
    m = PLUGIN.match(text["during"].splitlines()[0])
    assert int(m[2]) >= 2 and float(m[3]) > 0 and float(m[4]) > 0 and m[5].endswith("s"), m.groups()
    assert re.search(r"^rank 1: step \d+, \d+ s ago, [\d,]+ tok/s$", text["during"], re.M), text["during"]
    assert re.search(r"^verdict: PASS, step 8, test loss \d+\.\d{3}", text["after"], re.M), text["after"]
    assert "checkpoint: step-0000008" in text["after"] and "eta_s=U" in text["after"]
    rounds = [ln for ln in text["watched"].splitlines() if PLUGIN.match(ln)]
    assert len(rounds) >= 2 and "verdict: PASS" in text["watched"].split(rounds[-1])[-1], text["watched"]


def test_status_during_and_after_a_run(fabric, reference):
    during, after, p, _ = reference
    # The issue's figure is under 1 s on 2 fabric hosts (0.66 s measured through make); the test
    # bounds it at 5 s, a hang guard that a loaded CI box cannot trip, and prints what it saw.
    print("make status JSON=1 took", [round(x[2], 2) for x in during], "during,", round(after[2], 2), "s after")
    for st, code, secs in during:
        assert set(st) == STATUS_KEYS and st["running"] and st["reachable"], st
        assert code == 0 and st["status"] == "OK" and secs < 5.0, (code, secs, st)
        assert st["iters"] == 8 and 0 < st["step"] <= 8 and st["eta_s"] is not None
        assert set(st["ranks"]) == {"0", "1"} and all(v["since_s"] < 30 and v["tok_per_s"] for v in st["ranks"].values())
    st, code, secs = after
    assert code == 0 and not st["running"] and st["verdict"]["ok"] and st["step"] == 8 and secs < 5.0, (secs, st)
    assert st["latest_checkpoint"] == "step-0000008" and st["last_val"]["step"] == 8
    # The operator's terminal has one `step` line per report, not the per-rank step lines.
    assert re.search(r"^step 6/8 loss \S+ tok/s \d+ eta \d\d:\d\d:\d\d peak_mem_gb \S+$", p.stdout, re.M), p.stdout[-2000:]
    assert not re.search(r"iter \d+ rank \d", p.stdout)
    assert re.search(r"^\S+Z iter 6 rank 1 ", (ROOT / "runs/fab-long-ref/logs/launch-train.log").read_text(), re.M)


MIN_SPEEDUP = "0.4"  # the fabric's ranks share 2 cores: unthrottled, dual / control measured 0.87 here


@pytest.fixture(scope="module")
def control(fabric, long_cfg, reference):
    """`make control` of the reference run on fab1 (one host: the link plays no part in it)."""
    fmake(fabric, "control", *fab_vars(fabric, "fab-long-ref", CONFIG=str(long_cfg), CONTROL_HOST="fab1"))
    return "fab-long-ref-control"


def test_control_and_compare_on_the_fabric(fabric, control):
    """The rest of the chain on the released layout (#18): `make control` on fab1 with the same
    config, then `make compare`. With token-weighted gradients the dual run computes what the
    control computes (#19): compare's exactness check holds their step-1 loss to float error, and
    every step's loss stays within it. It passes MIN_SPEEDUP, the threshold the throttled run
    below fails."""
    run = "fab-long-ref"
    p = fmake(fabric, "compare", *fab_vars(fabric, run), f"MIN_SPEEDUP={MIN_SPEEDUP}", "TEST_BATCHES=4", "SAMPLES=1", "MAX_TOKENS=8", check=False)
    rep = json.loads((ROOT / f"runs/{run}/compare/report.json").read_text())
    assert p.returncode == 0 and rep["verdict"] == "pass", (p.stdout[-2000:], p.stderr[-2000:], rep["reasons"])
    exact = rep["loss"]["exact"]
    assert exact["ok"] and exact["step1_rel"] <= 1e-5 and exact["steps"] == 8, exact
    assert exact["max_rel"] <= 1e-5, exact  # every step's loss: 6e-7 measured; mlx-lm's averaging differs by ~1e-3
    assert rep["runs"]["control"]["world_size"] == 1 and rep["runs"]["dual"]["world_size"] == 2
    dual, ctl = losses(run), losses(control)
    assert dual.keys() == ctl.keys() and len(dual) == 8


def test_a_throttled_link_is_predicted_and_called_link_bound(fabric_faults, long_cfg, control):
    """#19: fab2's cable throttled to 100 kbit/s (tc tbf; at 200 kbit/s calibrate predicted 0.47x,
    too near the threshold for two loaded cores). `make calibrate` predicts the drop (the
    gradient all-reduce takes most of a dual step); the same training, 2 steps of it, is then slower
    than the control beyond MIN_SPEEDUP, and `make compare` calls it link-bound, naming that
    calibration. The unthrottled run passes the same threshold (the test above)."""
    fabric, run = fabric_faults, "fab-long-slow"
    cfg = long_cfg.with_name("fab-long-slow.yaml")  # iters and save_every may differ: still comparable
    cfg.write_text(long_cfg.read_text().replace("iters: 8", "iters: 2"))  # step 1's time is not counted
    before = set((ROOT / "runs").glob("calibration-*.json"))
    fabric.throttle_link("fab2", "100kbit")
    t0 = time.monotonic()
    try:
        fmake(fabric, "calibrate", *fab_vars(fabric, run, CONFIG=str(cfg)),
              "CALIBRATE_ARGS=--budget-s 5 --max-batch 2 --steps 1 --max-bytes 4096")
        (cal,) = set((ROOT / "runs").glob("calibration-*.json")) - before
        doc = json.loads(cal.read_text())
        sp = doc["speedup"]
        print(f"throttled calibration ({time.monotonic() - t0:.0f} s):", doc["link"]["grad_allreduce"],
              {k: sp.get(k) for k in ("expected_speedup", "compute_bound_speedup", "link_share")})
        assert sp["link_share"] >= 0.5 and sp["expected_speedup"] < 0.5 * sp["compute_bound_speedup"], sp
        assert sp["expected_speedup"] < 0.8 * float(MIN_SPEEDUP), sp  # the verdict below, predicted with margin
        t, out = train(fabric, cfg, run, WATCHDOG="90")  # one all-reduce takes ~11 s at this rate
        p, summary = finish(t, out, run)
        assert p.returncode == 0 and summary["ok"], (p.stderr[-3000:], summary)
        shutil.copytree(ROOT / "runs" / control, ROOT / "runs" / f"{run}-control", dirs_exist_ok=True)
        shutil.copy(ROOT / ".stamps" / "control.fab-long-ref", ROOT / ".stamps" / f"control.{run}")
        p = fmake(fabric, "compare", *fab_vars(fabric, run), f"MIN_SPEEDUP={MIN_SPEEDUP}", "TEST_BATCHES=4", "SAMPLES=1", "MAX_TOKENS=8",
                  check=False)
        rep = json.loads((ROOT / f"runs/{run}/compare/report.json").read_text())
        print(f"throttled run and compare ({time.monotonic() - t0:.0f} s):", rep["throughput"], rep["reasons"])
        assert p.returncode != 0 and rep["category"] == "the Thunder path itself", (rep["reasons"], p.stdout[-2000:])
        assert rep["throughput"]["link_bound"] is True and rep["throughput"]["speedup"] < float(MIN_SPEEDUP)
        assert f"link-bound: calibrate ({cal.relative_to(ROOT)})" in rep["reasons"][-1], rep["reasons"]
    finally:
        for f in set((ROOT / "runs").glob("calibration-*.json")) - before:
            f.unlink()


def test_rank_killed_mid_run_resumes_to_the_same_adapter(fabric_faults, long_cfg, reference):
    fabric, run = fabric_faults, "fab-long-kill"
    t, out = train(fabric, long_cfg, run, RESTARTS="1")
    wait_step(run, 5)
    assert fabric.kill("fab2", r"bin/train\.py"), "no rank process on fab2"
    p, summary = finish(t, out, run)
    assert p.returncode == 0 and summary["ok"], (p.stderr[-3000:], summary)
    assert len(summary["attempts"]) == 1 and summary["attempts"][0]["parity_exit"] in (0, 1), summary["attempts"]
    assert summary["attempts"][0]["last_step_seen"] < 8, "the kill came after the last step: nothing was resumed"
    assert re.search(rf"^restart run {run} attempt 1 of 1 ", p.stdout, re.M), p.stdout[-3000:]
    ref, got = adapter("fab-long-ref"), adapter(run)
    assert ref.keys() == got.keys()
    diff = max(float(np.max(np.abs(ref[k].astype(np.float64) - got[k].astype(np.float64)))) for k in ref)
    assert diff <= 1e-5, diff
    assert not any(no_rank_left(fabric).values())


def test_link_cut_for_good_falls_back_to_the_remaining_host(fabric_faults, long_cfg, reference):
    fabric, run = fabric_faults, "fab-long-cut"
    t, out = train(fabric, long_cfg, run, RESTARTS="1", FALLBACK="1", WATCHDOG="10")  # the cut is found by it
    wait_step(run, 5)
    fabric.cut_link("fab2")
    p, summary = finish(t, out, run)
    assert p.returncode == 0 and summary["ok"], (p.stderr[-3000:], summary)
    assert summary["fallback"]["lost"] == ["fab2"] and summary["world_size"] == 1, summary
    assert json.loads((ROOT / f"runs/{run}/manifest.json").read_text())["fallback"]["lost"] == ["fab2"]
    ref, got = losses("fab-long-ref"), losses(run)
    assert got.keys() == ref.keys()
    assert all(abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]) for s in ref), {s: (ref[s], got[s]) for s in ref}
    st, code, _ = status(fabric, run)
    assert code == 0 and st["verdict"]["fallback"]["lost"] == ["fab2"]
