"""bench/gate.py and bench/run_all.py's verdict on synthetic per-pair samples: a figure whose
spread lies inside its target is met, one wholly outside is missed (make bench exits 1), one that
straddles it is undecided here and fails nothing. The verdict is computed again here by a simpler
path (a sorted list's ends against the target), as STYLE.md asks of a number that decides.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gate  # noqa: E402  (bench/gate.py)
import run_all  # noqa: E402  (bench/run_all.py)

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py): nothing shared, no fabric

# (op, target, per-pair samples, outcome): inside, outside and straddling each kind of target.
CASES = [
    (">=", 0.97, (1.01, 0.99, 1.05, 0.98), "met"),
    (">=", 0.97, (0.74, 0.79, 0.71), "missed"),
    (">=", 0.97, (0.93, 1.02, 0.99, 1.08), "undecided"),
    ("<=", 0.15, (0.02, 0.05, 0.11), "met"),
    ("<=", 0.15, (0.21, 0.31, 0.57), "missed"),
    ("<=", 0.15, (0.03, 0.41, 0.11), "undecided"),
]


def by_hand(op: str, target: float, samples: tuple[float, ...]) -> str:
    """The same verdict by another path: the sorted samples' ends against the target."""
    lo, hi = sorted(samples)[0], sorted(samples)[-1]
    good_end, bad_end = (lo, hi) if op == ">=" else (-hi, -lo)
    bound = target if op == ">=" else -target
    if good_end >= bound:
        return "met"
    if bad_end < bound:
        return "missed"
    return "undecided"


@pytest.mark.parametrize(("op", "target", "samples", "outcome"), CASES)
def test_inside_outside_and_straddling(op, target, samples, outcome):
    v = gate.decide(gate.Gate("ratio", op, target, samples))
    assert v.outcome == outcome == by_hand(op, target, samples)
    assert v.gated == (outcome != "undecided")
    s, n = sorted(samples), len(samples)
    assert v.value == pytest.approx((s[(n - 1) // 2] + s[n // 2]) / 2)
    assert v.spread == (min(samples), max(samples))
    assert v.pairs == len(samples)


def test_a_target_exactly_on_a_sample_counts_as_met():
    assert gate.decide(gate.Gate("r", ">=", 1.0, (1.0, 1.2, 1.1))).outcome == "met"
    assert gate.decide(gate.Gate("r", "<=", 1.0, (1.0, 0.8, 0.9))).outcome == "met"


def test_fewer_than_three_pairs_decide_nothing():
    """One or two pairs bound nothing: a clear miss from two pairs is still undecided here."""
    v = gate.decide(gate.Gate("r", ">=", 0.97, (0.5, 0.6)))
    assert (v.outcome, v.gated) == ("undecided", False)
    assert "fewer than 3 pairs" in v.phrase()


def test_reported_figures_carry_a_spread_and_never_gate():
    v = gate.decide(gate.Gate("speedup", "reported", 1.8, (0.6, 1.2, 0.9)))
    assert (v.outcome, v.gated, v.spread) == ("reported", False, (0.6, 1.2))


def test_bad_samples_are_refused():
    with pytest.raises(ValueError, match="not finite"):
        gate.decide(gate.Gate("r", ">=", 1.0, (1.0, float("nan"), 1.1)))
    with pytest.raises(ValueError, match="op"):
        gate.decide(gate.Gate("r", ">", 1.0, (1.0, 1.1, 1.2)))


def test_the_gate_line_round_trips():
    g = gate.Gate("trainer_tok_per_s_ratio", ">=", 0.97, (1.01234567, 0.99, 1.05))
    (back,) = gate.parse(f"noise\n{gate.gate_line(g)}\nmore: 1 (x)\n")
    assert back.name == g.name and back.op == g.op and back.target == g.target
    assert back.samples == pytest.approx(g.samples, rel=1e-5)


def bench_output(samples: tuple[float, ...]) -> str:
    """What a bench script prints for one gated figure (gate.emit's two lines), captured."""
    g = gate.Gate("trainer_tok_per_s_ratio", ">=", 0.97, samples)
    v = gate.decide(g)
    return (
        f"trainer_tok_per_s: 1000.0 (median)\n"
        f"{g.name}: {v.value:.4g} (trainer vs mlx_lm lora; {v.phrase()})\n{gate.gate_line(g)}\n"
    )


def row(samples: tuple[float, ...], code: int = 0) -> dict:
    """A run_all row as run_external builds it from a benchmark's output."""
    out = bench_output(samples)
    metrics = run_all.parse_metrics(out)
    verdicts = run_all.attach_gates(metrics, out)
    status = "target missed" if code == 1 or gate.missed(verdicts) else "ok"
    return {
        "name": "trainer",
        "status": status,
        "metrics": metrics,
        "error": "",
        "load_start": [1.0, 1.0, 1.0],
        "load_end": [1.2, 1.1, 1.0],
        "wall_s": 1.0,
    }


@pytest.mark.parametrize(
    ("samples", "code", "gated", "words"),
    [
        ((1.01, 0.99, 1.05), 0, True, "1 gated figures met; undecided here: none"),
        ((0.74, 0.79, 0.71), 1, True, "a decidable target missed: trainer_tok_per_s_ratio 0.74"),
        (
            (0.93, 1.02, 0.99),
            0,
            False,
            "undecided here: trainer_tok_per_s_ratio [0.93, 1.02] vs >= 0.97",
        ),
    ],
)
def test_run_all_exit_code_and_last_line(samples, code, gated, words):
    b = row(samples)
    (m,) = [r for r in b["metrics"] if r["name"] == "trainer_tok_per_s_ratio"]
    assert m["value"] == pytest.approx(sorted(samples)[1])
    assert m["spread"] == [min(samples), max(samples)] and m["pairs"] == 3
    assert m["gated"] is gated
    assert "spread" not in m["detail"], (
        "the verdict's phrase stays out of the summary's detail column"
    )
    got, last = run_all.verdict([b], quick=False)
    assert (got, words in last) == (code, True), last
    assert last.startswith(f"bench: exit {code}, ")


def test_a_failed_or_skipped_row_is_exit_2_and_says_which():
    ok = row((1.01, 0.99, 1.05))
    skipped = {
        "name": "smoke",
        "status": "skipped",
        "metrics": [],
        "load_start": [0, 0, 0],
        "error": "would not finish before the 870 s deadline",
    }
    code, last = run_all.verdict([ok, row((0.7, 0.7, 0.7)), skipped], quick=False)
    assert code == 2 and "smoke skipped: would not finish before the 870 s deadline" in last, last


def test_the_summary_shows_the_spread_beside_the_value():
    doc = {
        "command": "make bench",
        "started": "now",
        "wall_s": 1.0,
        "load_start": [1, 1, 1],
        "load_end": [1, 1, 1],
        "verdict": "bench: exit 0, ...",
        "benchmarks": [row((0.93, 1.02, 0.99))],
        "machine": {
            "uname": "Linux",
            "cpus": 2,
            "memory_gib": 1,
            "python": "3",
            "mlx": "0",
            "mlx_lm": "0",
        },
    }
    md = run_all.summary_md(doc)
    (line,) = [ln for ln in md.splitlines() if "`trainer_tok_per_s_ratio`" in ln]
    assert (
        "| 0.99 | [0.93, 1.02] (3) | undecided here (load 1.0 1.0 1.0 -> 1.2 1.1 1.0) |" in line
    ), line


def test_bench_scripts_print_what_run_all_reads():
    """gate.emit's lines, printed by a child process, come back through run_all's parsers."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); import gate; "
        "gate.emit(gate.Gate('sync_noop_s', '<=', 1.0, (0.6, 0.7, 0.65)), 'no-op re-sync')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    metrics = run_all.parse_metrics(out)
    (v,) = run_all.attach_gates(metrics, out)
    (m,) = metrics
    assert (v.outcome, m["name"], m["detail"]) == ("met", "sync_noop_s", "no-op re-sync")
    assert json.loads(json.dumps(m))["spread"] == [0.6, 0.7]
