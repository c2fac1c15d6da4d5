"""gate: a benchmark's figure from interleaved pairs, its spread, and whether it decides here.

Usage (in a bench script; bench/run_all.py reads the lines back and decides again):
    from gate import Gate, emit
    g = Gate("trainer_tok_per_s_ratio", ">=", 0.97, (1.01, 0.99, 1.05, 0.98))
    verdict = emit(g, "trainer 1043 vs mlx_lm lora 1030 tok/s")

Example of what emit prints:
    trainer_tok_per_s_ratio: 1 (trainer 1043 vs mlx_lm lora 1030 tok/s; spread [0.98, 1.05] of 4
        pairs, target >= 0.97: met)
    gate trainer_tok_per_s_ratio >= 0.97 pairs 1.01 0.99 1.05 0.98

A gated figure is measured as one sample per interleaved pair (A B, B A, ...; the ratio of the two
runs of the pair, or the pair's own figure against a fixed budget). Its value is the median of the
samples and its spread [min, max]. The gate decides only where the whole spread lies on one side of
the target, so that the machine's noise cannot flip the verdict:
    met        every pair meets the target
    missed     no pair meets it: a real regression, `make bench` exits 1
    undecided  the spread straddles the target, or there are fewer than MIN_PAIRS pairs: the noise
               here is wider than the margin; reported with the load it ran under, it fails nothing
Op "reported" carries a figure's spread and its target for the reader, and never gates.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

MIN_PAIRS = 3  # below this a spread bounds nothing (all of 3 pairs on one side by chance: 1 in 8)
OPS = (">=", "<=", "reported")
GATE_LINE = re.compile(r"^gate ([a-z][a-z0-9_]*) (>=|<=|reported) (\S+) pairs((?: \S+)+)\s*$")


@dataclass(frozen=True)
class Gate:
    """A figure's per-pair samples and its target (op ">=": at least, "<=": at most)."""

    name: str
    op: str
    target: float
    samples: tuple[float, ...]


@dataclass(frozen=True)
class Verdict:
    """What a gate decided: the median, the spread, and met / missed / undecided / reported."""

    name: str
    op: str
    target: float
    value: float
    spread: tuple[float, float]
    pairs: int
    outcome: str
    gated: bool

    def as_json(self) -> dict:
        return {
            "value": self.value,
            "spread": list(self.spread),
            "pairs": self.pairs,
            "gated": self.gated,
            "outcome": self.outcome,
            "op": self.op,
            "target": self.target,
        }

    def phrase(self) -> str:
        """In words: `spread [0.93, 1.08] of 4 pairs, target >= 0.97: undecided here (...)`."""
        lo, hi = self.spread
        head = f"spread [{lo:.4g}, {hi:.4g}] of {self.pairs} pairs"
        if self.op == "reported":
            return f"{head}, reported, not a gate"
        why = ""
        if self.outcome == "undecided":
            why = (
                f" (fewer than {MIN_PAIRS} pairs)"
                if self.pairs < MIN_PAIRS
                else " (the spread straddles it)"
            )
        here = " here" if self.outcome == "undecided" else ""
        return f"{head}, target {self.op} {self.target:g}: {self.outcome}{here}{why}"


def meets(op: str, target: float, x: float) -> bool:
    return x >= target if op == ">=" else x <= target


def decide(gate: Gate, min_pairs: int = MIN_PAIRS) -> Verdict:
    """met when every sample meets the target, missed when none does, else undecided."""
    if gate.op not in OPS:
        raise ValueError(f"gate {gate.name}: op {gate.op!r} is none of {OPS}")
    xs = [float(x) for x in gate.samples]
    if not xs or not all(math.isfinite(x) for x in xs):
        raise ValueError(f"gate {gate.name}: samples {xs} are empty or not finite")
    good = [meets(gate.op, gate.target, x) for x in xs]
    if gate.op == "reported":
        outcome = "reported"
    elif len(xs) < min_pairs:
        outcome = "undecided"
    elif all(good):
        outcome = "met"
    elif not any(good):
        outcome = "missed"
    else:
        outcome = "undecided"
    return Verdict(
        gate.name,
        gate.op,
        gate.target,
        statistics.median(xs),
        (min(xs), max(xs)),
        len(xs),
        outcome,
        outcome in ("met", "missed"),
    )


def gate_line(gate: Gate) -> str:
    samples = " ".join(f"{x:.6g}" for x in gate.samples)
    return f"gate {gate.name} {gate.op} {gate.target:g} pairs {samples}"


def parse(text: str) -> list[Gate]:
    """Every `gate NAME OP TARGET pairs X ...` line in a benchmark's output."""
    out = []
    for line in text.splitlines():
        m = GATE_LINE.match(line.strip())
        if m:
            samples = tuple(float(x) for x in m.group(4).split())
            out.append(Gate(m.group(1), m.group(2), float(m.group(3)), samples))
    return out


def emit(gate: Gate, detail: str) -> Verdict:
    """Print the figure's `name: value (detail; spread ...: outcome)` line and its gate line."""
    v = decide(gate)
    print(f"{gate.name}: {v.value:.4g} ({detail}; {v.phrase()})", flush=True)
    print(gate_line(gate), flush=True)
    return v


def missed(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.outcome == "missed"]
