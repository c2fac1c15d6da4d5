#!/usr/bin/env python3
"""bench_scaling: dual / control on 2 pinned fabric hosts, and calibrate's prediction of it.

Usage:
    python bench/bench_scaling.py [--width 512] [--layers 4] [--batch 64] [--steps 6] [--runs 4]
                                  [--throttle-mbit M]

Example (what `make bench` runs through bench/run_all.py):
    .venv/bin/python bench/bench_scaling.py --runs 4

A compute-bound training step (an MLP of --layers x --width, nn.value_and_grad, SGD) stands for the
trainer's: the control runs it at the global batch 2 x --batch on one core (`taskset -c 0`); the dual
run is 2 ranks under `mlx.launch --backend ring` on a 2-host fabric brought up with
`tests/fabric.py up --pin` (each host's processes on its own core), each at --batch, gradients
averaged with mlx.nn.average_gradients (what mlx-lm's trainer calls). The launcher runs under
`nice -n 19`: mlx.launch's IO threads spin (see bench/README.md) and would take a third of this
2-core machine. --runs pairs (control, dual, one rank's work alone) run one after the other; each
figure is a sample a pair, printed with its median, spread and verdict (bench/gate.py):
    pinned_dual_speedup: dual samples/s / control samples/s, wall clock
        (target >= 1.8, reported, not a gate on this shared 2-core machine: under other load the two
        pinned ranks cannot both get a whole core; see bench/README.md, "Why two ranks are not 2x
        here"), so the detail also gives the on-CPU ratios (control CPU s / a rank's CPU s per step)
    speedup_prediction_error: |expected / on-CPU ratio - 1|, expected from bin/calibrate.py's
        speedup_model fed the pair's one-rank and control step CPU times and its gradient
        all_sum time measured on the same fabric (target <= 0.15, reported, not a gate here: the
        on-CPU ratio it checks moves with this VM's other load, every pair of a run alike, 0.68x
        to 1.70x in one day; see bench/README.md, "Which figures gate, and why")
Exits 0 when it measured, 2 on an error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import fabric_cli  # noqa: E402  (bench/fabric_cli.py: tests/fabric.py through its CLI)
from gate import Gate, emit  # noqa: E402  (bench/gate.py: samples, spread, verdict)

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, what in (("--width", 512, "MLP width"), ("--layers", 4, "MLP layers"),
                                ("--batch", 64, "per-rank batch (the control runs 2x)"),
                                ("--steps", 6, "timed steps per run"), ("--runs", 4, "pairs")):
        p.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--throttle-mbit", type=float, help="cap each host's veth with `tc ... tbf` (a slow link)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank's (or the control's) loop
    return p


def rank_main(a) -> int:
    """The step loop; prints one JSON line (rank 0) with its step time and the gradient all_sum time."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    g = mx.distributed.init()
    mx.random.seed(0)
    model = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)])
    opt = optim.SGD(learning_rate=1e-3)
    x, y = mx.random.normal((a.batch, a.width)), mx.random.normal((a.batch, a.width))
    loss_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())

    def step(reduce: bool) -> None:
        loss, grads = loss_grad(model, x, y)
        if reduce:
            grads = nn.average_gradients(grads)
        opt.update(model, grads)
        mx.eval(loss, model.parameters())

    step(g.size() > 1)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        step(g.size() > 1)
    step_s, cpu_s = (time.perf_counter() - t0) / a.steps, (time.process_time() - c0) / a.steps
    allsum_s = None
    if g.size() > 1:
        flat = mx.zeros((sum(v.size for _, v in nn.utils.tree_flatten(model.parameters())),))
        mx.eval(mx.distributed.all_sum(flat))
        t0 = time.perf_counter()
        for _ in range(3):
            mx.eval(mx.distributed.all_sum(flat))
        allsum_s = (time.perf_counter() - t0) / 3
    if g.rank() == 0:
        print(json.dumps({"step_s": step_s, "cpu_s": cpu_s, "allsum_s": allsum_s, "batch": a.batch, "size": g.size()}), flush=True)
    return 0


def run_json(argv: list[str], env: dict | None = None, timeout: float = 300) -> dict:
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not rows:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {p.returncode}:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return json.loads(rows[-1])


def load_calibrate():
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "bin" / "calibrate.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    return cal


def predicted(cal, one: dict, allsum_s: float, control_step_s: float) -> float:
    """bin/calibrate.py's speedup_model on this workload: control at 2B, each rank at B plus the
    all-reduce (step times as CPU seconds: what they take with a core to themselves, whatever the
    load)."""
    b = one["batch"]
    hosts = [
        {
            "ssh": "fab1",
            "ranks": [0],
            "sweep": [
                {"batch": b, "step_s": one["cpu_s"]},
                {"batch": 2 * b, "step_s": control_step_s},
            ],
        },
        {"ssh": "fab2", "ranks": [1], "sweep": [{"batch": b, "step_s": one["cpu_s"]}]},
    ]
    sp = cal.speedup_model(
        {"batch_size": 2 * b, "grad_accumulation_steps": 1},
        2,
        hosts,
        {"grad_allreduce": {"cost_s": allsum_s}},
        [b, b],
    )
    return sp["expected_speedup"]


@dataclass
class Pair:
    """One pair's runs: the control at 2 x batch, the dual run, one rank's work alone (at batch)."""

    control: dict
    dual: dict
    one: dict


def measure(a, env: dict) -> list[Pair]:
    me = [
        str(Path(__file__).resolve()),
        "--rank",
        "--width",
        str(a.width),
        "--layers",
        str(a.layers),
        "--steps",
        str(a.steps),
    ]
    control = lambda b: run_json(["taskset", "-c", "0", PY, *me, "--batch", str(b)])  # noqa: E731
    dual_argv = [
        "nice",
        "-n",
        "19",
        str(Path(PY).parent / "mlx.launch"),
        "--backend",
        "ring",
        "--hostfile",
        env["HOSTFILE"],
        "--",
        env["PYTHON"],
        *me,
        "--batch",
        str(a.batch),
    ]
    return [
        Pair(control(2 * a.batch), run_json(dual_argv, env), control(a.batch))
        for _ in range(a.runs)
    ]


def report(a, pairs: list[Pair]) -> int:
    """Each pair's wall speedup and prediction error, reported with spreads (bench/gate.py)."""
    cal = load_calibrate()
    b, load = a.batch, [round(x, 2) for x in os.getloadavg()]
    speedup = tuple(
        p.control["step_s"] / p.dual["step_s"] for p in pairs
    )  # both steps: 2 x batch samples
    cpu_bound = [
        p.control["cpu_s"] / p.dual["cpu_s"] for p in pairs
    ]  # the same, each rank alone on its core
    exp = [predicted(cal, p.one, p.dual["allsum_s"], p.control["cpu_s"]) for p in pairs]
    best = min(pairs, key=lambda p: p.dual["cpu_s"])  # the least disturbed, for the detail
    on_cpu = best.dual["cpu_s"] / best.dual["step_s"]
    med = statistics.median
    emit(
        Gate("pinned_dual_speedup", "reported", 1.8, speedup),
        f"dual {2 * b / best.dual['step_s']:.1f} vs control {2 * b / best.control['step_s']:.1f} "
        "samples/s in the "
        "least disturbed pair, target >= 1.8, reported, not a gate here; its ranks on-CPU "
        f"{on_cpu:.0%} of their "
        "step: the rest is other load on this 2-core machine; on-CPU ratios "
        f"{' '.join(f'{x:.2f}' for x in cpu_bound)}; "
        f"MLP {a.layers}x{a.width}, batch {b}/rank, 2 pinned fabric hosts"
        f"{f', link {a.throttle_mbit:g} Mbit/s' if a.throttle_mbit else ''}; load {load}",
    )
    emit(
        Gate(
            "speedup_prediction_error",
            "reported",
            0.15,
            tuple(abs(e / c - 1) for e, c in zip(exp, cpu_bound, strict=True)),
        ),
        f"a pair's |calibrate's speedup_model / the on-CPU ratio - 1|: expected {med(exp):.2f}x vs "
        "on-CPU "
        f"{med(cpu_bound):.2f}x (medians), wall {med(speedup):.2f}x; one rank "
        f"{med(p.one['cpu_s'] for p in pairs):.3f} "
        f"CPU s at batch {b}, gradient all_sum {med(p.dual['allsum_s'] for p in pairs) * 1e3:.1f} "
        "ms; target <= 0.15, "
        "reported, not a gate here: the on-CPU ratio moves with the other load as a whole; load "
        f"{load}",
    )
    return 0


def main() -> int:
    a = build_parser().parse_args()
    if a.rank:
        return rank_main(a)
    d = ROOT / "runs" / f"fabric-bench-scaling-{os.getpid()}"
    try:
        fab = fabric_cli.up(d, f"bs{os.getpid() % 10**6}", 2, pin=True)
        for h in fab.state["hosts"] if a.throttle_mbit else []:
            subprocess.run(["tc", "qdisc", "add", "dev", h["veth"], "root", "tbf", "rate", f"{a.throttle_mbit}mbit",
                            "burst", "64kb", "latency", "500ms"], check=True, capture_output=True)
        env = fab.env()
        env["HOSTFILE"] = str(fab.hostfile(2))
        r = measure(a, env)
    except (RuntimeError, subprocess.SubprocessError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        fabric_cli.down(d)
    return report(a, r)


if __name__ == "__main__":
    sys.exit(main())
