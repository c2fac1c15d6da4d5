#!/usr/bin/env python3
"""calibrate: measured training throughput and memory per host, the link's all_sum curve, and
what they predict for a data-parallel run: a per-rank batch and the expected speedup.

Usage:
    python bin/calibrate.py --hostfile HOSTFILE --model MODEL --config CONFIG \
        --remote-root DIR --python PY [--budget-s 120] [--max-batch 64] [--steps 3]
        [--mem-fraction 0.8] [--min-bytes 4096] [--max-bytes 268435456] [--tcp-bytes N]
        [--port P] [--out-dir runs] [--skip-compute] [--skip-link] [--timeout-s S]

Example (what `make calibrate` runs after sync and check-parity):
    python bin/calibrate.py --hostfile hostfile.json --model models/tiny-gemma4 \
        --config configs/stage1.yaml --remote-root "$PWD" --python "$PWD/.venv/bin/python"

Phases (the code must already be on the hosts: `make calibrate` runs sync first):
  1. compute, one host at a time (each alone, as the single-host control runs): on the
     configured model, LoRA layers and max_seq_length, the trainer's own compiled step
     (bin/train.py's model preparation, mlx-lm's default_loss, the optimizer update) at
     batch sizes 1, 2, 4, ... (plus the per-rank and global batch of the config), a warm-up
     step then --steps timed ones each, until the predicted peak memory of the next size
     passes --mem-fraction of the device's memory (Metal's recommended working set; on CPU
     hosts the memory available when the probe started), a size fails to allocate, or the
     --budget-s time budget would run out. Per size: tok/s, step time, peak memory.
  2. link, every rank at once through mlx.launch (the hostfile's backend, --cwd REMOTE_ROOT):
     the step at the recommended per-rank batch on every rank concurrently, the trainer's
     gradient all-reduce (mlx.nn.average_gradients over the real LoRA gradient tree), then
     all_sum of float32 arrays from --min-bytes to --max-bytes, doubling: mean and best time,
     algorithm and bus bandwidth (busbw = bytes / time x 2(N-1)/N, the bytes each rank moves);
     the large-message bandwidth is the best busbw over the sizes >= a quarter of the largest.
     On Linux (glibc) the ranks keep freed memory for reuse, as Metal's buffer cache does on
     the Macs: MLX's CPU build gives every collective's output fresh pages from the kernel, and
     the curve should measure the link, not page faults. The largest size is first timed once
     without that (`link.allocator.largest_into_fresh_memory`).
  3. a bare TCP transfer of --tcp-bytes between rank 0's and rank 1's hosts over rank 1's
     hostfile IP (python sockets): both directions at once (what a 2-rank ring all_sum moves:
     the baseline its large-message bandwidth is compared with), one direction into a reused
     buffer (the wire's ceiling when nothing comes back), and both directions each landing in
     fresh memory of the whole size.
Then: the recommended per-rank batch and gradient accumulation for the config's global batch
(batch_size x grad_accumulation_steps), and the expected speedup of the world over one host
at that global batch: control step time / (slowest rank's concurrent step time + the
gradient all_sum time for the LoRA parameter bytes at the measured curve). Writes
runs/calibration-<UTC time>.json atomically (`expected_speedup` is what `make compare` reads)
and prints a table. Exit 0 when written; 1 when a phase failed (nothing is written); 2 on
bad input.

Host-side modes (the orchestrator runs these; not for operators):
    bin/calibrate.py --compute-probe --probe-id ID --spec JSON       one host, over ssh
    bin/calibrate.py --rank-probe --probe-id ID --spec JSON          every rank, under mlx.launch
    bin/calibrate.py --tcp-recv --probe-id ID --spec JSON            receiver of the TCP baseline
    bin/calibrate.py --tcp-send --probe-id ID --spec JSON            sender of the TCP baseline
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

ANCHOR = "calibrate"
FORMAT = "thunder-runbook/calibration"
FORMAT_VERSION = 1
RESULT_PREFIX = "calibrate-probe-result "
KiB, MiB = 1 << 10, 1 << 20
ALL_REDUCE_BUCKET = 32 * MiB  # mlx.nn.average_gradients' default all_reduce_size
# What a size's name looks like in the table: 4 KiB, 1 MiB, 256 MiB.


# ---- small helpers shared by both sides ------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def sizes_between(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to hi (hi itself always included)."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= 2
    out.append(hi)
    return out


def machine_facts() -> dict:
    """What a host is: enough to tell two hosts apart and to read a figure in context."""
    from lib import parity_probe

    facts = {"hostname": socket.gethostname(), "platform": sys.platform, "machine": platform.machine(),
             "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        facts["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        facts["loadavg"] = None
    mem = parity_probe.probe_memory()
    facts["memory_total_bytes"] = mem.get("total_bytes")
    facts["memory_available_bytes"] = mem.get("available_bytes")
    facts["boot_id"] = boot_id()
    return facts


def boot_id() -> str | None:
    """The same value on ranks that share one kernel (the test fabric's hosts are namespaces
    of one machine): Linux's boot_id, macOS's boot session UUID."""
    try:
        if sys.platform.startswith("linux"):
            return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        if sys.platform == "darwin":
            p = subprocess.run(["sysctl", "-n", "kern.bootsessionuuid"], capture_output=True, text=True, timeout=5)
            return p.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
    return None


def load_trainer():
    """bin/train.py as a module: calibration prepares the model exactly as the trainer does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("thunder_train", Path(__file__).resolve().parent / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- host side: the model and the trainer's step -------------------------------------------
class Stepper:
    """The model with the trainer's LoRA layers and optimizer, and mlx-lm's compiled step
    (bin/train.py's loop without the gradient all-reduce) on full-length random batches."""

    def __init__(self, cfg: dict):
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.trainer import default_loss, grad_checkpoint

        self.mx, self.cfg = mx, cfg
        train = load_trainer()
        t0 = time.perf_counter()
        model, _tok = train.load_model(cfg)
        train.prepare_model(mx, model, cfg)
        self.optimizer = train.build_optimizer(cfg)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(model.parameters(), self.optimizer.state)
        self.load_s = time.perf_counter() - t0
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        maybe_set_recommended_wired_limit()  # as the trainer does (Metal: wire the model's memory)
        if cfg.get("grad_checkpoint"):
            grad_checkpoint(model.layers[0])
        self.model = model
        params = tree_flatten(model.trainable_parameters())
        self.trainable_params = int(sum(v.size for _, v in params))
        self.trainable_arrays = [(k, tuple(v.shape), str(v.dtype), int(v.nbytes)) for k, v in params]
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 256)
        lvg = nn.value_and_grad(model, default_loss)
        self.lvg = lvg
        state = [model.state, self.optimizer.state, mx.random.state]
        self.state = state
        opt = self.optimizer

        def step_fn(inputs, lengths):
            (lvalue, toks), grad = lvg(model, inputs, lengths)
            opt.update(model, grad)
            return lvalue, toks

        from functools import partial

        self.step = partial(mx.compile, inputs=state, outputs=state)(step_fn)
        model.train()
        self.seq = int(cfg["max_seq_length"])
        self.rng = mx.random.key(int(cfg.get("seed", 0)))

    def batch(self, b: int):
        mx = self.mx
        x = mx.random.randint(0, self.vocab, (b, self.seq), key=self.rng).astype(mx.int32)
        lengths = mx.array([[0, self.seq]] * b, dtype=mx.int32)
        mx.eval(x, lengths)
        return x, lengths

    def run(self, x, lengths) -> tuple[float, int]:
        """One step, evaluated: (seconds, tokens the loss counted)."""
        mx = self.mx
        t0 = time.perf_counter()
        lvalue, toks = self.step(x, lengths)
        mx.eval(self.state, lvalue, toks)
        dt = time.perf_counter() - t0
        loss = lvalue.item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss} at batch {x.shape[0]}")
        return dt, int(toks.item())

    def measure(self, b: int, steps: int) -> dict:
        """A warm-up step (compiles this shape), then `steps` timed steps."""
        mx = self.mx
        x, lengths = self.batch(b)
        mx.reset_peak_memory()
        compile_s, toks = self.run(x, lengths)
        times = []
        for _ in range(steps):
            dt, toks = self.run(x, lengths)
            times.append(dt)
        step_s = statistics.median(times)
        return {"batch": b, "seq": self.seq, "tokens_per_step": toks, "steps": steps,
                "step_s": round(step_s, 6), "step_s_min": round(min(times), 6),
                "step_s_max": round(max(times), 6), "compile_s": round(compile_s, 4),
                "tok_per_s": round(toks / step_s, 3) if step_s > 0 else None,
                "peak_mem_bytes": int(mx.get_peak_memory())}

    def zero_grads(self):
        mx = self.mx
        from mlx.utils import tree_map

        g = tree_map(lambda p: mx.zeros_like(p), self.model.trainable_parameters())
        mx.eval(g)
        return g


def memory_ceiling(mx, available_at_start: int | None) -> tuple[int | None, str]:
    """(bytes, source) a training process may use: Metal's recommended working set, else the
    memory available when the probe started (other processes share a CPU host's RAM), capped
    by MLX's own memory limit."""
    info = {}
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        try:
            info = mx.metal.device_info()
        except (AttributeError, RuntimeError):
            info = {}
    if info.get("max_recommended_working_set_size"):
        return int(info["max_recommended_working_set_size"]), "metal max_recommended_working_set_size"
    limit = None
    try:
        limit = int(mx.get_memory_limit())
    except (AttributeError, RuntimeError):
        pass
    if available_at_start:
        if limit and limit < available_at_start:
            return limit, "mlx memory limit"
        return int(available_at_start), "memory available at probe start"
    return limit, "mlx memory limit" if limit else "unknown"


OOM_RE = re.compile(r"Insufficient Memory|OutOfMemory|out of memory|Unable to allocate|\[metal::malloc\]|"
                    r"\[malloc\]|greater than the maximum allowed buffer size|bad_alloc|"
                    r"kIOGPUCommandBufferCallbackError", re.I)


def predict_linear(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x from the straight line through the last two points (None with fewer)."""
    if len(points) < 2:
        return None
    (x0, y0), (x1, y1) = points[-2], points[-1]
    if x1 == x0:
        return y1
    return y1 + (y1 - y0) / (x1 - x0) * (x - x1)


def compute_sweep(stepper: Stepper, spec: dict, emit) -> dict:
    """Batch sizes upward until memory, an allocation failure or the time budget says stop."""
    mx = stepper.mx
    t_start = time.monotonic()
    budget = float(spec["budget_s"])
    ceiling_total, source = memory_ceiling(mx, spec.get("available_at_start"))
    ceiling = int(ceiling_total * float(spec["mem_fraction"])) if ceiling_total else None
    # Powers of two up to --max-batch, and the sizes the speedup model needs (the config's per-rank
    # and global batch) even beyond it: measured, not extrapolated, when memory and time allow.
    sizes = sorted({b for b in sizes_between(1, int(spec["max_batch"])) if b <= spec["max_batch"]}
                   | {int(b) for b in spec.get("must", []) if int(b) > 0})
    rows, stop = [], {"reason": "max_batch", "detail": f"measured every size up to {sizes[-1]} (--max-batch "
                      f"{spec['max_batch']} and the config's sizes)"}
    for b in sizes:
        mem_pts = [(r["batch"], r["peak_mem_bytes"]) for r in rows]
        pred_mem = predict_linear(mem_pts, b) if len(mem_pts) >= 2 else (
            mem_pts[-1][1] * b / mem_pts[-1][0] if mem_pts else None)
        if ceiling and pred_mem is not None and pred_mem > ceiling:
            stop = {"reason": "memory", "detail": f"batch {b} would need ~{pred_mem / 1e9:.2f} GB, over "
                    f"{spec['mem_fraction']:g} x {ceiling_total / 1e9:.2f} GB ({source})", "next_batch": b,
                    "predicted_peak_mem_bytes": int(pred_mem)}
            break
        if rows:
            last = rows[-1]
            pred_step = predict_linear([(r["batch"], r["step_s"]) for r in rows], b) or last["step_s"] * b / last["batch"]
            pred_step = max(pred_step, last["step_s"])
            need = pred_step * (spec["steps"] + 1) + last["compile_s"] - last["step_s"]
            left = budget - (time.monotonic() - t_start)
            if need > left:
                stop = {"reason": "time", "detail": f"batch {b} would take ~{need:.1f} s, {max(left, 0):.1f} s of the "
                        f"{budget:g} s budget left", "next_batch": b}
                break
            if pred_step > spec["max_step_s"]:
                stop = {"reason": "step_time", "detail": f"batch {b} would take ~{pred_step:.1f} s a step, over "
                        f"--max-step-s {spec['max_step_s']:g}", "next_batch": b}
                break
        try:
            row = stepper.measure(b, int(spec["steps"]))
        except (RuntimeError, MemoryError, ValueError) as e:
            if OOM_RE.search(str(e)) or isinstance(e, MemoryError):
                stop = {"reason": "memory", "detail": f"batch {b} failed to allocate: {str(e)[:200]}", "next_batch": b}
                mx.clear_cache()
                break
            raise
        row["over_memory"] = bool(ceiling and row["peak_mem_bytes"] > ceiling)
        rows.append(row)
        emit(row)
        mx.clear_cache()
        if row["over_memory"]:
            stop = {"reason": "memory", "detail": f"batch {b} peaked at {row['peak_mem_bytes'] / 1e9:.2f} GB, over "
                    f"{spec['mem_fraction']:g} x {ceiling_total / 1e9:.2f} GB ({source})", "next_batch": b * 2}
            break
    return {"sweep": rows, "stopped": stop, "memory_ceiling_bytes": ceiling_total, "memory_ceiling_source": source,
            "mem_fraction": spec["mem_fraction"], "sweep_s": round(time.monotonic() - t_start, 3)}


def self_sha256() -> str:
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def print_result(obj: dict) -> None:
    """The one result line; it carries this file's sha256, so the orchestrator knows the host
    ran the same bin/calibrate.py (synced code) and not an older copy."""
    obj["calibrate_sha256"] = self_sha256()
    print(RESULT_PREFIX + json.dumps(obj, sort_keys=True, allow_nan=False), flush=True)


def check_same_code(host: str, result: dict) -> None:
    if result.get("calibrate_sha256") != self_sha256():
        raise RunbookError(f"{host} runs another bin/calibrate.py than this one (sha256 "
                           f"{str(result.get('calibrate_sha256'))[:12]}, here {self_sha256()[:12]}): run `make sync` "
                           "(make calibrate does it first)", ANCHOR)


def compute_probe(spec: dict) -> int:
    """One host alone: load, then the batch sweep; the result as one JSON line."""
    facts = machine_facts()
    spec["available_at_start"] = facts.get("memory_available_bytes")
    import mlx.core as mx
    import mlx_lm

    facts.update(mlx=mx.__version__, mlx_lm=mlx_lm.__version__, device=str(mx.default_device()))
    host = spec.get("host") or facts["hostname"]
    stepper = Stepper(spec["cfg"])
    event("calibrate-load", host=host, model=spec["cfg"]["model"], load_s=round(stepper.load_s, 3),
          trainable_params=stepper.trainable_params)

    def emit(r):
        event("calibrate-compute", host=host, batch=r["batch"], seq=r["seq"], step_s=r["step_s"],
              **{"tok/s": r["tok_per_s"]}, peak_mem_gb=round(r["peak_mem_bytes"] / 1e9, 4),
              compile_s=r["compile_s"])

    out = compute_sweep(stepper, spec, emit)
    facts["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out.update(facts=facts, load_s=round(stepper.load_s, 3), trainable_params=stepper.trainable_params,
               trainable_arrays=stepper.trainable_arrays)
    print_result(out)
    return 0


# ---- host side: every rank at once under mlx.launch ----------------------------------------
def rank_probe(spec: dict) -> int:
    import mlx.core as mx
    import numpy as np

    hf = os.environ.get("MLX_HOSTFILE")
    if hf and Path(hf).is_file() and not Path(hf).read_text().strip():
        os.environ.pop("MLX_HOSTFILE")
        os.environ.pop("MLX_RANK", None)
    group = mx.distributed.init(strict="MLX_RANK" in os.environ or "MLX_JACCL_COORDINATOR" in os.environ)
    rank, size = group.rank(), group.size()
    facts = machine_facts()
    facts.update(mlx=mx.__version__, device=str(mx.default_device()), rank=rank)
    out: dict = {"rank": rank, "world_size": size, "facts": facts}

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), stream=mx.cpu))

    def say(name, **kw):
        if rank == 0:
            event(name, **kw)

    if spec.get("per_rank_batch"):
        stepper = Stepper(spec["cfg"])
        out["load_s"] = round(stepper.load_s, 3)
        barrier()
        row = stepper.measure(int(spec["per_rank_batch"]), int(spec["steps"]))
        out["concurrent"] = row
        say("calibrate-concurrent", rank=0, batch=row["batch"], step_s=row["step_s"], **{"tok/s": row["tok_per_s"]})
        # The trainer's gradient all-reduce, on the real LoRA gradient tree.
        from mlx.nn import average_gradients

        grads = stepper.zero_grads()
        barrier()
        times = []
        for i in range(1 + int(spec["grad_reps"])):
            t0 = time.perf_counter()
            avg = average_gradients(grads)
            mx.eval(avg)
            if i:
                times.append(time.perf_counter() - t0)
        out["grad_allreduce"] = {"mean_s": statistics.mean(times), "min_s": min(times), "reps": len(times),
                                 "bytes": int(sum(a[3] for a in stepper.trainable_arrays))}
        say("calibrate-grad-allreduce", bytes=out["grad_allreduce"]["bytes"],
            mean_ms=round(1e3 * out["grad_allreduce"]["mean_s"], 3))
        del stepper, grads, avg
        mx.clear_cache()

    def time_allsum(nbytes: int) -> dict:
        n = max(nbytes // 4, size)
        x = mx.ones((n,), dtype=mx.float32)
        mx.eval(x)
        reps = reps_for(nbytes)
        for _ in range(2 if nbytes < MiB else 1):  # warm-up: buffers, connections
            mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))
        barrier()
        each = []
        t_loop = time.perf_counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            y = mx.distributed.all_sum(x, stream=mx.cpu)
            mx.eval(y)
            each.append(time.perf_counter() - t0)
        loop = time.perf_counter() - t_loop
        if not np.allclose(np.array(y[:4]), size):
            raise RuntimeError(f"all_sum of ones over {size} ranks gave {np.array(y[:4])}")
        del x, y
        mx.clear_cache()
        return {"bytes": n * 4, "reps": reps, "mean_s": loop / reps, "min_s": min(each),
                "median_s": statistics.median(each)}

    sizes = sizes_between(int(spec["min_bytes"]), int(spec["max_bytes"]))
    # MLX's CPU build has no buffer cache: each collective's new output array is fresh memory
    # from the C allocator, which returns big blocks to the kernel on free, so a 256 MiB all_sum
    # also pays 65,536 page faults. Metal's allocator (the Macs) keeps freed buffers for reuse;
    # so that the curve measures the link and not the kernel's page faulting, freed memory is
    # kept for reuse here too (glibc's mallopt), after the largest size is timed once without.
    # Every rank must run the same collectives: whether the extra timing runs is agreed on by
    # an all_sum, not decided by each rank from its own platform.
    possible = keep_freed_memory_possible()
    every = int(mx.distributed.all_sum(mx.array([1.0 if possible else 0.0]), stream=mx.cpu).item()) == size
    out["allocator"] = {"reuse_freed": False, "how": "the process's default allocator"}
    if every:
        row = time_allsum(sizes[-1])
        out["allocator"]["largest_without"] = row
        say("calibrate-allsum-fresh-memory", bytes=row["bytes"], reps=row["reps"],
            best_ms=round(1e3 * row["min_s"], 4), note="before reuse of freed memory")
    if possible and keep_freed_memory():  # no collective: a rank may do this alone
        out["allocator"].update(reuse_freed=True, how=KEEP_FREED_HOW)
    rows = []
    for nbytes in sizes:
        row = time_allsum(nbytes)
        rows.append(row)
        say("calibrate-allsum", bytes=row["bytes"], reps=row["reps"], mean_ms=round(1e3 * row["mean_s"], 4),
            best_ms=round(1e3 * row["min_s"], 4))
    out["allsum"] = rows
    out["calibrate_sha256"] = self_sha256()
    facts["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    path = Path(spec["result_dir"]) / f"rank-{rank}.json"
    atomic.write_json(path, out)
    barrier()
    say("calibrate-rank-probe", world_size=size, result_dir=spec["result_dir"])
    return 0


KEEP_FREED_HOW = "glibc mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB - 1): freed blocks stay in the heap"


def _glibc():
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory_possible() -> bool:
    return _glibc() is not None


def keep_freed_memory() -> bool:
    """Make this process keep freed memory for reuse (as Metal's buffer cache does): no block is
    given its own mmap, and the heap is not trimmed below 2 GiB of free space. True if applied."""
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1


def reps_for(nbytes: int) -> int:
    """Timed all_sum repetitions: many for small messages (latency), 5 for the largest (the best
    of them stands for the link; a shared or busy host disturbs single ones); the same on every
    rank (no rank decides alone how many collectives follow)."""
    return int(max(5, min(50, (64 * MiB) // max(nbytes, 1))))


# ---- host side: the bare TCP baseline --------------------------------------------------------
TCP_CHUNK = 4 * MiB
HEADER = 9  # 1 byte mode + 8 bytes length
# u: one direction into a reused 4 MiB buffer (the wire's ceiling); b: both directions at once
# (what a 2-rank ring all_sum moves); f: both directions, each side receiving into fresh memory
# of the whole size (a collective's output is a new array: its pages are faulted in as it lands).
TCP_MODES = {"u": "one_direction", "b": "both_directions", "f": "both_directions_fresh"}


def _recv_exact(conn: socket.socket, n: int, buf: bytearray | None = None) -> int:
    """Receive n bytes into a reused chunk, or (buf None) into a fresh anonymous mapping of n bytes."""
    import mmap

    dest = mmap.mmap(-1, max(n, 1)) if buf is None else None
    view, got = memoryview(dest if dest is not None else buf), 0
    try:
        while got < n:
            if dest is not None:
                k = conn.recv_into(view[got: got + min(TCP_CHUNK, n - got)])
            else:
                k = conn.recv_into(view[: min(len(buf), n - got)])
            if not k:
                raise ConnectionError(f"peer closed after {got} of {n} bytes")
            got += k
    finally:
        view.release()
        if dest is not None:
            dest.close()
    return got


def _send_n(conn: socket.socket, n: int, buf: bytearray) -> None:
    view, sent = memoryview(buf), 0
    while sent < n:
        k = min(len(buf), n - sent)
        conn.sendall(view[:k])
        sent += k


def _exchange(conn: socket.socket, mode: str, n: int, buf: bytearray) -> None:
    """Move n bytes for one rep: receive only (u) or send and receive at once (b, f)."""
    errors: list[BaseException] = []

    def send():
        try:
            _send_n(conn, n, bytearray(TCP_CHUNK))
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the caller's thread)
            errors.append(e)

    sender = threading.Thread(target=send, daemon=True) if mode in ("b", "f") else None
    if sender:
        sender.start()
    _recv_exact(conn, n, None if mode == "f" else buf)
    if sender:
        sender.join()
    if errors:
        raise errors[0]


def tcp_recv(spec: dict) -> int:
    """Listen on the given IP (port 0: the kernel picks), print the port, serve the reps."""
    srv = socket.socket(socket.AF_INET6 if ":" in spec["ip"] else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((spec["ip"], 0))
    srv.listen(1)
    srv.settimeout(float(spec.get("timeout_s", 120)))
    print(f"calibrate-tcp-listening port {srv.getsockname()[1]}", flush=True)
    buf = bytearray(TCP_CHUNK)
    for _ in range(int(spec["reps"])):
        conn, _ = srv.accept()
        conn.settimeout(float(spec.get("timeout_s", 120)))
        with conn:
            head = bytearray(HEADER)
            _recv_exact(conn, HEADER, head)
            mode, n = chr(head[0]), int.from_bytes(head[1:], "big")
            if mode not in TCP_MODES:
                raise ValueError(f"unknown TCP mode {mode!r}")
            _exchange(conn, mode, n, buf)
            conn.sendall(b"k")
    srv.close()
    return 0


def tcp_send(spec: dict) -> int:
    """Connect to the receiver, time each rep from the first byte to the receiver's ack (which
    it sends when it has received everything, and, both ways, sent everything)."""
    buf = bytearray(TCP_CHUNK)
    n = int(spec["bytes"])
    rows = []
    for mode in spec["modes"]:
        conn = socket.create_connection((spec["ip"], int(spec["port"])), timeout=float(spec.get("timeout_s", 120)))
        with conn:
            t0 = time.perf_counter()
            conn.sendall(mode.encode() + n.to_bytes(8, "big"))
            if mode == "u":
                _send_n(conn, n, buf)
            else:  # the peer sends while we send: receive its bytes the same way it receives ours
                errors: list[BaseException] = []

                def back(conn=conn, mode=mode, errors=errors):
                    try:
                        _recv_exact(conn, n, None if mode == "f" else bytearray(TCP_CHUNK))
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)

                th = threading.Thread(target=back, daemon=True)
                th.start()
                _send_n(conn, n, buf)
                th.join()
                if errors:
                    raise errors[0]
            if conn.recv(1) != b"k":
                raise ConnectionError("the receiver did not acknowledge")
            rows.append({"mode": TCP_MODES[mode], "seconds": time.perf_counter() - t0})
    print_result({"bytes": n, "reps": rows, "facts": machine_facts()})
    return 0


# ---- the model: from measurements to a recommendation and a speedup ---------------------------
def interp_time(curve: list[dict], nbytes: float, key: str = "mean_s") -> float:
    """All_sum seconds for nbytes from the measured curve: log-log interpolation between the
    measured sizes; below the smallest, the smallest's time (latency); above the largest, the
    largest's time scaled by size (its bandwidth)."""
    pts = sorted((r["bytes"], r[key]) for r in curve)
    xs = [p[0] for p in pts]
    if nbytes <= xs[0]:
        return pts[0][1]
    if nbytes >= xs[-1]:
        return pts[-1][1] * nbytes / xs[-1]
    i = bisect.bisect_left(xs, nbytes)
    if xs[i] == nbytes:
        return pts[i][1]
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    f = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def grad_buckets(arrays: list, bucket: int = ALL_REDUCE_BUCKET) -> list[int]:
    """The all_sum message sizes of mlx.nn.average_gradients for these trainable arrays
    ((name, shape, dtype, nbytes) in tree order): groups of at least `bucket` bytes when every
    dtype is the same, else one all_sum per array."""
    if not arrays:
        return []
    if len({a[2] for a in arrays}) > 1:
        return [a[3] for a in arrays]
    out, cur = [], 0
    for a in arrays:
        cur += a[3]
        if cur >= bucket:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def step_time_at(sweep: list[dict], b: int) -> tuple[float | None, str]:
    """(seconds per step, how) at batch b from a host's sweep: measured, or the straight line
    through the neighbouring measured sizes (a step's time is close to affine in the batch)."""
    rows = sorted(sweep, key=lambda r: r["batch"])
    for r in rows:
        if r["batch"] == b:
            return r["step_s"], "measured"
    if len(rows) < 2:
        if rows:
            return rows[0]["step_s"] * b / rows[0]["batch"], "scaled from one size"
        return None, "no measurement"
    below = [r for r in rows if r["batch"] < b]
    above = [r for r in rows if r["batch"] > b]
    if below and above:
        a, c = below[-1], above[0]
        how = "interpolated"
    elif below:
        a, c = below[-2] if len(below) > 1 else below[-1], below[-1]
        how = "extrapolated"
    else:
        a, c = above[0], above[1]
        how = "extrapolated"
    if c["batch"] == a["batch"]:
        return c["step_s"] * b / c["batch"], how
    t = a["step_s"] + (c["step_s"] - a["step_s"]) * (b - a["batch"]) / (c["batch"] - a["batch"])
    return max(t, 1e-9), how


def max_fitting_batch(host: dict) -> tuple[int | None, str, str]:
    """(batch, how, kind): the largest batch that fits this host's memory ceiling. kind is
    "measured" when the sweep stopped at memory (the next size would not fit), "predicted" from
    the peak-memory line (capped at 4x the largest measured), or "lower_bound" when nothing
    bounds it (no memory ceiling known)."""
    rows = [r for r in host.get("sweep", []) if not r.get("over_memory")]
    if not rows:
        return None, "no batch measured within memory", "measured"
    best = max(r["batch"] for r in rows)
    stop = host.get("stopped", {})
    if stop.get("reason") == "memory":
        return best, f"measured: batch {stop.get('next_batch', 2 * best)} would not fit", "measured"
    ceiling = host.get("memory_ceiling_bytes")
    if not ceiling:
        return best, "the largest measured (no memory ceiling known on this host)", "lower_bound"
    limit = ceiling * float(host.get("mem_fraction", 0.8))
    pts = sorted((r["batch"], r["peak_mem_bytes"]) for r in rows)
    if len(pts) >= 2 and pts[-1][0] != pts[-2][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        slope = max((y1 - y0) / (x1 - x0), 1.0)
    else:  # one size: as if all of its peak grew with the batch (an overestimate: safe)
        slope = pts[-1][1] / pts[-1][0]
        x1, y1 = pts[-1]
    pred = int(x1 + (limit - y1) / slope)
    return max(best, min(pred, 4 * best)), ("predicted from peak memory (capped at 4x the largest measured "
                                           f"batch {best})"), "predicted"


def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def recommend(cfg: dict, world: int, hosts: list[dict]) -> dict:
    """Per-rank micro-batch and gradient accumulation for the config's global batch on this
    world, and the single-host control's, from what fits every host's memory."""
    global_batch = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    out: dict = {"global_batch": global_batch, "world_size": world}
    if global_batch % world:
        lo = global_batch - global_batch % world
        out["error"] = (f"the global batch {global_batch} (batch_size x grad_accumulation_steps) is not divisible by "
                        f"the world size {world}: use {lo or world} or {lo + world}")
        return out
    per_rank_total = global_batch // world
    fits = [max_fitting_batch(h) for h in hosts]
    if any(f[0] is None for f in fits):
        out["error"] = "a host measured no batch within its memory: see the compute phase"
        return out
    cap = min(f[0] for f in fits)
    kinds = {f[2] for f in fits if f[0] == cap}
    m = largest_divisor_at_most(per_rank_total, cap)
    accum = per_rank_total // m
    out.update(per_rank_batch=m, grad_accumulation_steps=accum, config_batch_size=m * world,
               config_grad_accumulation_steps=accum, fits_memory_cap=cap,
               fits_memory_cap_kind="lower_bound" if "lower_bound" in kinds else ("measured" if "measured" in kinds
                                                                                  else "predicted"),
               fits_how={h["ssh"]: f[1] for h, f in zip(hosts, fits, strict=True)})
    why = [f"{global_batch} examples per optimizer step = {world} ranks x {per_rank_total}"]
    if m < per_rank_total:
        why.append(f"{per_rank_total} per rank does not fit (largest fitting batch {cap}): micro-batch {m} "
                   f"x {accum} accumulation steps")
    else:
        why.append(f"{m} per rank fits (largest fitting batch {cap})")
    out["why"] = "; ".join(why)
    host0_cap = fits[0][0] or cap
    mc = largest_divisor_at_most(global_batch, host0_cap)
    out["control"] = {"host": hosts[0]["ssh"], "batch": mc, "grad_accumulation_steps": global_batch // mc}
    return out


def ranks_per_machine(hosts: list[dict]) -> int:
    """The most ranks that share one machine (hosts with the same boot id are one machine)."""
    by: dict = {}
    for h in hosts:
        key = (h.get("facts") or {}).get("boot_id") or h["ssh"]
        by[key] = by.get(key, 0) + len(h.get("ranks") or [1])
    return max(by.values(), default=1)


def concurrent_batch(hosts: list[dict], m: int, steps: int, budget_s: float) -> int:
    """The per-rank batch the link phase times with every rank computing at once: m itself when
    (steps + 1) of its steps, slowed by the ranks sharing a machine, fit the time budget; else the
    largest measured batch below m that does (the slowdown measured there scales m's alone time)."""
    k = ranks_per_machine(hosts)

    def cost(b):
        ts = [step_time_at(h.get("sweep", []), b)[0] for h in hosts]
        return None if any(t is None for t in ts) else (steps + 1) * max(ts) * k

    measured = sorted({r["batch"] for h in hosts for r in h.get("sweep", []) if r["batch"] < m}, reverse=True)
    for b in [m, *measured]:
        c = cost(b)
        if c is not None and c <= budget_s:
            return b
    return measured[-1] if measured else m


def configured_split(cfg: dict, world: int) -> dict | None:
    """The config as `make train` and `make control` run it: each rank takes batch_size / world
    per micro-step, the control takes batch_size; both accumulate grad_accumulation_steps."""
    if cfg["batch_size"] % world:
        return None
    return {"per_rank_batch": cfg["batch_size"] // world, "grad_accumulation_steps": cfg["grad_accumulation_steps"],
            "control": {"batch": cfg["batch_size"], "grad_accumulation_steps": cfg["grad_accumulation_steps"]}}


def speedup_model(world: int, hosts: list[dict], split: dict, link: dict | None) -> dict:
    """Expected speedup of `world` ranks over one host (rank 0's) at the same global batch.

    control step = accum_c x t_alone(rank 0's host, micro-batch m_c)
    dual step    = accum x (max over hosts of t(m) while every rank computes at once
                   + one small all_sum: the trainer sums loss and tokens every micro-step)
                   + the gradient all_sum (average_gradients' buckets at the measured curve)
    """
    out: dict = {"formula": "t_control_step / (t_dual_compute + t_dual_allreduce)",
                 "per_rank_batch": split["per_rank_batch"], "grad_accumulation_steps": split["grad_accumulation_steps"],
                 "control_batch": split["control"]["batch"],
                 "control_grad_accumulation_steps": split["control"]["grad_accumulation_steps"]}
    h0 = hosts[0]
    tc, how_c = step_time_at(h0.get("sweep", []), split["control"]["batch"])
    if tc is None:
        out["unknown"] = f"{h0['ssh']}: no compute measurement"
        return out
    t_ctrl = split["control"]["grad_accumulation_steps"] * tc
    m, accum = split["per_rank_batch"], split["grad_accumulation_steps"]
    per_host, hows = [], {}
    conc = (link or {}).get("concurrent") or {}
    for h in hosts:
        c = conc.get(h["ssh"])
        alone_c = step_time_at(h.get("sweep", []), c["batch"])[0] if c else None
        if c and c["batch"] == m:
            per_host.append(c["step_s"])
            hows[h["ssh"]] = "measured with every rank computing at once"
        elif c and alone_c:
            t, how = step_time_at(h.get("sweep", []), m)
            slow = c["step_s"] / alone_c
            per_host.append(t * slow)
            hows[h["ssh"]] = (f"{how} alone x {slow:.2f}, the slowdown measured at batch {c['batch']} with every "
                              "rank computing at once")
        else:
            t, how = step_time_at(h.get("sweep", []), m)
            if t is None:
                out["unknown"] = f"{h['ssh']}: no compute measurement"
                return out
            per_host.append(t)
            hows[h["ssh"]] = how + " (host alone)"
    t_comp = accum * max(per_host)
    out.update(t_control_step_s=t_ctrl, control_how=how_c, t_dual_compute_s=t_comp, dual_compute_how=hows)
    if world == 1:
        out.update(t_dual_allreduce_s=0.0, t_dual_step_s=t_comp, expected_speedup=t_ctrl / t_comp,
                   compute_bound_speedup=t_ctrl / t_comp, link_share=0.0)
        return out
    out["compute_bound_speedup"] = t_ctrl / t_comp
    if not link or not link.get("allreduce"):
        out["unknown"] = "no all_sum measurement (the link phase did not run)"
        return out
    buckets = grad_buckets(h0.get("trainable_arrays") or [])
    t_grad = sum(interp_time(link["allreduce"], b) for b in buckets)
    t_small = accum * interp_time(link["allreduce"], 8)
    t_comm = t_grad + t_small
    t_dual = t_comp + t_comm
    out.update(grad_bytes=sum(buckets), grad_buckets=buckets, t_grad_allreduce_s=t_grad,
               t_step_stats_allsum_s=t_small, t_dual_allreduce_s=t_comm, t_dual_step_s=t_dual,
               expected_speedup=t_ctrl / t_dual, link_share=t_comm / t_dual)
    meas = link.get("grad_allreduce_measured")
    if meas:  # the same with the trainer's own all-reduce as timed (concatenate, all_sum, split)
        t_alt = t_comp + meas["mean_s"] + t_small
        out.update(t_grad_allreduce_measured_s=meas["mean_s"], expected_speedup_measured_allreduce=t_ctrl / t_alt)
    return out


# ---- the orchestrator ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile")
    p.add_argument("--model")
    p.add_argument("--config")
    p.add_argument("--remote-root", help="absolute path of the synced repo on every host")
    p.add_argument("--python", help="interpreter path on the hosts")
    p.add_argument("--budget-s", type=float, default=120.0, help="compute sweep time budget per host (default 120)")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch the sweep tries (default 64)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per batch size, after a warm-up (default 3)")
    p.add_argument("--max-step-s", type=float, default=60.0, help="stop the sweep before a step this slow")
    p.add_argument("--mem-fraction", type=float, default=0.8,
                   help="the share of the device's memory a batch may peak at (default 0.8)")
    p.add_argument("--min-bytes", type=int, default=4 * KiB, help="smallest all_sum message (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=256 * MiB, help="largest all_sum message (default 256 MiB)")
    p.add_argument("--tcp-bytes", type=int, default=None, help="bytes of the TCP baseline (default --max-bytes)")
    p.add_argument("--tcp-reps", type=int, default=3, help="TCP transfers each way (default 3)")
    p.add_argument("--grad-reps", type=int, default=5, help="timed gradient all-reduces (default 5)")
    p.add_argument("--port", type=int, default=None, help="first ring port (mlx.launch --starting-port)")
    p.add_argument("--out-dir", default=str(paths.RUNS), help="where calibration-<time>.json goes (default runs/)")
    p.add_argument("--skip-compute", action="store_true", help="measure only the link")
    p.add_argument("--skip-link", action="store_true", help="measure only compute (no expected speedup)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each phase beyond its budget")
    # host-side modes
    for mode in ("--compute-probe", "--rank-probe", "--tcp-recv", "--tcp-send"):
        p.add_argument(mode, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-id", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def host_argv(host: str, remote_root: str, python: str, argv: list[str]) -> list[str]:
    """`cd REMOTE_ROOT && PYTHON bin/calibrate.py ARGV` on host: ssh unless it is 127.0.0.1."""
    from lib.hostfile import is_local
    from lib.remote import ssh_argv

    cmd = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", remote_root, python, "bin/calibrate.py", *argv]
    return cmd if is_local(host) else ssh_argv(host, cmd)


class Streamed:
    """A child process whose output lines are echoed (except result lines) and kept."""

    def __init__(self, argv: list[str], echo: bool = True):
        self.lines: list[str] = []
        self.result: dict | None = None
        self.echo = echo
        self.proc = subprocess.Popen(argv, cwd=paths.ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for raw in iter(self.proc.stdout.readline, b""):
            for line in raw.decode(errors="replace").replace("\r", "\n").split("\n"):
                if not line.strip():
                    continue
                with self.cond:
                    if line.startswith(RESULT_PREFIX):
                        self.result = json.loads(line[len(RESULT_PREFIX):])
                    else:
                        self.lines.append(line)
                        if self.echo:
                            print(line, flush=True)
                    self.cond.notify_all()

    def wait_line(self, pattern: re.Pattern, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines:
                    m = pattern.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self.thread.is_alive():
                    return None
                self.cond.wait(min(left, 0.2))

    def wait(self, timeout: float) -> tuple[int, bool]:
        try:
            rc = self.proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            self.kill()
            rc, timed_out = self.proc.returncode, True
        self.thread.join(timeout=10)
        return rc, timed_out

    def kill(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def tail(self, n: int = 12) -> str:
        return "\n".join(self.lines[-n:])


def probe_pattern(probe_id: str) -> str:
    """The pkill -f pattern of this calibration's host-side processes and nothing else (the
    escaped '.' keeps it from matching the shell that runs pkill)."""
    return r"bin/calibrate\.py --[a-z-]+ --probe-id " + re.escape(probe_id) + r"( |$)"


def sweep_hosts(hf, probe_id: str) -> dict[str, str]:
    from lib.remote import run_on

    found = {}
    for host in hf.unique_ssh():
        r = run_on(host, ["sh", "-c", 'pkill -KILL -f -- "$1" && echo killed || true', "sh", probe_pattern(probe_id)],
                   timeout=15)
        found[host] = "killed leftovers" if "killed" in r.stdout else ("clean" if r.ok else "unreachable")
    return found


def free_ports(n: int) -> int:
    """A first port with n free consecutive ports on this machine (ranks on 127.0.0.1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for k in range(1, n):
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", base + k))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RunbookError("no free port range for the local ranks: pass --port", ANCHOR)


def phase_compute(args, hf, cfg: dict, probe_id: str, must: list[int]) -> list[dict]:
    hosts = []
    for host in hf.unique_ssh():
        ranks = [h.rank for h in hf.hosts if h.ssh == host]
        spec = {"cfg": cfg, "host": host, "budget_s": args.budget_s, "max_batch": args.max_batch,
                "steps": args.steps, "max_step_s": args.max_step_s, "mem_fraction": args.mem_fraction,
                "must": must}
        argv = host_argv(host, args.remote_root, args.python,
                         ["--compute-probe", "--probe-id", probe_id, "--spec", json.dumps(spec)])
        event("calibrate-phase", phase="compute", host=host, ranks=",".join(map(str, ranks)),
              budget_s=args.budget_s)
        s = Streamed(argv)
        rc, timed_out = s.wait(args.budget_s + args.timeout_s)
        if rc != 0 or s.result is None:
            why = f"timed out after {args.budget_s + args.timeout_s:g} s" if timed_out else f"exit {rc}"
            raise RunbookError(f"{host}: the compute probe failed ({why}):\n{s.tail()}\nrun `make sync` and "
                               f"`make check-parity HOSTFILE={args.hostfile}` first", ANCHOR)
        res = s.result
        check_same_code(host, res)
        res.update(ssh=host, ranks=ranks, ips=next(h.ips for h in hf.hosts if h.ssh == host))
        hosts.append(res)
    return hosts


def phase_link(args, hf, cfg: dict, probe_id: str, concurrent_batch: int | None) -> dict:
    from lib.remote import run_on

    result_dir = f"runs/.calibrate/{probe_id}"
    spec = {"cfg": cfg, "steps": args.steps, "grad_reps": args.grad_reps, "min_bytes": args.min_bytes,
            "max_bytes": args.max_bytes, "result_dir": result_dir}
    if concurrent_batch:
        spec["per_rank_batch"] = concurrent_batch
    port = args.port
    if port is None and all(h.ssh == "127.0.0.1" for h in hf.hosts):
        port = free_ports(hf.size)
    from lib import launch

    argv = launch.launch_argv(args.hostfile, hf, args.python, args.remote_root,
                              ["--rank-probe", "--probe-id", probe_id, "--spec", json.dumps(spec)], port,
                              script="bin/calibrate.py")
    event("calibrate-phase", phase="link", world_size=hf.size, backend=hf.backend or "ring",
          concurrent_batch=concurrent_batch or "-", sizes=f"{human_bytes(args.min_bytes)}..{human_bytes(args.max_bytes)}")
    s = Streamed(argv)
    rc, timed_out = s.wait(args.timeout_s)
    ranks = {}
    for h in hf.hosts:
        r = run_on(h.ssh, ["cat", f"{args.remote_root}/{result_dir}/rank-{h.rank}.json"], timeout=30)
        if r.ok:
            try:
                ranks[h.rank] = json.loads(r.stdout)
            except ValueError:
                pass
    for host in hf.unique_ssh():
        run_on(host, ["rm", "-rf", "--", f"{args.remote_root}/{result_dir}"], timeout=30)
    if rc != 0 or timed_out or len(ranks) != hf.size:
        missing = sorted(set(range(hf.size)) - set(ranks))
        why = f"timed out after {args.timeout_s:g} s" if timed_out else f"mlx.launch exit {rc}"
        raise RunbookError(f"the link probe failed ({why}; no result from ranks {missing}):\n{s.tail()}\n"
                           f"check `make check-parity HOSTFILE={args.hostfile}` (ssh, interpreter, code on every "
                           "host) and the ring ports", "runtime-parity" if missing else ANCHOR,
                           "runtime parity" if missing else None)
    for r, res in ranks.items():
        check_same_code(f"rank {r} ({hf.hosts[r].ssh})", res)
    return combine_ranks(hf, ranks)


def combine_ranks(hf, ranks: dict[int, dict]) -> dict:
    """One curve from every rank's: a collective ends when its slowest rank's does."""
    n = hf.size
    factor = 2 * (n - 1) / n
    rows = []
    for i, row in enumerate(ranks[0]["allsum"]):
        per = [ranks[r]["allsum"][i] for r in range(n)]
        mean_s = max(p["mean_s"] for p in per)
        min_s = max(p["min_s"] for p in per)
        b = row["bytes"]
        rows.append({"bytes": b, "reps": row["reps"], "mean_s": mean_s, "min_s": min_s,
                     "algbw_gbps": b / mean_s / 1e9, "busbw_gbps": b / mean_s / 1e9 * factor,
                     "best_algbw_gbps": b / min_s / 1e9, "best_busbw_gbps": b / min_s / 1e9 * factor})
    out = {"backend": hf.backend or "ring", "world_size": n, "busbw_factor": factor, "allreduce": rows,
           "rank_facts": [ranks[r]["facts"] for r in range(n)]}
    allocs = [ranks[r].get("allocator") or {"reuse_freed": False} for r in range(n)]
    out["allocator"] = {"reuse_freed": all(a["reuse_freed"] for a in allocs),
                        "how": "; ".join(sorted({a.get("how", "the process's default allocator") for a in allocs}))}
    if all("largest_without" in a for a in allocs):
        w = [a["largest_without"] for a in allocs]
        b, min_s, mean_s = w[0]["bytes"], max(x["min_s"] for x in w), max(x["mean_s"] for x in w)
        out["allocator"]["largest_into_fresh_memory"] = {"bytes": b, "reps": w[0]["reps"], "min_s": min_s,
                                                         "mean_s": mean_s, "best_busbw_gbps": b / min_s / 1e9 * factor}
    small, large = rows[0], rows[-1]
    out["latency_us"] = {"bytes": small["bytes"], "mean": 1e6 * small["mean_s"], "best": 1e6 * small["min_s"]}
    # Large-message bandwidth: the best bus bandwidth over the largest sizes (>= a quarter of the
    # largest: the plateau), so one disturbed size on a busy host does not stand for the link.
    plateau = [r for r in rows if r["bytes"] >= large["bytes"] / 4] or [large]
    top = max(plateau, key=lambda r: r["best_busbw_gbps"])
    out["bandwidth_gbps"] = {"bytes": top["bytes"], "busbw_mean": top["busbw_gbps"], "busbw_best": top["best_busbw_gbps"],
                             "algbw_mean": top["algbw_gbps"], "plateau_bytes": [r["bytes"] for r in plateau],
                             "largest": {"bytes": large["bytes"], "busbw_mean": large["busbw_gbps"],
                                         "busbw_best": large["best_busbw_gbps"]}}
    if "concurrent" in ranks[0]:
        conc: dict = {}
        for r in range(n):
            host = hf.hosts[r].ssh
            c = ranks[r]["concurrent"]
            if host not in conc or c["step_s"] > conc[host]["step_s"]:
                conc[host] = c
        out["concurrent"] = conc
        g = [ranks[r]["grad_allreduce"] for r in range(n)]
        out["grad_allreduce_measured"] = {"bytes": g[0]["bytes"], "mean_s": max(x["mean_s"] for x in g),
                                          "min_s": max(x["min_s"] for x in g), "reps": g[0]["reps"]}
    return out


def phase_tcp(args, hf, probe_id: str) -> dict:
    """Bare TCP from rank 0's host to rank 1's IP, one direction then both at once."""
    h0, h1 = hf.hosts[0], hf.hosts[1]
    if not h1.ips:
        return {"unknown": f"rank 1 ({h1.ssh}) has no IP in the hostfile to send to"}
    n = args.tcp_bytes or args.max_bytes
    modes = [m for m in TCP_MODES for _ in range(args.tcp_reps)]
    event("calibrate-phase", phase="tcp", sender=h0.ssh, receiver=f"{h1.ssh}/{h1.ips[0]}", bytes=n,
          reps=len(modes))
    recv = Streamed(host_argv(h1.ssh, args.remote_root, args.python,
                              ["--tcp-recv", "--probe-id", probe_id,
                               "--spec", json.dumps({"ip": h1.ips[0], "reps": len(modes), "timeout_s": 120})]),
                    echo=False)
    m = recv.wait_line(re.compile(r"calibrate-tcp-listening port (\d+)"), 60)
    if not m:
        recv.kill()
        raise RunbookError(f"{h1.ssh}: the TCP receiver did not start on {h1.ips[0]}:\n{recv.tail()}", ANCHOR)
    send = Streamed(host_argv(h0.ssh, args.remote_root, args.python,
                              ["--tcp-send", "--probe-id", probe_id,
                               "--spec", json.dumps({"ip": h1.ips[0], "port": int(m.group(1)), "bytes": n,
                                                     "modes": modes, "timeout_s": 120})]), echo=False)
    rc, timed_out = send.wait(300)
    rrc, _ = recv.wait(30)
    if rc != 0 or send.result is None:
        recv.kill()
        raise RunbookError(f"the TCP baseline {h0.ssh} -> {h1.ips[0]} failed (exit {rc}"
                           f"{', timed out' if timed_out else ''}):\n{send.tail()}\n{recv.tail()}", ANCHOR)
    check_same_code(h0.ssh, send.result)
    reps = send.result["reps"]
    out = {"sender": h0.ssh, "receiver": h1.ssh, "ip": h1.ips[0], "bytes": n, "reps": reps,
           "note": "GB/s per direction. one_direction: into a reused 4 MiB buffer (the wire's ceiling); "
                   "both_directions: the same bytes each way at once (what a 2-rank ring all_sum moves); "
                   "both_directions_fresh: as both, each side receiving into fresh memory of the whole size "
                   "(a collective's output is a new array whose pages fault in as the bytes land)"}
    for name in TCP_MODES.values():
        secs = [r["seconds"] for r in reps if r["mode"] == name]
        out[f"{name}_gbps_best"] = n / min(secs) / 1e9
        out[f"{name}_gbps_median"] = n / statistics.median(secs) / 1e9
        event("calibrate-tcp", mode=name, bytes=n, best_gbps=round(out[f"{name}_gbps_best"], 4),
              median_gbps=round(out[f"{name}_gbps_median"], 4))
    return out


def load_inputs(args):
    from lib import config as C
    from lib.hostfile import check_path
    from lib.hostfile import load as load_hostfile

    for flag in ("hostfile", "model", "config", "remote_root", "python"):
        if not getattr(args, flag):
            raise RunbookError(f"--{flag.replace('_', '-')} is required", ANCHOR)
    hf = load_hostfile(args.hostfile)
    check_path(args.remote_root, "REMOTE_ROOT")
    check_path(args.python, "PYTHON")
    cfg = C.load_config(args.config)
    cfg["model"] = args.model
    cfg["resume_adapter_file"] = None  # a calibration never starts from an adapter
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        raise RunbookError(f"--min-bytes {args.min_bytes} / --max-bytes {args.max_bytes}: need 4 <= min <= max", ANCHOR)
    if args.budget_s <= 0 or args.max_batch < 1 or args.steps < 1 or not 0 < args.mem_fraction <= 1:
        raise RunbookError("--budget-s, --max-batch, --steps must be positive and --mem-fraction in (0, 1]", ANCHOR)
    return hf, cfg


def must_sizes(cfg: dict, world: int) -> list[int]:
    g = cfg["batch_size"] * cfg["grad_accumulation_steps"]
    out = {cfg["batch_size"], g}
    if cfg["batch_size"] % world == 0:
        out.add(cfg["batch_size"] // world)
    if g % world == 0:
        out.add(g // world)
    return sorted(out)


def shared_machines(hosts: list[dict]) -> list[list[str]]:
    by: dict = {}
    for h in hosts:
        b = (h.get("facts") or {}).get("boot_id")
        if b:
            by.setdefault(b, []).append(h["ssh"])
    return [v for v in by.values() if len(v) > 1]


def out_path(out_dir: Path) -> Path:
    while True:
        p = out_dir / f"calibration-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        if not p.exists():
            return p
        time.sleep(1.0)


def make_command(args) -> str:
    v = {"HOSTFILE": args.hostfile, "MODEL": args.model, "CONFIG": args.config, "REMOTE_ROOT": args.remote_root,
         "PYTHON": args.python}
    return shlex.join(["make", "calibrate", *[f"{k}={x}" for k, x in v.items()]])


def orchestrate(args) -> int:
    from lib import launch
    from lib.hashing import sha256_file

    t0 = time.time()
    try:
        hf, cfg = load_inputs(args)
    except (RunbookError, ValueError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), ANCHOR), 2)
    probe_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    world = hf.size
    load_start = [round(x, 2) for x in os.getloadavg()]
    event("calibrate", hostfile=args.hostfile, world_size=world, backend=hf.backend or "ring", model=args.model,
          max_seq_length=cfg["max_seq_length"], batch_size=cfg["batch_size"],
          grad_accumulation_steps=cfg["grad_accumulation_steps"], loadavg=",".join(map(str, load_start)))
    unknown: dict[str, str] = {}
    hosts: list[dict] = []
    link = None
    tcp = None
    try:
        if not args.skip_compute:
            hosts = phase_compute(args, hf, cfg, probe_id, must_sizes(cfg, world))
        else:
            unknown["compute"] = "skipped (--skip-compute): no throughput, no recommendation, no expected speedup"
            hosts = [{"ssh": h, "ranks": [x.rank for x in hf.hosts if x.ssh == h], "sweep": []} for h in hf.unique_ssh()]
        rec = recommend(cfg, world, hosts) if hosts and hosts[0].get("sweep") else {"error": unknown.get("compute", "")}
        split = configured_split(cfg, world)
        conc_batch = None
        if split and "error" not in rec:
            target = split["per_rank_batch"] if split["per_rank_batch"] <= rec["fits_memory_cap"] else rec["per_rank_batch"]
            conc_batch = concurrent_batch(hosts, target, args.steps, args.budget_s)
        if world > 1 and not args.skip_link:
            link = phase_link(args, hf, cfg, probe_id, conc_batch)
            tcp = phase_tcp(args, hf, probe_id)
            link["tcp"] = tcp
        elif world == 1:
            unknown["link"] = "one rank: no link to measure"
        else:
            unknown["link"] = "skipped (--skip-link)"
    except RunbookError as e:
        sweep_hosts(hf, probe_id)
        if e.category:  # the failure table's shape: `FAILED category: ...; see RUNBOOK.md#<category>`
            launch.print_category(e.category, str(e.args[0]))
            return 1
        return die(e, 1)
    except KeyboardInterrupt:
        sweep_hosts(hf, probe_id)
        return die(RunbookError("interrupted; nothing written", ANCHOR), 130)
    except Exception:  # a bug: leave no probe behind, then show the traceback
        sweep_hosts(hf, probe_id)
        raise

    for h in hosts:
        if not h.get("facts") and link:
            h["facts"] = link["rank_facts"][h["ranks"][0]]
    if link and tcp and "one_direction_gbps_best" in tcp:
        best = link["bandwidth_gbps"]["busbw_best"]
        # The like-for-like baseline is both directions at once: a 2-rank ring all_sum sends and
        # receives the same bytes each way at the same time. Where both directions share one
        # pool of CPUs (the test fabric: every host on one machine) that is well below one way.
        link["allreduce_vs_tcp"] = {
            "baseline": "tcp_both_directions_gbps",
            "allsum_busbw_best_gbps": best, "tcp_one_direction_gbps": tcp["one_direction_gbps_best"],
            "tcp_both_directions_gbps": tcp["both_directions_gbps_best"],
            "tcp_both_directions_fresh_gbps": tcp["both_directions_fresh_gbps_best"],
            "tcp_over_allsum": tcp["one_direction_gbps_best"] / best if best else None,
            "tcp_both_over_allsum": tcp["both_directions_gbps_best"] / best if best else None,
            "tcp_fresh_over_allsum": tcp["both_directions_fresh_gbps_best"] / best if best else None,
            "bytes_allsum": link["bandwidth_gbps"]["bytes"], "bytes_tcp": tcp["bytes"]}
    if link and hosts and hosts[0].get("trainable_arrays"):
        buckets = grad_buckets(hosts[0]["trainable_arrays"])
        link["grad_allreduce_modeled"] = {"bytes": sum(buckets), "buckets": buckets,
                                          "mean_s": sum(interp_time(link["allreduce"], b) for b in buckets)}

    configured = speedup_model(world, hosts, split, link) if (split and hosts and hosts[0].get("sweep")) else \
        {"unknown": unknown.get("compute") or f"batch_size {cfg['batch_size']} is not divisible by {world} ranks"}
    recommended = speedup_model(world, hosts, {"per_rank_batch": rec["per_rank_batch"],
                                               "grad_accumulation_steps": rec["grad_accumulation_steps"],
                                               "control": rec["control"]}, link) if "error" not in rec else \
        {"unknown": rec.get("error")}
    for k in ("expected_speedup", "compute_bound_speedup", "link_share"):
        if configured.get(k) is None:
            unknown.setdefault(k, configured.get("unknown") or "not measured")
    exp = configured.get("expected_speedup")
    cb = configured.get("compute_bound_speedup")
    doc = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": None,
        "make_command": make_command(args),
        "command": shlex.join(["python", *sys.argv]),
        "git": launch.git_info(),
        "hostfile": {"path": args.hostfile, "sha256": sha256_file(args.hostfile), **hf.to_json(), "world_size": world},
        "model": args.model, "model_sha256": launch.model_hash(args.model),
        "config": {"path": args.config, "sha256": sha256_file(args.config),
                   **{k: cfg[k] for k in ("batch_size", "grad_accumulation_steps", "max_seq_length", "num_layers",
                                          "fine_tune_type", "lora_parameters", "grad_checkpoint", "optimizer")}},
        "remote_root": args.remote_root, "python": args.python,
        "settings": {k: getattr(args, k) for k in ("budget_s", "max_batch", "steps", "max_step_s", "mem_fraction",
                                                   "min_bytes", "max_bytes", "tcp_reps", "grad_reps")}
        | {"tcp_bytes": args.tcp_bytes or args.max_bytes},
        "orchestrator": {"hostname": socket.gethostname(), "loadavg_start": load_start},
        "hosts": [{k: v for k, v in h.items() if k != "trainable_arrays"} for h in hosts],
        "shared_machine": shared_machines(hosts),
        "link": link,
        "recommendation": rec,
        "speedup": {"configured": configured, "recommended": recommended},
        "expected_speedup": exp,
        "compute_bound_speedup": cb,
        "link_share": configured.get("link_share"),
        "link_bound": (exp < 0.9 * cb) if (exp is not None and cb is not None and world > 1) else None,
        "unknown": unknown,
    }
    if hosts and hosts[0].get("trainable_arrays"):
        doc["trainable_bytes"] = sum(a[3] for a in hosts[0]["trainable_arrays"])
        doc["trainable_params"] = hosts[0].get("trainable_params")
    doc["orchestrator"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["wall_s"] = round(time.time() - t0, 3)
    out_dir = Path(args.out_dir)
    path = out_path(out_dir)
    atomic.write_json(path, doc)
    print_table(doc)
    event("calibrate-done", file=paths.rel(path), expected_speedup=exp if exp is not None else "unknown",
          wall_s=doc["wall_s"])
    return 0


def fmt_num(v, spec=".3g", none="-"):
    return none if v is None else format(v, spec)


def print_table(doc: dict) -> None:
    print(f"calibration: {doc['hostfile']['path']} ({doc['hostfile']['world_size']} ranks, "
          f"{doc['link']['backend'] if doc['link'] else doc['hostfile']['backend'] or 'ring'}) model {doc['model']} "
          f"max_seq_length {doc['config']['max_seq_length']}; load {doc['orchestrator']['loadavg_start']}")
    for h in doc["hosts"]:
        f = h.get("facts") or {}
        print(f"  host {h['ssh']} (ranks {','.join(map(str, h['ranks']))}): {f.get('hostname', '?')} "
              f"{f.get('machine', '?')} {f.get('cpu_count', '?')} cpus, device {f.get('device', '?')}, "
              f"load {f.get('loadavg')}, memory ceiling {fmt_num((h.get('memory_ceiling_bytes') or 0) / 1e9, '.2f')} GB "
              f"({h.get('memory_ceiling_source', '?')}); stopped: {h.get('stopped', {}).get('detail', '-')}")
        if h.get("sweep"):
            print(f"    {'batch':>5} {'tokens':>7} {'step_s':>8} {'tok/s':>9} {'peak_mem_gb':>11}")
            for r in h["sweep"]:
                print(f"    {r['batch']:>5} {r['tokens_per_step']:>7} {r['step_s']:>8.3f} {r['tok_per_s']:>9.1f} "
                      f"{r['peak_mem_bytes'] / 1e9:>11.3f}")
    link = doc["link"]
    if link:
        print(f"  all_sum over {link['world_size']} ranks ({link['backend']}), busbw = algbw x {link['busbw_factor']:g}:")
        print(f"    {'bytes':>10} {'reps':>4} {'mean_ms':>9} {'best_ms':>9} {'busbw_GB/s':>10} {'best_GB/s':>9}")
        for r in link["allreduce"]:
            print(f"    {human_bytes(r['bytes']):>10} {r['reps']:>4} {1e3 * r['mean_s']:>9.3f} {1e3 * r['min_s']:>9.3f} "
                  f"{r['busbw_gbps']:>10.4f} {r['best_busbw_gbps']:>9.4f}")
        t = link.get("tcp") or {}
        if "one_direction_gbps_best" in t:
            v = link["allreduce_vs_tcp"]
            a = link.get("allocator") or {}
            fresh = a.get("largest_into_fresh_memory")
            print(f"  bare TCP {t['sender']} -> {t['receiver']} ({t['ip']}), {human_bytes(t['bytes'])}, best per "
                  f"direction: both directions at once {t['both_directions_gbps_best']:.3f} GB/s (what a 2-rank ring "
                  f"all_sum moves), one direction {t['one_direction_gbps_best']:.3f}, both into fresh memory "
                  f"{t['both_directions_fresh_gbps_best']:.3f}")
            print(f"  all_sum large-message busbw {v['allsum_busbw_best_gbps']:.3f} GB/s (best, at "
                  f"{human_bytes(v['bytes_allsum'])}"
                  + ("; freed memory reused" if a.get("reuse_freed") else "")
                  + (f"; {fresh['best_busbw_gbps']:.3f} GB/s at {human_bytes(fresh['bytes'])} into fresh memory"
                     if fresh else "")
                  + f") = 1/{fmt_num(v['tcp_both_over_allsum'], '.2f')} of both directions at once, "
                  f"1/{fmt_num(v['tcp_over_allsum'], '.2f')} of one direction, "
                  f"1/{fmt_num(v['tcp_fresh_over_allsum'], '.2f')} of both into fresh memory")
        if "grad_allreduce_modeled" in link:
            g = link["grad_allreduce_modeled"]
            meas = link.get("grad_allreduce_measured", {})
            print(f"  gradient all-reduce {human_bytes(g['bytes'])} in {len(g['buckets'])} all_sum(s): modeled "
                  f"{1e3 * g['mean_s']:.2f} ms, measured {fmt_num(1e3 * meas['mean_s'] if meas else None, '.2f')} ms")
    rec = doc["recommendation"]
    if "error" in rec:
        print(f"  recommendation: unknown: {rec['error']}")
    else:
        print(f"  recommendation: per-rank batch {rec['per_rank_batch']} x grad accumulation "
              f"{rec['grad_accumulation_steps']} (config batch_size {rec['config_batch_size']}, "
              f"grad_accumulation_steps {rec['config_grad_accumulation_steps']}); control on {rec['control']['host']}: "
              f"batch {rec['control']['batch']} x {rec['control']['grad_accumulation_steps']}. {rec['why']}")
    sp = doc["speedup"]["configured"]
    if doc["expected_speedup"] is not None:
        print(f"  expected_speedup {doc['expected_speedup']:.3f} (configured split: per-rank {sp['per_rank_batch']}, "
              f"control {sp['control_batch']}; control step {sp['t_control_step_s']:.4f} s, dual compute "
              f"{sp['t_dual_compute_s']:.4f} s + all_sum {sp.get('t_dual_allreduce_s', 0):.4f} s; without the link "
              f"{doc['compute_bound_speedup']:.3f}; link share {100 * (doc['link_share'] or 0):.1f}%)")
    else:
        print(f"  expected_speedup unknown: {doc['unknown'].get('expected_speedup')}")
    if doc["shared_machine"]:
        print(f"  note: {doc['shared_machine']} share one machine (same boot id): they compete for its cores, "
              "so the concurrent step time (not the alone one) is what a rank gets")


def main() -> int:
    args = build_parser().parse_args()
    modes = {"compute_probe": compute_probe, "rank_probe": rank_probe, "tcp_recv": tcp_recv, "tcp_send": tcp_send}
    for name, fn in modes.items():
        if getattr(args, name):
            try:
                return fn(json.loads(args.spec))
            except Exception as e:  # the orchestrator shows this line and the host's name
                print(f"error: {Path(__file__).name} --{name.replace('_', '-')} on {socket.gethostname()}: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
                if not isinstance(e, (RunbookError, OSError, RuntimeError, MemoryError)) and type(e).__name__ != "Failure":
                    import traceback

                    traceback.print_exc()
                return 1
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
