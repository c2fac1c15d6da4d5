#!/usr/bin/env python3
"""calibrate: per-host tok/s and peak memory of the trainer's step, the link's all_sum curve, and
what they predict: a per-rank batch and the expected speedup of the world over one host.

Usage:
    python bin/calibrate.py --hostfile HOSTFILE --model MODEL --config CONFIG --remote-root DIR --python PY [options]
Example (what `make calibrate` runs after sync and check-parity):
    python bin/calibrate.py --hostfile hostfile.json --model models/tiny-gemma4 \
        --config configs/stage1.yaml --remote-root "$PWD" --python "$PWD/.venv/bin/python"

compute: one host at a time over ssh, bin/train.py's compiled step (the config's `loss`, so the memory
and the recommended batch are that loss's) at batch 1, 2, 4, ... and the config's sizes, until memory
(--mem-fraction of the ceiling) or --budget-s says stop. link: every rank under mlx.launch: that step
at the per-rank batch, the gradient all-reduce, all_sum --min-bytes..--max-bytes (busbw).
expected_speedup = control step / dual step (see speedup_model).
Writes runs/calibration-<UTC>.json. Exit 0 written, 1 a phase failed (nothing written), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.log import OOM_RE, PARITY, RunbookError, die, event, failure  # noqa: E402

ANCHOR, FORMAT, RESULT, MiB = "calibrate", "thunder-runbook/calibration", "calibrate-result ", 1 << 20
SCRIPT = "bin/calibrate.py"


def facts() -> dict:
    import mlx.core as mx

    boot = Path("/proc/sys/kernel/random/boot_id")  # one value for the fabric's hosts: one machine
    return {"hostname": socket.gethostname(), "platform": sys.platform, "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "device": str(mx.default_device()), "boot_id": boot.read_text().strip() if boot.is_file() else None}


def memory_ceiling(mx) -> tuple[int | None, str]:
    size = mx.device_info().get("max_recommended_working_set_size")
    if size:
        return int(size), "metal max_recommended_working_set_size"
    m = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()) if sys.platform == "linux" else None
    return (int(m.group(1)) * 1024, "MemAvailable at probe start") if m else (None, "unknown")


# ---- host side: the trainer's step ----------------------------------------------------------
class Stepper:
    """bin/train.py's own model preparation, optimizer and compiled step on random full-length batches."""

    def __init__(self, cfg: dict):
        import importlib.util
        import types

        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.trainer import grad_checkpoint
        from mlx_lm.utils import load, maybe_set_recommended_wired_limit

        spec = importlib.util.spec_from_file_location("thunder_train", Path(__file__).with_name("train.py"))
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        t0 = time.perf_counter()
        model, _ = load(cfg["model"], tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                        trust_remote_code=cfg["trust_remote_code"])
        opt = train.prepare_model(mx, model, cfg)
        opt.init(model.trainable_parameters())
        mx.eval(model.parameters(), opt.state)
        self.load_s, self.mx, self.seq, self.model = time.perf_counter() - t0, mx, int(cfg["max_seq_length"]), model
        maybe_set_recommended_wired_limit()
        if cfg["grad_checkpoint"]:
            grad_checkpoint(model.layers[0])
        params = tree_flatten(model.trainable_parameters())
        self.trainable_params = int(sum(v.size for _, v in params))
        self.trainable_bytes = int(sum(v.nbytes for _, v in params))
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 256)
        self.state = [model.state, opt.state, mx.random.state]
        self.step = train.compiled_step(types.SimpleNamespace(mx=mx, model=model, optimizer=opt, cfg=cfg,
                                                              state=self.state))
        model.train()

    def measure(self, b: int, steps: int) -> dict:
        """A warm-up step (compiles this shape), then `steps` timed ones."""
        mx, times = self.mx, []
        x = mx.random.randint(0, self.vocab, (b, self.seq), key=mx.random.key(0)).astype(mx.int32)
        lengths = mx.array([[0, self.seq]] * b, dtype=mx.int32)
        mx.eval(x, lengths)
        mx.reset_peak_memory()
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            loss, toks, _ = self.step((x, lengths), None, True)
            mx.eval(self.state, loss, toks)
            times.append(time.perf_counter() - t0)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"the loss is {loss.item()} at batch {b}")
        step_s, toks = statistics.median(times[1:]), int(toks.item())
        return {"batch": b, "tokens_per_step": toks, "step_s": round(step_s, 6), "compile_s": round(times[0], 4),
                "tok_per_s": round(toks / step_s, 3), "peak_mem_bytes": int(mx.get_peak_memory())}


def compute_sweep(stepper: Stepper, spec: dict, emit) -> dict:
    """Batch sizes upward until predicted memory, an allocation failure or the time budget says stop."""
    mx, t_start, (total, source) = stepper.mx, time.monotonic(), spec.get("ceiling") or memory_ceiling(stepper.mx)
    ceiling, over = total * spec["mem_fraction"] if total else None, f"{spec['mem_fraction']:g} x {(total or 0) / 1e9:.2f} GB"
    sizes = set(spec["must"]) | {2**k for k in range(spec["max_batch"].bit_length())}
    rows, stop = [], {"reason": "max_batch", "detail": "measured every size up to --max-batch and the config's"}
    for b in sorted(sizes):
        if rows:  # straight lines through the last two sizes (one size: proportional)
            (b0, m0, t0), (b1, m1, t1) = [(r["batch"], r["peak_mem_bytes"], r["step_s"]) for r in (rows[-2:] * 2)[-2:]]
            mem = m1 + (m1 - m0) / (b1 - b0) * (b - b1) if b1 != b0 else m1 * b / b1
            need = (spec["steps"] + 1) * max(t1 + (t1 - t0) / (b1 - b0) * (b - b1) if b1 != b0 else t1 * b / b1, t1)
            left = spec["budget_s"] - (time.monotonic() - t_start)
            if ceiling and mem > ceiling:
                stop = {"reason": "memory", "next_batch": b, "detail": f"batch {b} would need ~{mem / 1e9:.2f} GB, "
                        f"over {over} ({source})"}
                break
            if need > left:
                stop = {"reason": "time", "next_batch": b, "detail": f"batch {b} would take ~{need:.1f} s, "
                        f"{max(left, 0):.1f} s of the {spec['budget_s']:g} s budget left"}
                break
        try:
            row = stepper.measure(b, spec["steps"])
        except (RuntimeError, MemoryError, ValueError) as e:
            if not (isinstance(e, MemoryError) or OOM_RE.search(str(e))):
                raise
            stop = {"reason": "memory", "next_batch": b, "detail": f"batch {b} failed to allocate: {str(e)[:200]}"}
            break
        finally:
            mx.clear_cache()
        rows.append({**row, "over_memory": bool(ceiling and row["peak_mem_bytes"] > ceiling)})
        emit(row)
        if rows[-1]["over_memory"]:
            stop = {"reason": "memory", "next_batch": b, "detail": f"batch {b} peaked over {over} ({source})"}
            break
    return {"sweep": rows, "stopped": stop, "memory_ceiling_bytes": total, "memory_ceiling_source": source,
            "mem_fraction": spec["mem_fraction"]}


def compute_probe(spec: dict) -> int:
    """One host alone: load, then the batch sweep; the result as one line."""
    import mlx.core as mx

    host, f, spec["ceiling"] = spec["host"], facts(), memory_ceiling(mx)  # before the model takes its share
    stepper = Stepper(spec["cfg"])
    event("calibrate-load", host=host, load_s=round(stepper.load_s, 3), trainable_params=stepper.trainable_params)
    out = compute_sweep(stepper, spec, lambda r: event(
        "calibrate-compute", host=host, batch=r["batch"], step_s=r["step_s"], **{"tok/s": r["tok_per_s"]},
        peak_mem_gb=round(r["peak_mem_bytes"] / 1e9, 4), compile_s=r["compile_s"]))
    out.update(facts=f, trainable_params=stepper.trainable_params, trainable_bytes=stepper.trainable_bytes)
    print(RESULT + json.dumps(out), flush=True)
    return 0


# ---- host side: every rank at once under mlx.launch -------------------------------------------
def keep_freed_memory() -> bool:
    """glibc: never mmap a block nor trim the heap, as Metal's buffer cache keeps buffers (else the curve
    measures page faults of fresh all_sum outputs)."""
    import ctypes

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**31 - 1) == 1  # M_MMAP_MAX, M_TRIM_THRESHOLD


def slowest(mx, *seconds: float) -> list[float]:
    """Each value's maximum over the ranks: a collective ends when its slowest rank's does."""
    return mx.distributed.all_max(mx.array(seconds, dtype=mx.float32), stream=mx.cpu).tolist()


def time_allsum(mx, nbytes: int, size: int) -> dict:
    x, reps, each = mx.ones((max(nbytes // 4, size),), dtype=mx.float32), int(max(5, min(50, 64 * MiB // nbytes))), []
    mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))  # warm-up
    for _ in range(reps):
        t0 = time.perf_counter()
        y = mx.distributed.all_sum(x, stream=mx.cpu)
        mx.eval(y)
        each.append(time.perf_counter() - t0)
    if y[0].item() != size:
        raise RuntimeError(f"all_sum of ones over {size} ranks gave {y[0].item()}")
    mean_s, min_s = slowest(mx, statistics.mean(each), min(each))
    bus = x.nbytes / 1e9 * 2 * (size - 1) / size  # GB each rank moves: busbw = bytes / time x 2(N-1)/N
    return {"bytes": x.nbytes, "reps": reps, "mean_s": mean_s, "min_s": min_s, "busbw_gbps": bus / mean_s,
            "best_busbw_gbps": bus / min_s}


def rank_probe(spec: dict) -> int:
    import mlx.core as mx
    from mlx.nn import average_gradients
    from mlx.utils import tree_map

    group = mx.distributed.init(strict=True)
    rank, size = group.rank(), group.size()
    kept = mx.distributed.all_min(mx.array([float(keep_freed_memory())]), stream=mx.cpu).item()
    out: dict = {"reuse_freed_memory": kept == 1}
    if spec["per_rank_batch"]:
        stepper = Stepper(spec["cfg"])
        row = stepper.measure(spec["per_rank_batch"], spec["steps"])
        each = mx.distributed.all_gather(mx.array([row["step_s"]]), stream=mx.cpu).tolist()
        out["concurrent"] = {"batch": row["batch"], "step_s": each, "tokens_per_step": row["tokens_per_step"]}
        grads, each = tree_map(mx.zeros_like, stepper.model.trainable_parameters()), []
        for _ in range(4):
            t0 = time.perf_counter()
            mx.eval(average_gradients(grads))
            each.append(time.perf_counter() - t0)
        mean_s, min_s = slowest(mx, statistics.mean(each[1:]), min(each[1:]))
        out["grad_allreduce"] = {"bytes": stepper.trainable_bytes, "mean_s": mean_s, "min_s": min_s}
        del stepper, grads
        mx.clear_cache()
    out["allsum"], n = [], spec["min_bytes"]
    while n < 2 * spec["max_bytes"]:
        r = time_allsum(mx, min(n, spec["max_bytes"]), size)
        out["allsum"].append(r)
        if rank == 0:
            event("calibrate-allsum", bytes=r["bytes"], reps=r["reps"], mean_ms=round(1e3 * r["mean_s"], 4),
                  best_ms=round(1e3 * r["min_s"], 4))
        n *= 2
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    return 0


# ---- the model: from measurements to a recommendation and a speedup ---------------------------
def step_time_at(sweep: list[dict], b: int) -> tuple[float | None, str]:
    """(seconds per step, how) at batch b: measured, or the line through the nearest two sizes."""
    rows = sorted(sweep, key=lambda r: r["batch"])
    exact = [r["step_s"] for r in rows if r["batch"] == b]
    if exact or len(rows) < 2:
        return (exact[0], "measured") if exact else (
            (rows[0]["step_s"] * b / rows[0]["batch"], "scaled from one size") if rows else (None, "no measurement"))
    below, above = [r for r in rows if r["batch"] < b], [r for r in rows if r["batch"] > b]
    a, c = (below[-1], above[0]) if below and above else ((below[-2], below[-1]) if below else (above[0], above[1]))
    t = a["step_s"] + (c["step_s"] - a["step_s"]) * (b - a["batch"]) / (c["batch"] - a["batch"])
    return max(t, 1e-9), "interpolated" if below and above else "extrapolated"


def max_fitting_batch(host: dict) -> tuple[int | None, str]:
    """(largest batch within memory, "measured" when memory stopped the sweep, else "lower_bound")."""
    fit = [r["batch"] for r in host.get("sweep", []) if not r.get("over_memory")]
    return (max(fit) if fit else None), "measured" if host.get("stopped", {}).get("reason") == "memory" else "lower_bound"


def recommend(cfg: dict, world: int, hosts: list[dict]) -> dict:
    """Per-rank micro-batch and accumulation that keep the config's global batch and fit every host."""
    g = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    fits = [max_fitting_batch(h) for h in hosts]
    if g % world or any(f[0] is None for f in fits):
        return {"error": "a host measured no batch within its memory: see the compute phase" if g % world == 0 else
                f"the global batch {g} (batch_size x grad_accumulation_steps) is not divisible by the world size "
                f"{world}: use {g - g % world or world} or {g - g % world + world}"}
    cap, per_rank = min(f[0] for f in fits), g // world
    m = max(d for d in range(1, min(per_rank, cap) + 1) if per_rank % d == 0)
    return {"per_rank_batch": m, "grad_accumulation_steps": per_rank // m, "config_batch_size": m * world,
            "config_grad_accumulation_steps": per_rank // m, "fits_memory_cap": cap,
            "fits_memory_cap_kind": "measured" if (cap, "measured") in fits else "lower_bound",
            "why": f"{g} examples per optimizer step = {world} ranks x {per_rank}; " + (
                f"{m} per rank fits" if m == per_rank else
                f"{per_rank} per rank does not fit: micro-batch {m} x {per_rank // m} accumulation steps")
            + f" (largest batch measured within memory: {cap})"}


def speedup_model(cfg: dict, world: int, hosts: list[dict], link: dict | None) -> dict:
    """control = accum x t(rank 0's host alone, batch_size); dual = accum x t(slowest rank, every
    rank computing, batch_size / world, the trainer's step with its all-reduce) - (accum - 1) x the
    all-reduce (it runs once per optimizer step). Without the concurrent step: alone + all-reduce."""
    accum, m = cfg["grad_accumulation_steps"], cfg["batch_size"] // world
    tc, how_c = step_time_at(hosts[0].get("sweep", []), cfg["batch_size"])
    if tc is None or cfg["batch_size"] % world:
        return {"unknown": f"batch_size {cfg['batch_size']} is not divisible by {world} ranks" if tc else
                f"{hosts[0]['ssh']}: no compute measurement"}
    if world > 1 and not (link or {}).get("grad_allreduce"):
        return {"unknown": "no gradient all-reduce measured (the link phase did not run)"}
    t_g, conc, per_host = link["grad_allreduce"]["mean_s"] if world > 1 else 0.0, (link or {}).get("concurrent", {}), {}
    for h in hosts:
        c = conc.get(h["ssh"])
        t, how = (c["step_s"], "measured with every rank computing") if c and c["batch"] == m else \
            step_time_at(h.get("sweep", []), m)
        if t is None:
            return {"unknown": f"{h['ssh']}: no compute measurement"}
        per_host[h["ssh"]] = (t if c and c["batch"] == m else t + t_g, how)
    t_ctrl, t_dual = accum * tc, accum * max(v[0] for v in per_host.values()) - (accum - 1) * t_g
    return {"per_rank_batch": m, "control_batch": cfg["batch_size"], "grad_accumulation_steps": accum,
            "t_control_step_s": t_ctrl, "control_how": how_c, "dual_how": {k: v[1] for k, v in per_host.items()},
            "t_dual_step_s": t_dual, "t_grad_allreduce_s": t_g, "expected_speedup": t_ctrl / t_dual,
            "compute_bound_speedup": t_ctrl / max(t_dual - t_g, 1e-9), "link_share": t_g / t_dual}


# ---- the orchestrator ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--hostfile", "--model", "--config", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    for flag, kind, default, what in (
            ("--budget-s", float, 120.0, "compute sweep seconds per host"), ("--steps", int, 3, "timed steps per size"),
            ("--max-batch", int, 64, "largest power-of-two batch tried"), ("--min-bytes", int, 4096, "smallest all_sum"),
            ("--mem-fraction", float, 0.8, "share of the memory ceiling a batch may peak at"),
            ("--max-bytes", int, 256 * MiB, "largest all_sum"),
            ("--timeout-s", float, 900.0, "bound on each phase beyond its budget"),
            ("--port", int, None, "first ring port (mlx.launch --starting-port)")):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    p.add_argument("--out-dir", default=str(paths.RUNS), help="where calibration-<UTC>.json goes")
    p.add_argument("--skip-compute", action="store_true", help="measure only the link")
    return p


def stream(argv: list[str], timeout: float, what: str, fix: str, category: str | None = None) -> dict:
    """Run argv, echo its lines but the result line; the result, else an error with its last lines."""
    from lib.launch import stop_group

    proc = subprocess.Popen(argv, cwd=paths.ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    fired: list[bool] = []
    timer = threading.Timer(timeout, lambda: fired.append(True) or stop_group(proc))
    timer.start()
    result, tail = None, []
    for line in proc.stdout:
        line = line.rstrip("\r\n")
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
        elif line.strip():
            print(line, flush=True)
            tail = (tail + [line])[-12:]
    rc = proc.wait()
    timer.cancel()
    if rc or result is None:
        why = f"timed out after {timeout:g} s" if fired else f"exit {rc}"
        message = f"{what} ({why}):\n" + "\n".join(tail) + f"\n{fix}"
        raise failure(category, message) if category else RunbookError(message, ANCHOR)
    return result


def phase_compute(args, hf, cfg: dict, probe_id: str) -> list[dict]:
    from lib.hostfile import Hostfile
    from lib.launch import launch_argv

    w, g = hf.size, cfg["batch_size"] * cfg["grad_accumulation_steps"]
    must = sorted({cfg["batch_size"], g} | {x // w for x in (cfg["batch_size"], g) if x % w == 0})
    hosts = []
    for host in hf.unique_ssh():
        spec = {"probe_id": probe_id, "cfg": cfg, "host": host, "budget_s": args.budget_s, "max_batch": args.max_batch,
                "steps": args.steps, "mem_fraction": args.mem_fraction, "must": must}
        alone = Hostfile(args.hostfile, [next(h for h in hf.hosts if h.ssh == host)])  # ssh, not mlx.launch
        argv = launch_argv(args.hostfile, alone, args.python, args.remote_root,
                           ["--compute-probe", json.dumps(spec)], script=SCRIPT)
        event("calibrate-phase", phase="compute", host=host, budget_s=args.budget_s)
        res = stream(argv, args.budget_s + args.timeout_s, f"{host}: the compute probe failed",
                     f"run `make sync` and `make check-parity HOSTFILE={args.hostfile}` first")
        hosts.append({"ssh": host, "ranks": [h.rank for h in hf.hosts if h.ssh == host], **res})
    return hosts


def phase_link(args, hf, cfg: dict, probe_id: str, per_rank_batch: int | None) -> dict:
    from lib.launch import launch_argv

    spec = {"probe_id": probe_id, "cfg": cfg, "steps": args.steps, "min_bytes": args.min_bytes, "max_bytes": args.max_bytes,
            "per_rank_batch": per_rank_batch}
    port = args.port
    if port is None and all(h.ssh == "127.0.0.1" for h in hf.hosts):  # ranks here: ports nobody else uses
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    argv = launch_argv(args.hostfile, hf, args.python, args.remote_root,
                       ["--rank-probe", json.dumps(spec)], port, script=SCRIPT)
    event("calibrate-phase", phase="link", world_size=hf.size, backend=hf.backend or "ring",
          per_rank_batch=per_rank_batch or "-", max_bytes=args.max_bytes)
    res = stream(argv, args.timeout_s, "the link probe failed", f"check `make check-parity HOSTFILE={args.hostfile}` "
                 "(ssh, interpreter, code on every host) and the ring ports", PARITY)
    rows = res.pop("allsum")
    # large messages: the best over the sizes >= a quarter of the largest (one disturbed size is not the link)
    top = max((r for r in rows if r["bytes"] >= rows[-1]["bytes"] / 4), key=lambda r: r["best_busbw_gbps"])
    link = {"backend": hf.backend or "ring", "world_size": hf.size, "allreduce": rows, **res,
            "latency_us": {"bytes": rows[0]["bytes"], "mean": 1e6 * rows[0]["mean_s"], "best": 1e6 * rows[0]["min_s"]},
            "bandwidth_gbps": {"bytes": top["bytes"], "busbw_mean": top["busbw_gbps"], "busbw_best": top["best_busbw_gbps"]}}
    if "concurrent" in res:  # per host, its slowest rank
        c, link["concurrent"] = res["concurrent"], {}
        for h, t in zip(hf.hosts, c["step_s"], strict=True):
            if t >= link["concurrent"].get(h.ssh, {}).get("step_s", 0):
                link["concurrent"][h.ssh] = {"batch": c["batch"], "step_s": t, "tok_per_s": c["tokens_per_step"] / t}
    return link


def load_inputs(args):
    from lib import config as C
    from lib.hostfile import check_path
    from lib.hostfile import load as load_hostfile

    hf = load_hostfile(args.hostfile)
    check_path(args.remote_root, "REMOTE_ROOT")
    check_path(args.python, "PYTHON")
    cfg = C.load_config(args.config)
    cfg.update(model=args.model, resume_adapter_file=None)
    if not 4 <= args.min_bytes <= args.max_bytes:
        raise RunbookError(f"--min-bytes {args.min_bytes} / --max-bytes {args.max_bytes}: need 4 <= min <= max", ANCHOR)
    if args.budget_s <= 0 or args.max_batch < 1 or args.steps < 1 or not 0 < args.mem_fraction <= 1:
        raise RunbookError("--budget-s, --max-batch, --steps must be positive and --mem-fraction in (0, 1]", ANCHOR)
    return hf, cfg


def measure(args, hf, cfg: dict, probe_id: str) -> dict:
    """The two phases, the recommendation and the speedup: the calibration's measured part."""
    hosts = [{"ssh": h, "ranks": [x.rank for x in hf.hosts if x.ssh == h], "sweep": []} for h in hf.unique_ssh()]
    unknown = {"compute": "skipped (--skip-compute): no throughput, recommendation or speedup"} if args.skip_compute else {}
    if not args.skip_compute:
        hosts = phase_compute(args, hf, cfg, probe_id)
    rec = recommend(cfg, hf.size, hosts) if not unknown else {"error": unknown["compute"]}
    per_rank = cfg["batch_size"] // hf.size if not unknown and cfg["batch_size"] % hf.size == 0 else None
    if per_rank and per_rank > rec.get("fits_memory_cap", per_rank) and rec["fits_memory_cap_kind"] == "measured":
        per_rank = rec["per_rank_batch"]  # the configured split does not fit: time the one that does
    link = phase_link(args, hf, cfg, probe_id, per_rank) if hf.size > 1 else None
    if hf.size == 1:
        unknown["link"] = "one rank: no link to measure"
    sp = {"unknown": unknown["compute"]} if "compute" in unknown else speedup_model(cfg, hf.size, hosts, link)
    unknown.update({k: sp["unknown"] for k in ("expected_speedup", "compute_bound_speedup") if sp.get(k) is None})
    boots: dict = {}
    for h in hosts:
        boots.setdefault((h.get("facts") or {}).get("boot_id") or h["ssh"], []).append(h["ssh"])
    exp, cb = sp.get("expected_speedup"), sp.get("compute_bound_speedup")
    return {"hosts": hosts, "shared_machine": [v for v in boots.values() if len(v) > 1], "link": link,
            "trainable_params": hosts[0].get("trainable_params"), "trainable_bytes": hosts[0].get("trainable_bytes"),
            "recommendation": rec, "speedup": sp, "expected_speedup": exp, "compute_bound_speedup": cb,
            "link_share": sp.get("link_share"), "link_bound": exp < 0.9 * cb if exp and cb and hf.size > 1 else None,
            "unknown": unknown}


def orchestrate(args) -> int:
    from lib import launch
    from lib.hashing import sha256_file

    t0, probe_id, load_start = time.time(), f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", os.getloadavg()
    try:
        hf, cfg = load_inputs(args)
    except (RunbookError, ValueError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), ANCHOR), 2)
    event("calibrate", hostfile=args.hostfile, world_size=hf.size, backend=hf.backend or "ring", model=args.model,
          max_seq_length=cfg["max_seq_length"], batch_size=cfg["batch_size"], loadavg=f"{load_start[0]:.2f}")
    try:
        measured = measure(args, hf, cfg, probe_id)
    except BaseException as e:  # leave no probe behind on any host, then say why (a bug: the traceback)
        from lib.remote import run_on

        for host in hf.unique_ssh():
            run_on(host, ["pkill", "-KILL", "-f", "--", r"bin/calibrate\.py --[a-z]+-probe .*" + probe_id])
        if isinstance(e, KeyboardInterrupt):
            return die(RunbookError("interrupted; nothing written", ANCHOR), 130)
        if not isinstance(e, RunbookError):
            raise
        return die(e, 1) if not e.category else (launch.print_category(e.category, str(e.args[0])) or 1)
    doc = {"format": FORMAT, "format_version": 2, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": shlex.join(["python", *sys.argv]), "git": launch.git_info(),
           "hostfile": {"path": args.hostfile, "sha256": sha256_file(args.hostfile), **hf.to_json(), "world_size": hf.size},
           "model": args.model, "model_sha256": launch.model_hash(args.model),
           "config": {"path": args.config, "sha256": sha256_file(args.config), **{k: cfg[k] for k in (
               "batch_size", "grad_accumulation_steps", "max_seq_length", "num_layers", "fine_tune_type",
               "lora_parameters", "grad_checkpoint", "optimizer", "loss", "loss_chunk_tokens")}},
           "loadavg": {"start": load_start, "end": os.getloadavg()}, **measured, "wall_s": round(time.time() - t0, 3)}
    path = Path(args.out_dir) / f"calibration-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    while path.exists():  # names sort by time; never overwrite one
        time.sleep(1)
        path = Path(args.out_dir) / f"calibration-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    atomic.write_json(path, doc)
    rec, sp = doc["recommendation"], doc["speedup"]
    print("recommendation: " + (rec.get("error") or f"per-rank batch {rec['per_rank_batch']} x accumulation "
                                f"{rec['grad_accumulation_steps']}: {rec['why']}"), flush=True)
    if sp.get("t_dual_step_s"):  # the link's figures are in the file
        print(f"speedup: control step {sp['t_control_step_s']:.4f} s / dual step {sp['t_dual_step_s']:.4f} s "
              f"(all-reduce {sp['t_grad_allreduce_s']:.4f} s); shared machine {doc['shared_machine']}", flush=True)
    event("calibrate-done", file=paths.rel(path), expected_speedup=doc["expected_speedup"] or "unknown",
          unknown=",".join(doc["unknown"]) or "-", wall_s=doc["wall_s"])
    return 0


def main() -> int:
    if sys.argv[1:2] in (["--compute-probe"], ["--rank-probe"]):  # on a host: --*-probe SPEC (carries the probe id)
        try:
            return (compute_probe if sys.argv[1] == "--compute-probe" else rank_probe)(json.loads(sys.argv[2]))
        except Exception as e:  # the orchestrator shows this line with the rest of the host's output
            print(f"error: {socket.gethostname()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
    return orchestrate(build_parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
