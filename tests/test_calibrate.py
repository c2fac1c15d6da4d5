"""calibrate: the model from measurements to a speedup, the compute sweep's stops, bad input,
and `make calibrate` on the multi-host fabric (its all_sum bandwidth against a bare TCP
transfer between the same hosts, measured in the same run)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
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
CURVE = [{"bytes": 4096, "mean_s": 1e-4, "min_s": 5e-5}, {"bytes": MiB, "mean_s": 1e-3, "min_s": 8e-4},
         {"bytes": 64 * MiB, "mean_s": 0.1, "min_s": 0.08}]


def test_interp_time_follows_the_measured_curve():
    assert cal.interp_time(CURVE, 4096) == 1e-4
    assert cal.interp_time(CURVE, 100) == 1e-4  # below the smallest: its latency
    assert cal.interp_time(CURVE, MiB) == 1e-3
    assert cal.interp_time(CURVE, 128 * MiB) == pytest.approx(0.2)  # above: the largest's bandwidth
    mid = cal.interp_time(CURVE, 8 * MiB)  # log-log between 1 MiB and 64 MiB
    assert 1e-3 < mid < 0.1
    assert mid == pytest.approx(0.01)  # half way in log size (1 -> 8 -> 64 MiB): half way in log time
    sizes = [2 ** k for k in range(10, 30)]
    times = [cal.interp_time(CURVE, s) for s in sizes]
    assert times == sorted(times)  # monotone


def test_grad_buckets_are_average_gradients_groups(model):
    """The message sizes the model charges are exactly mlx.nn.average_gradients' groups, on the
    tiny model's real LoRA tree and on a large synthetic one."""
    import mlx.nn.utils as nnu

    from lib import config as C

    cfg = C.load_config(ROOT / "configs" / "smoke.yaml")
    cfg["model"] = str(ROOT / MODEL)
    stepper = cal.Stepper(cfg)
    arrays = stepper.trainable_arrays
    assert arrays and stepper.trainable_params == sum(math.prod(a[1]) for a in arrays)
    for bucket in (cal.ALL_REDUCE_BUCKET, 16 * 1024, 1024):
        groups = nnu._group_by_size([a[0] for a in arrays], [math.prod(a[1]) for a in arrays], 4, bucket)
        want = [sum(arrays[i][3] for i in g) for g in groups]
        assert cal.grad_buckets(arrays, bucket) == want
    big = [(f"w{i}", (1024, 1024), "mlx.core.float32", 4 * MiB) for i in range(20)]  # 80 MiB
    assert cal.grad_buckets(big) == [32 * MiB, 32 * MiB, 16 * MiB]
    mixed = [("a", (4,), "mlx.core.float32", 16), ("b", (4,), "mlx.core.bfloat16", 8)]
    assert cal.grad_buckets(mixed) == [16, 8]  # mixed dtypes: one all_sum per array


def test_step_time_at_and_max_fitting_batch():
    sweep = [{"batch": 1, "step_s": 1.0, "peak_mem_bytes": 100}, {"batch": 2, "step_s": 1.5, "peak_mem_bytes": 150},
             {"batch": 4, "step_s": 2.5, "peak_mem_bytes": 250}]
    assert cal.step_time_at(sweep, 2) == (1.5, "measured")
    assert cal.step_time_at(sweep, 3) == (2.0, "interpolated")
    assert cal.step_time_at(sweep, 8) == (4.5, "extrapolated")
    assert cal.step_time_at([], 2) == (None, "no measurement")
    host = {"sweep": sweep, "stopped": {"reason": "memory", "next_batch": 8}, "memory_ceiling_bytes": 1000,
            "mem_fraction": 0.8}
    assert cal.max_fitting_batch(host) == (4, "measured: batch 8 would not fit", "measured")
    host["stopped"] = {"reason": "time"}
    b, how, kind = cal.max_fitting_batch(host)  # peak = 50 + 50 b; 0.8 x 1000 -> b = 15, capped at 4 x 4
    assert (b, kind) == (15, "predicted") and "predicted" in how
    host["memory_ceiling_bytes"] = 10**9
    assert cal.max_fitting_batch(host)[0] == 16  # the cap: 4x the largest measured
    one = {"sweep": sweep[:1], "stopped": {"reason": "time"}, "memory_ceiling_bytes": 1000, "mem_fraction": 0.8}
    assert cal.max_fitting_batch(one)[:1] == (4,)  # 100 per example, all of it as if it grew: 8, capped at 4
    assert cal.max_fitting_batch({"sweep": sweep, "stopped": {"reason": "time"}})[2] == "lower_bound"


def host(ssh, sweep, stop="memory"):
    return {"ssh": ssh, "sweep": sweep, "stopped": {"reason": stop}, "memory_ceiling_bytes": 10**12,
            "mem_fraction": 0.8, "trainable_arrays": [("w", (1024,), "mlx.core.float32", 4 * MiB)]}


def rows(*pairs):
    return [{"batch": b, "step_s": s, "peak_mem_bytes": b} for b, s in pairs]


def test_recommend_keeps_the_global_batch_and_accumulates_when_it_does_not_fit():
    cfg = {"batch_size": 8, "grad_accumulation_steps": 1}
    hosts = [host("mac4", rows((1, 1.0), (2, 1.8), (4, 3.4))), host("mac5", rows((1, 1.0), (2, 1.8)))]
    rec = cal.recommend(cfg, 2, hosts)
    assert (rec["per_rank_batch"], rec["grad_accumulation_steps"], rec["config_batch_size"]) == (2, 2, 4)
    assert rec["per_rank_batch"] * rec["grad_accumulation_steps"] * 2 == 8
    assert rec["control"] == {"host": "mac4", "batch": 4, "grad_accumulation_steps": 2}
    hosts[1]["sweep"] += rows((4, 3.3))
    rec = cal.recommend(cfg, 2, hosts)
    assert (rec["per_rank_batch"], rec["grad_accumulation_steps"]) == (4, 1) and "fits" in rec["why"]
    assert "not divisible by the world size 3: use 6 or 9" in cal.recommend({"batch_size": 8, "grad_accumulation_steps": 1},
                                                                           3, hosts)["error"]


def test_speedup_model_arithmetic():
    """control 8 on one host vs 4 per rank on two, plus the gradient all_sum at the curve."""
    hosts = [host("mac4", rows((4, 1.0), (8, 2.0))), host("mac5", rows((4, 1.2), (8, 2.4)))]
    split = {"per_rank_batch": 4, "grad_accumulation_steps": 1, "control": {"batch": 8, "grad_accumulation_steps": 1}}
    link = {"allreduce": CURVE}
    out = cal.speedup_model(2, hosts, split, link)
    t_comm = cal.interp_time(CURVE, 4 * MiB) + cal.interp_time(CURVE, 8)
    assert out["t_control_step_s"] == 2.0 and out["t_dual_compute_s"] == 1.2  # the slower host sets the pace
    assert out["expected_speedup"] == pytest.approx(2.0 / (1.2 + t_comm))
    assert out["compute_bound_speedup"] == pytest.approx(2.0 / 1.2)
    assert out["link_share"] == pytest.approx(t_comm / (1.2 + t_comm))
    conc = {"allreduce": CURVE, "concurrent": {"mac4": {"batch": 4, "step_s": 1.9}, "mac5": {"batch": 4, "step_s": 2.1}}}
    out = cal.speedup_model(2, hosts, split, conc)  # ranks sharing a machine: the concurrent time counts
    assert out["t_dual_compute_s"] == 2.1 and out["expected_speedup"] < 1
    assert "no all_sum" in cal.speedup_model(2, hosts, split, None)["unknown"]
    # concurrency measured at a smaller batch: its slowdown scales the alone time at the target
    conc = {"allreduce": CURVE, "concurrent": {"mac4": {"batch": 2, "step_s": 1.0}, "mac5": {"batch": 2, "step_s": 1.0}}}
    hosts[0]["sweep"] += rows((2, 0.5))
    hosts[1]["sweep"] += rows((2, 0.5))
    out = cal.speedup_model(2, hosts, split, conc)
    assert out["t_dual_compute_s"] == pytest.approx(2.4) and "slowdown measured at batch 2" in out["dual_compute_how"]["mac5"]


def test_concurrent_batch_fits_the_budget():
    shared = [dict(host("fab1", rows((1, 1.0), (2, 2.0), (4, 4.0))), ranks=[0], facts={"boot_id": "b"}),
              dict(host("fab2", rows((1, 1.0), (2, 2.0), (4, 4.0))), ranks=[1], facts={"boot_id": "b"})]
    assert cal.ranks_per_machine(shared) == 2
    assert cal.concurrent_batch(shared, 4, 3, 100) == 4  # 4 steps x 4 s x 2 ranks = 32 s
    assert cal.concurrent_batch(shared, 4, 3, 20) == 2  # 4 x 2 x 2 = 16 s
    assert cal.concurrent_batch(shared, 4, 3, 1) == 1  # nothing fits: the smallest measured
    shared[1]["facts"] = {"boot_id": "other"}
    assert cal.ranks_per_machine(shared) == 1 and cal.concurrent_batch(shared, 4, 3, 20) == 4


# ---- the compute sweep on the real model -----------------------------------------------------
@pytest.fixture(scope="module")
def stepper(model):
    from lib import config as C

    cfg = C.load_config(ROOT / "configs" / "smoke.yaml")
    cfg.update(model=str(ROOT / MODEL), max_seq_length=32)
    return cal.Stepper(cfg)


def sweep_spec(**kw):
    spec = {"budget_s": 60.0, "max_batch": 2, "steps": 1, "max_step_s": 60.0, "mem_fraction": 0.8, "must": [3, 4],
            "available_at_start": None}
    spec.update(kw)
    return spec


def test_compute_sweep_measures_up_to_max_batch(stepper):
    out = cal.compute_sweep(stepper, sweep_spec(), lambda r: None)
    assert [r["batch"] for r in out["sweep"]] == [1, 2, 3, 4]  # powers of two plus the config's sizes
    assert out["stopped"]["reason"] == "max_batch"
    for r in out["sweep"]:
        assert r["tokens_per_step"] == r["batch"] * 31 and r["tok_per_s"] > 0 and r["step_s"] > 0
    peaks = [r["peak_mem_bytes"] for r in out["sweep"]]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_compute_sweep_stops_at_the_memory_ceiling_and_the_time_budget(stepper):
    out = cal.compute_sweep(stepper, sweep_spec(mem_fraction=1e-9), lambda r: None)
    assert out["stopped"]["reason"] == "memory" and len(out["sweep"]) == 1 and out["sweep"][0]["over_memory"]
    out = cal.compute_sweep(stepper, sweep_spec(budget_s=1e-3), lambda r: None)
    assert out["stopped"]["reason"] == "time" and len(out["sweep"]) == 1


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
    assert "127.0.0.1: the compute probe failed" in p.stderr and "see RUNBOOK.md#calibrate" in p.stderr
    assert not list(tmp_path.glob("calibration-*.json"))


# ---- make calibrate on the fabric: the acceptance ------------------------------------------------
@pytest.mark.fabric
@pytest.mark.slow
def test_make_calibrate_on_two_fabric_hosts(fabric, model, tmp_path):
    """make calibrate (sync, check-parity, calibrate) on fab1+fab2 over the ring backend; all_sum
    up to 16 MiB. Its large-message bus bandwidth is within a factor of 3 of a bare TCP transfer
    of the same bytes between the same two hosts in the same run: both directions at once, as a
    2-rank ring all_sum moves them. The one-direction figure is printed too (the fabric's hosts
    share this machine's cores, so one direction alone runs well above each direction of a
    two-way exchange: see RUNBOOK.md#calibrate)."""
    hf = fabric.hostfile(2)
    out = tmp_path / "cal"
    args = ["--budget-s 10 --max-batch 2 --steps 1 --max-bytes 16777216 --tcp-reps 5 --grad-reps 3",
            f"--out-dir {out}"]
    try:
        p = make("calibrate", f"HOSTFILE={hf}", f"REMOTE_ROOT={fabric.remote_root}", f"PYTHON={fabric.python}",
                 f"MODEL={MODEL}", f"DATASET={DATASET}", "CONFIG=configs/smoke.yaml", "RUN=fab-calibrate",
                 "CALIBRATE_ARGS=" + " ".join(args), env=fabric.env(), timeout=600)
    finally:
        shutil.rmtree(ROOT / "runs" / "fab-calibrate", ignore_errors=True)  # its sync.json
    files = sorted(out.glob("calibration-*.json"))
    assert len(files) == 1, p.stdout
    doc = json.loads(files[0].read_text())
    assert doc["format"] == "thunder-runbook/calibration" and doc["hostfile"]["world_size"] == 2
    assert [h["ssh"] for h in doc["hosts"]] == ["fab1", "fab2"]
    for h in doc["hosts"]:
        assert h["facts"]["hostname"] == h["ssh"] and h["sweep"] and h["stopped"]["reason"] in (
            "max_batch", "time", "memory", "step_time")
        assert all(r["tok_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in h["sweep"])
    assert doc["shared_machine"] == [["fab1", "fab2"]]  # namespaces of one kernel
    link = doc["link"]
    sizes = [r["bytes"] for r in link["allreduce"]]
    assert sizes[0] == 4096 and sizes[-1] == 16 * MiB and sizes == sorted(sizes)
    assert all(r["mean_s"] >= r["min_s"] > 0 for r in link["allreduce"])
    assert set(link["concurrent"]) == {"fab1", "fab2"}
    assert link["grad_allreduce_measured"]["bytes"] == link["grad_allreduce_modeled"]["bytes"] == doc["trainable_bytes"]
    tcp = link["tcp"]
    assert tcp["sender"] == "fab1" and tcp["receiver"] == "fab2" and tcp["bytes"] == 16 * MiB
    v = link["allreduce_vs_tcp"]
    print(f"load {doc['orchestrator']['loadavg_start']}: all_sum best busbw {v['allsum_busbw_best_gbps']:.3f} GB/s, "
          f"TCP one direction {v['tcp_one_direction_gbps']:.3f} GB/s (x{v['tcp_over_allsum']:.2f}), both "
          f"{v['tcp_both_directions_gbps']:.3f} GB/s (x{v['tcp_both_over_allsum']:.2f}), both into fresh memory "
          f"{v['tcp_both_directions_fresh_gbps']:.3f} GB/s (x{v['tcp_fresh_over_allsum']:.2f})")
    # Within 3x of the bare TCP transfer that moves the same bytes the same way (both directions
    # at once), and never faster than the wire allows.
    assert v["baseline"] == "tcp_both_directions_gbps" and v["tcp_both_over_allsum"] <= 3.0, v
    assert v["allsum_busbw_best_gbps"] <= 3 * v["tcp_one_direction_gbps"]
    # glibc: the curve reuses freed memory (as Metal does); the largest size was also timed without.
    alloc = link["allocator"]
    assert alloc["reuse_freed"] is True and "mallopt" in alloc["how"]
    assert alloc["largest_into_fresh_memory"]["bytes"] == sizes[-1] and alloc["largest_into_fresh_memory"]["min_s"] > 0
    assert doc["expected_speedup"] > 0 and doc["compute_bound_speedup"] >= doc["expected_speedup"]
    assert 0 <= doc["link_share"] < 1
    assert doc["recommendation"]["per_rank_batch"] * doc["recommendation"]["grad_accumulation_steps"] * 2 == 6
    assert "calibrate-done file" in p.stdout and "expected_speedup" in p.stdout
    # nothing of the probe is left on the hosts
    for h in ("fab1", "fab2"):
        assert not fabric.procs(h, r"bin/calibrate\.py"), h
        assert not list((fabric.backing_dir(h) / "runs" / ".calibrate").glob("*"))


def test_rank_probe_cleans_up_when_the_launch_fails(tmp_path, model):
    """A link phase whose ranks cannot start (a port already taken) fails with the category and
    leaves no result folder behind."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        p = calibrate("--hostfile", "hostfile.local.json", "--model", MODEL, "--config", "configs/smoke.yaml",
                      "--remote-root", str(ROOT), "--python", str(ROOT / ".venv/bin/python"), "--out-dir",
                      str(tmp_path), "--skip-compute", "--max-bytes", "65536", "--port", str(port), "--timeout-s", "60",
                      timeout=180)
    finally:
        s.close()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED category: runtime parity: the link probe failed" in p.stderr, p.stderr
    assert "Couldn't bind socket" in p.stderr and p.stderr.rstrip().endswith("see RUNBOOK.md#runtime-parity")
    assert not list(tmp_path.glob("calibration-*.json"))
    left = subprocess.run(["pgrep", "-f", r"bin/calibrate\.py --rank-probe"], capture_output=True, text=True)
    assert not left.stdout.strip()
