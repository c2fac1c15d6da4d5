#!/usr/bin/env python3
"""run_all: every benchmark, at sizes that finish in under 15 minutes on a 2-core machine,
collected into bench/results.json and summarized in bench/README.md.

Usage:
    python bench/run_all.py [--only NAME,...] [--skip NAME,...] [--deadline-s 870] [--quick]
                            [--json bench/results.json] [--readme bench/README.md] [--no-readme]

Example (what `make bench` runs):
    .venv/bin/python bench/run_all.py
    .venv/bin/python bench/run_all.py --only scaling,loss
    make bench BENCH_ARGS=--quick     # every row once, smallest sizes (what make test types)

Benchmarks, in order (NAME: what runs):
    export        bench/bench_export.py --records 200000 --repeat 3
    check_parity  bench/bench_check_parity.py --runs 5          (its own 3-host fabric)
    sync          bench/bench_sync.py --mb 200 --reps 5          (its own 2-host fabric)
    trainer       bench/bench_trainer.py --config configs/demo.yaml --iters 20 --runs 5
                  --side-runs 3 --data datasets/bench
                  (bin/train.py vs raw `mlx_lm lora`, its real tokens, checkpoints and tracking)
    loss          bench/bench_loss.py --runs 3: chunked loss vs default_loss, peak memory and
                  step time
    scaling       bench/bench_scaling.py --runs 4: dual / control on 2 pinned fabric hosts and
                  calibrate's prediction of it (pinned_dual_speedup, speedup_prediction_error)
    shares        bench/bench_shares.py: one of 2 pinned fabric hosts at half a core, calibrated, then
                  trained with even shares and `rank_shares: auto` (uneven_shares_speedup)
    smoke         `make smoke` on 2 fabric hosts: wall clock against its two trainer launches
First it builds what they run on with the operator's own targets (`make tiny-model sample-corpus`,
`make export CORPUS=datasets/sample/corpus.jsonl DATASET=bench`), so it works from a fresh clone.
smoke runs on a 3-host fabric this script brings up (runs/fabric-bench-all-<pid>) and
takes down. Each benchmark prints `name: value (detail)` lines, and for each gated figure a
`gate NAME OP TARGET pairs X ...` line with one sample per interleaved pair (bench/gate.py);
they are collected with the command, exit status, wall time and the load average before and
after, and each gate is decided again here: met (every pair meets the target), missed (none
does), or undecided here (the spread straddles the target, or fewer than 3 pairs), which fails
nothing. A benchmark that would not finish before --deadline-s (default 870 s from the start)
is skipped and says so. Writes bench/results.json (git-ignored; each gated figure with value,
the median of its samples, spread [min, max], pairs and gated) and rewrites the summary between
the markers in bench/README.md with the command and the machine (uname, cores, memory, Python,
mlx). Exit 0 when every benchmark ran and no decidable target was missed, 1 when one was, 2 when
a benchmark failed or was skipped (--quick: 0 when every row ran, whatever its figures); the
last line says which of the three and why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import fabric_cli  # noqa: E402  (bench/fabric_cli.py: the fabric through its CLI)
import gate  # noqa: E402  (bench/gate.py: per-pair samples, spread, verdict)

from lib import atomic  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
MODEL = "models/tiny-gemma4"
# The benchmarks' own dataset: the sample corpus exported by `make export`, never the operator's DATASET.
DATASET = "bench"
CORPUS = "datasets/sample/corpus.jsonl"
LINE = re.compile(r"^([a-z][a-z0-9_]*): (-?[0-9][0-9.e+-]*)(?: \((.*)\))?\s*$")
BEGIN, END = "<!-- bench-summary:begin -->", "<!-- bench-summary:end -->"

EXTERNAL = [
    # (name, the full run, the quick run, seconds budgeted for the full run: what it takes at load
    # 3, about 1.3x an idle machine's; a row is skipped when its budget would end past the
    # deadline). Each gated figure is one sample per pair, the measured command and its baseline
    # interleaved: a single pair on this shared 2-core machine swings by more than the targets'
    # margins, and the spread of the pairs says whether a gate can be decided here (bench/gate.py).
    # --quick runs each row end to end once, at its smallest sizes: it proves the row works; its
    # figures are not the summary's.
    ("export", ["bench/bench_export.py", "--records", "200000", "--repeat", "3"],
     ["bench/bench_export.py", "--records", "2000"], 60),
    ("check_parity", ["bench/bench_check_parity.py", "--runs", "5"],
     ["bench/bench_check_parity.py", "--runs", "1"], 60),
    ("sync", ["bench/bench_sync.py", "--mb", "200", "--reps", "5"],
     ["bench/bench_sync.py", "--mb", "4", "--reps", "1"], 90),
    ("trainer", ["bench/bench_trainer.py", "--config", "configs/demo.yaml", "--iters", "20",
                 "--runs", "5", "--side-runs", "3", "--data", f"datasets/{DATASET}"],
     ["bench/bench_trainer.py", "--config", "configs/demo.yaml", "--iters", "10", "--runs", "1",
      "--data", f"datasets/{DATASET}"], 420),
    ("loss", ["bench/bench_loss.py", "--runs", "3"],
     ["bench/bench_loss.py", "--vocab", "16384", "--runs", "1"], 160),
    # its own 2-host pinned fabric
    ("scaling", ["bench/bench_scaling.py", "--runs", "4"],
     ["bench/bench_scaling.py", "--runs", "1"], 90),
    # its own 2-host pinned fabric, fab2 at half a core: calibrate, then train with even and auto
    # shares
    ("shares", ["bench/bench_shares.py"],
     ["bench/bench_shares.py", "--batch", "8", "--iters", "4", "--budget-s", "5", "--steps", "2"],
     200),
]
FABRIC = [("smoke", 90)]
NAMES = [n for n, *_ in EXTERNAL] + [n for n, _ in FABRIC]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    p.add_argument("--deadline-s", type=float, default=870.0, help="skip what would end after this (default 870)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results.json"))
    p.add_argument("--readme", default=str(ROOT / "bench" / "README.md"))
    p.add_argument("--no-readme", action="store_true", help="do not rewrite the README summary")
    p.add_argument("--quick", action="store_true",
                   help="every row once at its smallest sizes (the preparation too); writes "
                        "bench/results-quick.json and leaves the README summary alone")
    return p


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    u = platform.uname()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    vers = subprocess.run([PY, "-c", "import mlx.core as mx, mlx_lm, platform; "
                           "print(mx.__version__, mlx_lm.__version__, platform.python_version())"],
                          capture_output=True, text=True).stdout.split()
    return {"uname": f"{u.system} {u.release} {u.machine}", "node": u.node, "cpus": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1) if mem else None,
            "python": vers[2] if len(vers) == 3 else platform.python_version(),
            "mlx": vers[0] if vers else None, "mlx_lm": vers[1] if len(vers) > 1 else None}


def parse_metrics(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            out.append({"name": m.group(1), "value": float(m.group(2)), "detail": m.group(3) or ""})
    return out


def emit(name: str, value: float, detail: str) -> str:
    line = f"{name}: {value:.4g} ({detail})"
    print(line, flush=True)
    return line


def attach_gates(metrics: list[dict], text: str) -> list[gate.Verdict]:
    """Each `gate NAME ...` line decided again (bench/gate.py) and put on its metric: value (the
    median of the per-pair samples), spread, pairs, gated, outcome, op and target."""
    verdicts = [gate.decide(g) for g in gate.parse(text)]
    by_name = {m["name"]: m for m in metrics}
    for v in verdicts:
        if v.name not in by_name:
            by_name[v.name] = {"name": v.name, "value": v.value, "detail": ""}
            metrics.append(by_name[v.name])
        m = by_name[v.name]
        m["detail"] = m["detail"].removesuffix(f"; {v.phrase()}")
        m.update(v.as_json())
    return verdicts


def run_external(name: str, argv: list[str], timeout: float) -> dict:
    cmd = [PY, *argv]
    t0 = time.monotonic()
    ld = load()
    print(f"\n=== {name}: {shlex.join(['python', *argv])} (load {ld})", flush=True)
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        code, out, err = p.returncode, p.stdout, p.stderr
        status = {0: "ok", 1: "target missed"}.get(code, "error")
    except subprocess.TimeoutExpired as e:
        code, status = None, "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = f"timed out after {timeout:g} s"
    sys.stdout.write(out)
    metrics = parse_metrics(out)
    if status in ("ok", "target missed") and not metrics:
        status, err = (
            "error",
            f"exit {code} but no `name: value` line: the benchmark measured nothing\n{err}",
        )
    try:
        verdicts = attach_gates(metrics, out) if status in ("ok", "target missed") else []
    except ValueError as e:
        status, err, verdicts = "error", f"a gate line does not parse: {e}\n{err}", []
    if status == "ok" and gate.missed(verdicts):  # decided again here, whatever the exit code
        status = "target missed"
    if status != "ok":
        sys.stdout.write(err[-3000:])
    why = err.strip()[-600:] if status != "ok" else ""
    return {
        "name": name,
        "command": shlex.join(["python", *argv]),
        "exit_code": code,
        "status": status,
        "wall_s": round(time.monotonic() - t0, 2),
        "load_start": ld,
        "load_end": load(),
        "metrics": metrics,
        "error": why,
    }


# ---- the fabric benchmarks --------------------------------------------------------------------
class FabricBench:
    """One 3-host fabric for smoke (tests/fabric.py's CLI); down at the end, whatever happened."""

    def __init__(self):
        self.dir = ROOT / "runs" / f"fabric-bench-all-{os.getpid()}"
        self.fab = None
        self.made: list[Path] = []

    def up(self) -> None:
        self.fab = fabric_cli.up(self.dir, f"ba{os.getpid() % 10**6}", 3)
        self.env = self.fab.env()
        hf = self.fab.hostfile(3)
        p = subprocess.run([PY, "bin/sync.py", "--hostfile", str(hf), "--remote-root", self.fab.remote_root,
                            "--dataset", DATASET, "--model", MODEL], cwd=ROOT, env=self.env, capture_output=True,
                           text=True, timeout=300)
        if p.returncode:
            raise RuntimeError(f"sync to the bench fabric failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")

    def down(self) -> None:
        for d in self.made:
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
        fabric_cli.down(self.dir)  # warns, never hides the benchmark results behind a teardown error

    def smoke(self) -> list[str]:
        run = f"bench-smoke-{os.getpid()}"
        hf = self.fab.hostfile(2)
        self.made += [ROOT / "runs" / run, ROOT / ".stamps" / f"smoke.{run}"]
        argv = ["make", "--no-print-directory", "smoke", f"RUN={run}", f"HOSTFILE={hf}",
                f"REMOTE_ROOT={self.fab.remote_root}", f"PYTHON={self.fab.python}", f"MODEL={MODEL}",
                f"DATASET={DATASET}", "SETTINGS=/dev/null"]
        t0 = time.monotonic()
        p = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - t0
        if p.returncode:
            raise RuntimeError(f"make smoke failed:\n{p.stdout[-2500:]}\n{p.stderr[-1500:]}")
        summary = json.loads((ROOT / "runs" / run / "smoke.json").read_text())
        launches = sum(x["wall_s"] for x in summary["launches"])
        return [emit("smoke_wall_s", wall, f"ratio {wall / launches:.2f} vs its two trainer launches {launches:.1f} s; "
                     "the rest is sync, check-parity, manifest, sweep, fetch and the criteria; 2 fabric hosts")]


def run_fabric(names: list[str], deadline: float) -> list[dict]:
    out = []
    fb = FabricBench()
    try:
        t0 = time.monotonic()
        print(f"\n=== fabric: up 3 hosts, sync code + dataset + model (load {load()})", flush=True)
        fb.up()
        print(f"fabric ready in {time.monotonic() - t0:.1f} s", flush=True)
        for name in names:
            budget = dict(FABRIC)[name]
            cmd = {"smoke": "make smoke (2 fabric hosts)"}[name]
            entry = {"name": name, "command": cmd, "exit_code": None, "load_start": load(), "metrics": [], "error": ""}
            if time.monotonic() + budget > deadline:
                entry.update(status="skipped", wall_s=0, load_end=load(),
                             error=f"would not finish before the {deadline - START:.0f} s deadline")
                print(f"\n=== {name}: skipped ({entry['error']})", flush=True)
                out.append(entry)
                continue
            print(f"\n=== {name}: {cmd} (load {entry['load_start']})", flush=True)
            t1 = time.monotonic()
            try:
                lines = getattr(fb, name)()
                entry.update(status="ok", exit_code=0, metrics=parse_metrics("\n".join(lines)))
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                entry.update(status="error", exit_code=2, error=str(e)[-1500:])
                print(f"{name}: error: {str(e)[-1500:]}", flush=True)
            entry.update(wall_s=round(time.monotonic() - t1, 2), load_end=load())
            out.append(entry)
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        done = {e_["name"] for e_ in out}
        out += [{"name": n, "command": "", "exit_code": None, "status": "error", "wall_s": 0, "metrics": [],
                 "load_start": load(), "load_end": load(), "error": f"fabric: {e}"[-1500:]} for n in names if n not in done]
    finally:
        fb.down()
    return out


# ---- the summary -----------------------------------------------------------------------------
def spread_cell(r: dict) -> str:
    return f"[{r['spread'][0]:.4g}, {r['spread'][1]:.4g}] ({r['pairs']})" if "spread" in r else ""


def gate_cell(r: dict, b: dict) -> str:
    """met / missed / reported, or undecided here with the load the row ran under."""
    if r.get("outcome") != "undecided":
        return r.get("outcome", "")
    ld = lambda x: " ".join(map(str, x))  # noqa: E731
    return f"undecided here (load {ld(b['load_start'])} -> {ld(b['load_end'])})"


def summary_md(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        BEGIN,
        "",
        f"Last run: `{doc['command']}` at {doc['started']}, {doc['wall_s']:.0f} s in all "
        f"(budget 900 s), load average {doc['load_start']} at the start and {doc['load_end']} at "
        f"the end; it ended `{doc['verdict']}`.",
        f"Machine: {m['uname']}, {m['cpus']} cores, {m['memory_gib']} GiB, Python {m['python']}, "
        f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}.",
        "",
        "A value with a spread is the median of one sample a pair; the spread is [min, max].",
        "",
        "| benchmark | status | wall s | load at start | metric | value | spread (pairs) | gate | "
        "against the baseline |",
        "| --- | --- | ---: | --- | --- | ---: | --- | --- | --- |",
    ]
    for b in doc["benchmarks"]:
        rows = b["metrics"] or [
            {"name": "-", "value": None, "detail": b.get("error", "")[:160].replace("\n", " ")}
        ]
        for i, r in enumerate(rows):
            head = (
                f"| {b['name']} | {b['status']} | {b['wall_s']:.0f} | "
                f"{' '.join(map(str, b['load_start']))} |"
                if i == 0
                else "| | | | |"
            )
            val = "-" if r["value"] is None else f"{r['value']:.4g}"
            detail = r["detail"].replace("|", "/")
            lines.append(
                f"{head} `{r['name']}` | {val} | {spread_cell(r)} | {gate_cell(r, b)} | {detail} |"
            )
    lines += ["", END]
    return "\n".join(lines)


def gated(results: list[dict], outcome: str) -> list[tuple[dict, dict]]:
    """(row, metric) of every figure whose gate came out as outcome."""
    return [(b, r) for b in results for r in b["metrics"] if r.get("outcome") == outcome]


def verdict(results: list[dict], quick: bool) -> tuple[int, str]:
    """The exit code and the last line: 2 a row failed or was skipped, 1 a decidable target
    missed, else 0."""
    failed = [b for b in results if b["status"] not in ("ok", "target missed")]
    if failed:
        why = "; ".join(
            f"{b['name']} {b['status']}: {(b['error'].strip().splitlines() or ['-'])[-1][:200]}"
            for b in failed
        )
        return 2, f"bench: exit 2, a row failed or was skipped: {why}"
    if quick:
        return 0, f"bench: exit 0, every row ran once ({len(results)}); --quick gates nothing"
    missed = [b for b in results if b["status"] == "target missed"]
    if missed:
        what = [
            f"{r['name']} {r['value']:.4g}, spread [{r['spread'][0]:.4g}, {r['spread'][1]:.4g}] of "
            f"{r['pairs']} pairs, every one past {r['op']} {r['target']:g} ({b['name']}, load "
            f"{b['load_start']})"
            for b, r in gated(missed, "missed")
        ]
        what += [
            f"{b['name']}: {(b['error'].strip().splitlines() or ['its own check'])[-1][:200]}"
            for b in missed
            if not any(r.get("outcome") == "missed" for r in b["metrics"])
        ]
        return 1, f"bench: exit 1, a decidable target missed: {'; '.join(what)}"
    met = gated(results, "met")
    undecided = [
        f"{r['name']} [{r['spread'][0]:.4g}, {r['spread'][1]:.4g}] vs {r['op']} {r['target']:g} "
        f"(load {b['load_start']})"
        for b, r in gated(results, "undecided")
    ]
    return 0, (
        f"bench: exit 0, every row ran ({len(results)}) and no decidable target missed: "
        f"{len(met)} gated figures met; undecided here: {'; '.join(undecided) or 'none'}"
    )


def update_readme(path: Path, doc: dict) -> None:
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    block = summary_md(doc)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## Summary\n\n" + block + "\n"
    atomic.write_text(path, text)


START = time.monotonic()


def prepare() -> bool:
    """What the benchmarks run on, built through the operator's own make targets: the tiny model
    and the sample corpus exported into the benchmarks' own dataset (a no-op when unchanged)."""
    steps = [["tiny-model", "sample-corpus", "ARCH=gemma4"],
             ["export", f"CORPUS={CORPUS}", f"DATASET={DATASET}", "REPLACE=1"]]
    for targets in steps:
        argv = ["make", "--no-print-directory", *targets, "SETTINGS=/dev/null"]
        print(f"bench: {shlex.join(argv)}", flush=True)
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode:
            print(f"error: `{shlex.join(argv)}` failed (exit {p.returncode}); the benchmarks need the tiny model "
                  f"and datasets/{DATASET}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}", file=sys.stderr)
            return False
    return True


def main() -> int:
    args = build_parser().parse_args()
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    bad = sorted(set(only + skip) - set(NAMES))
    if bad:
        names = ", ".join(NAMES)
        print(f"bench: exit 2, unknown benchmark(s) {bad}; choose from {names}", file=sys.stderr)
        return 2
    chosen = [n for n in NAMES if (not only or n in only) and n not in skip]
    if args.quick:
        args.no_readme = True
        if args.json == str(ROOT / "bench" / "results.json"):
            args.json = str(ROOT / "bench" / "results-quick.json")
    deadline = START + args.deadline_s
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    ld0 = load()
    print(f"bench: {', '.join(chosen)}; deadline {args.deadline_s:g} s; load {ld0}", flush=True)
    if not prepare():
        print("bench: exit 2, a row failed or was skipped: the preparation (make tiny-model "
              "sample-corpus, make export DATASET=bench) failed, so no row ran", flush=True)
        return 2
    results = []
    for name, full, quick, budget in EXTERNAL:
        if name not in chosen:
            continue
        argv = quick if args.quick else full
        if time.monotonic() + budget > deadline:
            results.append({"name": name, "command": shlex.join(["python", *argv]), "exit_code": None,
                            "status": "skipped", "wall_s": 0, "metrics": [], "load_start": load(), "load_end": load(),
                            "error": f"would not finish before the {args.deadline_s:g} s deadline"})
            print(f"\n=== {name}: skipped (deadline)", flush=True)
            continue
        results.append(run_external(name, argv, min(budget * 2, max(deadline - time.monotonic(), 30))))
    fab = [n for n, _ in FABRIC if n in chosen]
    if fab:
        results += run_fabric(fab, deadline)
    code, last = verdict(results, args.quick)
    doc = {
        "command": "make bench"
        if not (only or skip or args.quick)
        else shlex.join(["python", "bench/run_all.py", *sys.argv[1:]]),
        "started": started,
        "wall_s": round(time.monotonic() - START, 1),
        "load_start": ld0,
        "load_end": load(),
        "machine": machine(),
        "exit_code": code,
        "verdict": last,
        "benchmarks": results,
    }
    atomic.write_json(args.json, doc)
    if not args.no_readme:
        update_readme(Path(args.readme), doc)
    print(
        f"\nbench: {len(results)} benchmarks in {doc['wall_s']:.0f} s; "
        + ", ".join(f"{b['name']} {b['status']}" for b in results)
        + f"; wrote {os.path.relpath(args.json, ROOT)}",
        flush=True,
    )
    sys.stderr.flush()
    print(last, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
