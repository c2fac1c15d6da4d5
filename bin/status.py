#!/usr/bin/env python3
"""status: where a train/control run stands, from Mac1, while it runs and after; never touches it.

Usage:
    python bin/status.py --run RUN --remote-root DIR --python PY [--json]

Example (`make status RUN=stage1 JSON=1`, e.g. from cron):
    python bin/status.py --run stage1 --remote-root "$PWD" --python "$PWD/.venv/bin/python" --json

One ssh call to rank 0's host (BatchMode, 5 s; else this Mac's copy) reads metrics, failure files and the
latest checkpoint; per-rank steps and tok/s come from this Mac's launch log; the supervisor from its lock.
Exit 0 OK, 1 WARNING (a rank silent 600 s), 2 CRITICAL (failed, or running with no supervisor), 3 UNKNOWN
(rank 0's host unreachable while running). RUNBOOK.md#status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import paths, supervisor  # noqa: E402
from lib.remote import run_on  # noqa: E402

STATUS = ("OK", "WARNING", "CRITICAL", "UNKNOWN")
SILENT_S = 600.0  # a running rank silent this long is a WARNING
VERDICT_KEYS = ("ok", "category", "why", "final_step", "test_loss", "attempts", "fallback", "best_adapter")
RANK_LINE = re.compile(r"^(\S+Z) .*?iter (\d+) rank (\d+) .*?tokens (\d+) step_s (\S+)")
# Runs on rank 0's host (or on this Mac's copy) with the run folder as argv[1]: one JSON object.
PROBE = r"""
import json, pathlib, sys
def load(text):
    try: return json.loads(text)
    except ValueError: return {}
def tail(p):
    return p.read_bytes()[-65536:].decode(errors="replace") if p.is_file() else ""
d = pathlib.Path(sys.argv[1])
lid = load(tail(d / "logs" / "rank-0.joined.json")).get("launch_id")
fails = {p.name.split(".")[0]: load(tail(p)) for p in sorted((d / "logs").glob("rank-*.failure.json"))}
print(json.dumps({"metrics": [m for m in map(load, tail(d / "metrics.jsonl").splitlines()) if m],
                  "failures": {n: f for n, f in fails.items() if f.get("launch_id") == lid},
                  "latest": tail(d / "checkpoints" / "latest").strip() or None}))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--run", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    return p


def probe(host: str, root: str, python: str, run_rel: str) -> dict | None:
    """PROBE's answer from host, here for 127.0.0.1 (None: unreachable or no answer within 5 s)."""
    r = run_on(host, ["sh", "-c", 'cd "$1" && exec "$2" - "$3"', "sh", root, python, run_rel], 5, input=PROBE)
    with contextlib.suppress(ValueError):
        return json.loads(r.stdout) if r.ok else None


def main() -> int:
    args = build_parser().parse_args()
    run_dir, run_rel = paths.RUNS / paths.check_run_id(args.run), f"runs/{args.run}"
    man = paths.read_json(run_dir / "manifest.json")
    stage, iters = man.get("stage") or "train", man.get("iters")
    running = "ended" not in (man.get("stages") or {}).get(stage, {"ended": None})
    hosts = [h["ssh"] for h in (man.get("hostfile") or {}).get("hosts", [])]
    hosts = (man.get("fallback") or {}).get("hosts") or hosts  # after a fallback, rank 0 may be another host
    remote = probe(hosts[0], args.remote_root, args.python, run_rel) if hosts else None
    src = (remote or probe("127.0.0.1", str(paths.ROOT), sys.executable, run_rel)  # complete once fetched
           or {"metrics": [], "failures": {}, "latest": None})  # no answer here either: the rows below say so
    train = [m for m in src["metrics"] if m.get("kind") == "train"]
    val = next((m for m in reversed(src["metrics"]) if m.get("kind") == "val"), None)
    seen: dict[str, list] = {}  # per rank, from this Mac's launch log: its last 20 steps
    log = run_dir / "logs" / f"launch-{stage}.log"
    for line in (log.read_bytes()[-262144:].decode(errors="replace") if log.is_file() else "").splitlines():
        if m := RANK_LINE.match(line):
            seen.setdefault(m[3], []).append((m[1], int(m[2]), int(m[4]), float(m[5])))
    ranks = {}
    for r, rows in sorted(seen.items()):
        tail, ago = rows[-20:], time.time() - datetime.fromisoformat(rows[-1][0]).timestamp()
        secs, tokens = sum(x[3] for x in tail), sum(x[2] for x in tail)
        ranks[r] = {"last_step": rows[-1][1], "since_s": round(ago, 1), "tok_per_s": round(tokens / secs, 1)
                    if secs else None, "step_s": statistics.median(x[3] for x in tail)}
    step, step_s = (train or [{}])[-1].get("step"), ranks.get("0", {}).get("step_s")
    verdict = {} if running else paths.read_json(run_dir / f"{stage}.json")
    sup = supervisor.holder(man.get("control_of") or args.run)  # a control's is its dual run's
    by = "" if sup is None else f", supervised by pid {sup.get('pid')}" + (
        f" (detached from its terminal: output in {sup['detached']})" if sup.get("detached") else "")
    silent = [r for r, v in ranks.items() if v["since_s"] > SILENT_S]
    code, why = next((c, w) for bad, c, w in (  # the first row that holds
        (not man, 3, f"no runs/{args.run}/manifest.json on this Mac"),
        (running and src["failures"] or not running and not verdict.get("ok"), 2,
         f"{stage} failed: {verdict.get('category') or 'a rank wrote a failure file'}"),
        (running and man and sup is None, 2, f"{stage} has no supervisor (killed?): make stop "
         f"RUN={args.run}, then RESUME=1; see RUNBOOK.md#{supervisor.ANCHOR}"),
        (running and remote is None, 3, "rank 0's host did not answer within 5 s"),
        (running and silent, 1, f"rank(s) {', '.join(silent)} silent for over {SILENT_S:g} s"),
        (True, 0, f"step {step}/{iters}{by}" if running else "finished")) if bad)
    eta = round((iters - step) * step_s, 1) if running and step is not None and step_s else None
    st = {"run": args.run, "stage": stage, "running": running, "reachable": remote is not None,
          "step": step, "iters": iters, "eta_s": eta, "train_loss": train[-1]["loss"] if train else None,
          "loss_trend": [round(m["loss"], 5) for m in train[-5:]], "ranks": ranks,
          "last_val": {"step": val["step"], "loss": val["loss"]} if val else None,
          "latest_checkpoint": src["latest"], "failures": src["failures"], "status": STATUS[code],
          "why": why, "verdict": {k: verdict.get(k) for k in VERDICT_KEYS} if verdict else None,
          "supervisor": sup}
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return code
    hms = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta is not None else "-"
    print(f"STATUS {st['status']} - {why} | {stage} step {step}/{iters} eta {hms} loss {st['train_loss']} "
          f"trend {st['loss_trend']} val {st['last_val']} checkpoint {src['latest']}")
    for r, v in ranks.items():
        print(f"rank {r}: step {v['last_step']}, {v['since_s']:.0f} s ago, {v['tok_per_s']} tok/s")
    for n, f in src["failures"].items():
        print(f"{n}: {f.get('category')}: {f.get('message')}")
    if st["verdict"]:
        print(f"verdict: {'PASS' if st['verdict']['ok'] else 'FAIL'} {json.dumps(st['verdict'])}")
    return code


if __name__ == "__main__":
    sys.exit(main())
