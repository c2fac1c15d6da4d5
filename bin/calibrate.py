#!/usr/bin/env python3
"""calibrate: per-host tok/s and peak memory of the trainer's step, the link's all_sum curve, and
what they predict: a per-rank batch and the expected speedup of the world over one host.

Usage:
    python bin/calibrate.py --hostfile HOSTFILE --model MODEL --config CONFIG --remote-root DIR \
        --python PY [options]
Example (what `make calibrate` runs after sync and check-parity):
    python bin/calibrate.py --hostfile hostfile.json --model models/tiny-gemma4 \
        --config configs/stage1.yaml --remote-root "$PWD" --python "$PWD/.venv/bin/python"

compute: one host at a time over ssh, bin/train.py's step with the config's `loss` at batch 1, 2, 4, ...
and the config's sizes until memory (MEM_FRACTION of the ceiling) or --budget-s says stop. link: every
rank under mlx.launch: that step at the per-rank batch with and without its update, the gradient
all-reduce alone (its cost to a step: the larger of the two), all_sum --min-bytes..--max-bytes
(busbw). expected_speedup = control step / dual step (see speedup_model).
Writes runs/calibration-<UTC>.json. Exit 0 written, 1 a phase failed (nothing written), 2 bad input.
"""

from __future__ import annotations

import argparse
import functools
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
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, hostfile, launch, paths  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import OOM_RE, PARITY, RunbookError, die, event, failure  # noqa: E402
from lib.remote import run_on  # noqa: E402

ANCHOR, FORMAT, RESULT, MiB = "calibrate", "thunder-runbook/calibration", "calibrate-result ", 1 << 20
SCRIPT, MEM_FRACTION = "bin/calibrate.py", 0.8  # a batch may peak at this share of the memory ceiling
NOISE_FLOOR = 0.05  # ranks whose records/s differ by no more than this (or their own noise) share equally


def memory_ceiling(mx) -> tuple[int | None, str]:
    size = mx.device_info().get("max_recommended_working_set_size")
    if size:
        return int(size), "metal max_recommended_working_set_size"
    linux = sys.platform == "linux"
    m = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()) if linux else None
    return (int(m.group(1)) * 1024, "MemAvailable at probe start") if m else (None, "unknown")


# ---- host side: the trainer's step ----------------------------------------------------------
def stepper(cfg: dict) -> types.SimpleNamespace:
    """bin/train.py's model preparation, optimizer and compiled step, set up as its train() does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from bin import train

    model, _ = load(cfg["model"], tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                    trust_remote_code=cfg["trust_remote_code"])
    st = types.SimpleNamespace(mx=mx, model=model, cfg=cfg, optimizer=train.prepare_model(mx, model, cfg))
    mx.eval(model.parameters(), st.optimizer.state)
    st.step, params = train.compiled_step(st), [v for _, v in tree_flatten(model.trainable_parameters())]
    st.trainable_params, st.trainable_bytes = sum(v.size for v in params), sum(v.nbytes for v in params)
    model.train()
    return st


def measure_batch(st, b: int, steps: int, update: bool = True) -> dict:
    """A warm-up step (compiles this shape), then `steps` timed ones on random full-length rows; without
    `update`, only the forward and backward (no all-reduce, no optimizer step)."""
    mx, seq, times = st.mx, int(st.cfg["max_seq_length"]), []
    x = mx.random.randint(0, 256, (b, seq), key=mx.random.key(0)).astype(mx.int32)  # ids every vocab has
    if st.cfg["batching"] == "length":  # the trainer's weights: every position of a full row a target
        targets = mx.ones((b, seq - 1), dtype=mx.float32)
    else:  # mlx-lm's (offset, length) per row
        targets = mx.array([[0, seq]] * b, dtype=mx.int32)
    mx.reset_peak_memory()
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss, toks, out = st.step((x, targets), None, update)
        mx.eval(st.state, loss, toks, out)
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"the loss is {loss.item()} at batch {b}")
    step_s, toks = statistics.median(times[1:]), int(toks.item())
    return {"batch": b, "tokens_per_step": toks, "step_s": round(step_s, 6),
            "min_s": round(min(times[1:]), 6), "max_s": round(max(times[1:]), 6),
            "compile_s": round(times[0], 4),
            "tok_per_s": round(toks / step_s, 3), "peak_mem_bytes": int(mx.get_peak_memory())}


def compute_sweep(st, spec: dict) -> dict:
    """Batch sizes upward until predicted memory, an allocation failure or the time budget says stop."""
    mx, t_start, fraction = st.mx, time.monotonic(), spec["mem_fraction"]
    total, source = spec.get("ceiling") or memory_ceiling(mx)
    ceiling, over = total and total * fraction, f"{fraction:g} x {(total or 0) / 1e9:.2f} GB ({source})"
    rows, stop = [], ("max_batch", None, "measured every size to --max-batch and the config's")
    for b in sorted(set(spec["must"]) | {2**k for k in range(spec["max_batch"].bit_length())}):
        # predicted by the line through the last two sizes (one size: proportional; none: 0)
        mem, t = (step_time_at(rows, b, key)[0] or 0 for key in ("peak_mem_bytes", "step_s"))
        need = (spec["steps"] + 1) * max([t] + [r["step_s"] for r in rows[-1:]])  # no less than the last
        left = spec["budget_s"] - (time.monotonic() - t_start)
        if ceiling and mem > ceiling:
            stop = ("memory", b, f"batch {b} would need ~{mem / 1e9:.2f} GB, over {over}")
            break
        if need > left:
            stop = ("time", b, f"batch {b} would take ~{need:.1f} s, {max(left, 0):.1f} s of the "
                               f"{spec['budget_s']:g} s budget left")
            break
        try:
            row = measure_batch(st, b, spec["steps"])
        except (RuntimeError, MemoryError, ValueError) as e:
            if not (isinstance(e, MemoryError) or OOM_RE.search(str(e))):
                raise
            stop = ("memory", b, f"batch {b} failed to allocate: {str(e)[:200]}")
            break
        finally:
            mx.clear_cache()
        rows.append({**row, "over_memory": bool(ceiling and row["peak_mem_bytes"] > ceiling)})
        event("calibrate-compute", host=spec.get("host"), batch=b, step_s=row["step_s"],
              **{"tok/s": row["tok_per_s"]}, peak_mem_gb=round(row["peak_mem_bytes"] / 1e9, 4),
              compile_s=row["compile_s"])
        if rows[-1]["over_memory"]:
            stop = ("memory", b, f"batch {b} peaked over {over}")
            break
    return {"sweep": rows, "stopped": dict(zip(("reason", "next_batch", "detail"), stop, strict=True)),
            "memory_ceiling_bytes": total, "memory_ceiling_source": source, "mem_fraction": fraction}


def compute_probe(spec: dict) -> dict:
    """One host alone: its facts, the model loaded, the batch sweep."""
    import mlx.core as mx

    boot = Path("/proc/sys/kernel/random/boot_id")  # one boot id: one machine (the fabric's hosts)
    facts = {"hostname": socket.gethostname(), "platform": sys.platform, "machine": platform.machine(),
             "device": str(mx.default_device()), "loadavg": [round(x, 2) for x in os.getloadavg()],
             "cpu_count": os.cpu_count(), "boot_id": boot.read_text().strip() if boot.is_file() else None}
    spec["ceiling"] = memory_ceiling(mx)  # before the model takes its share
    st = stepper(spec["cfg"])
    return dict(compute_sweep(st, spec), facts=facts, trainable_params=st.trainable_params,
                trainable_bytes=st.trainable_bytes)


# ---- host side: every rank at once under mlx.launch -------------------------------------------
def timed(mx, reps: int, fn, *args, warm: int = 1, **kw) -> list[float]:
    """[mean, best] seconds of fn after `warm` warm-up calls, each the slowest rank's (a collective's)."""
    each = []
    for _ in range(reps + warm):
        t0 = time.perf_counter()
        mx.eval(fn(*args, **kw))
        each.append(time.perf_counter() - t0)
    return mx.distributed.all_max(mx.array([statistics.mean(each[warm:]), min(each[warm:])]),
                                  stream=mx.cpu).tolist()


def rank_probe(spec: dict) -> dict | None:
    """Every rank: the step at its own batch (its share) with every rank computing, the gradient all-reduce,
    then all_sum from min_bytes to max_bytes doubling (busbw = bytes / time x 2(N-1)/N)."""
    import ctypes

    import mlx.core as mx
    from mlx.nn import average_gradients
    from mlx.utils import tree_map

    # glibc keeps freed memory (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD max) as Metal's buffer cache does,
    # else all_sum's times are page faults
    libc = platform.libc_ver()[0] == "glibc" and ctypes.CDLL("libc.so.6")
    kept = bool(libc) and libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**31 - 1) == 1
    group = mx.distributed.init(strict=True)
    size, kept = group.size(), mx.distributed.all_min(mx.array([float(kept)]), stream=mx.cpu)
    out: dict = {"reuse_freed_memory": kept.item() == 1, "allsum": []}
    if spec["rank_batches"]:
        st, b = stepper(spec["cfg"]), spec["rank_batches"][group.rank()]
        row = measure_batch(st, b, spec["steps"])
        local = measure_batch(st, b, spec["steps"], update=False)
        grads = tree_map(mx.zeros_like, st.model.trainable_parameters())
        # train's all-reduce, timed once with no warm-up call (the steps above ran it), after a barrier: a
        # faster rank is done with its local steps first, and its wait for the slower one is not the link's
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), stream=mx.cpu))
        alone = timed(mx, 1, average_gradients, grads, warm=0, communication_stream=mx.cpu)[1]
        mine = [row["step_s"], row["min_s"], local["step_s"], local["min_s"], local["max_s"],
                row["tokens_per_step"]]
        each, k = mx.distributed.all_gather(mx.array(mine), stream=mx.cpu).tolist(), len(mine)
        out["concurrent"] = {"batch": spec["rank_batches"], "step_s": each[0::k], "local_step_s": each[2::k],
                             "local_min_s": each[3::k], "local_max_s": each[4::k],
                             "tokens_per_step": [int(x) for x in each[5::k]]}
        # What the all-reduce costs a step: at least its time alone, more when the step minus the same step
        # without its update says so (TCP restarts slowly after each step's compute: 3.4 s alone, 5.2 s in
        # a step on a 300 kbit/s link). The time alone is the floor: a load spike on the step without its
        # update once made the difference 0.6 s for a 3.4 s all-reduce.
        in_step = max(each[1::k]) - max(each[3::k])
        out["grad_allreduce"] = {"bytes": st.trainable_bytes, "cost_s": max(alone, in_step), "alone_s": alone,
                                 "in_step_s": in_step}
        del st, grads
        mx.clear_cache()
    n = spec["min_bytes"]
    while n < 2 * spec["max_bytes"]:
        x = mx.ones((max(min(n, spec["max_bytes"]) // 4, size),), dtype=mx.float32)
        reps, bus = int(max(5, min(50, 64 * MiB // x.nbytes))), x.nbytes / 1e9 * 2 * (size - 1) / size
        mean_s, min_s = timed(mx, reps, mx.distributed.all_sum, x, stream=mx.cpu)
        out["allsum"].append({"bytes": x.nbytes, "reps": reps, "mean_s": mean_s, "min_s": min_s,
                              "busbw_gbps": bus / mean_s, "best_busbw_gbps": bus / min_s})
        if group.rank() == 0:
            event("calibrate-allsum", bytes=x.nbytes, reps=reps, mean_ms=round(1e3 * mean_s, 4),
                  best_ms=round(1e3 * min_s, 4))
        n *= 2
    return out if group.rank() == 0 else None


# ---- the model: from measurements to a recommendation and a speedup ---------------------------
def step_time_at(sweep: list[dict], b: int, key: str = "step_s") -> tuple[float | None, str]:
    """(key's value at batch b (the step time), how): measured, or the line through the nearest two sizes."""
    rows = sorted(sweep, key=lambda r: r["batch"])
    exact = [r[key] for r in rows if r["batch"] == b]
    if exact or len(rows) < 2:
        one = rows and (rows[0][key] * b / rows[0]["batch"], "scaled from one size")
        return (exact[0], "measured") if exact else one or (None, "no measurement")
    below, above = [r for r in rows if r["batch"] < b], [r for r in rows if r["batch"] > b]
    a, c = (below[-1], above[0]) if below and above else (below[-2:] if below else above[:2])
    t = a[key] + (c[key] - a[key]) * (b - a["batch"]) / (c["batch"] - a["batch"])
    return max(t, 1e-9), "interpolated" if below and above else "extrapolated"


def max_fitting_batch(host: dict) -> tuple[int | None, str]:
    """(largest batch within memory, "measured" when memory stopped the sweep, else "lower_bound")."""
    fit = [r["batch"] for r in host.get("sweep", []) if not r.get("over_memory")]
    return max(fit, default=None), ("measured" if host.get("stopped", {}).get("reason") == "memory"
                                    else "lower_bound")


def recommend(cfg: dict, world: int, hosts: list[dict]) -> dict:
    """Per-rank micro-batch and accumulation that keep the config's global batch and fit every host."""
    g = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    fits = [max_fitting_batch(h) for h in hosts]
    if g % world:
        return {"error": f"the global batch {g} (batch_size x grad_accumulation_steps) is not divisible by "
                         f"the world size {world}: use {g - g % world or world} or {g - g % world + world}"}
    if any(f[0] is None for f in fits):
        return {"error": "a host measured no batch within its memory (or --skip-compute): "
                         "see the compute phase"}
    cap, per_rank = min(f[0] for f in fits), g // world
    m = max(d for d in range(1, min(per_rank, cap) + 1) if per_rank % d == 0)
    return {"per_rank_batch": m, "grad_accumulation_steps": per_rank // m, "config_batch_size": m * world,
            "fits_memory_cap": cap,
            "fits_memory_cap_kind": "measured" if (cap, "measured") in fits else "lower_bound",
            "why": f"{g} examples per optimizer step = {world} ranks x {per_rank}; " + (
                f"{m} per rank fits" if m == per_rank else
                f"{per_rank} per rank does not fit: micro-batch {m} x {per_rank // m} accumulation steps")
            + f" (largest batch measured within memory: {cap})"}


def speedup_model(cfg: dict, world: int, hosts: list[dict], link: dict | None,
                  batches: list[int] | None) -> dict:
    """control = accum x t(rank 0's host alone, batch_size); dual = accum x t(slowest rank, every
    rank computing its share (batches), the trainer's step with its all-reduce) - (accum - 1) x the
    all-reduce (it runs once per optimizer step). Without the concurrent step: alone + all-reduce."""
    accum = cfg["grad_accumulation_steps"]
    tc, how_c = step_time_at(hosts[0].get("sweep", []), cfg["batch_size"])
    if tc is None or not batches:
        return {"unknown": f"batch_size {cfg['batch_size']} is not divisible by {world} ranks" if tc else
                f"{hosts[0]['ssh']}: no compute measurement"}
    if world > 1 and not (link or {}).get("grad_allreduce"):
        return {"unknown": "no gradient all-reduce measured (the link phase did not run)"}
    t_g = link["grad_allreduce"]["cost_s"] if world > 1 else 0.0
    conc, per_host = (link or {}).get("concurrent", {}), {}
    for h in hosts:
        c, m = conc.get(h["ssh"]), max(batches[r] for r in h["ranks"])
        t, how = (c["step_s"], "measured with every rank computing") if c and c["batch"] == m else \
            step_time_at(h.get("sweep", []), m)
        if t is None:
            return {"unknown": f"{h['ssh']}: no compute measurement"}
        per_host[h["ssh"]] = (t if c and c["batch"] == m else t + t_g, how)
    slowest = max(v[0] for v in per_host.values())
    t_g = min(t_g, slowest)  # noise aside, a step holds its whole all-reduce
    t_ctrl, t_dual = accum * tc, accum * slowest - (accum - 1) * t_g
    return {"rank_batches": batches, "control_batch": cfg["batch_size"], "grad_accumulation_steps": accum,
            "t_control_step_s": t_ctrl, "control_how": how_c,
            "t_dual_step_s": t_dual, "t_grad_allreduce_s": t_g,
            "dual_how": {k: v[1] for k, v in per_host.items()}, "expected_speedup": t_ctrl / t_dual,
            "compute_bound_speedup": t_ctrl / max(t_dual - t_g, 1e-9), "link_share": t_g / t_dual}


def shares_rule(cfg: dict, link: dict | None) -> dict | None:
    """rank_shares: auto's shares (and plan's workload_distribution): in proportion to each rank's records/s,
    timed with every rank computing its share; equal when the ranks differ by no more than their own
    step-to-step noise (the spread of a rank's step times over its median, at least NOISE_FLOOR)."""
    ranks = (link or {}).get("ranks")
    if not ranks:
        return None
    rates = [r["records_per_s"] for r in ranks]
    spread, noise = max(rates) / min(rates) - 1, max(NOISE_FLOOR, *(r["noise"] for r in ranks))
    seen = (f"records/s {' : '.join(f'{x:.3g}' for x in rates)} (ranks in hostfile order) differ by "
            f"{spread:.0%}, the step-to-step noise is {noise:.0%}")
    if spread <= noise:
        return {"shares": [1] * len(ranks), "rule": "equal", "why": f"{seen}: equal shares",
                "records_per_s": rates, "noise": noise}
    shares = C.rank_batches({"batch_size": cfg["batch_size"], "rank_shares": rates}, len(ranks))
    # The gain over the split measured: the slowest rank's records at its rate, plus the all-reduce, before
    # and after (a step's time grows in proportion to its records: the sweeps' rows say so).
    t_g = link.get("grad_allreduce", {}).get("cost_s", 0.0)
    measured = [x["batch"] for x in ranks]
    t = [max(n / r for n, r in zip(split, rates, strict=True)) + t_g for split in (measured, shares)]
    return {"shares": shares, "rule": "proportional", "why": f"{seen}: shares in proportion to records/s",
            "records_per_s": rates, "noise": noise, "expected_gain": t[0] / t[1]}


# ---- the orchestrator ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--hostfile", "--model", "--config", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    for flag, kind, default, what in (
            ("--budget-s", float, 120.0, "compute seconds per host"), ("--steps", int, 3, "timed steps"),
            ("--max-batch", int, 64, "largest power-of-two batch"),
            ("--min-bytes", int, 4096, "least all_sum"), ("--max-bytes", int, 256 * MiB, "largest all_sum"),
            ("--timeout-s", float, 900.0, "bound on each phase beyond its budget"),
            ("--port", int, None, "first ring port (mlx.launch --starting-port)")):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    p.add_argument("--out-dir", default=str(paths.RUNS), help="where calibration-<UTC>.json goes")
    p.add_argument("--skip-compute", action="store_true", help="measure only the link")
    return p


def run_probe(argv: list[str], timeout: float, what: str, fix: str, category: str | None = None) -> dict:
    """Run a probe (its events and errors reach the terminal as they come): its result, else an error."""
    launcher = any(Path(a).name == "mlx.launch" for a in argv[:4])  # its stdin and ssh as a training run's
    try:
        run = launch.run_launcher if launcher else functools.partial(subprocess.run, stdin=subprocess.DEVNULL)
        p = run(argv, cwd=paths.ROOT, stdout=subprocess.PIPE, text=True, errors="replace", timeout=timeout,
                start_new_session=True)
        why = f"exit {p.returncode}" if p.returncode or RESULT not in p.stdout else ""
    except subprocess.TimeoutExpired:  # the orchestrator then stops what is left of the probe on every host
        why = f"timed out after {timeout:g} s"
    if not why:
        return json.loads(p.stdout.split(RESULT, 1)[1].splitlines()[0])
    message = f"{what} ({why}), its lines above: {fix}"
    raise failure(category, message) if category else RunbookError(message, ANCHOR)


def phase_compute(args, hf, cfg: dict, probe_id: str, hosts: list[dict]) -> None:
    w, g = hf.size, cfg["batch_size"] * cfg["grad_accumulation_steps"]
    must = sorted({cfg["batch_size"], g} | {x // w for x in (cfg["batch_size"], g) if x % w == 0})
    for h in hosts:
        spec = {"probe_id": probe_id, "cfg": cfg, "host": h["ssh"], "budget_s": args.budget_s, "must": must,
                "max_batch": args.max_batch, "steps": args.steps, "mem_fraction": MEM_FRACTION}
        alone = hostfile.Hostfile(args.hostfile, [hf.hosts[h["ranks"][0]]])  # over ssh, not mlx.launch
        argv = launch.launch_argv(args.hostfile, alone, args.python, args.remote_root,
                                  ["--compute-probe", json.dumps(spec)], script=SCRIPT)
        event("calibrate-phase", phase="compute", host=h["ssh"], budget_s=args.budget_s)
        h.update(run_probe(argv, args.budget_s + args.timeout_s, f"{h['ssh']}: the compute probe failed",
                           f"run `make sync` and `make check-parity HOSTFILE={args.hostfile}` first"))


def phase_link(args, hf, cfg: dict, probe_id: str, batches: list[int] | None) -> dict:
    spec = {"probe_id": probe_id, "cfg": cfg, "steps": args.steps, "min_bytes": args.min_bytes,
            "max_bytes": args.max_bytes, "rank_batches": batches}
    port = args.port
    if port is None and all(h.ssh == "127.0.0.1" for h in hf.hosts):  # ranks here: ports nobody else uses
        with socket.create_server(("127.0.0.1", 0)) as s:
            port = s.getsockname()[1]
    argv = launch.launch_argv(args.hostfile, hf, args.python, args.remote_root,
                              ["--rank-probe", json.dumps(spec)], port, script=SCRIPT)
    event("calibrate-phase", phase="link", world_size=hf.size, backend=hf.backend or "ring",
          rank_batches=json.dumps(batches) if batches else "-", max_bytes=args.max_bytes)
    res = run_probe(argv, args.timeout_s, "the link probe failed", f"check `make check-parity HOSTFILE="
                    f"{args.hostfile}` (ssh, interpreter, code on every host) and the ring ports", PARITY)
    rows = res.pop("allsum")
    # large messages: the best over the sizes >= a quarter of the largest (one disturbed size is not the link)
    top = max((r for r in rows if r["bytes"] >= rows[-1]["bytes"] / 4), key=lambda r: r["best_busbw_gbps"])
    link = {"backend": hf.backend or "ring", "world_size": hf.size, "allreduce": rows, **res,
            "bandwidth_gbps": {"bytes": top["bytes"], "busbw_mean": top["busbw_gbps"],
                               "busbw_best": top["best_busbw_gbps"]}}
    if c := res.get("concurrent"):  # per rank (its compute alone: local_step_s), then per host its slowest
        link["ranks"] = [{"rank": i, "ssh": h.ssh, "batch": b, "step_s": t, "tokens_per_step": n,
                          "local_step_s": lt, "records_per_s": b / lt, "noise": (hi - lo) / lt}
                         for i, (h, b, t, lt, lo, hi, n) in enumerate(zip(
                             hf.hosts, c["batch"], c["step_s"], c["local_step_s"], c["local_min_s"],
                             c["local_max_s"], c["tokens_per_step"], strict=True))]
        slowest = {s: max((r for r in link["ranks"] if r["ssh"] == s), key=lambda r: r["step_s"])
                   for s in hf.unique_ssh()}
        link["concurrent"] = {s: {"batch": r["batch"], "step_s": r["step_s"], "tok_per_s":
                                  r["tokens_per_step"] / r["step_s"]} for s, r in slowest.items()}
    return link


def measure(args, hf, cfg: dict, probe_id: str) -> dict:
    """The two phases, the recommendation and the speedup: the calibration's measured part."""
    hosts = [{"ssh": s, "ranks": [h.rank for h in hf.hosts if h.ssh == s]} for s in hf.unique_ssh()]
    if not args.skip_compute:
        phase_compute(args, hf, cfg, probe_id, hosts)
    rec = recommend(cfg, hf.size, hosts)
    per_rank = None if args.skip_compute or cfg["batch_size"] % hf.size else cfg["batch_size"] // hf.size
    if per_rank and rec.get("fits_memory_cap_kind") == "measured" and per_rank > rec["fits_memory_cap"]:
        per_rank = rec["per_rank_batch"]  # the configured split does not fit: time the one that does
    listed = isinstance(cfg["rank_shares"], list) and hf.size > 1 and not args.skip_compute
    batches = C.rank_batches(cfg, hf.size) if listed else [per_rank] * hf.size if per_rank else None
    link = phase_link(args, hf, cfg, probe_id, batches) if hf.size > 1 else None
    sp, boots, shares = speedup_model(cfg, hf.size, hosts, link, batches), {}, shares_rule(cfg, link)
    for h in hosts:
        boots.setdefault((h.get("facts") or {}).get("boot_id") or h["ssh"], []).append(h["ssh"])
    return {"hosts": hosts, "shared_machine": [v for v in boots.values() if len(v) > 1], "link": link,
            **{k: hosts[0].get(k) for k in ("trainable_params", "trainable_bytes")}, "recommendation": rec,
            "speedup": sp, "rank_shares": shares,
            **{k: sp.get(k) for k in ("expected_speedup", "compute_bound_speedup", "link_share")}}


def orchestrate(args) -> int:
    t0, probe_id, load_start = time.time(), f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", os.getloadavg()
    try:
        hf, cfg = hostfile.load(args.hostfile), C.load_config(args.config)
        hostfile.check_path(args.remote_root, "REMOTE_ROOT")
        hostfile.check_path(args.python, "PYTHON")
        if not 4 <= args.min_bytes <= args.max_bytes or min(args.budget_s, args.max_batch, args.steps) <= 0:
            raise RunbookError(f"--min-bytes {args.min_bytes} / --max-bytes {args.max_bytes}: need 4 <= min "
                               "<= max; --budget-s, --max-batch, --steps: positive", ANCHOR)
    except (RunbookError, ValueError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), ANCHOR), 2)
    cfg.update(model=args.model, resume_adapter_file=None)
    event("calibrate", hostfile=args.hostfile, world_size=hf.size, backend=hf.backend or "ring",
          model=args.model, batch_size=cfg["batch_size"], loadavg=f"{load_start[0]:.2f}")
    try:
        measured = measure(args, hf, cfg, probe_id)
    except BaseException as e:  # leave no probe behind on any host, then say why (a bug: the traceback)
        for host in hf.unique_ssh():
            run_on(host, ["pkill", "-KILL", "-f", "--", r"bin/calibrate\.py --[a-z]+-probe .*" + probe_id])
        if isinstance(e, KeyboardInterrupt):
            return die(RunbookError("interrupted; nothing written", ANCHOR), 130)
        if not isinstance(e, RunbookError):
            raise
        return die(e, 1) if not e.category else (launch.print_category(e.category, str(e.args[0])) or 1)
    created = time.gmtime()
    doc = {"format": FORMAT, "format_version": 2, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", created),
           "command": shlex.join(["python", *sys.argv]), "git": launch.git_info(),
           "hostfile": {"path": args.hostfile, "sha256": sha256_file(args.hostfile), **hf.to_json(),
                        "world_size": hf.size},
           "model": args.model, "model_sha256": launch.model_hash(args.model),
           "config": {"path": args.config, "sha256": sha256_file(args.config), **{k: cfg[k] for k in (
               "batch_size", "grad_accumulation_steps", "max_seq_length", "num_layers", "fine_tune_type",
               "lora_parameters", "grad_checkpoint", "optimizer", "loss", "loss_chunk_tokens")}},
           "loadavg": {"start": load_start, "end": os.getloadavg()}, **measured,
           "wall_s": round(time.time() - t0, 3)}
    path = Path(args.out_dir) / f"calibration-{time.strftime('%Y%m%dT%H%M%SZ', created)}.json"
    atomic.write_json(path, doc)
    rec = doc["recommendation"]
    print("recommendation: " + (rec.get("error") or f"per-rank batch {rec['per_rank_batch']} x accumulation "
                                f"{rec['grad_accumulation_steps']}: {rec['why']}"), flush=True)
    event("calibrate-done", file=paths.rel(path), wall_s=doc["wall_s"],
          expected_speedup=doc["expected_speedup"] or json.dumps(doc["speedup"]["unknown"]),
          rank_shares=json.dumps((doc["rank_shares"] or {}).get("shares")))
    return 0


def main() -> int:
    if sys.argv[1:2] in (["--compute-probe"], ["--rank-probe"]):  # on a host; SPEC carries the probe id
        result, sys.stdout = sys.stdout, sys.stderr  # events and errors go to stderr; stdout is the result's
        try:
            out = (compute_probe if sys.argv[1] == "--compute-probe" else rank_probe)(json.loads(sys.argv[2]))
        except Exception as e:  # the operator's terminal shows it with the rest of the host's output
            print(f"error: {socket.gethostname()}: {type(e).__name__}: {e}", flush=True)
            return 1
        if out is not None:
            print(RESULT + json.dumps(out), file=result, flush=True)
        return 0
    return orchestrate(build_parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
