#!/usr/bin/env python3
"""bench_loss: lib/loss.py's chunked LoRA loss against mlx-lm's default_loss at Gemma 4's vocabulary.

Usage:
    python bench/bench_loss.py [--model models/tiny-gemma4] [--vocab 262144] [--batch 4]
        [--tokens 128] [--chunk 64] [--runs 3] [--no-compile] [--max-memory-ratio 0.3]
        [--max-time-ratio 1.0] [--json OUT]

Example (what `make bench` runs):
    .venv/bin/python bench/bench_loss.py

The model is --model's config (tiny-gemma4: soft-capping, tied embeddings) with its vocabulary
and per-layer-input vocabulary widened to --vocab rows, random weights built in memory; LoRA
(rank 8) on every layer as mlx-lm applies it. One forward and backward (nn.value_and_grad,
compiled as mlx-lm's trainer compiles its step unless --no-compile) on one random batch of
--batch x (--tokens + 1) ids, all tokens unmasked. After a warm-up of each on one chunk's worth
of tokens (it compiles the same kernels), --runs pairs
alternate (default, chunked; chunked, default; ...) so load on the shared machine falls on
both alike. Peak memory is what one step adds to the resident model: mx.get_peak_memory() over the
step after mx.reset_peak_memory(), less mx.get_active_memory() before it (the weights, which both
losses share and which grow with the model's per-layer-input width, not with the loss); the peak
with the weights is printed too. Each ratio is a sample a pair (chunked over default_loss), printed
in run_all's `name: value (detail)` shape with its median, spread and verdict (bench/gate.py):
    loss_peak_memory_ratio: R (chunked A GB vs default_loss B GB ...; spread ..., <= 0.3: met)
    loss_step_time_ratio: R (chunked A s vs default_loss B s ...; spread ..., target <= 1: met)
and exits 1 when every pair misses a ratio's target (0.3x memory, 1.0x time: issue #19), 2 when
the two losses differ by more than 1e-4 relative.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.tuner.trainer import default_loss  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from lib import atomic  # noqa: E402
from lib import loss as L  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from gate import Gate, emit, missed  # noqa: E402  (bench/gate.py: samples, spread, verdict)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-gemma4", help="a model folder whose config.json is widened")
    p.add_argument("--vocab", type=int, default=262144, help="vocabulary rows (default: Gemma 4's 262144)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="tokens per sequence after the shift (default 128)")
    p.add_argument("--chunk", type=int, default=L.CHUNK_TOKENS, help="the chunked loss's loss_chunk_tokens")
    p.add_argument("--runs", type=int, default=3, help="pairs of measured steps (default 3)")
    p.add_argument("--no-compile", action="store_true", help="eager steps instead of mx.compile")
    p.add_argument("--max-memory-ratio", type=float, default=0.3)
    p.add_argument("--max-time-ratio", type=float, default=1.0)
    p.add_argument("--json", help="also write the numbers to this file")
    return p


def wide_model(folder: Path, vocab: int):
    """The folder's architecture with `vocab` embedding rows, random weights, LoRA on every layer."""
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = vocab
    if "vocab_size_per_layer_input" in config:
        config["vocab_size_per_layer_input"] = vocab
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    return model


def make_step(model, loss, compiled: bool):
    """One forward and backward; the gradients evaluated with the loss."""
    vg = nn.value_and_grad(model, loss)

    def step(batch, lengths):
        (value, ntoks), grad = vg(model, batch, lengths)
        return value, ntoks, grad

    return partial(mx.compile, inputs=model.state, outputs=model.state)(step) if compiled else step


def measure(step, batch, lengths) -> dict:
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()  # the model's weights and LoRA: the same for both losses
    t0, c0 = time.perf_counter(), time.process_time()
    value, ntoks, grad = step(batch, lengths)
    mx.eval(value, ntoks, grad)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"s": dt, "cpu_s": cpu, "peak": mx.get_peak_memory() - resident, "resident": resident,
            "loss": value.item(), "ntoks": ntoks.item()}


def main() -> int:
    args = build_parser().parse_args()
    folder = Path(args.model) if Path(args.model).is_absolute() else ROOT / args.model
    if not (folder / "config.json").is_file():
        print(f"error: {folder}/config.json not found: run `make tiny-model`", file=sys.stderr)
        return 2
    model = wide_model(folder, args.vocab)
    mx.random.seed(1)
    batch = mx.random.randint(0, args.vocab, (args.batch, args.tokens + 1))
    lengths = mx.array([[1, args.tokens]] * args.batch)  # mlx-lm's (offset, length): every token counts
    steps = {"default": make_step(model, default_loss, not args.no_compile),
             "chunked": make_step(model, L.make_loss(args.chunk), not args.no_compile)}
    load_start = [round(x, 2) for x in os.getloadavg()]
    runs = {name: [] for name in steps}
    n = max(1, args.chunk // args.batch)  # one chunk's worth of tokens
    for step in steps.values():  # warm-up: it compiles the same kernels
        measure(step, batch[:, : n + 1], mx.array([[1, n]] * args.batch))
    for i in range(args.runs):
        for name in (("default", "chunked") if i % 2 == 0 else ("chunked", "default")):
            runs[name].append(measure(steps[name], batch, lengths))
    return report(args, runs, load_start)


def report(args, runs: dict[str, list[dict]], load_start: list[float]) -> int:
    """The two ratios, a sample a pair (chunked over default_loss), with spreads (bench/gate.py)."""
    d, c = runs["default"], runs["chunked"]
    rel = abs(c[0]["loss"] - d[0]["loss"]) / abs(d[0]["loss"])
    med = statistics.median
    load_end = [round(x, 2) for x in os.getloadavg()]
    where = (
        f"{args.batch} x {args.tokens} tokens, vocab {args.vocab}, chunk {args.chunk}, "
        f"{'eager' if args.no_compile else 'compiled'}, load {load_start} -> {load_end}"
    )
    print(
        f"losses: default_loss {d[0]['loss']:.6f} chunked {c[0]['loss']:.6f} (relative {rel:.1e}), "
        f"ntoks {d[0]['ntoks']} {c[0]['ntoks']}; step s default {[round(r['s'], 2) for r in d]} "
        f"chunked {[round(r['s'], 2) for r in c]}"
    )
    if rel > 1e-4 or d[0]["ntoks"] != c[0]["ntoks"]:
        print(f"error: the two losses differ (relative {rel:.1e})", file=sys.stderr)
        return 2
    res = max(r["resident"] for r in d + c)
    peak_d, peak_c = med(r["peak"] for r in d), med(r["peak"] for r in c)
    verdicts = [
        emit(
            Gate(
                "loss_peak_memory_ratio",
                "<=",
                args.max_memory_ratio,
                tuple(x["peak"] / y["peak"] for x, y in zip(c, d, strict=True)),
            ),
            f"chunked {peak_c / 1e9:.3f} GB vs default_loss {peak_d / 1e9:.3f} GB over the weights "
            "(medians); "
            f"with the weights ({res / 1e9:.3f} GB) {(peak_c + res) / 1e9:.3f} vs "
            f"{(peak_d + res) / 1e9:.3f} GB; {where}",
        ),
        emit(
            Gate(
                "loss_step_time_ratio",
                "<=",
                args.max_time_ratio,
                tuple(x["s"] / y["s"] for x, y in zip(c, d, strict=True)),
            ),
            f"chunked {med(r['s'] for r in c):.2f} s vs default_loss {med(r['s'] for r in d):.2f} "
            "s (medians); "
            f"cpu {med(r['cpu_s'] for r in c):.2f} s vs {med(r['cpu_s'] for r in d):.2f} s; "
            f"{where}",
        ),
    ]
    if args.json:
        atomic.write_json(
            args.json,
            {v.name: v.as_json() for v in verdicts}
            | {
                "peak_bytes": {
                    "default": [r["peak"] for r in d],
                    "chunked": [r["peak"] for r in c],
                },
                "step_s": {"default": [r["s"] for r in d], "chunked": [r["s"] for r in c]},
                "cpu_s": {"default": [r["cpu_s"] for r in d], "chunked": [r["cpu_s"] for r in c]},
                "loss_relative_difference": rel,
                "setting": where,
            },
        )
    return 1 if missed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
