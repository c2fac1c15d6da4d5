"""plan: the coordinator-format training plan from real inputs (a local check-parity, sync and
calibration), validated against the format's SCHEMA below; unknowns said explicitly; foreign or
stale inputs not used; the schema itself refuses what it must."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import shutil

import pytest
from conftest import PY, ROOT, make, run

spec = importlib.util.spec_from_file_location("plan", ROOT / "bin" / "plan.py")
plan_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_mod)

MODEL = "models/tiny-gemma4"
DATASET = "domain_sft_v1_high_signal_thunder"
CONFIG = "configs/smoke.yaml"
LOCAL = "hostfile.local.json"
VENV_PY = str(ROOT / ".venv" / "bin" / "python")
RUN = f"plantest-{os.getpid()}"
PLACEHOLDERS = ("todo", "tbd", "placeholder", "n/a", "xxx", "...", "samples/sec", "gs://")


def M(inner):
    """A measured value, or the explicit unknown object."""
    return ("?", inner)


# ---- the coordinator format's schema (version 2.0.0): {key: spec} is an object with exactly those keys,
# [spec, n] an array of at least n, "=a|b" one of those strings, "kind>=n" a bounded number, M(spec)
# spec or an unknown ------------------------------------------------------------------------------
STATUS = "=pass|fail|unknown"
SCHEMA = {
    "version": "=" + plan_mod.VERSION, "generated": {"created": "str", "tool": "str", "git": "map", "command": "str"},
    "sources": {"hostfile": "map", "config": "map", "model_sha256": "str", "parity": M("map"), "calibration": M("map")},
    "unknowns": [{"field": "str", "reason": "str"}, 0],
    "strategy": {"approach": "str", "parallelism": "=data", "nodes": "int>=1", "total_gpus": "int>=1",
                 "gpus_per_node": "int>=1", "device": M("str"), "trainable_params": M("int>=1")},
    "batch_configuration": {
        "per_gpu_batch_size": M("int>=1"), "total_batch_size": "int>=1", "gradient_accumulation_steps": "int>=1",
        "learning_rate": "num>=0", "warmup_epochs": M("num>=0"), "epochs": M("num>=0"), "fits_memory": M("bool"),
        "epochs_warning": "text",
        "recommended": M({"per_gpu_batch_size": "int>=1", "gradient_accumulation_steps": "int>=1",
                          "config_batch_size": "int>=1", "largest_fitting_batch": "int>=1",
                          "largest_fitting_batch_kind": "=measured|lower_bound", "why": "str"})},
    "distributed_config": {"mlx_launch_command": "str", "gradient_sync": "str",
                           "backend": "=ring|jaccl|jaccl-ring|mpi|nccl", "unified_memory": M("bool"),
                           "mlx_env_vars": "map"},
    "rdma_config": {"enabled": "bool", "backend": "str", "platform": "str", "verified": M("bool"), "setup": M("str"),
                    "env_vars": "map", "expected_speedup": M("num>=0")},
    "checkpoint_strategy": {"approach": "str", "async": "bool", "compression": "str", "storage": "str",
                            "frequency": "str", "retention": "str", "resume_command": "str",
                            "expected_recovery_time": M({"seconds": "num>=0", "source": "str"})},
    "performance_targets": {"throughput": M({"tok_per_s": "num>=0", "source": "str"}), "expected_speedup": M("num>=0"),
                            "min_speedup": "num>=0", "gpu_utilization": M("num>=0"), "peak_memory_gb": M("num>=0"),
                            "checkpoint_overhead": {"target_pct": "num>=0", "measured_pct": M("num>=0")}},
    "verification_steps": ["str", 3],
    "pre_rdma_sync": {"sync_script": "str", "command": "str", "validation_checks": ["str", 1], "block_on_failure": "bool",
                      "sync_status": M("=success|failed"), "sync_output": M("str")},
    "hardware_calibration": {"measured_performance": M("map"), "workload_distribution": M("map"),
                             "workload_rule": M("=proportional|equal"), "workload_why": M("str"), "macos_qos_api": "str",
                             "calibration_notes": M("str"), "calibration_file": M("str")},
    "worker_consistency": {"validation_checks": ["str", 1], "script_hash": "str",
                           "is_consistent": M("bool"), "consistency_threshold": "num>=0",
                           "divergent_workers": M(["str", 0]), "byzantine_detection": {"enabled": "false", "reason": "str"}},
    "coordinator_chunking": {"enabled": "bool", "chunk_size": "int>=1", "dataset_size": M("int>=0"),
                             "num_chunks": M("int>=0"), "why": "str", "progress_reporting": "str",
                             "memory_management": {"gc_collect": "bool", "mx_clear_cache": "bool"}},
    "pre_flight_checklist": {"checks": [{"name": "=" + "|".join(plan_mod.LAYERS), "status": STATUS, "detail": "str",
                                         "fix_command": "text"}, len(plan_mod.LAYERS)],
                             "validation_layers": ["str", 1], "block_on_failure": "bool", "overall_status": STATUS},
}
KINDS = {"str": lambda v: isinstance(v, str) and v != "", "text": lambda v: isinstance(v, str),
         "bool": lambda v: isinstance(v, bool), "false": lambda v: v is False, "map": lambda v: isinstance(v, dict),
         "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "num": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def validate(obj, spec, path: str = "$") -> list[str]:
    """Errors of obj against a SCHEMA spec (empty: valid)."""
    if isinstance(spec, tuple):  # M(spec)
        if isinstance(obj, dict) and set(obj) == {"value", "unknown"} and obj["value"] is None:
            return [] if isinstance(obj["unknown"], str) and len(obj["unknown"]) >= 3 else [f"{path}: unknown without why"]
        return validate(obj, spec[1], path)
    if isinstance(spec, dict):
        if not isinstance(obj, dict):
            return [f"{path}: expected an object, got {json.dumps(obj)[:60]}"]
        errs = [f"{path}: missing key {k!r}" for k in spec if k not in obj]
        errs += [f"{path}: unexpected key {k!r}" for k in obj if k not in spec]
        return errs + [e for k in spec if k in obj for e in validate(obj[k], spec[k], f"{path}.{k}")]
    if isinstance(spec, list):
        if not isinstance(obj, list):
            return [f"{path}: expected an array, got {json.dumps(obj)[:60]}"]
        errs = [f"{path}: {len(obj)} items, at least {spec[1]} required"] if len(obj) < spec[1] else []
        return errs + [e for i, v in enumerate(obj) for e in validate(v, spec[0], f"{path}[{i}]")]
    if spec.startswith("="):
        return [] if obj in spec[1:].split("|") else [f"{path}: {obj!r} is not one of {spec[1:].split('|')}"]
    kind, _, low = spec.partition(">=")
    if not KINDS[kind](obj):
        return [f"{path}: expected {kind}, got {json.dumps(obj)[:60]}"]
    return [f"{path}: {obj} < minimum {low}"] if low and obj < float(low) else []


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """A runs folder with a real check-parity result, sync.json and calibration for the two local ranks."""
    if not (ROOT / MODEL / "config.json").is_file():
        make("tiny-model", "ARCH=gemma4")
    if not (ROOT / "datasets" / DATASET / "manifest.json").is_file():
        make("export")
    r = tmp_path_factory.mktemp("runs")
    p = run([PY, "bin/check_parity.py", "--hostfile", LOCAL, "--python", VENV_PY, "--remote-root", str(ROOT),
             "--model", MODEL, "--dataset", DATASET, "--state-dir", str(r / "parity"), "--min-disk-gb", "0.1"],
            check=False)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    run([PY, "bin/sync.py", "--hostfile", LOCAL, "--remote-root", str(ROOT), "--dataset", DATASET, "--model", MODEL,
         "--run", RUN])
    shutil.move(str(ROOT / "runs" / RUN), str(r / RUN))
    run([PY, "bin/calibrate.py", "--hostfile", LOCAL, "--model", MODEL, "--config", CONFIG, "--remote-root", str(ROOT),
         "--python", VENV_PY, "--budget-s", "30", "--max-batch", "2", "--steps", "1", "--max-bytes", "262144",
         "--out-dir", str(r)], timeout=300)
    return r


def plan(runs, *extra, hostfile=LOCAL, config=CONFIG, check=True):
    p = run([PY, "bin/plan.py", "--hostfile", hostfile, "--config", config, "--model", MODEL, "--dataset", DATASET,
             "--remote-root", str(ROOT), "--python", VENV_PY, "--run", RUN, "--runs-dir", str(runs), *extra],
            check=check)
    doc = json.loads((runs / "plan.json").read_text()) if (runs / "plan.json").is_file() else None
    return p, doc


def leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_plan_from_measured_inputs(runs_dir):
    p, doc = plan(runs_dir, "--min-speedup", "0", "--strict")
    assert p.returncode == 0, p.stdout + p.stderr
    assert validate(doc, SCHEMA) == []
    stamped = sorted(runs_dir.glob("plan-*.json"))
    assert stamped and json.loads(stamped[-1].read_text()) == doc
    assert doc["version"] == "2.0.0" and all(s in doc for s in plan_mod.SECTIONS)
    cal = json.loads(sorted(runs_dir.glob("calibration-*.json"))[-1].read_text())
    st, bc, pt = doc["strategy"], doc["batch_configuration"], doc["performance_targets"]
    assert (st["total_gpus"], st["nodes"], st["gpus_per_node"]) == (2, 1, 2)
    assert st["trainable_params"] == cal["trainable_params"] and st["device"] == "Device(cpu, 0)"
    assert (bc["per_gpu_batch_size"], bc["total_batch_size"], bc["gradient_accumulation_steps"]) == (3, 6, 1)
    assert bc["recommended"]["per_gpu_batch_size"] == cal["recommendation"]["per_rank_batch"]
    assert bc["fits_memory"] is True
    assert pt["expected_speedup"] == cal["expected_speedup"] and pt["min_speedup"] == 0
    assert pt["throughput"]["tok_per_s"] > 0
    hc = doc["hardware_calibration"]
    assert hc["calibration_file"].endswith(sorted(runs_dir.glob("calibration-*.json"))[-1].name)
    assert set(hc["measured_performance"]) == {"127.0.0.1"} and hc["workload_distribution"] == {"127.0.0.1": 1.0}
    assert hc["workload_rule"] == cal["rank_shares"]["rule"] and cal["rank_shares"]["why"] in hc["workload_why"]
    assert "the run splits evenly: set `rank_shares: auto`" in hc["workload_why"], hc  # smoke.yaml sets none
    assert doc["distributed_config"]["mlx_launch_command"].startswith(str(ROOT / ".venv" / "bin" / "mlx.launch"))
    assert doc["distributed_config"]["unified_memory"] is False  # Linux x86_64: measured, not assumed
    assert doc["rdma_config"]["enabled"] is False
    assert doc["pre_rdma_sync"]["sync_status"] == "success"
    assert doc["worker_consistency"]["is_consistent"] is True and doc["worker_consistency"]["divergent_workers"] == []
    assert doc["coordinator_chunking"]["dataset_size"] == json.loads(
        (ROOT / "datasets" / DATASET / "manifest.json").read_text())["counts"]["train"]
    checks = {c["name"]: c for c in doc["pre_flight_checklist"]["checks"]}
    assert set(checks) == set(plan_mod.LAYERS)
    assert all(c["status"] == "pass" for c in checks.values()), checks
    assert doc["pre_flight_checklist"]["overall_status"] == "pass"
    # measured values, never placeholders; what is not known says why
    for path, v in leaves({k: doc[k] for k in plan_mod.SECTIONS}):
        if isinstance(v, str):
            assert not any(w in v.lower() for w in PLACEHOLDERS), (path, v)
    assert {u["field"] for u in doc["unknowns"]} >= {"performance_targets.gpu_utilization", "rdma_config.verified"}
    assert "plan-check name worker_layer status pass" in p.stdout and "overall_status pass" in p.stdout


def test_plan_with_nothing_measured_says_so_and_strict_fails(tmp_path):
    p, doc = plan(tmp_path, check=False)
    assert p.returncode == 0, p.stderr
    assert validate(doc, SCHEMA) == []
    unknown = {u["field"]: u["reason"] for u in doc["unknowns"]}
    assert "no calibration yet: run `make calibrate" in unknown["performance_targets.expected_speedup"]
    assert "no check-parity result" in unknown["worker_consistency.is_consistent"]
    assert doc["batch_configuration"]["recommended"] == {"value": None, "unknown": unknown[
        "batch_configuration.recommended"]}
    assert doc["pre_flight_checklist"]["overall_status"] == "unknown"
    assert doc["batch_configuration"]["per_gpu_batch_size"] == 3  # from the config: known without measuring
    p, _ = plan(tmp_path, "--strict", check=False)
    assert p.returncode == 1 and "pre-flight unknown" in p.stderr and "see RUNBOOK.md#plan" in p.stderr


@pytest.mark.parametrize("iters, warned", [(20, "raise iters"), (400, None),
                                           (4000, "lower iters")])
def test_epochs_are_iters_times_batch_size_over_the_train_records(tmp_path, iters, warned):
    """#39: the plan says how many passes over this dataset's train split `iters` makes (an
    iteration is one batch of batch_size records, whatever grad_accumulation_steps), and warns out
    of 0.5..10 epochs, naming what to change."""
    import yaml

    cfg = yaml.safe_load((ROOT / CONFIG).read_text())
    cfg.update(iters=iters, grad_accumulation_steps=2, save_every=2)
    config = tmp_path / "epochs.yaml"
    config.write_text(yaml.safe_dump(cfg))
    p, doc = plan(tmp_path, config=str(config))
    assert validate(doc, SCHEMA) == []
    man = json.loads((ROOT / "datasets" / DATASET / "manifest.json").read_text())
    records = man["files"]["train.jsonl"]["records"]
    epochs = iters * cfg["batch_size"] / records
    bc = doc["batch_configuration"]
    assert bc["epochs"] == pytest.approx(epochs)
    assert f"plan-epochs epochs {epochs:.6g} train_records {records}" in p.stdout, p.stdout
    if warned is None:
        assert bc["epochs_warning"] == "" and "warning stage plan" not in p.stdout
        return
    assert warned in bc["epochs_warning"] and str(config) in bc["epochs_warning"], bc
    assert f"is {epochs:.2f} epochs of {records} train records" in bc["epochs_warning"]
    assert f"one epoch: {math.ceil(records / cfg['batch_size'])} iters" in bc["epochs_warning"]
    assert f"warning stage plan what epochs message {json.dumps(bc['epochs_warning'])}" in p.stdout


def test_a_calibration_of_other_hosts_or_settings_is_not_used(runs_dir):
    _, doc = plan(runs_dir, hostfile="hostfile.json")  # Mac4 + Mac5: nothing here was measured for them
    assert validate(doc, SCHEMA) == []
    why = doc["performance_targets"]["expected_speedup"]["unknown"]
    assert "was measured for hosts ['127.0.0.1', '127.0.0.1']" in why and "make calibrate HOSTFILE=hostfile.json" in why
    assert "checked ['127.0.0.1'], not ['mac4', 'mac5']" in doc["worker_consistency"]["is_consistent"]["unknown"]
    _, doc = plan(runs_dir, config="configs/demo.yaml")
    why = doc["hardware_calibration"]["calibration_file"]["unknown"]
    assert "max_seq_length 256, not 192" in why
    # The recommended batch and its memory are the config's loss's: a calibration of the other loss is refused.
    chunked = runs_dir / "chunked.yaml"
    chunked.write_text((ROOT / CONFIG).read_text().replace("loss: default", "") + "loss: chunked\n")
    _, doc = plan(runs_dir, config=str(chunked))
    why = doc["hardware_calibration"]["calibration_file"]["unknown"]
    assert "loss 'default', not 'chunked'" in why and "make calibrate" in why, why


def test_stale_or_failing_parity(runs_dir, tmp_path):
    _, doc = plan(runs_dir, "--max-parity-age-s", "0")
    checks = {c["name"]: c for c in doc["pre_flight_checklist"]["checks"]}
    assert checks["health_check"]["status"] == "unknown" and "min old" in checks["health_check"]["detail"]
    # the same result with one host's code differing: the worker layer fails and names it
    shutil.copytree(runs_dir, tmp_path / "r", dirs_exist_ok=True)
    last = tmp_path / "r" / "parity" / "last.json"
    res = json.loads(last.read_text())
    for c in res["checks"]:
        if c["name"] == "code":
            c.update(status="fail", detail="differs: lib/hostfile.py", fix="make sync")
    res["status"], res["code"] = "CRITICAL", 2
    last.write_text(json.dumps(res))
    _, doc = plan(tmp_path / "r")
    checks = {c["name"]: c for c in doc["pre_flight_checklist"]["checks"]}
    assert checks["worker_consistency"]["status"] == "fail" and "differs: lib/hostfile.py" in checks[
        "worker_consistency"]["detail"]
    assert checks["health_check"]["status"] == "fail"
    assert doc["worker_consistency"]["divergent_workers"] == ["127.0.0.1"]
    assert doc["worker_consistency"]["is_consistent"] is False
    assert doc["pre_flight_checklist"]["overall_status"] == "fail"
    # a hand-edited result (a bad ts) is not check-parity's output: the plan says so, it does not stop
    last.write_text(json.dumps({**res, "ts": "yesterday"}))
    p, doc = plan(tmp_path / "r")
    checks = {c["name"]: c for c in doc["pre_flight_checklist"]["checks"]}
    assert p.returncode == 0 and checks["health_check"]["status"] == "unknown", checks["health_check"]
    assert "is not check-parity's output" in checks["health_check"]["detail"], checks["health_check"]
    last.write_text(json.dumps({**res, "checks": ["not", "a", "check"]}))  # checks that are not objects
    p, doc = plan(tmp_path / "r")
    health = {c["name"]: c for c in doc["pre_flight_checklist"]["checks"]}["health_check"]
    assert p.returncode == 0 and "is not check-parity's output" in health["detail"], health


def test_schema_refuses_what_it_must(runs_dir):
    _, good = plan(runs_dir)
    assert validate(good, SCHEMA) == []

    def errs(mutate):
        d = copy.deepcopy(good)
        mutate(d)
        return validate(d, SCHEMA)

    assert any("missing key 'rdma_config'" in e for e in errs(lambda d: d.pop("rdma_config")))
    assert errs(lambda d: d.update(version="1.0.0"))
    assert errs(lambda d: d["performance_targets"].update(expected_speedup="2-3x over TCP ring"))  # a placeholder
    assert errs(lambda d: d["performance_targets"].update(expected_speedup={"value": None}))  # unknown without why
    assert errs(lambda d: d["performance_targets"].update(expected_speedup={"value": 1.5, "unknown": "x"}))
    assert errs(lambda d: d["strategy"].update(total_gpus=0))
    assert errs(lambda d: d["strategy"].update(total_gpus=True))  # a bool is not an integer
    assert any("unexpected key 'gpu_count'" in e for e in errs(lambda d: d["strategy"].update(gpu_count=2)))
    assert errs(lambda d: d["pre_flight_checklist"].update(overall_status="maybe"))
    assert errs(lambda d: d["pre_flight_checklist"]["checks"].pop())
    assert errs(lambda d: d["worker_consistency"]["byzantine_detection"].update(enabled=True))
    assert errs(lambda d: d["batch_configuration"].update(learning_rate=float("nan")))


def test_make_plan(runs_dir):
    p = make("-n", "plan", f"RUN={RUN}", f"HOSTFILE={LOCAL}", f"CONFIG={CONFIG}", f"MODEL={MODEL}", "MIN_SPEEDUP=0")
    assert f"bin/plan.py --run {RUN} --hostfile {LOCAL} --config {CONFIG}" in p.stdout and "--min-speedup 0" in p.stdout
    before = set((ROOT / "runs").glob("plan-*.json"))
    p = make("plan", f"RUN={RUN}", f"HOSTFILE={LOCAL}", f"CONFIG={CONFIG}", f"MODEL={MODEL}", f"REMOTE_ROOT={ROOT}",
             f"PYTHON={VENV_PY}")
    new = set((ROOT / "runs").glob("plan-*.json")) - before
    try:
        assert len(new) == 1 and "plan file runs/plan-" in p.stdout
        doc = json.loads((ROOT / "runs" / "plan.json").read_text())
        assert validate(doc, SCHEMA) == [] and doc == json.loads(next(iter(new)).read_text())
    finally:
        for f in new:
            f.unlink()


def test_workload_follows_the_calibrations_shares_rule():
    """#29: two Macs, one measured at half the other's records/s: the plan gives it a third of the batch,
    says the rule and why, and says what CONFIG makes of it; equal shares give 1/N; no shares rule in the
    calibration is an explicit unknown."""
    import types

    from lib.hostfile import parse

    hf = parse({"backend": "ring", "hosts": [{"ssh": "mac4", "ips": ["10.0.0.4"]}, {"ssh": "mac5", "ips": ["10.0.0.5"]}]})
    rule = {"shares": [4, 2], "rule": "proportional", "why": "records/s 6 : 3 differ by 100%"}
    c = types.SimpleNamespace(hf=hf, world=2, nodes={"mac4": 1, "mac5": 1}, cal={"file": "cal.json", "rank_shares":
                              rule}, cal_why=None, cfg={"batch_size": 6, "rank_shares": "auto"},
                              args=types.SimpleNamespace(config="configs/stage1.yaml"))
    w = plan_mod.workload(c)
    assert w["workload_distribution"] == pytest.approx({"mac4": 2 / 3, "mac5": 1 / 3}) and w["workload_rule"] == \
        "proportional" and w["workload_why"] == "records/s 6 : 3 differ by 100%; configs/stage1.yaml: the run " \
        "takes these (rank_shares: auto)", w
    c.cfg["rank_shares"], c.cal["rank_shares"] = [5, 3], dict(rule, shares=[1, 1], rule="equal")
    w = plan_mod.workload(c)
    assert w["workload_distribution"] == {"mac4": 0.5, "mac5": 0.5} and w["workload_rule"] == "equal"
    assert w["workload_why"].endswith("the run takes its own rank_shares [5, 3]")
    del c.cal["rank_shares"]
    assert plan_mod.workload(c)["workload_rule"] == {"value": None, "unknown": "cal.json has no rank_shares (one "
                                                                               "rank, or --skip-compute)"}
