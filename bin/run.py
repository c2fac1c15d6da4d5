#!/usr/bin/env python3
"""train / control: the real run on every rank, or the single-host control on one.

Usage:
    python bin/run.py --stage train|control --run RUN --hostfile H --config C --model M --dataset D \
        --remote-root DIR --python PY [--resume] [--watchdog S] [--control-host H] [--restarts N [--fallback]]
    python bin/run.py --stop RUN        # make stop: its supervisor told to stop, then every host swept

Example (what `make train` runs after smoke, sync and check-parity):
    python bin/run.py --stage train --run stage1 --hostfile hostfile.json --config configs/stage1.yaml \
        --model mlx-community/gemma-4-e2b-it-bf16 --dataset domain_sft_v1_high_signal_thunder \
        --remote-root "$PWD" --python "$PWD/.venv/bin/python"

train writes runs/<RUN>/train.json; control, the same config, data, seed and global batch on one host
(rank 0's by default), runs/<RUN>-control/control.json. Restarts: see RUNBOOK.md#restarts-and-fallback;
one supervisor per run, Ctrl-C, a closed terminal, make stop: RUNBOOK.md#one-launch-per-run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, hostfile, launch, paths, supervisor  # noqa: E402
from lib.config import rank_batches, set_flag  # noqa: E402
from lib.hostfile import check_hostname  # noqa: E402
from lib.log import HANG, RunbookError, die, event  # noqa: E402
from lib.remote import run_on  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("train", "control"), required=True)
    launch.add_common_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    p.add_argument("--control-host", default="", help="control: the host to run on (default: rank 0's)")
    p.add_argument("--restarts", type=int, default=0, help="automatic resumes after a hang-category failure")
    p.add_argument("--fallback", action="store_true", help="at the last restart, drop hosts unreachable")
    return p


def control_setup(args, hf):
    """Makes args the control's (run id, one-host hostfile); returns the dual run's variables and it."""
    dual = {"RUN": args.run, "HOSTFILE": args.hostfile, "CONTROL_HOST": args.control_host}
    ssh = check_hostname(args.control_host, "CONTROL_HOST") if args.control_host else hf.hosts[0].ssh
    ips = next((h.ips for h in hf.hosts if h.ssh == ssh), [])
    args.run = f"{args.run}-control"
    path = paths.run_dir(args.run) / "hostfile.json"
    one = {"ssh": ssh, "ips": ips, "rdma": [None] if hf.backend.startswith("jaccl") else []}  # jaccl: 1 x 1
    atomic.write_json(path, {"backend": hf.backend, "envs": hf.envs, "hosts": [one]})
    args.hostfile, args.rank_shares, args.rank_batches = paths.rel(path), None, [sum(args.rank_batches)]
    return dual, hostfile.load(args.hostfile)


def recover(args, hf, n: int, swept: dict):
    """Restart n (its launch swept): back off, drop hosts still unreachable (--fallback at the last), gate."""
    time.sleep(min(2.0 * 2 ** (n - 1), 60.0))  # 2 s, then twice as long each time, at most 60 s
    rec, lost = {"attempt": n, "swept": swept}, [h for h, v in swept.items() if v.startswith("unreachable")]
    if args.fallback and n == args.restarts and 0 < len(lost) < len(hf.unique_ssh()):
        if lost := [h for h in lost if not run_on(h, ["true"], timeout=10).ok]:  # still silent after backoff
            path = paths.run_dir(args.run) / "hostfile-fallback.json"
            keep = [h.rank for h in hf.hosts if h.ssh not in lost]  # and their columns of a jaccl rdma matrix
            left = [{"ssh": h.ssh, "ips": h.ips, "rdma": [d for j, d in enumerate(h.rdma) if j in keep]}
                    for h in hf.hosts if h.rank in keep]
            atomic.write_json(path, {"backend": hf.backend, "envs": hf.envs, "hosts": left})
            args.hostfile, hf = paths.rel(path), hostfile.load(path)
            bs, args.rank_batches = sum(args.rank_batches), [sum(args.rank_batches) // hf.size] * hf.size
            if args.rank_shares:  # the hosts left keep their shares, re-normalized over the same global batch
                args.rank_shares = [args.rank_shares[k] for k in keep]
                args.rank_batches = rank_batches({"batch_size": bs, "rank_shares": args.rank_shares}, hf.size)
            rec["fallback"] = {"lost": lost, "hosts": [h.ssh for h in hf.hosts], "hostfile": args.hostfile,
                               "rank_batches": args.rank_batches}
            man = paths.RUNS / args.run / "manifest.json"
            atomic.write_json(man, {**paths.read_json(man), "fallback": rec["fallback"]})
    p = subprocess.run([sys.executable, "bin/check_parity.py", "--gate", "runtime", "--python", args.python,
                        "--remote-root", args.remote_root, "--json", "--hostfile", args.hostfile],
                       cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
    rec["fallback_parity_exit" if "fallback" in rec else "parity_exit"] = p.returncode
    return hf, rec, p.returncode in (0, 1)


def stop(run: str) -> int:
    """make stop: SIGTERM to RUN's supervisor (it stops its launch, fetches, writes its summary); every host
    of RUN's manifests swept for its ranks meanwhile (a dead supervisor's too); then its end awaited, 60 s."""
    if pid := (supervisor.holder(paths.check_run_id(run)) or {}).get("pid"):
        os.kill(int(pid), signal.SIGTERM)
    mans = [paths.read_json(paths.RUNS / d / "manifest.json") for d in (run, run + "-control")]
    hosts = {check_hostname(h["ssh"], "ssh") for m in mans for h in m.get("hostfile", {}).get("hosts", [])}
    swept, deadline = launch.sweep(sorted(hosts), run) if hosts else {}, time.monotonic() + 60
    while (held := supervisor.holder(run) is not None) and time.monotonic() < deadline:
        time.sleep(0.2)
    event("stop", run=run, supervisor=pid or "none", **swept)
    return die(f"supervisor {pid} alive 60 s past SIGTERM; see RUNBOOK.md#{supervisor.ANCHOR}") if held else 0


def main() -> int:
    if sys.argv[1:2] == ["--stop"]:
        return stop(sys.argv[2])
    args, t0 = build_parser().parse_args(), time.time()
    try:
        hf, cfg = launch.load_inputs(args, args.stage)
        dual, hf = control_setup(args, hf) if args.stage == "control" else ({}, hf)
        if args.fallback and cfg.get("grad_average") != "tokens":
            raise RunbookError(f"{args.config}: FALLBACK=1 needs `grad_average: tokens` in the config "
                               "(set it before the run starts)", "restarts-and-fallback")
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    run_dir, run_rel = paths.run_dir(args.run), f"runs/{args.run}"
    v = launch.variables(args, args.stage, RESUME=args.resume and "1", RESTARTS=args.restarts,
                         FALLBACK=args.fallback and "1", **dual)
    launch.write_manifest(run_dir, args.stage, v, hf, {"world_size": hf.size, "stage": args.stage,
                                                      "iters": cfg["iters"], "control_of": dual.get("RUN"),
                                                      "rank_batches": args.rank_batches,
                                                      "chat_template_args": cfg["chat_template_args"]})
    targs = launch.trainer_args(args, run_rel, args.config, resume=args.resume)
    argv = launch.launch_argv(args.hostfile, hf, args.python, args.remote_root, targs, args.port)
    launch.write_reproduce(run_dir, args.stage, launch.make_cmd(args.stage, v), [argv], args.dataset)
    log, world0, attempts = f"launch-{args.stage}.log", hf.size, []
    res, ev, run_argv, cat, why = launch.launch_and_collect(args, hf, run_rel, targs, log, cfg["iters"])
    while cat == HANG and len(attempts) < args.restarts:  # restart: resume from the latest good checkpoint
        hf, rec, go = recover(args, hf, len(attempts) + 1, ev["swept"])
        attempts.append({**rec, "after": cat, "why": why, "last_step_seen": (res.steps or [None])[-1]})
        event("restart", run=args.run, attempt=len(attempts), of=args.restarts, after=why, world_size=hf.size,
              relaunch=go, **({"lost": rec["fallback"]["lost"]} if "fallback" in rec else {}))
        if go:  # a checkpoint of another world size resumes with the same global batch
            t = [*targs, *["--resume"] * ("--resume" not in targs)]  # a copy: targs stays as launched
            t += ["--allow-world-change"] if hf.size != world0 else []
            t = set_flag(t, "--rank-shares", json.dumps(args.rank_shares)) if args.rank_shares else t
            res, ev, run_argv, cat, why = launch.launch_and_collect(args, hf, run_rel, t, log, cfg["iters"])
    last = {"train": {}, "test": {}, "done": {}} | {m.get("kind"): m for m in launch.metrics(run_dir)}
    best, adapters = last["done"].get("best_adapter"), run_dir / "adapters" / "adapters.safetensors"
    summary = launch.summarize(res, cat, why, {
        "stage": args.stage, "run": args.run, "world_size": hf.size, "joined": sorted(ev["joined"]),
        "rank_batches": args.rank_batches,
        "final_step": last["train"].get("step"), "test_loss": last["test"].get("loss"), "attempts": attempts,
        "test_ppl": last["test"].get("ppl"), "best_val_loss": last["done"].get("best_val_loss"),
        "adapter": f"{run_rel}/adapters" if adapters.is_file() else None, "fetched": ev["fetched"],
        "best_adapter": f"{run_rel}/checkpoints/{Path(best).name}" if best else None, "swept": ev["swept"],
        "fallback": (attempts or [{}])[-1].get("fallback"), "total_wall_s": round(time.time() - t0, 3)})
    return supervisor.release(args, launch.conclude(run_dir, args.stage, summary, cfg, run_argv, hf.size))


if __name__ == "__main__":
    sys.exit(main())
