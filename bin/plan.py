#!/usr/bin/env python3
"""plan: the training plan as JSON in the coordinator format (version 2.0.0), from what is known.

Usage:
    python bin/plan.py --hostfile HOSTFILE --config CONFIG --model MODEL --dataset NAME \
        --remote-root DIR --python PY [--run RUN] [--calibration FILE] [--parity FILE]
        [--runs-dir runs] [--out-dir runs] [--max-parity-age-s 3600] [--min-speedup X]
        [--json] [--strict]

Example (what `make plan` runs):
    python bin/plan.py --hostfile hostfile.json --config configs/stage1.yaml \
        --model models/tiny-gemma4 --dataset domain_sft_v1_high_signal_thunder \
        --remote-root "$PWD" --python "$PWD/.venv/bin/python" --run stage1

Sections (the planning assistant's format): strategy, batch_configuration, distributed_config,
rdma_config, checkpoint_strategy, performance_targets, verification_steps, pre_rdma_sync,
hardware_calibration, worker_consistency, coordinator_chunking, pre_flight_checklist; plus
`sources` (every input file with its hash or time) and `unknowns` (every value that could not
be known, with why and the command that would make it known). Filled from the hostfile, the
config (lib/config.py), the dataset manifest, the newest check-parity result
(runs/parity/last.json), the newest calibration (runs/calibration-*.json, used only when it was
measured for these hosts, this model and these LoRA/sequence settings) and the run folder's
sync.json, smoke.json and metrics.jsonl. Measured values only: a value that cannot be known is
`{"value": null, "unknown": "<why>: <command>"}`, never a guess. The plan is checked against
SCHEMA (below) before it is written to runs/plan-<UTC time>.json and copied to runs/plan.json
(both atomic). Prints one line per pre-flight check and a summary. Exit 0 when written (1 with
--strict unless every pre-flight check passes), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl, launch, paths  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import digest_of, sha256_file, tree_hashes  # noqa: E402
from lib.hostfile import Hostfile, check_path  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

ANCHOR = "plan"
VERSION = "2.0.0"
CHUNK_THRESHOLD = 50_000  # the planning assistant's coordinator chunking threshold (examples)
CHECKPOINT_OVERHEAD_TARGET_PCT = 3.0  # bench/bench_trainer.py's budget
SECTIONS = ("strategy", "batch_configuration", "distributed_config", "rdma_config", "checkpoint_strategy",
            "performance_targets", "verification_steps", "pre_rdma_sync", "hardware_calibration",
            "worker_consistency", "coordinator_chunking", "pre_flight_checklist")
LAYERS = ("hardware_layer", "worker_layer", "checkpoint_layer", "gradient_layer", "performance_layer",
          "health_check", "pre_rdma_sync", "worker_consistency")


def unknown(reason: str) -> dict:
    """A value that cannot be known, and why (with the command that would make it known)."""
    return {"value": None, "unknown": reason}


# ---- the schema: a hand-written subset of JSON Schema, checked by validate() -----------------
def T(kind: str, **kw) -> dict:
    return {"type": kind, **kw}


def OBJ(props: dict, required: list | None = None, additional: bool = False) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, "additional": additional}


def ARR(items: dict, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "min_items": min_items}


def ANY(*nodes: dict) -> dict:
    return {"any_of": list(nodes)}


UNKNOWN = OBJ({"value": T("null"), "unknown": T("string", min_length=3)})


def M(node: dict) -> dict:
    """A measured value, or the explicit unknown object."""
    return ANY(node, UNKNOWN)


STR, NUM, INT, BOOL = T("string", min_length=1), T("number"), T("integer"), T("boolean")
POS = T("number", minimum=0)
MAP = T("object", additional=True, properties={}, required=[])
STATUS = T("string", enum=["pass", "fail", "unknown"])
CHECK = OBJ({"name": T("string", enum=list(LAYERS)), "status": STATUS, "detail": STR, "fix_command": T("string")})

SCHEMA = OBJ({
    "version": T("string", enum=[VERSION]),
    "generated": OBJ({"created": STR, "tool": STR, "git": MAP, "command": STR}),
    "sources": OBJ({"hostfile": MAP, "config": MAP, "dataset": M(MAP), "parity": M(MAP),
                    "calibration": M(MAP), "sync": M(MAP), "smoke": M(MAP)}),
    "unknowns": ARR(OBJ({"field": STR, "reason": STR})),
    "strategy": OBJ({
        "approach": STR, "parallelism": T("string", enum=["data"]), "nodes": T("integer", minimum=1),
        "total_gpus": T("integer", minimum=1), "gpus_per_node": T("integer", minimum=1),
        "ranks_per_node": MAP, "device": M(STR), "model": STR, "model_sha256": STR,
        "fine_tune_type": T("string", enum=list(C.FINE_TUNE_TYPES)), "trainable_params": M(T("integer", minimum=1)),
        "trainer": STR}),
    "batch_configuration": OBJ({
        "per_gpu_batch_size": M(T("integer", minimum=1)), "total_batch_size": T("integer", minimum=1),
        "config_batch_size": T("integer", minimum=1),
        "gradient_accumulation_steps": T("integer", minimum=1), "learning_rate": T("number", minimum=0),
        "lr_schedule": ANY(MAP, T("null")), "warmup_steps": T("integer", minimum=0),
        "warmup_epochs": M(POS), "iters": T("integer", minimum=1), "epochs": M(POS),
        "max_seq_length": T("integer", minimum=2), "fits_memory": M(BOOL),
        "recommended": M(OBJ({"per_gpu_batch_size": T("integer", minimum=1),
                              "gradient_accumulation_steps": T("integer", minimum=1),
                              "config_batch_size": T("integer", minimum=1),
                              "config_grad_accumulation_steps": T("integer", minimum=1),
                              "largest_fitting_batch": T("integer", minimum=1),
                              "largest_fitting_batch_kind": T("string", enum=["measured", "predicted", "lower_bound"]),
                              "why": STR}))}),
    "distributed_config": OBJ({
        "mlx_launch_command": STR, "make_command": STR, "gradient_sync": STR,
        "backend": T("string", enum=["ring", "jaccl", "jaccl-ring", "mpi", "nccl"]), "unified_memory": M(BOOL),
        "hosts": ARR(OBJ({"rank": T("integer", minimum=0), "ssh": STR, "ips": ARR(STR)}), 1),
        "remote_root": STR, "python": STR, "mlx_env_vars": MAP}),
    "rdma_config": OBJ({
        "enabled": BOOL, "backend": STR, "platform": STR, "devices": T("array", items={}, min_items=0),
        "verified": M(BOOL), "setup": M(STR), "env_vars": MAP, "expected_speedup": M(POS),
        "link": M(OBJ({"backend": STR, "latency_us": POS, "busbw_gbps": POS, "bytes": T("integer", minimum=1),
                       "tcp_one_direction_gbps": M(POS), "tcp_both_directions_gbps": M(POS)}))}),
    "checkpoint_strategy": OBJ({
        "approach": STR, "async": BOOL, "compression": STR, "storage": STR, "frequency": STR,
        "save_every": T("integer", minimum=1), "retention": STR, "keep_last_k": T("integer", minimum=2),
        "resume_command": STR, "expected_recovery_time": M(OBJ({"seconds": POS, "source": STR})),
        "checkpoint_size_bytes": M(OBJ({"bytes": T("integer", minimum=0), "source": STR}))}),
    "performance_targets": OBJ({
        "throughput": M(OBJ({"tok_per_s": POS, "scope": STR, "source": STR})),
        "expected_speedup": M(POS), "compute_bound_speedup": M(POS), "min_speedup": POS,
        "loss_tolerance": POS, "gpu_utilization": M(POS),
        "checkpoint_overhead": OBJ({"target_pct": POS, "measured_pct": M(POS)}),
        "peak_memory_gb": M(POS)}),
    "verification_steps": ARR(STR, 3),
    "pre_rdma_sync": OBJ({
        "sync_script": STR, "command": STR, "validation_checks": ARR(STR, 1), "block_on_failure": BOOL,
        "sync_status": M(T("string", enum=["success", "failed"])), "sync_output": M(STR)}),
    "hardware_calibration": OBJ({
        "measured_performance": M(MAP), "concurrent_performance": M(MAP), "workload_distribution": MAP,
        "imbalance": M(POS), "macos_qos_api": STR, "calibration_notes": M(STR), "calibration_file": M(STR),
        "shared_machine": M(ARR(ARR(STR)))}),
    "worker_consistency": OBJ({
        "validation_checks": ARR(STR, 1), "script_hash": STR, "code_hash": STR, "is_consistent": M(BOOL),
        "consistency_threshold": T("number", minimum=0, maximum=1), "divergent_workers": M(ARR(STR)),
        "byzantine_detection": OBJ({"enabled": T("boolean", enum=[False]), "reason": STR})}),
    "coordinator_chunking": OBJ({
        "enabled": BOOL, "threshold": T("integer", minimum=1), "chunk_size": T("integer", minimum=1),
        "dataset_size": M(T("integer", minimum=0)), "num_chunks": M(T("integer", minimum=0)),
        "would_enable": M(BOOL), "why": STR,
        "memory_management": OBJ({"clear_cache_threshold": T("integer", minimum=0), "gc_collect": BOOL,
                                  "mx_clear_cache": BOOL}),
        "progress_reporting": STR}),
    "pre_flight_checklist": OBJ({
        "checks": ARR(CHECK, len(LAYERS)), "validation_layers": ARR(STR, 1), "block_on_failure": BOOL,
        "overall_status": STATUS}),
})


def validate(obj, schema: dict, path: str = "$") -> list[str]:
    """Errors of obj against a SCHEMA-style node (empty list: valid)."""
    if "any_of" in schema:
        tries = [validate(obj, s, path) for s in schema["any_of"]]
        if any(not t for t in tries):
            return []
        best = min(tries, key=len)
        return best if len(best) == 1 else [f"{path}: matches none of {len(tries)} alternatives: {best[0]}"]
    kind = schema.get("type")
    errs: list[str] = []
    if not kind:
        return errs
    ok = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
          "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "null": lambda v: v is None,
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}[kind]
    if not ok(obj):
        return [f"{path}: expected {kind}, got {type(obj).__name__} {json.dumps(obj)[:60]}"]
    if "enum" in schema and obj not in schema["enum"]:
        errs.append(f"{path}: {obj!r} is not one of {schema['enum']}")
    if kind in ("integer", "number"):
        if "minimum" in schema and obj < schema["minimum"]:
            errs.append(f"{path}: {obj} < minimum {schema['minimum']}")
        if "maximum" in schema and obj > schema["maximum"]:
            errs.append(f"{path}: {obj} > maximum {schema['maximum']}")
    if kind == "string" and len(obj) < schema.get("min_length", 0):
        errs.append(f"{path}: shorter than {schema['min_length']} characters")
    if kind == "array":
        if len(obj) < schema.get("min_items", 0):
            errs.append(f"{path}: {len(obj)} items, at least {schema['min_items']} required")
        for i, v in enumerate(obj):
            errs += validate(v, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in obj:
                errs.append(f"{path}: missing key {k!r}")
        for k, v in obj.items():
            if k in props:
                errs += validate(v, props[k], f"{path}.{k}")
            elif not schema.get("additional", True):
                errs.append(f"{path}: unexpected key {k!r}")
    return errs


def unknowns_in(obj, path: str = "") -> list[dict]:
    """Every explicit unknown in the plan, with its dotted path."""
    out = []
    if isinstance(obj, dict):
        if set(obj) == {"value", "unknown"} and obj["value"] is None:
            return [{"field": path, "reason": obj["unknown"]}]
        for k, v in obj.items():
            out += unknowns_in(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += unknowns_in(v, f"{path}[{i}]")
    return out


# ---- inputs ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--remote-root", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--run", default="stage1", help="the run whose sync.json, smoke.json, metrics are read")
    p.add_argument("--runs-dir", default=str(paths.RUNS), help="where runs, parity and calibrations live")
    p.add_argument("--calibration", help="a calibration file (default: the newest runs/calibration-*.json)")
    p.add_argument("--parity", help="a check-parity result (default: runs/parity/last.json)")
    p.add_argument("--out-dir", default=None, help="where plan-<time>.json and plan.json go (default: --runs-dir)")
    p.add_argument("--max-parity-age-s", type=float, default=3600.0,
                   help="an older check-parity result is stale (default 3600)")
    p.add_argument("--min-speedup", type=float, default=None, help="the speedup compare requires (default: its own)")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout (and nothing else)")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every pre-flight check passes")
    return p


def read_json(path: Path) -> tuple[dict | None, str]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), ""
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"


def age_s(ts: str | None) -> float | None:
    """Seconds since an ISO time with an offset or Z (the project's two shapes)."""
    from datetime import datetime

    if not ts:
        return None
    try:
        t = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        return None
    return max(0.0, time.time() - t.timestamp())


def load_parity(args, hf: Hostfile) -> dict:
    """The check-parity result for these hosts: {ok, status, checks, file, age_s} or {error}."""
    path = Path(args.parity) if args.parity else Path(args.runs_dir) / "parity" / "last.json"
    cmd = (f"make check-parity HOSTFILE={args.hostfile} PYTHON={args.python} REMOTE_ROOT={args.remote_root} "
           f"MODEL={args.model} DATASET={args.dataset}")
    data, why = read_json(path)
    if data is None:
        return {"error": f"no check-parity result ({paths.rel(path)} {why}): run `{cmd}`", "command": cmd}
    checks = data.get("checks") or []
    seen = {c.get("host") for c in checks} - {"-"}
    want = set(hf.unique_ssh())
    if not want <= seen:
        return {"error": f"{paths.rel(path)} checked {sorted(seen) or 'no host'}, not {sorted(want)}: run `{cmd}`",
                "command": cmd}
    age = age_s(data.get("ts"))
    out = {"file": paths.rel(path), "status": data.get("status"), "code": data.get("code"), "ts": data.get("ts"),
           "age_s": round(age, 1) if age is not None else None, "checks": checks, "command": cmd}
    if age is None or age > args.max_parity_age_s:
        out["stale"] = (f"{paths.rel(path)} is {'of unknown age' if age is None else f'{age / 60:.0f} min old'} "
                        f"(limit {args.max_parity_age_s / 60:.0f} min): run `{cmd}`")
    return out


def calibration_mismatches(cal: dict, hf: Hostfile, cfg: dict, model: str, model_sha: str) -> list[str]:
    out = []
    hosts = [(h.get("ssh"), list(h.get("ips", []))) for h in (cal.get("hostfile") or {}).get("hosts", [])]
    want = [(h.ssh, list(h.ips)) for h in hf.hosts]
    if hosts != want:
        out.append(f"hosts {[h[0] for h in hosts]} (ips {[h[1] for h in hosts]}), not {[h[0] for h in want]} "
                   f"(ips {[h[1] for h in want]})")
    if ((cal.get("hostfile") or {}).get("backend") or "ring") != (hf.backend or "ring"):
        out.append(f"backend {cal['hostfile'].get('backend') or 'ring'}, not {hf.backend or 'ring'}")
    if cal.get("model") != model or (cal.get("model_sha256") and cal.get("model_sha256") != model_sha):
        out.append(f"model {cal.get('model')} ({str(cal.get('model_sha256'))[:12]}), not {model} ({model_sha[:12]})")
    ccfg = cal.get("config") or {}
    for k in ("max_seq_length", "num_layers", "fine_tune_type", "lora_parameters", "grad_checkpoint"):
        if ccfg.get(k) != cfg.get(k):
            out.append(f"{k} {ccfg.get(k)!r}, not {cfg.get(k)!r}")
    return out


def load_calibration(args, hf: Hostfile, cfg: dict, model_sha: str) -> dict:
    cmd = (f"make calibrate HOSTFILE={args.hostfile} MODEL={args.model} CONFIG={args.config} "
           f"REMOTE_ROOT={args.remote_root} PYTHON={args.python}")
    if args.calibration:
        path = Path(args.calibration)
    else:
        files = sorted(Path(args.runs_dir).glob("calibration-*.json"))
        if not files:
            return {"error": f"no calibration yet: run `{cmd}`", "command": cmd}
        path = files[-1]
    cal, why = read_json(path)
    if cal is None or not isinstance(cal, dict):
        return {"error": f"{paths.rel(path)} {why or 'is not an object'}: run `{cmd}`", "command": cmd}
    bad = calibration_mismatches(cal, hf, cfg, args.model, model_sha)
    if bad:
        return {"error": f"the newest calibration {paths.rel(path)} was measured for {'; '.join(bad)}: run `{cmd}`",
                "file": paths.rel(path), "command": cmd}
    return {"file": paths.rel(path), "cal": cal, "command": cmd}


def dataset_facts(name: str) -> dict:
    m = paths.DATASETS / name / "manifest.json"
    data, why = read_json(m)
    if data is None:
        return {"error": f"datasets/{name}/manifest.json {why}: run `make export DATASET={name}`"}
    counts = data.get("counts") or {}
    return {"name": name, "manifest_sha256": sha256_file(m), "dataset_sha256": data.get("dataset_sha256"),
            "records": {k: counts.get(k) for k in ("train", "valid", "test")}}


# ---- the sections ----------------------------------------------------------------------------------
def val(d: dict, key: str, reason: str):
    v = d.get(key) if d else None
    return v if v is not None else unknown(reason)


def build_plan(args) -> dict:
    hf = load_hostfile(args.hostfile)
    check_path(args.remote_root, "REMOTE_ROOT")
    check_path(args.python, "PYTHON")
    paths.check_run_id(args.run)
    cfg = C.load_config(args.config)
    cfg["model"] = args.model
    world = hf.size
    backend = hf.backend or "ring"
    model_sha = launch.model_hash(args.model)
    compare = load_compare()
    min_speedup = args.min_speedup if args.min_speedup is not None else compare.DEFAULT_MIN_SPEEDUP
    runs = Path(args.runs_dir)
    run_dir = runs / args.run

    parity = load_parity(args, hf)
    calib = load_calibration(args, hf, cfg, model_sha)
    cal = calib.get("cal")
    cal_why = calib.get("error", "")
    ds = dataset_facts(args.dataset)
    sync, sync_why = read_json(run_dir / "sync.json")
    smoke, smoke_why = read_json(run_dir / "smoke.json")
    sync_cmd = (f"make sync RUN={args.run} HOSTFILE={args.hostfile} REMOTE_ROOT={args.remote_root} "
                f"DATASET={args.dataset} MODEL={args.model}")
    smoke_cmd = (f"make smoke RUN={args.run} HOSTFILE={args.hostfile} REMOTE_ROOT={args.remote_root} "
                 f"PYTHON={args.python} DATASET={args.dataset} MODEL={args.model}")
    train_make = (f"make train RUN={args.run} HOSTFILE={args.hostfile} CONFIG={args.config} MODEL={args.model} "
                  f"DATASET={args.dataset} REMOTE_ROOT={args.remote_root} PYTHON={args.python}")

    global_batch = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    per_rank = cfg["batch_size"] // world if cfg["batch_size"] % world == 0 else None
    ranks_per_node: dict[str, int] = {}
    for h in hf.hosts:
        ranks_per_node[h.ssh] = ranks_per_node.get(h.ssh, 0) + 1
    train_records = (ds.get("records") or {}).get("train")

    # ---- strategy
    cal_hosts = {h["ssh"]: h for h in (cal or {}).get("hosts", [])}
    devices = sorted({(h.get("facts") or {}).get("device") for h in cal_hosts.values()} - {None})
    strategy = {
        "approach": f"MLX data parallel: mlx.launch runs bin/train.py on {world} rank(s), {backend} backend"
                    + (" over the hostfile's IPs" if backend == "ring" else " (RDMA over Thunderbolt)"),
        "parallelism": "data",
        "nodes": len(ranks_per_node),
        "total_gpus": world,
        "gpus_per_node": max(ranks_per_node.values()),
        "ranks_per_node": ranks_per_node,
        "device": ", ".join(devices) if devices else unknown(cal_why or "the calibration has no device facts"),
        "model": args.model,
        "model_sha256": model_sha,
        "fine_tune_type": cfg["fine_tune_type"],
        "trainable_params": cal["trainable_params"] if cal and cal.get("trainable_params") else unknown(
            cal_why or "the calibration did not load the model (--skip-compute)"),
        "trainer": "bin/train.py: mlx-lm LoRA (its model loading, LoRA layers, default_loss, average_gradients), "
                   "exact resume, atomic verified checkpoints",
    }

    # ---- batch configuration
    sched = cfg.get("lr_schedule")
    warmup = int(sched.get("warmup", 0)) if isinstance(sched, dict) else 0
    rec = (cal or {}).get("recommendation") or {}
    recommended = unknown(cal_why or rec.get("error") or "no recommendation in the calibration")
    fits = unknown(cal_why or "no recommendation in the calibration")
    if cal and "per_rank_batch" in rec:
        recommended = {"per_gpu_batch_size": rec["per_rank_batch"],
                       "gradient_accumulation_steps": rec["grad_accumulation_steps"],
                       "config_batch_size": rec["config_batch_size"],
                       "config_grad_accumulation_steps": rec["config_grad_accumulation_steps"],
                       "largest_fitting_batch": rec["fits_memory_cap"], "why": rec["why"]}
        kind = rec.get("fits_memory_cap_kind", "measured")
        recommended["largest_fitting_batch_kind"] = kind
        if per_rank is not None:
            if per_rank <= rec["fits_memory_cap"]:
                fits = True
            elif kind == "lower_bound":
                fits = unknown(f"{calib['file']}: batch {rec['fits_memory_cap']} fits and nothing bounds it from above "
                               "(no memory ceiling known on a host): run `make calibrate` with a larger budget")
            else:
                fits = False
    elif cal and rec.get("error"):
        recommended = unknown(f"{calib['file']}: {rec['error']}")
    batch = {
        "per_gpu_batch_size": per_rank if per_rank is not None else unknown(
            f"batch_size {cfg['batch_size']} is not divisible by the world size {world}: fix {args.config}"),
        "total_batch_size": global_batch,
        "config_batch_size": cfg["batch_size"],
        "gradient_accumulation_steps": cfg["grad_accumulation_steps"],
        "learning_rate": float(cfg["learning_rate"]),
        "lr_schedule": sched,
        "warmup_steps": warmup,
        "warmup_epochs": warmup * global_batch / train_records if train_records else unknown(
            ds.get("error", "the dataset manifest has no train count")),
        "iters": cfg["iters"],
        "epochs": cfg["iters"] * global_batch / train_records if train_records else unknown(
            ds.get("error", "the dataset manifest has no train count")),
        "max_seq_length": cfg["max_seq_length"],
        "fits_memory": fits,
        "recommended": recommended,
    }

    # ---- distributed config
    from argparse import Namespace

    targs = launch.trainer_args(Namespace(model=args.model, dataset=args.dataset, seed=None), f"runs/{args.run}",
                                args.config)
    launch_cmd = shlex.join(launch.launch_argv(args.hostfile, hf, args.python, args.remote_root, targs))
    facts = [h.get("facts") or {} for h in cal_hosts.values()]
    unified = unknown(cal_why or "no host facts in the calibration")
    if facts and all(f.get("platform") for f in facts):
        unified = all(f.get("platform") == "darwin" and f.get("machine") == "arm64" for f in facts)
    envs = {"MLX_RANK": "set per rank by mlx.launch (0..world-1)",
            "MLX_HOSTFILE": "set by mlx.launch: the ring's ip:port list" if backend == "ring" else
            "set by mlx.launch (jaccl: MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR)"}
    for e in hf.envs:
        k, _, v = e.partition("=")
        envs[k] = v
    distributed = {
        "mlx_launch_command": launch_cmd,
        "make_command": train_make,
        "gradient_sync": "mlx.nn.average_gradients: all_sum of the LoRA gradients in 32 MiB buckets, once per "
                         "optimizer step (after grad_accumulation_steps micro-steps)",
        "backend": backend,
        "unified_memory": unified,
        "hosts": [{"rank": h.rank, "ssh": h.ssh, "ips": h.ips} for h in hf.hosts],
        "remote_root": args.remote_root,
        "python": args.python,
        "mlx_env_vars": envs,
    }

    # ---- rdma
    jaccl = backend.startswith("jaccl")
    rdma_checks = [c for c in parity.get("checks", []) if c.get("name") == "resources.rdma"]
    if not jaccl:
        verified = unknown("the hostfile's backend is ring: no RDMA devices to verify")
    elif "error" in parity:
        verified = unknown(parity["error"])
    elif rdma_checks:
        verified = all(c.get("status") == "pass" and "skipped" not in c.get("detail", "") for c in rdma_checks)
    else:
        verified = unknown("check-parity reported no resources.rdma row: run it on the Macs")
    link = (cal or {}).get("link") or {}
    link_summary = unknown(cal_why or ("one rank: no link" if world == 1 else "the calibration has no link phase"))
    if link.get("allreduce"):
        tcp = link.get("tcp") or {}
        link_summary = {
            "backend": link["backend"], "latency_us": link["latency_us"]["mean"],
            "busbw_gbps": link["bandwidth_gbps"]["busbw_mean"], "bytes": link["bandwidth_gbps"]["bytes"],
            "tcp_one_direction_gbps": tcp.get("one_direction_gbps_best", unknown(tcp.get("unknown", "no TCP baseline"))),
            "tcp_both_directions_gbps": tcp.get("both_directions_gbps_best", unknown(tcp.get("unknown", "no TCP baseline"))),
        }
    rdma = {
        "enabled": jaccl,
        "backend": backend,
        "platform": "JACCL needs macOS 26.2+ and a Thunderbolt 5 cable between every pair" if jaccl else
                    "ring over TCP (Thunderbolt bridge IPs on the Macs); no RDMA",
        "devices": [h.rdma for h in hf.hosts],
        "verified": verified,
        "setup": "`rdma_ctl enable` once per Mac, from Recovery OS" if jaccl else unknown(
            "not needed: the hostfile's backend is ring"),
        "env_vars": {k: v for k, v in envs.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")},
        "expected_speedup": backend_ratio(runs, hf),
        "link": link_summary,
    }

    # ---- checkpoints
    recovery = unknown(f"no passing smoke for run {args.run} ({paths.rel(run_dir / 'smoke.json')} {smoke_why or 'failed'}): "
                       f"run `{smoke_cmd}`")
    if smoke and smoke.get("ok") and len(smoke.get("launches", [])) >= 2:
        recovery = {"seconds": smoke["launches"][1]["wall_s"],
                    "source": f"{paths.rel(run_dir / 'smoke.json')}: the resume launch's wall time (start, "
                              "checkpoint load, steps to the end)"}
    ck_size = checkpoint_size(run_dir, cal)
    checkpoint = {
        "approach": "atomic verified checkpoints (lib/checkpoint.py): write to a temporary folder, fsync, rename, "
                    "verify the manifest; exact resume of weights, optimizer, RNG and data order",
        "async": False,
        "compression": "none (safetensors)",
        "storage": f"{args.remote_root}/runs/{args.run}/checkpoints on rank 0's host ({hf.hosts[0].ssh}), "
                   f"fetched to runs/{args.run}/ after the run",
        "frequency": f"every {cfg['save_every']} steps (save_every) and the last step",
        "save_every": cfg["save_every"],
        "retention": f"the last {cfg['keep_last_k']} plus the best by validation loss and the final one",
        "keep_last_k": cfg["keep_last_k"],
        "resume_command": train_make + " RESUME=1",
        "expected_recovery_time": recovery,
        "checkpoint_size_bytes": ck_size,
    }

    # ---- performance targets
    sp = ((cal or {}).get("speedup") or {}).get("configured") or {}
    throughput = unknown(cal_why or sp.get("unknown") or (cal or {}).get("unknown", {}).get("expected_speedup", "not measured"))
    if sp.get("t_dual_step_s"):
        tokens = global_batch * (cfg["max_seq_length"] - 1)
        throughput = {"tok_per_s": tokens / sp["t_dual_step_s"], "scope": "the whole group, full-length sequences",
                      "source": f"{calib['file']}: global batch x (max_seq_length - 1) tokens / the modeled dual step"}
    measured_pct = unknown(f"no finished train run in {paths.rel(run_dir)}: run `{train_make}`")
    done = [e for e in (jsonl.read(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else [])
            if e.get("kind") == "done" and e.get("train_wall_s")]
    if done:
        measured_pct = 100 * done[-1].get("checkpoint_s", 0) / done[-1]["train_wall_s"]
    peak = unknown(cal_why or "no per-rank batch (batch_size not divisible by the world size)")
    if cal and per_rank is not None:
        rows = [r for h in cal.get("hosts", []) for r in h.get("sweep", []) if r["batch"] == per_rank]
        if rows:
            peak = max(r["peak_mem_bytes"] for r in rows) / 1e9
        else:
            done = sorted({r["batch"] for h in cal.get("hosts", []) for r in h.get("sweep", [])})
            peak = unknown(f"{calib['file']} measured batches {done}, not {per_rank} (the sweep stopped: "
                           f"{'; '.join(h.get('stopped', {}).get('detail', '?') for h in cal.get('hosts', []))}): run "
                           f"`{calib['command']} CALIBRATE_ARGS=--budget-s=600`")
    cal_unknown = (cal or {}).get("unknown", {})
    performance = {
        "throughput": throughput,
        "expected_speedup": cal["expected_speedup"] if cal and cal.get("expected_speedup") is not None else unknown(
            cal_why or cal_unknown.get("expected_speedup", "not measured")),
        "compute_bound_speedup": cal["compute_bound_speedup"] if cal and cal.get("compute_bound_speedup") is not None
        else unknown(cal_why or cal_unknown.get("compute_bound_speedup", "not measured")),
        "min_speedup": min_speedup,
        "loss_tolerance": compare.DEFAULT_TOLERANCE,
        "gpu_utilization": unknown("MLX exposes no GPU utilization counter; tok/s against expected_speedup stands in"),
        "checkpoint_overhead": {"target_pct": CHECKPOINT_OVERHEAD_TARGET_PCT, "measured_pct": measured_pct},
        "peak_memory_gb": peak,
    }

    # ---- verification
    parity_cmd = parity.get("command") or "make check-parity"
    verification = [
        f"{parity_cmd}: unattended ssh to every host (self-ssh too), the same interpreter, packages, code, model and "
        "dataset bytes everywhere (exit 0)",
        f"{sync_cmd}: code + dataset (+ model) at REMOTE_ROOT on every host, verified by sha256",
        f"{calib['command']}: per-host tok/s and memory, the all_sum curve, the expected speedup",
        f"{smoke_cmd}: the group forms with world size {world}, every rank loads the dataset, a checkpoint lands and "
        "verifies, the resume continues the step count",
        f"{train_make}: the run (watchdog, checkpoints every {cfg['save_every']} steps)",
        f"{train_make.replace('make train', 'make control', 1)}: the single-host control (rank 0's host) on the same "
        "data, seed and global batch",
        f"make compare RUN={args.run}: test loss within {100 * compare.DEFAULT_TOLERANCE:g}% of the control's and a "
        f"speedup above {min_speedup:g}x",
    ]

    # ---- pre-RDMA sync
    sync_status = unknown(f"{paths.rel(run_dir / 'sync.json')} {sync_why or 'unreadable'}: run `{sync_cmd}`")
    sync_output = sync_status
    if sync:
        sync_status = "success" if sync.get("ok") else "failed"
        sync_output = "; ".join(f"{h.get('host')}: {'verified' if h.get('verified') else 'NOT verified'} "
                                f"({', '.join(h.get('actions') or []) or 'no action'})"
                                for h in sync.get("hosts", [])) + f" at {sync.get('ts')}"
    pre_sync = {
        "sync_script": "bin/sync.py (make sync)",
        "command": sync_cmd,
        "validation_checks": ["code sha256 (bin lib configs Makefile requirements.lock)", "dataset files sha256 = manifest",
                              "model files present (sha256 with SYNC_MODEL=1)", "probe again after the transfer"],
        "block_on_failure": True,
        "sync_status": sync_status,
        "sync_output": sync_output,
    }

    # ---- hardware calibration
    per_host_perf, conc_perf, notes, imbalance, shared = (unknown(cal_why or "not measured"),) * 5
    if cal:
        alone = {}
        for h in cal.get("hosts", []):
            rows = sorted(h.get("sweep", []), key=lambda r: r["batch"])
            at = [r for r in rows if r["batch"] == per_rank] or [r for r in rows if per_rank and r["batch"] < per_rank]
            if at:
                r = at[-1]
                alone[h["ssh"]] = {"tok_per_s": r["tok_per_s"], "batch": r["batch"], "step_s": r["step_s"],
                                   "alone": True}
        if alone:
            per_host_perf = alone
        else:
            per_host_perf = unknown(f"{calib['file']}: no sweep row at or below the per-rank batch {per_rank}"
                                    + (f" ({cal_unknown.get('compute')})" if cal_unknown.get("compute") else ""))
        conc = link.get("concurrent") or {}
        if conc:
            conc_perf = {h: r["tok_per_s"] for h, r in conc.items()}
            steps = [r["step_s"] for r in conc.values()]
            imbalance = max(steps) / min(steps) if min(steps) > 0 else unknown("a zero step time")
        else:
            conc_perf = unknown(cal_unknown.get("link") or "the calibration has no concurrent measurement")
            imbalance = unknown(cal_unknown.get("link") or "the calibration has no concurrent measurement")
        shared = cal.get("shared_machine", [])
        notes = calibration_notes(cal)
    hardware = {
        "measured_performance": per_host_perf,
        "concurrent_performance": conc_perf,
        "workload_distribution": {h: n / world for h, n in ranks_per_node.items()},
        "imbalance": imbalance,
        "macos_qos_api": "not set: the trainer runs at the default QoS class (no pthread_set_qos_class_self_np call)",
        "calibration_notes": notes,
        "calibration_file": calib["file"] if cal else unknown(cal_why),
        "shared_machine": shared,
    }

    # ---- worker consistency
    code_hash = digest_of(tree_hashes(paths.ROOT, ["bin", "lib", "configs", "requirements.lock"]))
    consistency_names = ("runtime.python", "runtime.packages", "runtime.mlx", "code", "model", "dataset")
    if "error" in parity:
        consistent: object = unknown(parity["error"])
        divergent: object = unknown(parity["error"])
    else:
        rows = [c for c in parity["checks"] if c.get("name") in consistency_names]
        bad = sorted({c["host"] for c in rows if c.get("status") == "fail"})
        consistent = not bad and bool(rows)
        divergent = bad
        if parity.get("stale"):
            consistent = unknown(parity["stale"])
    worker = {
        "validation_checks": [f"check-parity {n}" for n in consistency_names],
        "script_hash": sha256_file(paths.ROOT / "bin" / "train.py"),
        "code_hash": code_hash,
        "is_consistent": consistent,
        "consistency_threshold": 1.0,
        "divergent_workers": divergent,
        "byzantine_detection": {"enabled": False, "reason": "not wanted: every host must match exactly (hashes and "
                                "versions); a host that differs is fixed with make sync / make provision, never outvoted"},
    }

    # ---- coordinator chunking
    chunking = {
        "enabled": False,
        "threshold": CHUNK_THRESHOLD,
        "chunk_size": CHUNK_THRESHOLD,
        "dataset_size": train_records if train_records is not None else unknown(ds.get("error", "no train count")),
        "num_chunks": math.ceil(train_records / CHUNK_THRESHOLD) if train_records else unknown(
            ds.get("error", "no train count")),
        "would_enable": train_records >= CHUNK_THRESHOLD if train_records is not None else unknown(
            ds.get("error", "no train count")),
        "why": "the trainer tokenizes every record up front (mlx-lm CacheDataset) and streams batches from memory; "
               "it does not chunk: a dataset at or over the threshold is flagged in the checkpoint layer",
        "memory_management": {"clear_cache_threshold": cfg["clear_cache_threshold"], "gc_collect": False,
                              "mx_clear_cache": cfg["clear_cache_threshold"] > 0},
        "progress_reporting": f"`iter N rank R loss L tokens T step_s S` every step on every rank; `iter N train_loss "
                              f"L lr LR tok/s X peak_mem_gb M` every {cfg['steps_per_report']} step(s) on rank 0; the "
                              "same events in runs/<RUN>/metrics.jsonl",
    }

    checks = preflight(args, cfg, hf, parity, calib, sync, sync_cmd, smoke, ds, ck_size, min_speedup, per_rank, fits)
    statuses = {c["status"] for c in checks}
    overall = "fail" if "fail" in statuses else ("unknown" if "unknown" in statuses else "pass")
    pre_flight = {"checks": checks, "validation_layers": ["hardware", "worker", "checkpoint", "gradient", "performance",
                                                          "health", "pre_rdma_sync", "worker_consistency"],
                  "block_on_failure": True, "overall_status": overall}

    plan = {
        "version": VERSION,
        "generated": {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tool": "bin/plan.py",
                      "git": launch.git_info(),
                      "command": shlex.join(["make", "plan", f"RUN={args.run}", f"HOSTFILE={args.hostfile}",
                                             f"CONFIG={args.config}", f"MODEL={args.model}", f"DATASET={args.dataset}",
                                             f"REMOTE_ROOT={args.remote_root}", f"PYTHON={args.python}"])},
        "sources": {
            "hostfile": {"path": args.hostfile, "sha256": sha256_file(args.hostfile)},
            "config": {"path": args.config, "sha256": sha256_file(args.config)},
            "dataset": {k: v for k, v in ds.items() if k != "error"} if "error" not in ds else unknown(ds["error"]),
            "parity": {k: parity[k] for k in ("file", "status", "code", "ts", "age_s") if k in parity}
            if "error" not in parity else unknown(parity["error"]),
            "calibration": {"file": calib["file"], "created": cal.get("created"),
                            "age_s": round(age_s(cal.get("created")) or 0, 1)} if cal else unknown(cal_why),
            "sync": {"file": paths.rel(run_dir / "sync.json"), "ok": sync.get("ok"), "ts": sync.get("ts")}
            if sync else unknown(f"{paths.rel(run_dir / 'sync.json')} {sync_why}: run `{sync_cmd}`"),
            "smoke": {"file": paths.rel(run_dir / "smoke.json"), "ok": smoke.get("ok")}
            if smoke else unknown(f"{paths.rel(run_dir / 'smoke.json')} {smoke_why}: run `{smoke_cmd}`"),
        },
        "unknowns": [],
        "strategy": strategy,
        "batch_configuration": batch,
        "distributed_config": distributed,
        "rdma_config": rdma,
        "checkpoint_strategy": checkpoint,
        "performance_targets": performance,
        "verification_steps": verification,
        "pre_rdma_sync": pre_sync,
        "hardware_calibration": hardware,
        "worker_consistency": worker,
        "coordinator_chunking": chunking,
        "pre_flight_checklist": pre_flight,
    }
    plan["unknowns"] = unknowns_in({k: plan[k] for k in SECTIONS})
    return plan


def load_compare():
    import importlib.util

    spec = importlib.util.spec_from_file_location("thunder_compare", paths.ROOT / "bin" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def backend_ratio(runs: Path, hf: Hostfile):
    """jaccl over ring large-message bandwidth from the newest calibration of these hosts on
    each backend; unknown unless both exist."""
    names = [h.ssh for h in hf.hosts]
    newest: dict[str, float] = {}
    for f in sorted(runs.glob("calibration-*.json")):
        d, _ = read_json(f)
        if not isinstance(d, dict) or not (d.get("link") or {}).get("bandwidth_gbps"):
            continue
        if [h.get("ssh") for h in (d.get("hostfile") or {}).get("hosts", [])] != names:
            continue
        b = d["link"]["backend"]
        newest["jaccl" if b.startswith("jaccl") else b] = d["link"]["bandwidth_gbps"]["busbw_mean"]
    if "jaccl" in newest and "ring" in newest and newest["ring"] > 0:
        return newest["jaccl"] / newest["ring"]
    have = ", ".join(sorted(newest)) or "none"
    return unknown(f"needs a calibration of these hosts over ring and over jaccl (have: {have}): run `make calibrate` "
                   "with a ring hostfile and with a jaccl one")


def checkpoint_size(run_dir: Path, cal: dict | None):
    ck = run_dir / "checkpoints"
    dirs = sorted(d for d in ck.glob("step-*") if d.is_dir()) if ck.is_dir() else []
    if dirs:
        size = sum(f.stat().st_size for f in dirs[-1].rglob("*") if f.is_file())
        return {"bytes": size, "source": f"{paths.rel(dirs[-1])} (the newest checkpoint on disk)"}
    if cal and cal.get("trainable_bytes"):
        return {"bytes": 3 * int(cal["trainable_bytes"]),
                "source": "3 x the calibration's trainable bytes (adapter weights + Adam's two moments; metadata excluded)"}
    return unknown("no checkpoint on disk and no calibration of the model: run `make smoke` or `make calibrate`")


def calibration_notes(cal: dict) -> str:
    parts = []
    for h in cal.get("hosts", []):
        f = h.get("facts") or {}
        best = max(h.get("sweep", []), key=lambda r: r["tok_per_s"] or 0, default=None)
        if best:
            parts.append(f"{h['ssh']} ({f.get('device', '?')}, {f.get('cpu_count', '?')} cpus, load {f.get('loadavg')}): "
                         f"best {best['tok_per_s']:.0f} tok/s at batch {best['batch']}; stopped by "
                         f"{h.get('stopped', {}).get('reason', '?')}")
    link = cal.get("link") or {}
    if link.get("bandwidth_gbps"):
        parts.append(f"all_sum {link['backend']}: {link['latency_us']['mean']:.0f} us at "
                     f"{link['latency_us']['bytes']} B, {link['bandwidth_gbps']['busbw_mean']:.3f} GB/s bus bandwidth at "
                     f"{link['bandwidth_gbps']['bytes'] >> 20} MiB")
        v = link.get("allreduce_vs_tcp") or {}
        if v.get("tcp_both_over_allsum"):
            parts.append(f"bare TCP both ways at once is {v['tcp_both_over_allsum']:.2f}x the all_sum's best bus "
                         f"bandwidth ({v['tcp_over_allsum']:.2f}x one way)")
    if cal.get("expected_speedup") is not None:
        parts.append(f"expected speedup {cal['expected_speedup']:.2f}x (without the link "
                     f"{cal['compute_bound_speedup']:.2f}x, link share {100 * (cal.get('link_share') or 0):.0f}%)")
    if cal.get("shared_machine"):
        parts.append(f"{cal['shared_machine']} share one machine: ranks compete for its cores")
    return "; ".join(parts) or "the calibration holds no measurement"


def check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix_command": fix}


def preflight(args, cfg, hf, parity, calib, sync, sync_cmd, smoke, ds, ck_size, min_speedup, per_rank, fits) -> list[dict]:
    cal = calib.get("cal")
    out = []
    pcmd = parity.get("command", "make check-parity")
    ccmd = calib.get("command", "make calibrate")
    # hardware: the calibration exists for these hosts and the per-rank batch fits
    if not cal:
        out.append(check("hardware_layer", "unknown", calib.get("error", "no calibration"), ccmd))
    elif isinstance(fits, dict):
        out.append(check("hardware_layer", "unknown", fits.get("unknown") or "no memory measurement", ccmd))
    elif fits is True:
        rec = cal["recommendation"]
        out.append(check("hardware_layer", "pass", f"per-rank batch {per_rank} fits every host (largest fitting batch "
                         f"{rec['fits_memory_cap']}, {rec.get('fits_memory_cap_kind', 'measured')}; {calib['file']})"))
    elif fits is False:
        rec = cal["recommendation"]
        out.append(check("hardware_layer", "fail", f"per-rank batch {per_rank} does not fit (largest fitting batch "
                         f"{rec['fits_memory_cap']}): use batch_size {rec['config_batch_size']} with "
                         f"grad_accumulation_steps {rec['config_grad_accumulation_steps']}",
                         f"edit {args.config}: batch_size: {rec['config_batch_size']}, grad_accumulation_steps: "
                         f"{rec['config_grad_accumulation_steps']}"))
    else:
        out.append(check("hardware_layer", "unknown", "the calibration has no memory measurement at this batch", ccmd))
    # worker: ssh and runtime on every host
    if "error" in parity:
        out.append(check("worker_layer", "unknown", parity["error"], pcmd))
        out.append(check("health_check", "unknown", parity["error"], pcmd))
        out.append(check("worker_consistency", "unknown", parity["error"], pcmd))
    else:
        rows = parity["checks"]

        def layer(names, label):
            bad = [c for c in rows if c.get("name", "").split(".")[0] in names and c.get("status") == "fail"]
            if bad:
                return "fail", "; ".join(f"{c['host']} {c['name']}: {c['detail']}" for c in bad[:4])
            if parity.get("stale"):
                return "unknown", parity["stale"]
            return "pass", f"{label} pass on {', '.join(hf.unique_ssh())} ({parity['file']}, {parity['ts']})"

        st, d = layer(("ssh", "runtime", "link"), "ssh, runtime and link checks")
        out.append(check("worker_layer", st, d, pcmd if st != "pass" else ""))
        code = parity.get("code")
        st = "fail" if code in (2, 3) else ("unknown" if parity.get("stale") else "pass")
        out.append(check("health_check", st, parity.get("stale") or f"check-parity status {parity.get('status')} "
                         f"(exit {code}) {parity.get('age_s')} s ago", pcmd if st != "pass" else ""))
        st, d = layer(("code", "model", "dataset", "runtime"), "code, model, dataset and runtime checks")
        out.append(check("worker_consistency", st, d, (f"{sync_cmd} (or make provision)") if st == "fail" else
                         (pcmd if st == "unknown" else "")))
    # checkpoint: free disk at REMOTE_ROOT against the checkpoints kept
    disk = [c for c in parity.get("checks", []) if c.get("name") == "resources.disk"]
    if "error" in parity or not disk:
        out.append(check("checkpoint_layer", "unknown", parity.get("error", "check-parity reported no disk row"), pcmd))
    elif any(c["status"] == "fail" for c in disk):
        out.append(check("checkpoint_layer", "fail", "; ".join(f"{c['host']}: {c['detail']}" for c in disk
                                                                 if c["status"] == "fail"),
                         "free disk space at REMOTE_ROOT, then " + pcmd))
    else:
        keep = cfg["keep_last_k"] + 2
        size = ck_size.get("bytes") if isinstance(ck_size, dict) else None
        need = f"~{keep * size / 1e6:.1f} MB for {keep} checkpoints" if size else "checkpoint size unknown"
        big = (ds.get("records") or {}).get("train") or 0
        extra = (f"; the dataset has {big} train records (>= {CHUNK_THRESHOLD}): the trainer holds them all in memory"
                 if big >= CHUNK_THRESHOLD else "")
        out.append(check("checkpoint_layer", "pass", f"{'; '.join(c['host'] + ': ' + c['detail'] for c in disk)}; "
                         f"{need}{extra}"))
    # gradient: the batch divides over the world, cadences fall on optimizer updates
    problems = []
    try:
        C.check_world(cfg, hf.size)
    except RunbookError as e:
        problems.append(str(e.args[0]))
    accum = cfg["grad_accumulation_steps"]
    for key in ("save_every", "iters"):
        if cfg[key] % accum:
            problems.append(f"{key} {cfg[key]} is not a multiple of grad_accumulation_steps {accum}")
    out.append(check("gradient_layer", "fail" if problems else "pass",
                     "; ".join(problems) or f"global batch {cfg['batch_size']} x {accum} over {hf.size} ranks "
                     f"({cfg['batch_size'] // hf.size} per rank per micro-step); save_every and iters fall on updates",
                     f"edit {args.config}" if problems else ""))
    # performance: the expected speedup clears compare's bar
    exp = cal.get("expected_speedup") if cal else None
    if exp is None:
        why = calib.get("error") or (cal or {}).get("unknown", {}).get("expected_speedup", "no expected speedup")
        out.append(check("performance_layer", "unknown", why, ccmd))
    else:
        ok = exp > min_speedup
        out.append(check("performance_layer", "pass" if ok else "fail",
                         f"expected speedup {exp:.2f}x vs the required {min_speedup:g}x ({calib['file']}; link share "
                         f"{100 * (cal.get('link_share') or 0):.0f}%)",
                         "" if ok else "see RUNBOOK.md#thunder-path: faster link/backend, a larger per-rank batch, or "
                                       "fewer ranks; then " + ccmd))
    # pre-RDMA sync: this run's sync verified every host
    if not sync:
        out.append(check("pre_rdma_sync", "unknown", f"no sync for run {args.run} yet", sync_cmd))
    else:
        hosts = {h.get("host") for h in sync.get("hosts", []) if h.get("verified")}
        missing = sorted(set(hf.unique_ssh()) - hosts)
        st = "pass" if sync.get("ok") and not missing else "fail"
        out.append(check("pre_rdma_sync", st, f"sync at {sync.get('ts')}: "
                         + ("every host verified" if st == "pass" else f"not verified on {missing or 'some host'}"),
                         "" if st == "pass" else sync_cmd))
    order = {n: i for i, n in enumerate(LAYERS)}
    return sorted(out, key=lambda c: order[c["name"]])


# ---- main ------------------------------------------------------------------------------------------
def main() -> int:
    args = build_parser().parse_args()
    try:
        plan = build_plan(args)
    except (RunbookError, ValueError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), ANCHOR), 2)
    errs = validate(plan, SCHEMA)
    if errs:  # a bug in this script, not in the inputs: say exactly where
        return die(RunbookError("the plan does not match its schema (a bug in bin/plan.py): " + "; ".join(errs[:5]),
                                ANCHOR), 3)
    out_dir = Path(args.out_dir or args.runs_dir)
    path = out_dir / f"plan-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    atomic.write_json(path, plan)
    atomic.write_json(out_dir / "plan.json", plan)
    pf = plan["pre_flight_checklist"]
    if args.json:
        print(atomic.dumps_json(plan), end="")
    else:
        for c in pf["checks"]:
            event("plan-check", name=c["name"], status=c["status"], detail=json.dumps(c["detail"]),
                  fix=json.dumps(c["fix_command"]) if c["fix_command"] else "-")
        for u in plan["unknowns"]:
            event("plan-unknown", field=u["field"], reason=json.dumps(u["reason"]))
        bc, pt = plan["batch_configuration"], plan["performance_targets"]
        event("plan", file=paths.rel(path), overall_status=pf["overall_status"], world_size=plan["strategy"]["total_gpus"],
              per_gpu_batch_size=json.dumps(bc["per_gpu_batch_size"]),
              expected_speedup=json.dumps(pt["expected_speedup"]), unknowns=len(plan["unknowns"]))
    if args.strict and pf["overall_status"] != "pass":
        return die(RunbookError(f"pre-flight {pf['overall_status']}: see the plan-check lines", ANCHOR), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
