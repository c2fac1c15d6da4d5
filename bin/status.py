#!/usr/bin/env python3
"""status: where a train/control run stands, from Mac1, while it runs and after; never touches it.

Usage:
    python bin/status.py --run RUN --hostfile H --remote-root DIR --python PY [--json] [--silent-s S]

Example (`make status RUN=stage1 JSON=1`, e.g. from cron):
    python bin/status.py --run stage1 --hostfile hostfile.json --remote-root "$PWD" \
        --python "$PWD/.venv/bin/python" --json

One ssh call to rank 0's host (BatchMode, timeouts) runs a small script over its run folder:
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
if m.is_file():
    with open(m, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        for line in f.read().decode(errors="replace").splitlines()[-400:]:
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
    for flag in ("--run", "--hostfile", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--silent-s", type=float, default=600.0, help="a running rank silent this long is a WARNING")
    return p


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def probe(man: dict, args, run_rel: str) -> dict | None:
    """Rank 0's view of the run folder over ssh (None: unreachable or no answer within 5 s)."""
    hosts = (man.get("fallback") or {}).get("hosts") or [h["ssh"] for h in (man.get("hostfile") or {}).get("hosts", [])]
    if not hosts:
        return None
    r = run_on(hosts[0], ["sh", "-c", 'cd "$1" && exec "$2" - "$3"', "sh", args.remote_root, args.python, run_rel],
               timeout=5, input=PROBE)
    try:
        return json.loads(r.stdout) if r.ok else None
    except ValueError:
        return None


def ranks_from_log(log: Path, now: float) -> dict:
    """Per rank: last step, seconds since it, tok/s over its last 20 steps (the launch log's tail)."""
    seen: dict[int, list] = {}
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 262144))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        if m := RANK_LINE.match(line):
            seen.setdefault(int(m[3]), []).append((m[1], int(m[2]), int(m[4]), float(m[5])))
    out = {}
    for r, rows in sorted(seen.items()):
        ts, step = rows[-1][0], rows[-1][1]
        tail = rows[-20:]
        secs = sum(x[3] for x in tail)
        out[str(r)] = {"last_step": step, "since_s": round(now - calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")), 1),
                       "tok_per_s": round(sum(x[2] for x in tail) / secs, 1) if secs else None,
                       "step_s": statistics.median(x[3] for x in tail)}
    return out


def gather(args) -> tuple[dict, int]:
    run_dir, run_rel, now = paths.RUNS / args.run, f"runs/{args.run}", time.time()
    man = read_json(run_dir / "manifest.json")
    stage = man.get("stage") or "train"
    running = "ended" not in (man.get("stages") or {}).get(stage, {"ended": None})
    remote = probe(man, args, run_rel)
    local = {"metrics": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()[-400:] if x.strip()]
             if (run_dir / "metrics.jsonl").is_file() else [], "failures": {}, "latest": None}
    src = remote or local
    mets = src["metrics"]
    train = [m for m in mets if m.get("kind") == "train"]
    val = next((m for m in reversed(mets) if m.get("kind") == "val"), None)
    ranks = ranks_from_log(run_dir / "logs" / f"launch-{stage}.log", now)
    iters = man.get("iters") or (next((m for m in reversed(mets) if m.get("kind") == "done"), {}).get("step"))
    step = train[-1]["step"] if train else None
    step_s = ranks.get("0", {}).get("step_s")
    verdict = None if running else read_json(run_dir / f"{stage}.json")
    st = {"run": args.run, "stage": stage, "running": running, "reachable": remote is not None,
          "step": step, "iters": iters,
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
    print(f"STATUS {st['status']} - {st['why']} | {st['stage']} step {st['step']}/{st['iters']} eta {eta} "
          f"loss {st['train_loss']} val {st['last_val']} checkpoint {st['latest_checkpoint']}")
    for r, v in st["ranks"].items():
        print(f"rank {r}: step {v['last_step']}, {v['since_s']:.0f} s ago, {v['tok_per_s']} tok/s")
    for name, f in st["failures"].items():
        print(f"{name}: {f.get('category')}: {f.get('message')}")
    if st["verdict"]:
        print(f"verdict: {'PASS' if st['verdict']['ok'] else 'FAIL'} {st['verdict']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
