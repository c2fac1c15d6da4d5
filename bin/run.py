#!/usr/bin/env python3
"""train / control: the real run on every rank, or the single-host control on one.

Usage:
    python bin/run.py --stage train   --run RUN --hostfile H --config C --model M --dataset D \
        --remote-root DIR --python PY [--resume] [--watchdog S]
    python bin/run.py --stage control --run RUN [--control-host HOST] ... (same flags)

Examples (what `make train` and `make control` run after sync and check-parity):
    python bin/run.py --stage train --run stage1 --hostfile hostfile.json \
        --config configs/stage1.yaml --model mlx-community/gemma-4-e2b-it-bf16 \
        --dataset domain_sft_v1_high_signal_thunder --remote-root "$PWD" --python "$PWD/.venv/bin/python"

train requires a passing smoke for the same code, dataset, model and hostfile; it runs the
trainer through mlx.launch, watched by the watchdog, and writes runs/<RUN>/train.json.
control runs the same config, dataset, seed and global batch with world size 1 on one host
(rank 0's by default) in runs/<RUN>-control/, without mlx.launch (mlx 0.32.4 gives a lone
rank an empty MLX_HOSTFILE that mx.distributed.init() cannot parse), and writes
runs/<RUN>-control/control.json. Both write manifest.json and reproduce.sh first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, launch, paths  # noqa: E402
from lib.hostfile import Hostfile, check_hostname  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("train", "control"), required=True)
    launch.add_common_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    p.add_argument("--control-host", default="", help="control: the host to run on (default: rank 0's)")
    p.add_argument("--skip-smoke-check", action="store_true",
                   help="train without a passing smoke for this code/dataset/model/hostfile (not for real runs)")
    return p


def control_hostfile(hf: Hostfile, host: str, run: str) -> str:
    """A one-host hostfile for the control run, written into its run folder."""
    pick = next((h for h in hf.hosts if h.ssh == host), None) if host else hf.hosts[0]
    if pick is None:
        check_hostname(host, "CONTROL_HOST")
        pick = type(hf.hosts[0])(0, host, [], [])
    path = paths.run_dir(run) / "hostfile.json"
    atomic.write_json(path, {"backend": hf.backend, "envs": hf.envs,
                             "hosts": [{"ssh": pick.ssh, "ips": pick.ips, "rdma": []}]})
    return paths.rel(path)


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.time()
    try:
        hf, cfg = launch.load_inputs(args)
        dual_run, dual_hostfile = args.run, args.hostfile
        if args.stage == "control":
            args.run = f"{dual_run}-control"
            args.hostfile = control_hostfile(hf, args.control_host, args.run)
            hf = load_hostfile(args.hostfile)
        elif not args.skip_smoke_check:
            key = launch.smoke_key(args.hostfile, args.dataset, args.model)
            if not (paths.ROOT / ".stamps" / "smoke-ok" / f"{key}.json").is_file():
                raise RunbookError("no passing smoke for this code, dataset, model and hostfile: "
                                   f"run `make smoke HOSTFILE={args.hostfile} DATASET={args.dataset} MODEL={args.model}` first",
                                   "smoke")
    except (RunbookError, ValueError) as e:
        return die(e, 2)

    run_dir = paths.run_dir(args.run)
    run_rel = f"runs/{args.run}"
    v = launch.variables(args, RESUME="1" if args.resume else "")
    if args.stage == "control":
        v["RUN"] = dual_run
        v["HOSTFILE"] = dual_hostfile
        if args.control_host:
            v["CONTROL_HOST"] = args.control_host
    extra = {"world_size": hf.size, "stage": args.stage}
    if args.stage == "control":
        extra["control_of"] = dual_run
    launch.write_manifest(run_dir, args.stage, v, hf, extra)
    if args.stage == "control":
        dual_manifest = paths.RUNS / dual_run / "manifest.json"
        if dual_manifest.is_file():
            m = json.loads(dual_manifest.read_text())
            m["control_run"] = args.run
            atomic.write_json(dual_manifest, m)

    targs = launch.trainer_args(args, run_rel, args.config, resume=args.resume)
    argv = launch.launch_argv(args.hostfile, hf, args.python, args.remote_root, targs, args.port)
    launch.write_reproduce(run_dir, args.stage, launch.make_cmd(args.stage, v), [argv])
    res, ev, run_argv = launch.launch_and_collect(args, hf, run_rel, targs, f"launch-{args.stage}.log")
    cat, why = launch.categorize(res, ev, hf.size)
    mets = launch.metrics(run_dir)
    tests = [m for m in mets if m.get("kind") == "test"]
    trains = [m for m in mets if m.get("kind") == "train"]
    summary = launch.summarize(res, cat, why, {
        "stage": args.stage, "run_dir": run_rel, "world_size": hf.size,
        "resumed": args.resume,
        "joined": sorted(ev["joined"]),
        "final_step": trains[-1]["step"] if trains else None,
        "test_loss": tests[-1].get("loss") if tests else None,
        "test_ppl": tests[-1].get("ppl") if tests else None,
        "adapter": f"{run_rel}/adapters" if (run_dir / "adapters" / "adapters.safetensors").is_file() else None,
        "swept": ev["swept"], "fetched": ev["fetched"], "total_wall_s": round(time.time() - t0, 3),
    })
    atomic.write_json(run_dir / f"{args.stage}.json", summary)
    launch.finish_manifest(run_dir, args.stage, summary)
    if cat:
        launch.print_category(cat, why)
    if cat == "out of memory":
        print("fallback ladder (paste one; each keeps the global batch):", file=sys.stderr)
        for line in launch.oom_ladder(cfg, run_argv, hf.size):
            print(line, file=sys.stderr)
    event(args.stage, run=args.run, status="PASS" if summary["ok"] else "FAIL",
          test_loss=summary["test_loss"], wall_s=summary["total_wall_s"])
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
