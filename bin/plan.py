#!/usr/bin/env python3
"""plan: the training plan as JSON in the coordinator format (version 2.0.0), from what is known.

Usage:
    python bin/plan.py --hostfile HOSTFILE --config CONFIG --model MODEL --dataset NAME \
        --remote-root DIR --python PY [--run RUN] [--strict]
Example (what `make plan` runs):
    python bin/plan.py --hostfile hostfile.json --config configs/stage1.yaml --model models/tiny-gemma4 \
        --dataset domain_sft_v1_high_signal_thunder --remote-root "$PWD" --python "$PWD/.venv/bin/python"

Sections from the hostfile, config, dataset manifest, runs/parity/last.json, the newest matching
calibration and the run's sync/smoke/metrics; what cannot be known is {"value": null, "unknown": "<why>"}.
Written to runs/plan-<UTC>.json and runs/plan.json (tests/test_plan.py holds it to the format's schema).
Exit 0 written (1 with --strict unless every check passes), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import types
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bin.compare import DEFAULT_MIN_SPEEDUP, DEFAULT_TOLERANCE  # noqa: E402
from lib import atomic, hostfile, launch, paths  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import CATEGORIES, THUNDER, RunbookError, die, event  # noqa: E402

ANCHOR, VERSION, CHUNK = "plan", "2.0.0", 50_000  # CHUNK: the assistant's coordinator chunking threshold
SECTIONS = ("strategy", "batch_configuration", "distributed_config", "rdma_config", "checkpoint_strategy",
            "performance_targets", "verification_steps", "pre_rdma_sync", "hardware_calibration",
            "worker_consistency", "coordinator_chunking", "pre_flight_checklist")
LAYERS = ("hardware_layer", "worker_layer", "checkpoint_layer", "gradient_layer", "performance_layer",
          "health_check", "pre_rdma_sync", "worker_consistency")
CONSISTENCY = ("code", "model", "dataset", "runtime")  # check-parity rows every host must pass alike
CAL_KEYS = ("max_seq_length", "num_layers", "fine_tune_type", "lora_parameters", "grad_checkpoint", "loss",
            "loss_chunk_tokens")  # a calibration measured with other values is not used
EPOCHS_LOW, EPOCHS_HIGH = 0.5, 10  # below: most records never trained; above: each memorized


def unknown(reason: str, value=None):
    """value, or when it is None the explicit unknown with its reason."""
    return {"value": None, "unknown": reason} if value is None else value


def unknowns_in(obj: dict, path: str = "") -> list[dict]:
    """Every explicit unknown in the plan's objects (no array holds one), with its dotted path."""
    if set(obj) == {"value", "unknown"} and obj["value"] is None:
        return [{"field": path, "reason": obj["unknown"]}]
    return [u for k, v in obj.items() if isinstance(v, dict)
            for u in unknowns_in(v, f"{path}.{k}".lstrip("."))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--hostfile", "--config", "--model", "--dataset", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--run", default="stage1", help="the run whose sync, smoke and metrics are read")
    p.add_argument("--runs-dir", default=str(paths.RUNS), help="where runs, parity and calibrations live")
    p.add_argument("--max-parity-age-s", type=float, default=3600.0, help="older check-parity is stale")
    p.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                   help="the speedup compare requires")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every pre-flight check passes")
    return p


# ---- inputs ------------------------------------------------------------------------------------
def load_parity(c) -> dict:
    """The check-parity result for these hosts: {file, status, code, ts, checks, stale?} or {error}.
    The newer of the scheduled check's (runs/parity/) and the run's own launch gate's (runs/RUN/parity/)."""
    runs, want = Path(c.args.runs_dir), sorted(set(c.hf.unique_ssh()))
    gates = (runs / c.args.run / "parity" / "last.json", runs / "parity" / "last.json")
    found = [p for p in gates if p.is_file()]
    path = max(found, key=lambda p: p.stat().st_mtime) if found else runs / "parity" / "last.json"
    data, rel, fix = paths.read_json(path), paths.rel(path), f"run `{c.cmd['check-parity']}`"
    if not data:
        return {"error": f"no check-parity result ({rel} missing or unreadable): {fix}"}
    try:
        seen = sorted({x.get("host") for x in data.get("checks", [])} - {"-"})
        out = {k: data[k] for k in ("status", "code", "ts", "checks")} | {"file": rel}
        age = time.time() - datetime.strptime(out["ts"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (AttributeError, KeyError, TypeError, ValueError):
        return {"error": f"{rel} is not check-parity's output (status, code, ts, checks): {fix}"}
    if not set(want) <= set(seen):
        return {"error": f"{rel} checked {seen}, not {want}: {fix}"}
    if age > c.args.max_parity_age_s:
        out["stale"] = (f"{rel} is {age / 60:.0f} min old "
                        f"(limit {c.args.max_parity_age_s / 60:.0f} min): {fix}")
    return out


def load_calibration(c) -> tuple[dict, str]:
    """(the newest calibration if measured for these hosts, model and settings, else {}; why not)."""
    files, fix = sorted(Path(c.args.runs_dir).glob("calibration-*.json")), f"run `{c.cmd['calibrate']}`"
    if not files:
        return {}, f"no calibration yet: {fix}"
    cal, rel = paths.read_json(files[-1]), paths.rel(files[-1])
    hf, conf, model = cal.get("hostfile", {}), cal.get("config", {}), cal.get("model")
    hosts = [(h.get("ssh"), h.get("ips")) for h in hf.get("hosts", [])]
    bad = [why for ok, why in (
        (cal.get("format_version") == 2, f"format version {cal.get('format_version')}, not 2"),
        (hosts == [(h.ssh, h.ips) for h in c.hf.hosts], f"hosts {[h[0] for h in hosts]}"),
        ((hf.get("backend") or "ring") == c.backend, f"backend {hf.get('backend')}"),
        ((model, cal.get("model_sha256")) == (c.args.model, c.model_sha), f"model {model}"),
        *((conf.get(k) == c.cfg[k], f"{k} {conf.get(k)!r}, not {c.cfg[k]!r}") for k in CAL_KEYS)) if not ok]
    if bad:
        return {}, f"the newest calibration {rel} was measured for {'; '.join(bad)}: {fix}"
    return dict(cal, file=rel), ""


def gather(args) -> types.SimpleNamespace:
    """Every input, read once: the hostfile and config (bad ones are errors), the rest as found."""
    hf, cfg = hostfile.load(args.hostfile), C.load_config(args.config)
    hostfile.check_path(args.remote_root, "REMOTE_ROOT")
    hostfile.check_path(args.python, "PYTHON")
    paths.check_run_id(args.run)
    v = {"HOSTFILE": args.hostfile, "CONFIG": args.config, "MODEL": args.model, "DATASET": args.dataset,
         "REMOTE_ROOT": args.remote_root, "PYTHON": args.python, "RUN": args.run}
    cmd = {t: shlex.join(launch.make_cmd(t, v)) for t in (
        "check-parity", "sync", "calibrate", "smoke", "train", "control", "compare", "plan")}
    c = types.SimpleNamespace(args=args, hf=hf, cfg=cfg, world=hf.size, backend=hf.backend or "ring", cmd=cmd,
                              model_sha=launch.model_hash(args.model), run_dir=Path(args.runs_dir) / args.run)
    c.parity, (c.cal, c.cal_why) = load_parity(c), load_calibration(c)
    c.calibrate_longer = f"run `{cmd['calibrate']} CALIBRATE_ARGS=--budget-s=600`"
    files = paths.read_json(paths.DATASETS / args.dataset / "manifest.json").get("files") or {}
    c.train_records = (files.get("train.jsonl") or {}).get("records")
    c.ds_why = f"datasets/{args.dataset}/manifest.json missing or without a train count: run `make export`"
    c.sync, c.smoke = (paths.read_json(c.run_dir / f) for f in ("sync.json", "smoke.json"))
    c.global_batch = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    c.nodes = {h: sum(x.ssh == h for x in hf.hosts) for h in hf.unique_ssh()}  # ranks per host
    c.per_rank = cfg["batch_size"] // hf.size if cfg["batch_size"] % hf.size == 0 else None
    c.checks = {x["name"]: x for x in preflight(c)}
    return c


# ---- the sections ------------------------------------------------------------------------------
def epochs_of(c) -> float | None:
    """The passes over the train split `iters` makes: an iteration is one batch of batch_size
    records (grad_accumulation_steps of them make an optimizer step)."""
    if not c.train_records:
        return None
    return c.cfg["iters"] * c.cfg["batch_size"] / c.train_records


def epochs_warning(c) -> str:
    """Why `iters` does not fit this dataset (epochs out of EPOCHS_LOW..EPOCHS_HIGH) and the fix,
    or "" when it fits or the dataset is not known."""
    epochs = epochs_of(c)
    if epochs is None or EPOCHS_LOW <= epochs <= EPOCHS_HIGH:
        return ""
    iters, bs = c.cfg["iters"], c.cfg["batch_size"]
    records = c.train_records
    one = math.ceil(records / bs)  # the iters of one epoch
    made = f"iters {iters} x batch_size {bs} is {epochs:.2f} epochs of {records} train records"
    if epochs < EPOCHS_LOW:
        return (f"{made}, most of them never trained: raise iters in {c.args.config} "
                f"(one epoch: {one} iters)")
    return (f"{made}, each seen over {EPOCHS_HIGH} times (the adapter memorizes them): lower "
            f"iters in {c.args.config} (one epoch: {one} iters), or add records")


def model_sections(c) -> dict:
    cal, cfg, why = c.cal, c.cfg, c.cal_why or "not in the calibration"
    rec, sp, hosts = cal.get("recommendation", {}), cal.get("speedup", {}), cal.get("hosts", [])
    devices = sorted({(h.get("facts") or {}).get("device") for h in hosts} - {None})
    per_step = c.train_records and c.global_batch / c.train_records  # epochs an optimizer step covers
    peak = [r["peak_mem_bytes"] / 1e9 for h in hosts for r in h.get("sweep", []) if r["batch"] == c.per_rank]
    done = [e for e in launch.metrics(c.run_dir) if e.get("kind") == "done" and e.get("train_wall_s")]
    return {"strategy": {
        "approach": f"MLX data parallel: mlx.launch runs bin/train.py on {c.world} rank(s), {c.backend}",
        "parallelism": "data", "nodes": len(c.nodes), "total_gpus": c.world,
        "gpus_per_node": max(c.nodes.values()), "device": ", ".join(devices) or unknown(why),
        "trainable_params": unknown(why, cal.get("trainable_params"))},
        "batch_configuration": {
        "per_gpu_batch_size": unknown(f"batch_size {cfg['batch_size']} is not divisible by the world size "
                                      f"{c.world}: fix {c.args.config}", c.per_rank),
        "total_batch_size": c.global_batch, "gradient_accumulation_steps": cfg["grad_accumulation_steps"],
        "learning_rate": float(cfg["learning_rate"]), "fits_memory": verdict(c.checks["hardware_layer"]),
        "warmup_epochs": unknown(c.ds_why,
                                 per_step and int((cfg["lr_schedule"] or {}).get("warmup", 0)) * per_step),
        "epochs": unknown(c.ds_why, epochs_of(c)), "epochs_warning": epochs_warning(c),
        "recommended": {"per_gpu_batch_size": rec["per_rank_batch"], "gradient_accumulation_steps":
                        rec["grad_accumulation_steps"], "config_batch_size": rec["config_batch_size"],
                        "largest_fitting_batch": rec["fits_memory_cap"], "largest_fitting_batch_kind":
                        rec["fits_memory_cap_kind"], "why": rec["why"]} if "why" in rec else
        unknown(c.cal_why or f"{cal['file']}: {rec.get('error')}")},
        "performance_targets": {
        "throughput": {"tok_per_s": c.global_batch * (cfg["max_seq_length"] - 1) / sp["t_dual_step_s"],
                       "source": f"{cal['file']}: global batch x (max_seq_length - 1) / the dual step"}
        if sp.get("t_dual_step_s") else unknown(c.cal_why or sp.get("unknown")),
        "expected_speedup": unknown(c.cal_why or sp.get("unknown"), cal.get("expected_speedup")),
        "min_speedup": c.args.min_speedup,
        "gpu_utilization": unknown("MLX has no GPU utilization counter: tok/s and expected_speedup stand in"),
        "peak_memory_gb": max(peak) if peak else unknown(
            c.cal_why or f"{cal['file']}: batch {c.per_rank} not measured: {c.calibrate_longer}"),
        "checkpoint_overhead": {"target_pct": 3.0, "measured_pct": unknown(
            f"no finished run in {paths.rel(c.run_dir)}: run `{c.cmd['train']}`",
            100 * done[-1].get("checkpoint_s", 0) / done[-1]["train_wall_s"] if done else None)}}}


def launch_sections(c) -> dict:
    facts = [h.get("facts") or {} for h in c.cal.get("hosts", [])]
    envs = {"MLX_RANK": "set per rank by mlx.launch", "MLX_HOSTFILE": "set by mlx.launch"} | dict(
        e.partition("=")[::2] for e in c.hf.envs)
    shares = c.cfg["rank_shares"] if isinstance(c.cfg["rank_shares"], list) and c.world > 1 else None
    ns = types.SimpleNamespace(model=c.args.model, dataset=c.args.dataset, seed=None, rank_shares=shares)
    targs = launch.trainer_args(ns, f"runs/{c.args.run}", c.args.config)
    jaccl, ring = c.backend.startswith("jaccl"), "the hostfile's backend is ring"
    smoke = c.smoke if c.smoke.get("ok") and len(c.smoke.get("launches", [])) >= 2 else None
    return {"distributed_config": {
        "mlx_launch_command": shlex.join(launch.launch_argv(c.args.hostfile, c.hf, c.args.python,
                                                            c.args.remote_root, targs)),
        "backend": c.backend, "mlx_env_vars": envs,
        "gradient_sync": "mlx.nn.average_gradients: all_sum of the LoRA gradients per optimizer step",
        "unified_memory": all(f.get("platform") == "darwin" and f.get("machine") == "arm64" for f in facts)
        if facts and all(f.get("platform") for f in facts) else unknown(c.cal_why or "no host facts")},
        "rdma_config": {
        "enabled": jaccl, "backend": c.backend, "env_vars": {k: v for k, v in envs.items() if k[:3] != "MLX"},
        "platform": "JACCL: macOS 26.2+, a Thunderbolt 5 cable a pair" if jaccl else "ring over TCP: no RDMA",
        "verified": verdict(parity_layer(c, "rdma", ("resources.rdma",), "")) if jaccl else
        unknown(f"{ring}: no RDMA devices to verify"),
        "setup": "`rdma_ctl enable` once per Mac in Recovery OS" if jaccl else unknown(f"{ring}: not needed"),
        "expected_speedup": unknown("JACCL vs ring: link.bandwidth_gbps of a ring and a jaccl calibration")},
        "checkpoint_strategy": {
        "approach": "atomic verified checkpoints (lib/checkpoint.py) for exact resume",
        "async": False, "compression": "none (safetensors)", "resume_command": c.cmd["train"] + " RESUME=1",
        "storage": f"{c.args.remote_root}/runs/{c.args.run}/checkpoints on {c.hf.hosts[0].ssh}, then fetched",
        "frequency": f"every {c.cfg['save_every']} steps and the last", "retention":
        f"the last {c.cfg['keep_last_k']}, the best by validation loss and the final one",
        "expected_recovery_time": {"seconds": smoke["launches"][1]["wall_s"], "source": f"runs/{c.args.run}/"
                                   "smoke.json: the resume launch's wall time"} if smoke else unknown(
            f"no passing smoke for run {c.args.run} (smoke.json missing or not ok): run `{c.cmd['smoke']}`")}}


def workload(c) -> dict:
    """Each host's part of the global batch by the calibration's shares rule (lib: bin/calibrate.py
    shares_rule: in proportion to measured records/s, or equal within the noise), and what CONFIG does."""
    rule = (c.cal or {}).get("rank_shares") or {}
    if not rule:
        why = c.cal_why or f"{c.cal['file']} has no rank_shares (one rank, or --skip-compute)"
        return {k: unknown(why) for k in ("workload_distribution", "workload_rule", "workload_why")}
    n = C.rank_batches({"batch_size": c.cfg["batch_size"], "rank_shares": rule["shares"]}, c.world)
    shares = c.cfg["rank_shares"]
    runs = ("the run takes these (rank_shares: auto)" if shares == "auto" else
            f"the run takes its own rank_shares {shares}" if shares else
            "the run splits evenly: set `rank_shares: auto` to take these")
    return {"workload_distribution": {h: sum(b for x, b in zip(c.hf.hosts, n, strict=True) if x.ssh == h) /
                                      sum(n) for h in c.nodes},
            "workload_rule": rule["rule"], "workload_why": f"{rule['why']}; {c.args.config}: {runs}"}


def host_sections(c) -> dict:
    cal, p, s = c.cal, c.parity, c.sync
    fit = {h["ssh"]: [r for r in h.get("sweep", []) if r["batch"] <= (c.per_rank or 0)]
           for h in cal.get("hosts", [])}
    bad = sorted({x["host"] for x in parity_rows(c, CONSISTENCY) if x["status"] == "fail"})
    conc, no_sync = (cal.get("link") or {}).get("concurrent", {}), f"{paths.rel(c.run_dir)}/sync.json missing"
    notes = [f"{h['ssh']}: {h['stopped']['detail']}" for h in cal.get("hosts", []) if "stopped" in h]
    return {"pre_rdma_sync": {
        "sync_script": "bin/sync.py (make sync)", "command": c.cmd["sync"], "block_on_failure": True,
        "validation_checks": ["code sha256", "dataset files sha256 = manifest", "model files",
                              "probe after the transfer"],
        "sync_status": ("success" if s["ok"] else "failed") if s else
                       unknown(f"{no_sync}: run `{c.cmd['sync']}`"),
        "sync_output": "; ".join(f"{h['host']}: {'verified' if h.get('verified') else 'NOT verified'}" for h
                                 in s.get("hosts", [])) + f" at {s.get('ts')}" if s else unknown(no_sync)},
        "hardware_calibration": {
        "measured_performance": {h: {"batch": r["batch"], "tok_per_s_alone": r["tok_per_s"],
                                     "tok_per_s_every_rank": conc.get(h, {}).get("tok_per_s")}
                                 for h, rows in fit.items() if rows for r in rows[-1:]}
        or unknown(c.cal_why or f"no sweep row at or below batch {c.per_rank}"),
        **workload(c),
        "macos_qos_api": "not set: the trainer runs at the default QoS class",
        "calibration_notes": "; ".join(notes + [f"link share {cal.get('link_share')}, shared machine "
                                                f"{cal.get('shared_machine')}"]) if cal else
                             unknown(c.cal_why),
        "calibration_file": cal["file"] if cal else unknown(c.cal_why)},
        "worker_consistency": {
        "validation_checks": [f"check-parity {n}" for n in CONSISTENCY], "consistency_threshold": 1.0,
        "script_hash": sha256_file(paths.ROOT / "bin" / "train.py"),
        "is_consistent": verdict(c.checks["worker_consistency"]),
        "divergent_workers": unknown(p["error"]) if "error" in p else bad,
        "byzantine_detection": {"enabled": False, "reason": "every host must match exactly; one that differs "
                                "is fixed (make sync / make provision), never outvoted"}},
        "coordinator_chunking": {
        "enabled": False, "chunk_size": CHUNK, "dataset_size": unknown(c.ds_why, c.train_records),
        "num_chunks": unknown(c.ds_why, c.train_records and math.ceil(c.train_records / CHUNK)),
        "why": "the trainer tokenizes every record up front (mlx-lm's CacheDataset) and does not chunk",
        "memory_management": {"gc_collect": False, "mx_clear_cache": True},
        "progress_reporting": "`iter N train_loss L tok/s X` lines and runs/<RUN>/metrics.jsonl"},
        "verification_steps": [f"{c.cmd[t]}: {what}" for t, what in (
            ("check-parity", "ssh, interpreter, packages, code, model and dataset bytes the same everywhere"),
            ("sync", "code + dataset (+ model) at REMOTE_ROOT on every host, verified by sha256"),
            ("calibrate", "per-host tok/s and memory, the all_sum curve, the expected speedup"),
            ("smoke", f"{c.world} ranks form the group, a checkpoint lands and verifies, a resume continues"),
            ("train", f"the run, checkpoints every {c.cfg['save_every']} steps"),
            ("control", "the single-host control on the same data, seed and global batch"),
            ("compare", f"test loss within {100 * DEFAULT_TOLERANCE:g}% of the control's, speedup over "
                        f"{c.args.min_speedup:g}x"))]}


def check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix_command": "" if status == "pass" else fix}


def verdict(x: dict):
    """A check as a plan value: true when it passed, false when it failed, else unknown with its detail."""
    return unknown(x["detail"], {"pass": True, "fail": False}.get(x["status"]))


def parity_rows(c, names: tuple) -> list[dict]:
    """check-parity's rows named in `names` (or under one of them)."""
    return [x for x in c.parity.get("checks", []) if {x["name"], x["name"].split(".")[0]} & set(names)]


def parity_layer(c, name: str, names: tuple, fix: str) -> dict:
    """Passes when check-parity's rows of `names` passed on every host."""
    p, rows = c.parity, parity_rows(c, names)
    if bad := [x for x in rows if x["status"] == "fail"]:
        return check(name, "fail", "; ".join(f"{x['host']} {x['name']}: {x['detail']}" for x in bad[:4]), fix)
    if "error" in p or p.get("stale") or not rows:
        return check(name, "unknown", p.get("error") or p.get("stale") or f"check-parity reported no "
                     f"{'/'.join(names)} row", c.cmd["check-parity"])
    return check(name, "pass", f"{', '.join(names)} pass on {', '.join(c.hf.unique_ssh())} "
                 f"({p['file']}, {p['ts']})")


def preflight(c) -> list[dict]:
    """One check per layer of LAYERS, in that order, each with the command that fixes it."""
    cal, p, cfg, n = c.cal, c.parity, c.cfg, c.per_rank
    rec, pc, cc, sc = cal.get("recommendation", {}), c.cmd["check-parity"], c.cmd["calibrate"], c.cmd["sync"]
    cap, edit = rec.get("fits_memory_cap"), f"edit {c.args.config}"
    split = "" if n else f"batch_size {cfg['batch_size']} is not divisible by {c.world}"
    why = c.cal_why or rec.get("error") or split
    if not why and n > cap and rec["fits_memory_cap_kind"] != "measured":
        why = f"{cal['file']}: batch {cap} fits and larger ones were not measured: {c.calibrate_longer}"
    problems = [f"{k} {cfg[k]} is not a multiple of grad_accumulation_steps"
                for k in ("save_every", "iters") if cfg[k] % cfg["grad_accumulation_steps"]]
    problems += [split] if split else []
    exp, unsure = cal.get("expected_speedup"), p.get("error") or p.get("stale")
    verified = {h["host"] for h in c.sync.get("hosts", []) if h.get("verified")}
    return [
        check("hardware_layer", "unknown", why, cc) if why else
        check("hardware_layer", "pass", f"per-rank batch {n} fits every host (largest measured {cap}; "
              f"{cal['file']})") if n <= cap else
        check("hardware_layer", "fail", f"per-rank batch {n} does not fit: {rec['why']}",
              f"{edit}: batch_size {rec['config_batch_size']}, "
              f"grad_accumulation_steps {rec['grad_accumulation_steps']}"),
        parity_layer(c, "worker_layer", ("ssh", "runtime", "link"), pc),
        parity_layer(c, "checkpoint_layer", ("resources.disk",), f"free disk at REMOTE_ROOT; {pc}"),
        check("gradient_layer", "fail" if problems else "pass", "; ".join(problems) or f"global batch "
              f"{c.global_batch} over {c.world} ranks ({n} per rank per micro-step)", edit),
        check("performance_layer", "unknown", c.cal_why or cal["speedup"]["unknown"], cc) if exp is None else
        check("performance_layer", "pass" if exp > c.args.min_speedup else "fail",
              f"expected speedup {exp:.2f}x vs the required {c.args.min_speedup:g}x ({cal['file']})",
              f"see RUNBOOK.md#{CATEGORIES[THUNDER]}; then {cc}"),
        check("health_check", "fail" if p.get("code") in (2, 3) else "unknown" if unsure else "pass",
              unsure or f"check-parity {p['status']} (exit {p['code']})", pc),
        check("pre_rdma_sync", "pass" if c.sync.get("ok") and verified >= set(c.hf.unique_ssh()) else "fail",
              f"sync at {c.sync.get('ts')}: verified on {sorted(verified)}", sc) if c.sync else
        check("pre_rdma_sync", "unknown", f"no sync for run {c.args.run} yet", sc),
        parity_layer(c, "worker_consistency", CONSISTENCY, f"{sc} (or make provision)")]


def build_plan(args) -> dict:
    c = gather(args)
    checks = list(c.checks.values())
    overall = next((s for s in ("fail", "unknown") if any(x["status"] == s for x in checks)), "pass")
    plan = {"version": VERSION,
            "generated": {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "tool": "bin/plan.py", "git": launch.git_info(), "command": c.cmd["plan"]},
            "sources": {"hostfile": {"path": args.hostfile, "sha256": sha256_file(args.hostfile)},
                        "config": {"path": args.config, "sha256": sha256_file(args.config)},
                        "model_sha256": c.model_sha,
                        "parity": unknown(c.parity["error"]) if "error" in c.parity else
                        {k: c.parity[k] for k in ("file", "status", "ts")},
                        "calibration": {"file": c.cal["file"], "created": c.cal.get("created")} if c.cal
                        else unknown(c.cal_why)},
            "unknowns": [], **model_sections(c), **launch_sections(c), **host_sections(c),
            "pre_flight_checklist": {
                "checks": checks, "block_on_failure": True,
                "validation_layers": [n.removesuffix("_layer") for n in LAYERS],
                "overall_status": overall}}
    plan["unknowns"] = unknowns_in({k: plan[k] for k in SECTIONS})
    return plan


def main() -> int:
    args = build_parser().parse_args()
    try:
        plan = build_plan(args)
    except (RunbookError, ValueError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), ANCHOR), 2)
    path = Path(args.runs_dir) / f"plan-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    atomic.write_json(path, plan)
    atomic.write_json(path.with_name("plan.json"), plan)
    pf = plan["pre_flight_checklist"]
    for x in pf["checks"]:
        event("plan-check", name=x["name"], status=x["status"], detail=json.dumps(x["detail"]),
              fix=json.dumps(x["fix_command"]) if x["fix_command"] else "-")
    for u in plan["unknowns"]:
        event("plan-unknown", field=u["field"], reason=json.dumps(u["reason"]))
    bc = plan["batch_configuration"]
    if not isinstance(bc["epochs"], dict):  # an unknown is a plan-unknown line
        records = plan["coordinator_chunking"]["dataset_size"]
        event("plan-epochs", epochs=bc["epochs"], train_records=records)
    if bc["epochs_warning"]:
        event("warning", stage="plan", what="epochs", message=json.dumps(bc["epochs_warning"]))
    event("plan", file=paths.rel(path), overall_status=pf["overall_status"], unknowns=len(plan["unknowns"]))
    if args.strict and pf["overall_status"] != "pass":
        return die(RunbookError(f"pre-flight {pf['overall_status']}: see the plan-check lines", ANCHOR), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
