#!/usr/bin/env python3
"""status: where a train/control run stands, from Mac1, while it runs and after; never touches it.

Usage:
    python bin/status.py --run RUN --remote-root DIR --python PY [--json] [--silent-s S]

Example (`make status RUN=stage1 JSON=1`, e.g. from cron):
    python bin/status.py --run stage1 --remote-root "$PWD" --python "$PWD/.venv/bin/python" --json

One ssh call to rank 0's host (the manifest's hostfile; BatchMode, timeouts) runs a small script:
the tail of metrics.jsonl, logs/rank-R.failure.json, checkpoints/latest. Per-rank last-step
times and tok/s come from this Mac's timestamped launch log (mlx.launch forwards every rank's
`iter N rank R` line); the verdict from runs/<RUN>/<stage>.json once the stage has ended.
Text starts `STATUS OK - ...`. Exit 0 OK, 1 WARNING (a rank silent for --silent-s), 2 CRITICAL
(failed), 3 UNKNOWN (rank 0's host unreachable and no local copy).
"""

from __future__ import annotations

import argparse
import calendar
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import paths  # noqa: E402
from lib.remote import run_on  # noqa: E402

STATUS = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}
RANK_LINE = re.compile(r"^(\S+Z) .*?iter (\d+) rank (\d+) .*?tokens (\d+) step_s (\S+)")
# Runs on rank 0's host with the run folder as argv[1]: one JSON object on stdout.
PROBE = r"""
import json, sys
from pathlib import Path
d = Path(sys.argv[1]); out = {"exists": d.is_dir(), "metrics": [], "failures": {}, "latest": None}
m = d / "metrics.jsonl"
for line in (m.read_bytes()[-65536:].decode(errors="replace") if m.is_file() else "").splitlines():
    try: out["metrics"].append(json.loads(line))
    except ValueError: pass
def load(p):
    try: return json.loads(p.read_text())
    except (OSError, ValueError): return {}
lid = load(d / "logs" / "rank-0.joined.json").get("launch_id")
for p in sorted((d / "logs").glob("rank-*.failure.json")):
    if (f := load(p)).get("launch_id") == lid: out["failures"][p.name.split(".")[0]] = f
lp = d / "checkpoints" / "latest"
out["latest"] = lp.read_text().strip() if lp.is_file() else None
print(json.dumps(out))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--run", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--silent-s", type=float, default=600.0, help="a running rank silent this long is a WARNING")
    return p


def probe(man: dict, args, run_rel: str) -> dict | None:
    """Rank 0's view of the run folder over ssh (None: unreachable or no answer within 5 s)."""
    hosts = (man.get("fallback") or {}).get("hosts") or [h["ssh"] for h in (man.get("hostfile") or {}).get("hosts", [])]
    r = hosts and run_on(hosts[0], ["sh", "-c", 'cd "$1" && exec "$2" - "$3"', "sh", args.remote_root, args.python, run_rel],
               timeout=5, input=PROBE)
    try:
        return json.loads(r.stdout) if r and r.ok else None
    except ValueError:
        return None


def ranks_from_log(log: Path, now: float) -> dict:
    """Per rank: last step, seconds since it, tok/s and median step time over its last 20 steps."""
    seen: dict[str, list] = {}
    for line in (log.read_bytes()[-262144:].decode(errors="replace") if log.is_file() else "").splitlines():
        if m := RANK_LINE.match(line):
            seen.setdefault(m[3], []).append((m[1], int(m[2]), int(m[4]), float(m[5])))
    out = {}
    for r, rows in sorted(seen.items()):
        tail, ago = rows[-20:], now - calendar.timegm(time.strptime(rows[-1][0], "%Y-%m-%dT%H:%M:%SZ"))
        secs = sum(x[3] for x in tail)
        out[r] = {"last_step": rows[-1][1], "since_s": round(ago, 1), "step_s": statistics.median(x[3] for x in tail),
                  "tok_per_s": round(sum(x[2] for x in tail) / secs, 1) if secs else None}
    return out


def gather(args) -> tuple[dict, int]:
    run_dir, run_rel, now = paths.RUNS / args.run, f"runs/{args.run}", time.time()
    read = lambda p: json.loads(p.read_text()) if p.is_file() else {}  # noqa: E731 (written atomically)
    man = read(run_dir / "manifest.json")
    stage = man.get("stage") or "train"
    running = "ended" not in (man.get("stages") or {}).get(stage, {"ended": None})
    remote = probe(man, args, run_rel)  # else this Mac's copy (complete once the stage has ended)
    src = remote or json.loads(subprocess.run([sys.executable, "-", run_rel], input=PROBE, capture_output=True,
                                              text=True, cwd=paths.ROOT).stdout)
    mets = src["metrics"]
    train = [m for m in mets if m.get("kind") == "train"]
    val = next((m for m in reversed(mets) if m.get("kind") == "val"), None)
    ranks = ranks_from_log(run_dir / "logs" / f"launch-{stage}.log", now)
    iters = man.get("iters") or (next((m for m in reversed(mets) if m.get("kind") == "done"), {}).get("step"))
    step = train[-1]["step"] if train else None
    step_s = ranks.get("0", {}).get("step_s")
    verdict = None if running else read(run_dir / f"{stage}.json")
    st = {"run": args.run, "stage": stage, "running": running, "reachable": remote is not None, "step": step, "iters": iters,
          "eta_s": round((iters - step) * step_s, 1) if running and iters and step is not None and step_s else None,
          "train_loss": train[-1]["loss"] if train else None, "loss_trend": [round(m["loss"], 5) for m in train[-5:]],
          "last_val": {"step": val["step"], "loss": val["loss"]} if val else None, "ranks": ranks,
          "latest_checkpoint": src.get("latest"), "failures": src.get("failures") or {},
          "verdict": {k: verdict.get(k) for k in ("ok", "category", "why", "final_step", "test_loss", "attempts",
                                                  "fallback", "best_adapter")} if verdict else None}
    silent = [r for r, v in ranks.items() if v["since_s"] > args.silent_s]
    if not man:
        code, why = 3, f"no runs/{args.run}/manifest.json on this Mac"
    elif (not running and not (verdict or {}).get("ok")) or (running and st["failures"]):
        code, why = 2, f"{stage} failed: {(verdict or {}).get('category') or 'a rank wrote a failure file'}"
    elif running and remote is None:
        code, why = 3, "rank 0's host did not answer within 5 s"
    elif running and silent:
        code, why = 1, f"rank(s) {', '.join(silent)} silent for over {args.silent_s:g} s"
    else:
        code, why = 0, "finished" if not running else f"step {step}/{iters}"
    st.update(status=STATUS[code], why=why)
    return st, code


def main() -> int:
    args = build_parser().parse_args()
    paths.check_run_id(args.run)
    st, code = gather(args)
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return code
    eta = time.strftime("%H:%M:%S", time.gmtime(st["eta_s"])) if st["eta_s"] is not None else "-"
    print(f"STATUS {st['status']} - {st['why']} | {st['stage']} step {st['step']}/{st['iters']} eta {eta} loss "
          f"{st['train_loss']} trend {st['loss_trend']} val {st['last_val']} checkpoint {st['latest_checkpoint']}")
    print("".join(f"rank {r}: step {v['last_step']}, {v['since_s']:.0f} s ago, {v['tok_per_s']} tok/s\n"
                  for r, v in st["ranks"].items()) + "".join(f"{n}: {f.get('category')}: {f.get('message')}\n"
                                                             for n, f in st["failures"].items()), end="")
    if st["verdict"]:
        print(f"verdict: {'PASS' if st['verdict']['ok'] else 'FAIL'} {json.dumps(st['verdict'])}")
    return code


if __name__ == "__main__":
    sys.exit(main())
