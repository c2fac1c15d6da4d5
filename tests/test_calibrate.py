"""calibrate: the model from measurements to a recommendation and a speedup, the compute sweep's
stops on the real model and the trainer's step, bad input, a failing probe, and `make calibrate`
on the multi-host fabric."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess

import pytest
from conftest import PY, ROOT, make, run

spec = importlib.util.spec_from_file_location("calibrate", ROOT / "bin" / "calibrate.py")
cal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cal)

MODEL = "models/tiny-gemma4"
DATASET = "domain_sft_v1_high_signal_thunder"
MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    if not (ROOT / MODEL / "config.json").is_file():
        make("tiny-model", "ARCH=gemma4")
    return MODEL


# ---- the model: pure functions on measured shapes -------------------------------------------
def rows(*pairs, mem=None):
    return [{"batch": b, "step_s": s, "peak_mem_bytes": (mem or {}).get(b, 100 * b)} for b, s in pairs]


def test_step_time_at_and_max_fitting_batch():
    sweep = rows((1, 1.0), (2, 1.5), (4, 2.5))
    assert cal.step_time_at(sweep, 2) == (1.5, "measured")
    assert cal.step_time_at(sweep, 3) == (2.0, "interpolated")
    assert cal.step_time_at(sweep, 8) == (4.5, "extrapolated")
    assert cal.step_time_at(sweep[:1], 3) == (3.0, "scaled from one size")
    assert cal.step_time_at([], 2) == (None, "no measurement")
    assert cal.max_fitting_batch({"sweep": sweep, "stopped": {"reason": "memory"}}) == (4, "measured")
    assert cal.max_fitting_batch({"sweep": sweep, "stopped": {"reason": "time"}}) == (4, "lower_bound")
    over = sweep[:2] + [dict(sweep[2], over_memory=True)]
    assert cal.max_fitting_batch({"sweep": over, "stopped": {"reason": "memory"}}) == (2, "measured")
    assert cal.max_fitting_batch({"sweep": []})[0] is None


def host(ssh, sweep, stop="memory", ranks=None):
    return {"ssh": ssh, "sweep": sweep, "stopped": {"reason": stop}, "ranks": ranks or [int(ssh[-1]) - 4]}


def test_recommend_keeps_the_global_batch_and_accumulates_when_it_does_not_fit():
    cfg = {"batch_size": 8, "grad_accumulation_steps": 1}
    hosts = [host("mac4", rows((1, 1.0), (2, 1.8), (4, 3.4))), host("mac5", rows((1, 1.0), (2, 1.8)))]
    rec = cal.recommend(cfg, 2, hosts)
    assert (rec["per_rank_batch"], rec["grad_accumulation_steps"], rec["config_batch_size"]) == (2, 2, 4)
    assert rec["per_rank_batch"] * rec["grad_accumulation_steps"] * 2 == 8 and "does not fit" in rec["why"]
    assert rec["fits_memory_cap"] == 2 and rec["fits_memory_cap_kind"] == "measured"
    hosts[1]["sweep"] += rows((4, 3.3))
    hosts[1]["stopped"]["reason"] = "time"
    rec = cal.recommend(cfg, 2, hosts)
    assert (rec["per_rank_batch"], rec["grad_accumulation_steps"]) == (4, 1) and "4 per rank fits" in rec["why"]
    assert rec["fits_memory_cap_kind"] == "measured"  # mac4 bounds the cap by memory
    hosts[0]["stopped"]["reason"] = "time"
    assert cal.recommend(cfg, 2, hosts)["fits_memory_cap_kind"] == "lower_bound"
    assert "not divisible by the world size 3: use 6 or 9" in cal.recommend(cfg, 3, hosts)["error"]


def test_speedup_model_arithmetic():
    """control 8 on one host vs 4 per rank on two: the slowest rank's concurrent step (the trainer's,
    its all-reduce included) sets the pace; alone + the all-reduce where nothing ran concurrently."""
    cfg = {"batch_size": 8, "grad_accumulation_steps": 1}
    hosts = [host("mac4", rows((4, 1.0), (8, 2.0))), host("mac5", rows((4, 1.2), (8, 2.4)))]
    link = {"grad_allreduce": {"cost_s": 0.1}, "allreduce": [{"bytes": 4096, "mean_s": 1e-4}]}
    out = cal.speedup_model(cfg, 2, hosts, link, [4, 4])
    assert out["t_control_step_s"] == 2.0 and out["t_dual_step_s"] == pytest.approx(1.3)  # mac5 + the all-reduce
    assert out["expected_speedup"] == pytest.approx(2.0 / 1.3)
    assert out["compute_bound_speedup"] == pytest.approx(2.0 / 1.2)
    assert out["link_share"] == pytest.approx(0.1 / 1.3) and "alone" not in out["dual_how"]["mac5"]
    link["concurrent"] = {"mac4": {"batch": 4, "step_s": 1.9}, "mac5": {"batch": 4, "step_s": 2.1}}
    out = cal.speedup_model(cfg, 2, hosts, link, [4, 4])  # ranks sharing a machine: the concurrent time counts
    assert out["t_dual_step_s"] == 2.1 and out["expected_speedup"] < 1
    assert out["dual_how"]["mac4"] == "measured with every rank computing"
    out = cal.speedup_model(dict(cfg, grad_accumulation_steps=2), 2, hosts, link, [4, 4])  # one all-reduce per update
    assert out["t_control_step_s"] == 4.0 and out["t_dual_step_s"] == pytest.approx(2 * 2.1 - 0.1)
    assert "no gradient all-reduce" in cal.speedup_model(cfg, 2, hosts, None, [4, 4])["unknown"]
    assert "not divisible by 3 ranks" in cal.speedup_model(cfg, 3, hosts, link, None)["unknown"]
    one = cal.speedup_model(cfg, 1, hosts[:1], None, [8])
    assert one["expected_speedup"] == 1.0 and one["link_share"] == 0.0
    # An all-reduce timed alone in a load spike (2.5 s) over the concurrent step that holds it (2.1 s): at
    # most that step (it failed CI twice as link_share 1.01 and 1.26).
    link["grad_allreduce"]["cost_s"] = 2.5
    out = cal.speedup_model(cfg, 2, hosts, link, [4, 4])
    assert out["t_grad_allreduce_s"] == 2.1 and out["link_share"] == 1.0, out
    # Shares [6, 2]: each host at its own batch, from its sweep where the concurrent step timed another.
    link["grad_allreduce"]["cost_s"] = 0.1
    out = cal.speedup_model(cfg, 2, hosts, link, [6, 2])
    assert out["t_dual_step_s"] == pytest.approx(1.5 + 0.1) and out["rank_batches"] == [6, 2]
    assert out["dual_how"] == {"mac4": "interpolated", "mac5": "extrapolated"}, out


def rank(batch, local_s, lo, hi, ssh="mac4"):
    return {"ssh": ssh, "batch": batch, "local_step_s": local_s, "records_per_s": batch / local_s,
            "noise": (hi - lo) / local_s}


def test_shares_follow_measured_speed_beyond_the_noise():
    """Equal hosts (3% apart) share equally; one at half speed gets a third of the batch; a host whose
    own steps vary by 60% is not told apart from one 50% slower."""
    cfg = {"batch_size": 12}
    same = cal.shares_rule(cfg, {"ranks": [rank(6, 1.0, 0.99, 1.01), rank(6, 1.03, 1.02, 1.04)]})
    assert same["shares"] == [1, 1] and same["rule"] == "equal" and "3%" in same["why"], same
    half_ranks = [rank(6, 1.0, 0.99, 1.01), rank(6, 2.0, 1.98, 2.02)]
    half = cal.shares_rule(cfg, {"ranks": half_ranks})
    assert half["shares"] == [8, 4] and half["rule"] == "proportional", half
    assert "records/s 6 : 3 (ranks in hostfile order) differ by 100%" in half["why"]
    # the gain over the split measured: 2 s (6 records at 3/s) vs 1.33 s (8 at 6/s, 4 at 3/s), no all-reduce
    assert half["expected_gain"] == pytest.approx(1.5)
    slow_link = cal.shares_rule(cfg, {"ranks": half_ranks, "grad_allreduce": {"cost_s": 1.0}})
    assert slow_link["expected_gain"] == pytest.approx(3 / (1 + 4 / 3))  # the all-reduce is not shared
    noisy = cal.shares_rule(cfg, {"ranks": [rank(6, 1.0, 0.7, 1.3), rank(6, 1.5, 1.45, 1.55)]})
    assert noisy["rule"] == "equal" and noisy["noise"] == pytest.approx(0.6), noisy
    three = cal.shares_rule({"batch_size": 8}, {"ranks": [rank(2, 1.0, 1, 1)] * 2 + [rank(4, 1.0, 1, 1)]})
    assert three["shares"] == [2, 2, 4] and three["rule"] == "proportional"
    assert cal.shares_rule(cfg, None) is None and cal.shares_rule(cfg, {"ranks": []}) is None


# ---- the compute sweep on the real model and the trainer's step ---------------------------------
@pytest.fixture(scope="module")
def stepper(model):
    from lib import config as C

    cfg = C.load_config(ROOT / "configs" / "smoke.yaml")
    cfg.update(model=str(ROOT / MODEL), max_seq_length=32)
    return cal.stepper(cfg)


def sweep_spec(**kw):
    return {"budget_s": 60.0, "max_batch": 2, "steps": 1, "mem_fraction": 0.8, "must": [3, 4], **kw}


def test_the_stepper_runs_the_trainers_compiled_step(stepper):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    before = {k: mx.array(v) for k, v in tree_flatten(stepper.model.trainable_parameters())}
    row = cal.measure_batch(stepper, 2, 1)
    after = dict(tree_flatten(stepper.model.trainable_parameters()))
    assert any(not mx.array_equal(before[k], after[k]).item() for k in before)  # the optimizer updated LoRA
    assert row["tokens_per_step"] == 2 * 31 and stepper.trainable_params == sum(v.size for v in before.values())
    assert stepper.trainable_bytes == sum(v.nbytes for v in before.values())
    local = cal.measure_batch(stepper, 2, 1, update=False)  # the step without its all-reduce and update
    still = dict(tree_flatten(stepper.model.trainable_parameters()))
    assert all(mx.array_equal(after[k], still[k]).item() for k in after) and local["tokens_per_step"] == 2 * 31


def test_compute_sweep_measures_up_to_max_batch(stepper):
    out = cal.compute_sweep(stepper, sweep_spec())
    assert [r["batch"] for r in out["sweep"]] == [1, 2, 3, 4]  # powers of two plus the config's sizes
    assert out["stopped"]["reason"] == "max_batch" and out["memory_ceiling_bytes"] > 0
    for r in out["sweep"]:
        assert r["tokens_per_step"] == r["batch"] * 31 and r["tok_per_s"] > 0 and r["step_s"] > 0
    peaks = [r["peak_mem_bytes"] for r in out["sweep"]]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_compute_sweep_stops_at_the_memory_ceiling_and_the_time_budget(stepper):
    out = cal.compute_sweep(stepper, sweep_spec(mem_fraction=1e-9))
    assert out["stopped"]["reason"] == "memory" and len(out["sweep"]) == 1 and out["sweep"][0]["over_memory"]
    out = cal.compute_sweep(stepper, sweep_spec(budget_s=1e-3))
    assert out["stopped"]["reason"] == "time" and len(out["sweep"]) == 1
    assert "s of the 0.001 s budget left" in out["stopped"]["detail"]


# ---- the command line ----------------------------------------------------------------------
def calibrate(*args, check=False, **kw):
    return run([PY, "bin/calibrate.py", *args], check=check, **kw)


def test_bad_input_exits_2_naming_the_fix(tmp_path):
    base = ["--model", MODEL, "--config", "configs/smoke.yaml", "--remote-root", str(ROOT),
            "--python", str(ROOT / ".venv/bin/python"), "--out-dir", str(tmp_path)]
    p = calibrate("--hostfile", str(tmp_path / "nope.json"), *base)
    assert p.returncode == 2 and "does not exist" in p.stderr and "RUNBOOK.md#hostfile" in p.stderr
    p = calibrate("--hostfile", "hostfile.local.json", *base, "--min-bytes", "1024", "--max-bytes", "512")
    assert p.returncode == 2 and "RUNBOOK.md#calibrate" in p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 4\n")
    p = calibrate("--hostfile", "hostfile.local.json", *[a if a != "configs/smoke.yaml" else str(bad) for a in base])
    assert p.returncode == 2 and "batch_sise" in p.stderr and "did you mean 'batch_size'" in p.stderr
    assert not list(tmp_path.glob("calibration-*.json"))


def test_a_failing_probe_exits_1_names_the_host_and_writes_nothing(tmp_path, model):
    p = calibrate("--hostfile", "hostfile.local.json", "--model", MODEL, "--config", "configs/smoke.yaml",
                  "--remote-root", str(ROOT), "--python", "/nonexistent/bin/python", "--out-dir", str(tmp_path),
                  timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "127.0.0.1: the compute probe failed (exit 127)" in p.stderr and "/nonexistent/bin/python" in p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#calibrate")
    assert not list(tmp_path.glob("calibration-*.json"))


def test_a_link_probe_whose_ranks_cannot_start_fails_with_the_category(tmp_path, model):
    """A ring port already taken: the runtime parity category, no file, no probe left running."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        p = calibrate("--hostfile", "hostfile.local.json", "--model", MODEL, "--config", "configs/smoke.yaml",
                      "--remote-root", str(ROOT), "--python", str(ROOT / ".venv/bin/python"), "--out-dir",
                      str(tmp_path), "--skip-compute", "--max-bytes", "65536", "--port", str(s.getsockname()[1]),
                      "--timeout-s", "60", timeout=180)
    finally:
        s.close()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED category: runtime parity: the link probe failed" in p.stderr, p.stderr
    assert "Couldn't bind socket" in p.stderr and p.stderr.rstrip().endswith("see RUNBOOK.md#runtime-parity")
    assert not list(tmp_path.glob("calibration-*.json"))
    left = subprocess.run(["pgrep", "-f", r"bin/calibrate\.py --rank-probe"], capture_output=True, text=True)
    assert not left.stdout.strip()


# ---- make calibrate on the fabric: the acceptance ------------------------------------------------
@pytest.mark.fabric
@pytest.mark.slow
def test_make_calibrate_on_two_fabric_hosts(fabric, model, tmp_path):
    """make calibrate (sync, check-parity, calibrate) on fab1+fab2 over the ring backend, all_sum up
    to 1 MiB (bigger sizes only cost test time: the fabric's hosts share this machine's cores)."""
    hf = fabric.hostfile(2)
    out = tmp_path / "cal"
    try:
        p = make("calibrate", f"HOSTFILE={hf}", f"REMOTE_ROOT={fabric.remote_root}", f"PYTHON={fabric.python}",
                 f"MODEL={MODEL}", f"DATASET={DATASET}", "CONFIG=configs/smoke.yaml", "RUN=fab-calibrate",
                 f"CALIBRATE_ARGS=--budget-s 10 --max-batch 2 --steps 1 --max-bytes 1048576 --out-dir {out}",
                 env=fabric.env(), timeout=600)
    finally:
        shutil.rmtree(ROOT / "runs" / "fab-calibrate", ignore_errors=True)  # its sync.json
    files = sorted(out.glob("calibration-*.json"))
    assert len(files) == 1, p.stdout
    doc = json.loads(files[0].read_text())
    assert doc["format"] == "thunder-runbook/calibration" and doc["hostfile"]["world_size"] == 2
    assert [h["ssh"] for h in doc["hosts"]] == ["fab1", "fab2"]
    for h in doc["hosts"]:
        assert h["facts"]["hostname"] == h["ssh"] and h["sweep"] and h["stopped"]["reason"] in (
            "max_batch", "time", "memory")
        assert all(r["tok_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in h["sweep"])
    assert doc["shared_machine"] == [["fab1", "fab2"]]  # namespaces of one kernel
    link = doc["link"]
    sizes = [r["bytes"] for r in link["allreduce"]]
    assert sizes[0] == 4096 and sizes[-1] == MiB and sizes == sorted(sizes)
    assert all(r["mean_s"] >= r["min_s"] > 0 for r in link["allreduce"])
    assert set(link["concurrent"]) == {"fab1", "fab2"} and link["reuse_freed_memory"] is True
    # each rank timed at its share (smoke.yaml: 6 records, even), and the shares rule applied to them
    assert [(r["ssh"], r["batch"]) for r in link["ranks"]] == [("fab1", 3), ("fab2", 3)], link["ranks"]
    assert all(r["records_per_s"] > 0 and r["noise"] >= 0 for r in link["ranks"])
    shares = doc["rank_shares"]
    assert shares["rule"] in ("equal", "proportional") and len(shares["shares"]) == 2, shares
    assert shares["shares"] == [1, 1] if shares["rule"] == "equal" else sum(shares["shares"]) == 6, shares
    g = link["grad_allreduce"]
    assert g["bytes"] == doc["trainable_bytes"] > 0 and g["cost_s"] == max(g["alone_s"], g["in_step_s"]) > 0
    print(f"load {doc['loadavg']['start']}: all_sum best busbw {link['bandwidth_gbps']['busbw_best']:.3f} GB/s")
    assert doc["expected_speedup"] > 0 and doc["compute_bound_speedup"] >= doc["expected_speedup"]
    assert 0 <= doc["link_share"] < 1 and doc["speedup"]["dual_how"]["fab2"] == "measured with every rank computing"
    assert doc["recommendation"]["per_rank_batch"] * doc["recommendation"]["grad_accumulation_steps"] * 2 == 6
    assert "calibrate-done file" in p.stdout and "expected_speedup" in p.stdout
    for h in ("fab1", "fab2"):  # nothing of the probe is left on the hosts
        assert not fabric.procs(h, r"bin/calibrate\.py"), h
