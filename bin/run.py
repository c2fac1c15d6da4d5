#!/usr/bin/env python3
"""train / control: the real run on every rank, or the single-host control on one.

Usage:
    python bin/run.py --stage train|control --run RUN --hostfile H --config C --model M \
        --dataset D --remote-root DIR --python PY [--resume] [--watchdog S] [--control-host HOST] \
        [--restarts N [--fallback]]

Example (what `make train` runs after sync and check-parity):
    python bin/run.py --stage train --run stage1 --hostfile hostfile.json \
        --config configs/stage1.yaml --model mlx-community/gemma-4-e2b-it-bf16 \
        --dataset domain_sft_v1_high_signal_thunder --remote-root "$PWD" --python "$PWD/.venv/bin/python"

The smoke gate is make's (train's stamp depends on smoke's, which re-runs on any change to code,
dataset, model or hostfile); train writes runs/<RUN>/train.json; control runs the same config, dataset, seed and global batch as a
world of one on one host (rank 0's by default) in runs/<RUN>-control/ and writes control.json.
Both write manifest.json and reproduce.sh first; the summary names the best-by-validation
adapter (a checkpoint folder that mlx_lm generate/fuse load as it is).

--restarts N: after a rank death, a hang or a link partition, sweep every host, re-run the
runtime parity gate, wait (backoff) and resume from the latest verified checkpoint, at most N
times. --fallback: a host still unreachable at the last restart is dropped; the run resumes on
the others with the same global batch (hostfile-fallback.json). Each attempt goes to the summary.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, launch, paths  # noqa: E402
from lib.hostfile import check_hostname  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import HANG, RunbookError, die, event  # noqa: E402
from lib.remote import run_on  # noqa: E402

BACKOFF_S = 2.0  # the first restart waits this long, each next one twice as long (at most 60 s)
WORLD_FLAG = "--allow-world-change"  # bin/train.py: resume a checkpoint of another world size, same global batch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("train", "control"), required=True)
    launch.add_common_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    p.add_argument("--control-host", default="", help="control: the host to run on (default: rank 0's)")
    p.add_argument("--restarts", type=int, default=0, help="resume automatically after a rank death, hang or partition, at most N times")
    p.add_argument("--fallback", action="store_true", help="at the last restart, go on without a host still unreachable")
    return p


def control_setup(args, hf) -> dict:
    """The control's run id and one-host hostfile (written into its run folder); returns the
    make variables that name the dual run."""
    dual = {"RUN": args.run, "HOSTFILE": args.hostfile, "CONTROL_HOST": args.control_host}
    pick = next((h for h in hf.hosts if h.ssh == args.control_host), None) if args.control_host else hf.hosts[0]
    if pick is None:
        check_hostname(args.control_host, "CONTROL_HOST")
        pick = type(hf.hosts[0])(0, args.control_host, [], [])
    args.run = f"{args.run}-control"
    path = paths.run_dir(args.run) / "hostfile.json"
    atomic.write_json(path, {"backend": hf.backend, "envs": hf.envs, "hosts": [{"ssh": pick.ssh, "ips": pick.ips, "rdma": []}]})
    args.hostfile = paths.rel(path)
    return dual


def recover(args, hf, run_rel: str, n: int):
    """Restart n: sweep every host, wait (backoff), the runtime parity gate; at the last restart
    with --fallback, hosts still unreachable are dropped. Returns (hostfile, record, relaunch)."""
    swept = launch.sweep(hf, run_rel)
    time.sleep(min(BACKOFF_S * 2 ** (n - 1), 60.0))
    gate = [sys.executable, "bin/check_parity.py", "--gate", "runtime", "--python", args.python,
            "--remote-root", args.remote_root, "--json", "--hostfile"]
    lost = [h for h, v in swept.items() if v.startswith("unreachable")]
    dropping = args.fallback and n == args.restarts and lost and len(lost) < len(hf.unique_ssh())
    if dropping:  # hosts still silent after the backoff go without the full gate's wait on them
        lost = [h for h in lost if not run_on(h, ["true"], timeout=10).ok]
    rec = {"attempt": n, "swept": swept}
    if not (dropping and lost):
        p = subprocess.run([*gate, args.hostfile], cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
        rec["parity_exit"] = p.returncode
        return hf, rec, p.returncode in (0, 1)
    left = [h for h in hf.hosts if h.ssh not in lost]
    path = paths.run_dir(args.run) / "hostfile-fallback.json"
    atomic.write_json(path, {"backend": hf.backend, "envs": hf.envs,
                             "hosts": [{"ssh": h.ssh, "ips": h.ips, "rdma": h.rdma} for h in left]})
    args.hostfile, rec["fallback"] = paths.rel(path), {"lost": lost, "hosts": [h.ssh for h in left], "hostfile": paths.rel(path)}
    p = subprocess.run([*gate, args.hostfile], cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
    rec["fallback_parity_exit"] = p.returncode
    return load_hostfile(args.hostfile), rec, p.returncode in (0, 1)


def run_with_restarts(args, hf, run_rel: str, targs: list[str], total: int | None):
    """The launch, and up to --restarts resumed launches after a hang-category failure."""
    res, ev, argv = launch.launch_and_collect(args, hf, run_rel, targs, f"launch-{args.stage}.log", total)
    cat, why = launch.categorize(res, ev, hf.size)
    attempts, world0 = [], hf.size
    while cat == HANG and len(attempts) < args.restarts:
        hf, rec, go = recover(args, hf, run_rel, len(attempts) + 1)
        attempts.append({**rec, "after": cat, "why": why, "last_step_seen": res.steps[-1] if res.steps else None})
        event("restart", run=args.run, attempt=len(attempts), of=args.restarts, after=why, world_size=hf.size,
              relaunch=go, **({"lost": rec["fallback"]["lost"]} if "fallback" in rec else {}))
        if go:
            t = [*targs, "--resume"] if "--resume" not in targs else targs
            t += [WORLD_FLAG] if hf.size != world0 else []
            res, ev, argv = launch.launch_and_collect(args, hf, run_rel, t, f"launch-{args.stage}.log", total)
            cat, why = launch.categorize(res, ev, hf.size)
    return res, ev, argv, cat, why, hf, attempts


def main() -> int:
    args, t0 = build_parser().parse_args(), time.time()
    try:
        hf, cfg = launch.load_inputs(args)
        dual = control_setup(args, hf) if args.stage == "control" else {}
        hf = load_hostfile(args.hostfile)
        if args.fallback and cfg.get("grad_average") != "tokens":
            raise RunbookError(f"{args.config}: FALLBACK=1 resumes on fewer hosts with the same global batch, which "
                               "needs `grad_average: tokens` in the config (set it before the run starts)", "restarts-and-fallback")
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    run_dir, run_rel = paths.run_dir(args.run), f"runs/{args.run}"
    v = {**launch.variables(args, RESUME="1" if args.resume else "", RESTARTS=args.restarts,
                                FALLBACK="1" if args.fallback else ""), **{k: x for k, x in dual.items() if x}}
    extra = {"world_size": hf.size, "stage": args.stage, "iters": cfg.get("iters"), **({"control_of": dual["RUN"]} if dual else {})}
    launch.write_manifest(run_dir, args.stage, v, hf, extra)
    if dual and (dual_manifest := paths.RUNS / dual["RUN"] / "manifest.json").is_file():
        atomic.write_json(dual_manifest, {**launch.read_json(dual_manifest), "control_run": args.run})
    targs = launch.trainer_args(args, run_rel, args.config, resume=args.resume)
    argv = launch.launch_argv(args.hostfile, hf, args.python, args.remote_root, targs, args.port)
    launch.write_reproduce(run_dir, args.stage, launch.make_cmd(args.stage, v), [argv], args.dataset)
    total = int(cfg["iters"]) if cfg.get("iters") else None
    res, ev, run_argv, cat, why, hf, attempts = run_with_restarts(args, hf, run_rel, targs, total)
    fallback = next((a["fallback"] for a in attempts if "fallback" in a), None)
    if fallback:
        atomic.write_json(run_dir / "manifest.json", {**launch.read_json(run_dir / "manifest.json"), "fallback": fallback})
    mets = launch.metrics(run_dir)
    last = {kind: next((m for m in reversed(mets) if m.get("kind") == kind), {}) for kind in ("train", "test", "done")}
    best = last["done"].get("best_adapter")
    summary = launch.summarize(res, cat, why, {
        "stage": args.stage, "run": args.run, "run_dir": run_rel, "world_size": hf.size, "resumed": args.resume,
        "joined": sorted(ev["joined"]), "final_step": last["train"].get("step"),
        "test_loss": last["test"].get("loss"), "test_ppl": last["test"].get("ppl"),
        "adapter": f"{run_rel}/adapters" if (run_dir / "adapters" / "adapters.safetensors").is_file() else None,
        "best_adapter": f"{run_rel}/checkpoints/{Path(best).name}" if best else None,
        "best_val_loss": last["done"].get("best_val_loss"),
        "restarts": args.restarts, "attempts": attempts, "fallback": fallback,
        "swept": ev["swept"], "fetched": ev["fetched"], "total_wall_s": round(time.time() - t0, 3)})
    return launch.conclude(run_dir, args.stage, summary, cfg, run_argv, hf.size)


if __name__ == "__main__":
    sys.exit(main())
