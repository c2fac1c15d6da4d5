#!/usr/bin/env python3
"""smoke: a tiny run through the real launcher, a checkpoint, a resume; the plan's gate.

Usage:
    python bin/smoke.py --run RUN --hostfile HOSTFILE --config configs/smoke.yaml \
        --model MODEL --dataset NAME --remote-root DIR --python PY [--watchdog S]

Example (what `make smoke` runs after sync and check-parity):
    python bin/smoke.py --run stage1 --hostfile hostfile.json --config configs/smoke.yaml \
        --model models/tiny-gemma4 --dataset domain_sft_v1_high_signal_thunder \
        --remote-root "$PWD" --python "$PWD/.venv/bin/python"

Launch 1 trains to the first checkpoint (save_every); launch 2 resumes to `iters`. Then one
line per criterion of the plan: every rank joined with the expected world size; every rank
loaded the synced dataset (its hash equals the local manifest's); the checkpoints verify;
validation ran; the resume continued the step count. Artifacts land in runs/<RUN>/smoke/, the
verdict in runs/<RUN>/smoke.json. Exit 0 only when all hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import checkpoint as ckpt  # noqa: E402
from lib import launch, paths  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launch.add_common_args(p)
    return p


def criteria(args, hf, run_rel: str, joined: dict, res2, save_every: int, iters: int) -> dict:
    """The plan's success criteria, each (ok, detail) from what the ranks and the run folder say."""
    local = launch.dataset_sha256(args.dataset)
    sizes = sorted({j.get("world_size") for j in joined.values()})
    data = "; ".join(f"rank {r}: {j.get('records')} records, dataset {str(j.get('dataset_sha256'))[:12]}"
                     for r, j in sorted(joined.items()))
    checks = [(c.name, *ckpt.verify(c)) for c in ckpt.listing(paths.ROOT / run_rel / "checkpoints")]
    mets = launch.metrics(paths.ROOT / run_rel)
    vals = [m for m in mets if m.get("kind") == "val"]
    trains = [int(m["step"]) for m in mets if m.get("kind") == "train"]
    steps = (min(res2.steps), max(res2.steps)) if res2 and res2.steps else None
    return {
        "joined": (len(joined) == hf.size and sizes == [hf.size], f"{len(joined)}/{hf.size} ranks joined with world size {sizes}"),
        "real_data": (len(joined) == hf.size and all(int(j.get("records", 0)) > 0 and j.get("dataset_sha256") == local
                                                     for j in joined.values()), f"{data} (local {local[:12]})"),
        "checkpoint": (bool(checks) and all(ok for _, ok, _ in checks),
                       "; ".join(f"{n}: {'verified' if ok else why}" for n, ok, why in checks) or "no checkpoint under checkpoints/"),
        "validation": (bool(vals), f"{len(vals)} validation events" + (f", last loss {vals[-1]['loss']:.4f}" if vals else "")),
        "resume": (bool(steps) and steps[0] > save_every and steps[1] == iters,
                   f"phase 1 to step {save_every}, phase 2 steps {steps}; metrics steps "
                   f"{min(trains) if trains else None}..{max(trains) if trains else None}"),
    }


def main() -> int:
    args, t0 = build_parser().parse_args(), time.time()
    try:
        hf, cfg = launch.load_inputs(args)
        iters, save_every = int(cfg["iters"]), int(cfg["save_every"])
        if not 0 < save_every < iters:
            raise RunbookError(f"{args.config}: smoke needs 0 < save_every ({save_every}) < iters ({iters}) so that "
                               "a checkpoint lands and a resume follows", "smoke")
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    run_dir, run_rel, v = paths.run_dir(args.run), f"runs/{args.run}/smoke", launch.variables(args)
    launch.write_manifest(run_dir, "smoke", v, hf, {"world_size": hf.size})
    res, ev, argv = launch.launch_and_collect(args, hf, run_rel, launch.trainer_args(args, run_rel, args.config, iters=save_every),
                                              "launch-1.log")
    cat, why = launch.categorize(res, ev, hf.size)
    res2, ev2, argv2 = None, {"joined": {}}, None
    if cat is None:
        res2, ev2, argv2 = launch.launch_and_collect(
            args, hf, run_rel, launch.trainer_args(args, run_rel, args.config, iters=iters, resume=True), "launch-2.log")
        cat, why = launch.categorize(res2, ev2, hf.size)
    launch.write_reproduce(run_dir, "smoke", launch.make_cmd("smoke", v), [a for a in (argv, argv2) if a], args.dataset)
    crit = criteria(args, hf, run_rel, {**ev["joined"], **ev2["joined"]}, res2, save_every, iters)
    for name, (ok, detail) in crit.items():
        event("smoke-check", name=name, status="ok" if ok else "FAIL", detail=detail)
    ok = cat is None and all(ok for ok, _ in crit.values())
    summary = launch.summarize(res2 or res, cat, why, {
        "stage": "smoke", "run": args.run, "run_dir": run_rel, "world_size": hf.size,
        "criteria": {k: {"ok": c, "detail": d} for k, (c, d) in crit.items()},
        "launches": [{"returncode": r.returncode, "wall_s": round(r.wall_s, 3)} for r in (res, res2) if r],
        "swept": ev.get("swept"), "total_wall_s": round(time.time() - t0, 3), "ok": ok})
    return launch.conclude(run_dir, "smoke", summary, cfg, argv2 or argv, hf.size)


if __name__ == "__main__":
    sys.exit(main())
