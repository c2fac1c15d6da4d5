#!/usr/bin/env python3
"""status: where a train/control run stands, from Mac1, while it runs and after; never touches it.

Usage:
    python bin/status.py --run RUN --remote-root DIR --python PY [--json] [--watch N]

Example (`make status RUN=stage1 JSON=1`, e.g. from cron):
    python bin/status.py --run stage1 --remote-root "$PWD" --python "$PWD/.venv/bin/python" --json

The first line is a monitoring plugin's, with perfdata (step, loss, tok_per_s, eta_s); --watch N redraws
every N seconds until the run ends. One ssh call to rank 0's host (BatchMode, 5 s; else this Mac's copy)
reads metrics, failure files and the latest checkpoint; per-rank steps and tok/s come from this Mac's
launch log; the supervisor from its lock.
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

from lib import paths, supervisor, tracking  # noqa: E402
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
mets = (d / "metrics.jsonl").read_bytes().decode(errors="replace") if (d / "metrics.jsonl").is_file() else ""
track = [load(x) for x in mets.splitlines() if '"kind": "tracking"' in x]  # each launch's first events
print(json.dumps({"metrics": [m for m in map(load, mets[-65536:].splitlines()) if m], "tracking": track[-1:],
                  "failures": {n: f for n, f in fails.items() if f.get("launch_id") == lid},
                  "latest": tail(d / "checkpoints" / "latest").strip() or None}))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--run", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--watch", type=float, metavar="N", help="redraw every N seconds until the run ends")
    return p


def probe(host: str, root: str, python: str, run_rel: str) -> dict | None:
    """PROBE's answer from host, here for 127.0.0.1 (None: unreachable or no answer within 5 s)."""
    r = run_on(host, ["sh", "-c", 'cd "$1" && exec "$2" - "$3"', "sh", root, python, run_rel], 5, input=PROBE)
    with contextlib.suppress(ValueError):
        return json.loads(r.stdout) if r.ok else None


def gather(args) -> tuple[dict, int]:
    """The run's state (`make status JSON=1`'s object) and its plugin exit code."""
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
    track = (src.get("tracking") or [None])[0]
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
          "supervisor": sup, "tracking": track and {k: track.get(k) for k in ("mode", "id", "url", "dir")}}
    return st, code


def num(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def human(st: dict) -> list[str]:
    """What a person reads: the plugin line (perfdata: step, loss, tok_per_s, eta_s), then a line a fact."""
    ranks, eta, val, v = st["ranks"], st["eta_s"], st["last_val"], st["verdict"]
    tok = sum(r["tok_per_s"] or 0 for r in ranks.values()) if st["running"] and ranks else None
    hms = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta is not None else "-"
    perf = {"step": st["step"], "loss": st["train_loss"] and round(st["train_loss"], 4),
            "tok_per_s": tok and round(tok, 1), "eta_s": eta and f"{eta:.0f}s"}
    L = [f"STATUS {st['status']} - {st['why']} | " + " ".join(f"{k}={'U' if x is None else x}"
                                                               for k, x in perf.items())]
    trend = " ".join(num(x) for x in st["loss_trend"])
    trend = f" (last {len(st['loss_trend'])}: {trend})" if trend else ""
    L.append(f"{st['stage']}: step {num(st['step'], '')} of {num(st['iters'], '')}, loss "
             f"{num(st['train_loss'])}{trend}" + (f", {tok:,.0f} tok/s, ETA {hms}" if tok else ""))
    if val:
        L.append(f"validation: loss {num(val['loss'])} at step {val['step']}")
    L.append(f"checkpoint: {st['latest_checkpoint'] or 'none yet'}")
    if st["tracking"]:
        L.append(tracking.describe(st["tracking"]))
    L += [f"rank {r}: step {x['last_step']}, {x['since_s']:.0f} s ago, {num(x['tok_per_s'], ',.0f')} tok/s"
          for r, x in ranks.items()]
    L += [f"{n} failed: {f.get('category')}: {f.get('message')}" for n, f in st["failures"].items()]
    if v:
        fb = f", on {', '.join(v['fallback'].get('hosts') or [])} after FALLBACK" if v.get("fallback") else ""
        why = f"{v.get('category') or 'no category'}: {v.get('why') or 'no reason recorded'}"
        L.append(f"verdict: PASS, step {v.get('final_step')}, test loss {num(v.get('test_loss'))}{fb}"
                 if v["ok"] else f"verdict: FAIL, {why}")
    return L


def main() -> int:
    args = build_parser().parse_args()
    while True:
        st, code = gather(args)
        if args.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")  # redraw in place on a terminal; a pipe gets one block a round
        print(json.dumps(st, sort_keys=True) if args.json else "\n".join(human(st)), flush=True)
        if not (args.watch and st["running"]):
            return code
        time.sleep(max(args.watch, 1.0))


if __name__ == "__main__":
    sys.exit(main())
