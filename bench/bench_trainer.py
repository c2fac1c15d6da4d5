#!/usr/bin/env python3
"""bench_trainer: bin/train.py's throughput against raw `mlx_lm lora`, and its checkpoint cost.

Usage:
    python bench/bench_trainer.py [--config configs/stage1.yaml] [--iters 30] [--runs 4]
        [--side-runs N] [--model models/tiny-gemma4] [--data datasets/NAME]
        [--hostfile hostfile.local.json]
        [--val-batches 2] [--test-batches 2] [--min-ratio 0.97] [--max-ckpt-pct 3.0]
        [--min-real 1.3] [--max-tracking 0.02] [--json OUT] [--keep]

Example (what `make bench` runs through bench/run_all.py):
    .venv/bin/python bench/bench_trainer.py --config configs/demo.yaml --iters 20 --runs 5 \\
        --side-runs 3 --data datasets/bench

Runs the same config, seed, data, model and ranks (mlx.launch --hostfile, ring backend)
through bin/train.py and through `mlx_lm lora`, --runs pairs of four runs whose order
alternates (T M L W, W L M T, ...: the two runs of each ratio side by side, so that load on
the machine falls on both alike): T the trainer on mlx-lm's batches (`batching: mlx_lm`), M raw
`mlx_lm lora`, L the trainer on its own batches (`batching: length`), W the trainer with
`report_to: wandb` (WANDB_MODE=offline: nothing leaves the machine); L and W only in the first
--side-runs pairs, the pairs after them T M or M T: L's and W's figures have margins a few
pairs bound, T's ratio to M has none to spare. --val-batches and --test-batches go to all (they
only shorten the runs: validation and test are outside the measured steps). Throughput is what
each reports for its training steps (tokens / step time, validation and saving excluded, as
mlx-lm counts them), over every report window but the first (compilation); T and M see the same
tokens in the same order, so each window's tokens come from the trainer's metrics and each
tool's time is tokens / its reported tok/s. CPU seconds (the launch and its ranks, from
getrusage) are printed too. Also checks that T and M report the same losses (they are the same
run).
Each gated figure is one sample a pair, printed with its median, its spread [min, max] and its
verdict (bench/gate.py: met, missed, or undecided here when the spread straddles the target):
    trainer_tok_per_s_ratio: T's tok/s over M's                                (target >= 0.97)
    trainer_real_tokens_ratio: the records' tokens (no padding) per second of L over M's on the
        same steps (M's real tokens per window are T's, which trains its very batches) (>= 1.3)
    checkpoint_pct_of_train_wall: T's time per checkpoint (write, fsync, rename, manifest,
        prune, the adapter copy) over the training time of save_every steps at T's median step
        time, as a percentage: its share of the train wall at the config's cadence     (<= 3)
    tracking_overhead_ratio: W's training loop's time in W&B calls over its step time (the done
        event's tracking_s over the steps' step_s, the first step left out)           (<= 0.02)
    tracked_tok_per_s_ratio: W's tok/s over T's (it also counts wandb's own service process
        taking CPU from the ranks), reported, not a gate
Exits 1 when a gated figure is missed by every pair (the issues' targets), 2 when a run fails
or the losses disagree, else 0 (undecided figures fail nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gate import Gate, emit, missed  # noqa: E402  (bench/gate.py: samples, spread, verdict)

from lib import atomic  # noqa: E402
from lib import config as C  # noqa: E402
from lib.launch import run_launcher  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
LAUNCH = str(Path(PY).with_name("mlx.launch"))
ROW = re.compile(r"^\s*(\d+)\s+([0-9.]+) [▼▲]\s+([0-9,]+)\s+([0-9.]+)k\s*$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/stage1.yaml")
    p.add_argument("--iters", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--runs", type=int, default=4, help="runs of each tool, in alternating pairs (default 4)")
    p.add_argument("--side-runs", type=int, help="pairs that also run L and W (default: all)")
    p.add_argument("--val-batches", type=int, default=2, help="to both tools (default 2; -1 = the config's)")
    p.add_argument("--test-batches", type=int, default=2, help="to both tools (default 2; -1 = the config's)")
    p.add_argument("--model", default="models/tiny-gemma4")
    p.add_argument("--data", default="datasets/bench", help="an exported dataset (make bench exports datasets/bench)")
    p.add_argument("--hostfile", default="hostfile.local.json")
    p.add_argument("--min-ratio", type=float, default=0.97)
    p.add_argument("--max-ckpt-pct", type=float, default=3.0)
    p.add_argument("--min-real", type=float, default=1.3, help="batching: length's real tok/s over mlx-lm's")
    p.add_argument("--max-tracking", type=float, default=0.02, help="W&B's share of the step time")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    return p


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 65000:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def common(args) -> list[str]:
    out = ["--iters", str(args.iters)]
    if args.val_batches != -1:
        out += ["--val-batches", str(args.val_batches)]
    if args.test_batches != -1:
        out += ["--test-batches", str(args.test_batches)]
    return out


def launch(args, cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    argv = [LAUNCH, "--hostfile", args.hostfile, "--backend", "ring", "--starting-port", str(free_port_pair()),
            "--", PY, *cmd]
    t0, c0 = time.monotonic(), children_cpu()
    env = {**os.environ, "WANDB_MODE": "offline"}  # the tracked runs: never an upload from a benchmark
    p = run_launcher(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)  # as lib/launch's
    return p, time.monotonic() - t0, children_cpu() - c0


def run_trainer(args, cfg_path: str, run_dir: Path) -> dict:
    cmd = ["bin/train.py", "--config", cfg_path, "--model", args.model, "--data", args.data,
           "--run-dir", str(run_dir), *common(args)]
    p, wall, cpu = launch(args, cmd)
    fails = list(run_dir.glob("logs/rank-*.failure.json"))
    if p.returncode or fails or "done step" not in p.stdout:
        raise RuntimeError(f"trainer run failed: {[f.read_text() for f in fails]}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    evs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [e for e in evs if e["kind"] == "train"]
    ckpts = [e["seconds"] for e in evs if e["kind"] == "checkpoint"]
    steps = [e["step_s"] for e in evs if e["kind"] == "step"][1:]
    (done,) = [e for e in evs if e["kind"] == "done"]
    return {"windows": {e["step"]: (e["loss"], e["tokens"], e["tok_per_s"]) for e in trains}, "wall_s": wall,
            "cpu_s": cpu, "checkpoint_s": statistics.median(ckpts), "checkpoints": len(ckpts),
            "step_s": statistics.median(steps), "steps_s": sum(steps), "tracking_s": done.get("tracking_s"),
            "real": real_by_window(evs, sorted(e["step"] for e in trains)),
            "train_s": {e["step"]: e["train_s"] for e in trains},
            "padding_fraction": done.get("padding_fraction")}


def real_by_window(evs: list, ends: list[int]) -> dict[int, int]:
    """The records' tokens (no padding) trained in each report window, from the step events."""
    real = {end: 0 for end in ends}
    for e in evs:
        if e["kind"] == "step":
            end = next(x for x in ends if x >= e["step"])
            real[end] += e["real_tokens"]
    return real


def real_throughput(real: dict[int, int], seconds: dict[int, float]) -> float:
    """Real tokens per second over every report window but the first (compilation)."""
    windows = sorted(real)[1:]
    return sum(real[s] for s in windows) / sum(seconds[s] for s in windows)


def run_mlx_lm(args, cfg_path: str, adapter_dir: Path) -> dict:
    cmd = ["-m", "mlx_lm", "lora", "-c", cfg_path, "--train", "--model", args.model, "--data", args.data,
           "--adapter-path", str(adapter_dir), *common(args)]
    p, wall, cpu = launch(args, cmd)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout)
    rows = {int(m.group(1)): (float(m.group(2)), float(m.group(3).replace(",", "")))
            for m in map(ROW.match, plain.splitlines()) if m}
    if p.returncode or not rows or "Node with rank" in p.stderr and "exited with code" in p.stderr:
        raise RuntimeError(f"mlx_lm lora failed\n{plain[-3000:]}\n{p.stderr[-3000:]}")
    return {"windows": rows, "wall_s": wall, "cpu_s": cpu}


def throughput(windows_tokens: dict[int, int], tps: dict[int, float]) -> float:
    steps = sorted(windows_tokens)[1:]  # the first window pays for compilation
    tokens = sum(windows_tokens[s] for s in steps)
    seconds = sum(windows_tokens[s] / tps[s] for s in steps)
    return tokens / seconds


@dataclass
class Runs:
    """Each tool's runs, one a pair: T (trainer), M (mlx_lm lora), L (length batches), W (wandb)."""

    trainer: list = field(default_factory=list)
    mlx_lm: list = field(default_factory=list)
    length: list = field(default_factory=list)
    tracked: list = field(default_factory=list)


def write_configs(args, work: Path) -> dict[str, Path]:
    """Each tool's config: all with mlx-lm's maths and chat format, T and M on mlx-lm's batches."""
    from mlx_lm.utils import load_tokenizer

    # Both with mlx-lm's maths (the mean of the ranks' mean losses): a config's `grad_average:
    # tokens` weighs the ranks by their tokens, which mlx-lm does not, and the reported losses would
    # differ. And both in the one chat format raw `mlx_lm lora` renders (it takes no
    # chat_template_args): its default, thinking on exactly when the tokenizer has a thinking mode.
    thinking = str(load_tokenizer(Path(args.model)).has_thinking).lower()
    # Neither tracks (raw mlx_lm lora would start its own W&B callback); W does.
    # And mlx-lm's batches and masks (`batching: mlx_lm`): the P1 ratio compares the same work.
    mine = (
        "grad_average|chat_template_args|report_to|project_name|batching|record_weights|mask_prompt"
    )
    base = re.sub(rf"(?m)^({mine}):.*$", "", (ROOT / args.config).read_text())
    base += f"\ngrad_average: mlx_lm\nchat_template_args: {{enable_thinking: {thinking}}}\n"
    texts = {
        "trainer": base + "batching: mlx_lm\n",
        "mlx_lm": base + "batching: mlx_lm\n",
        "tracked": base + "batching: mlx_lm\nreport_to: wandb\n",
        # The trainer's own batches (`batching: length`), same config: the real-token throughput.
        "length": base + "batching: length\n",
    }
    paths = {}
    for tool, text in texts.items():
        paths[tool] = work / f"{tool}.yaml"
        paths[tool].write_text(text)
    return paths


def run_pairs(args, configs: dict[str, Path], work: Path) -> Runs:
    """--runs pairs, T M L W then W L M T: each ratio's two runs side by side; L and W in the first
    --side-runs pairs only."""
    runs = Runs()
    for i in range(args.runs):
        order = ("trainer", "mlx_lm", "length", "tracked")[: 4 if i < side_runs(args) else 2]
        for tool in order if i % 2 == 0 else order[::-1]:
            cfg, folder = str(configs[tool]), work / f"{tool}-{i}"
            one = (
                run_mlx_lm(args, cfg, folder)
                if tool == "mlx_lm"
                else run_trainer(args, cfg, folder)
            )
            getattr(runs, tool).append(one)
        t, m = runs.trainer[-1], runs.mlx_lm[-1]
        sides = (f", length {runs.length[-1]['wall_s']:.1f} s wall, tracked "
                 f"{runs.tracked[-1]['wall_s']:.1f} s wall" if i < side_runs(args) else "")
        print(
            f"pair {i + 1}/{args.runs}: trainer {t['wall_s']:.1f} s wall {t['cpu_s']:.1f} s cpu, "
            f"mlx_lm lora {m['wall_s']:.1f} s wall {m['cpu_s']:.1f} s cpu{sides}",
            flush=True,
        )
    return runs


def side_runs(args) -> int:
    """How many pairs also run L and W: --side-runs, at most --runs (unset: every pair)."""
    return args.runs if args.side_runs is None else min(args.side_runs, args.runs)


def check_runs(runs: Runs) -> float:
    """T and M train the same batches: their reported losses agree (the worst relative difference
    is returned), and every W tracked; else RuntimeError."""
    worst = 0.0
    for o, t in zip(runs.trainer, runs.mlx_lm, strict=True):
        if sorted(o["windows"]) != sorted(t["windows"]):
            raise RuntimeError(
                f"report steps differ: {sorted(o['windows'])} vs {sorted(t['windows'])}"
            )
        worst = max(
            worst,
            *(
                abs(o["windows"][s][0] - t["windows"][s][0]) / abs(t["windows"][s][0])
                for s in o["windows"]
            ),
        )
    if worst > 1e-3:
        raise RuntimeError(f"the two runs report different losses (worst relative {worst:.2e})")
    if any(w["tracking_s"] is None for w in runs.tracked):
        raise RuntimeError(
            "a run with report_to: wandb did not track (no tracking_s in its done event)"
        )
    return worst


@dataclass
class Samples:
    """One sample a pair of every figure."""

    trainer_tps: list
    mlx_lm_tps: list
    tracked_tps: list
    mlx_lm_real: list
    length_real: list
    ckpt_pct: list
    tracking: list


def samples(runs: Runs, save_every: int) -> Samples:
    """Each pair's figures. T and M see the same tokens a window: each one's time is tokens / its
    tok/s."""
    tok = {s: w[1] for s, w in runs.trainer[0]["windows"].items()}

    def tps(run: dict, column: int) -> float:
        return throughput(tok, {s: w[column] for s, w in run["windows"].items()})

    # Real tokens: M's per window are T's (the same batches: the losses agree), over M's own time
    # for the window; L's over its own training time.
    m_real = [
        real_throughput(o["real"], {s: tok[s] / w[1] for s, w in m["windows"].items()})
        for o, m in zip(runs.trainer, runs.mlx_lm, strict=True)
    ]
    pct = [
        100 * o["checkpoint_s"] / (o["checkpoint_s"] + save_every * o["step_s"])
        for o in runs.trainer
    ]
    return Samples(
        trainer_tps=[tps(o, 2) for o in runs.trainer],
        mlx_lm_tps=[tps(m, 1) for m in runs.mlx_lm],
        tracked_tps=[tps(w, 2) for w in runs.tracked],
        mlx_lm_real=m_real,
        length_real=[real_throughput(x["real"], x["train_s"]) for x in runs.length],
        ckpt_pct=pct,
        tracking=[w["tracking_s"] / w["steps_s"] for w in runs.tracked],
    )


def per_pair(a: list, b: list) -> tuple[float, ...]:
    return tuple(x / y for x, y in zip(a, b, strict=True))


def report(args, runs: Runs, s: Samples, save_every: int) -> list:
    """The medians, then each gated figure with its spread and verdict (bench/gate.py)."""
    med = statistics.median
    cpu = per_pair([o["cpu_s"] for o in runs.trainer], [m["cpu_s"] for m in runs.mlx_lm])
    wall = per_pair([o["wall_s"] for o in runs.trainer], [m["wall_s"] for m in runs.mlx_lm])
    tok_ratio = per_pair(s.trainer_tps, s.mlx_lm_tps)
    print(
        f"trainer_tok_per_s: {med(s.trainer_tps):.1f} (median; ratio {med(tok_ratio):.3f} vs "
        "mlx_lm lora)"
    )
    print(f"mlx_lm_lora_tok_per_s: {med(s.mlx_lm_tps):.1f} (median; ratio 1.000 vs itself)")
    print(
        f"trainer_cpu_s: {med(o['cpu_s'] for o in runs.trainer):.1f} (ratio {med(cpu):.3f} vs "
        "mlx_lm lora, "
        "launch + ranks, whole run)"
    )
    print(
        f"trainer_wall_s: {med(o['wall_s'] for o in runs.trainer):.1f} (ratio {med(wall):.3f} vs "
        "mlx_lm lora, "
        "process start to exit)"
    )
    load = [round(x, 2) for x in os.getloadavg()]
    gates = [
        (
            Gate("trainer_tok_per_s_ratio", ">=", args.min_ratio, tok_ratio),
            f"trainer {med(s.trainer_tps):.1f} vs mlx_lm lora {med(s.mlx_lm_tps):.1f} tok/s, "
            f"mlx-lm's batches; load {load}",
        ),
        (
            Gate(
                "trainer_real_tokens_ratio",
                ">=",
                args.min_real,
                per_pair(s.length_real, s.mlx_lm_real[: len(s.length_real)]),
            ),
            f"batching: length {med(s.length_real):.1f} real tok/s vs mlx_lm lora "
            f"{med(s.mlx_lm_real):.1f}; "
            f"padding_fraction {med(x['padding_fraction'] for x in runs.length):.3f}; load {load}",
        ),
        (
            Gate("checkpoint_pct_of_train_wall", "<=", args.max_ckpt_pct, tuple(s.ckpt_pct)),
            f"checkpoint {med(o['checkpoint_s'] for o in runs.trainer):.3f} s, step "
            f"{med(o['step_s'] for o in runs.trainer):.3f} s (medians), save_every {save_every}, "
            "percent",
        ),
        (
            Gate("tracking_overhead_ratio", "<=", args.max_tracking, tuple(s.tracking)),
            "W&B calls in the loop over the step time, report_to: wandb offline",
        ),
        (
            Gate(
                "tracked_tok_per_s_ratio",
                "reported",
                1.0,
                per_pair(s.tracked_tps, s.trainer_tps[: len(s.tracked_tps)]),
            ),
            "tracked tok/s over untracked, wandb's service process included",
        ),
    ]
    return [emit(g, detail) for g, detail in gates]


def write_json(args, runs: Runs, s: Samples, verdicts: list) -> None:
    atomic.write_json(
        args.json,
        {
            "trainer_tok_per_s": s.trainer_tps,
            "mlx_lm_lora_tok_per_s": s.mlx_lm_tps,
            "length_real_tok_per_s": s.length_real,
            "mlx_lm_real_tok_per_s": s.mlx_lm_real,
            "checkpoint_pct_of_train_wall": s.ckpt_pct,
            "tracking": s.tracking,
            "padding_fraction": [x["padding_fraction"] for x in runs.length],
            "verdicts": {v.name: v.as_json() for v in verdicts},
            "runs": args.runs,
            "iters": args.iters,
            "config": args.config,
        },
    )


def main() -> int:
    args = build_parser().parse_args()
    cfg = C.resolve(args.config, {"model": args.model, "data": args.data, "iters": args.iters})
    if not (ROOT / args.model / "config.json").is_file() and not Path(args.model).is_dir():
        print(f"error: model {args.model} not found: run `make tiny-model`", file=sys.stderr)
        return 2
    if (
        not (ROOT / args.data / "train.jsonl").is_file()
        and not (Path(args.data) / "train.jsonl").is_file()
    ):
        print(f"error: dataset {args.data} not found: run `make export`", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-", dir=ROOT / "runs"))
    try:
        runs = run_pairs(args, write_configs(args, work), work)
        worst = check_runs(runs)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"config: {args.config} iters {args.iters} batch {cfg['batch_size']} save_every "
        f"{cfg['save_every']}, "
        f"ranks via {args.hostfile}, model {args.model}, data {args.data}; {args.runs} pairs; "
        f"losses agree (worst relative {worst:.1e})"
    )
    s = samples(runs, cfg["save_every"])
    verdicts = report(args, runs, s, cfg["save_every"])
    if args.json:
        write_json(args, runs, s, verdicts)
    return 1 if missed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
