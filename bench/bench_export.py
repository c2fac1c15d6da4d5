#!/usr/bin/env python3
"""bench_export: the exporter's wall time and peak RSS against a bare json.loads pass.

Usage:
    python bench/bench_export.py [--records N] [--corpus PATH] [--keep] [--generate-only]
                                 [--target-ratio 3.5] [--max-rss-mb 300] [--repeat N] [--json OUT]

Example:
    .venv/bin/python bench/bench_export.py                    # 1,000,000 records, ~500 MB
    .venv/bin/python bench/bench_export.py --records 100000   # a quick run

Generates a corpus (a mix of every input shape, ~500 bytes a record, 1% exact duplicates
and 0.04% bad lines, which stays under the default reject threshold) into a temp folder
(or --corpus PATH, reused when it already holds --records lines), then runs, each as its
own child process (wall clock, CPU and peak RSS from wait4):
  1. the baseline: `for line in f: json.loads(line)` over the same file, in this run;
  2. bin/export.py on it into a fresh temp folder (an existing one would be a no-op).
--repeat pairs (baseline, export) run one after the other. Prints `export_wall_s: X (ratio Y
vs json.loads pass Z s)` for the fastest of each, then, with their medians, spreads and verdicts
(bench/gate.py), `export_peak_rss_mb` (a sample a pair) and `export_wall_ratio` (each pair's
export over its baseline); exits 1 when every export's RSS is over --max-rss-mb (issue #15's P3:
300 MB), 2 when the export itself fails. The ratio's target (--target-ratio, P3's 3.5x) is
reported, not a gate: the exporter is one process on purpose (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gate import Gate, emit, missed  # noqa: E402  (bench/gate.py: samples, spread, verdict)

BASELINE = (
    "import json, sys\n"
    "with open(sys.argv[1], encoding='utf-8') as f:\n"
    "    for line in f:\n"
    "        try:\n"
    "            json.loads(line)\n"
    "        except ValueError:\n"
    "            pass\n"
)
WORDS = ("the a of to in is for on with as by at from that this it be are was an or which "
         "module function class object method value return type list dict string integer "
         "exception raise import loop iterator generator context manager attribute name "
         "scope closure decorator descriptor protocol buffer byte encoding unicode café "
         "naïve «quoted» \"escaped\" path\\sep tab\there").split(" ")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--corpus", help="write (or reuse) the generated corpus here")
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    p.add_argument("--generate-only", action="store_true", help="write the corpus and stop")
    p.add_argument("--target-ratio", type=float, default=3.5, help="reported, not a gate")
    p.add_argument("--max-rss-mb", type=float, default=300.0)
    p.add_argument("--json", help="also write the figures as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="measure both N times, interleaved, and keep the fastest of each "
                   "(steadier on a busy machine)")
    return p


def generate(path: Path, n: int, seed: int = 0) -> int:
    """Write n lines: records of every shape, ~1% exact duplicates, ~0.04% bad lines."""
    rng = random.Random(seed)
    pool = []
    for _ in range(4096):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 18))]
        pool.append(json.dumps(" ".join(words), ensure_ascii=False)[1:-1])
    sources = [f"bench/source-{k:02d}" for k in range(20)]
    weights = ["1.0", "0.5", "2", "1.25"]
    m = len(pool)
    lines: list[str] = []
    prev = ""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for i in range(n):
            a, b, c, d = pool[i % m], pool[(i * 7 + 1) % m], pool[(i * 13 + 5) % m], pool[(i * 31 + 11) % m]
            head = f'"record_id": "bench-{i:08d}", "weight": {weights[i % 4]}, "source": "{sources[i % 20]}"'
            k = i % 10
            if i % 2500 == 17:
                line = '{"record_id": "broken", "text": "unterminated'
            elif i % 2500 == 1234:
                line = ""
            elif i % 100 == 50 and prev:
                line = prev.replace(f"bench-{i - 1:08d}", f"bench-dup-{i:08d}")  # same content
            elif k < 4:
                line = f'{{{head}, "text": "{a} {b} ({i}) {c} {d} {a}"}}'
            elif k < 7:
                line = f'{{{head}, "prompt": "{a} {i}?", "response": "{b} {c} {d} {a}"}}'
            elif k < 9:
                line = (f'{{{head}, "messages": [{{"role": "system", "content": "{d}"}}, '
                        f'{{"role": "user", "content": "{a} #{i}"}}, '
                        f'{{"role": "assistant", "content": "{b} {c}"}}]}}')
            else:
                line = f'{{{head}, "instruction": "{a} {i}", "input": "{c}", "output": "{b} {d}"}}'
            lines.append(line)
            prev = line
            if len(lines) >= 4096:
                f.write("\n".join(lines) + "\n")
                lines.clear()
        if lines:
            f.write("\n".join(lines) + "\n")
    return n


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            n += block.count(b"\n")
    return n


def measure(cmd: list[str], log: Path) -> dict:
    """Wall seconds, CPU seconds, peak RSS (wait4) and exit code of a command; its output goes to log."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.stderr.write(log.read_text(errors="replace"))
    scale = 1 << 20 if sys.platform == "darwin" else 1 << 10  # ru_maxrss: bytes vs KiB
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "rss": ru.ru_maxrss / scale, "code": code}


def main() -> int:
    args = build_parser().parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_export."))
    try:
        corpus = Path(args.corpus) if args.corpus else work / "corpus.jsonl"
        if not (corpus.exists() and count_lines(corpus) == args.records):
            t0 = time.perf_counter()
            generate(corpus, args.records, args.seed)
            print(f"generated {corpus} records {args.records} "
                  f"mb {corpus.stat().st_size / 1e6:.1f} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        if args.generate_only:
            return 0
        size_mb = corpus.stat().st_size / 1e6
        py = sys.executable
        # Warm the page cache so neither measurement pays for the disk.
        count_lines(corpus)
        out = work / "dataset"
        cmd = [py, str(ROOT / "bin" / "export.py"), str(corpus), "--out", str(out)]
        pairs = []
        for _ in range(
            args.repeat
        ):  # interleaved pairs; the fastest of each is the least disturbed
            b = measure([py, "-c", BASELINE, str(corpus)], work / "baseline.log")
            if b["code"] != 0:
                print("bench_export: the baseline pass failed", file=sys.stderr)
                return 2
            shutil.rmtree(out, ignore_errors=True)
            e = measure(cmd, work / "export.log")
            if e["code"] != 0:
                print("bench_export: the export failed (output above)", file=sys.stderr)
                return 2
            pairs.append((b, e))
        base = min((b for b, _ in pairs), key=lambda r: r["wall"])
        exp = min((e for _, e in pairs), key=lambda r: r["wall"])
        counts = json.loads((out / "manifest.json").read_text())["counts"]
        base_s, exp_s, exp_rss = base["wall"], exp["wall"], exp["rss"]
        ratio = exp_s / base_s
        print(
            f"bench_export records {args.records} corpus_mb {size_mb:.1f} repeat {args.repeat} "
            f"exported {counts['exported']} rejected {counts['rejected']} "
            f"duplicates {counts['duplicates']} cpus {os.cpu_count()} "
            f"load {os.getloadavg()[0]:.1f}"
        )
        print(
            f"json_loads_wall_s: {base_s:.2f} (cpu {base['cpu']:.2f} s, peak rss {base['rss']:.0f} "
            "MB)"
        )
        print(
            f"export_wall_s: {exp_s:.2f} (ratio {ratio:.2f} vs json.loads pass {base_s:.2f} s; "
            f"target {args.target_ratio:g}, reported, not a gate; cpu {exp['cpu']:.2f} s)"
        )
        rss_mb = tuple(e["rss"] for _, e in pairs)
        rss = emit(
            Gate("export_peak_rss_mb", "<=", args.max_rss_mb, rss_mb),
            "one process; a sample a pair",
        )
        emit(
            Gate(
                "export_wall_ratio",
                "reported",
                args.target_ratio,
                tuple(e["wall"] / b["wall"] for b, e in pairs),
            ),
            f"export over the json.loads pass, a pair's; target {args.target_ratio:g}",
        )
        result = {
            "records": args.records,
            "corpus_mb": round(size_mb, 1),
            "json_loads_wall_s": round(base_s, 3),
            "export_wall_s": round(exp_s, 3),
            "ratio": round(ratio, 3),
            "export_peak_rss_mb": round(exp_rss, 1),
            "export_cpu_s": round(exp["cpu"], 2),
            "json_loads_cpu_s": round(base["cpu"], 2),
            "target_ratio": args.target_ratio,
            "max_rss_mb": args.max_rss_mb,
        }
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        ok = not missed([rss])
        print(f"bench_export {'OK' if ok else 'FAIL'}", flush=True)
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
