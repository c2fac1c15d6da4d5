#!/usr/bin/env python3
"""smoke: a tiny run through the real launcher, a checkpoint, a resume; the plan's gate.

Usage:
    python bin/smoke.py --run RUN --hostfile HOSTFILE --config configs/smoke.yaml \
        --model MODEL --dataset NAME --remote-root DIR --python PY [--watchdog S]

Example (what `make smoke` runs after sync and check-parity):
    python bin/smoke.py --run stage1 --hostfile hostfile.json --config configs/smoke.yaml \
        --model models/tiny-gemma4 --dataset domain_sft_v1_high_signal_thunder \
        --remote-root "$PWD" --python "$PWD/.venv/bin/python"

Phase 1 trains to the config's first checkpoint (save_every steps); phase 2 resumes from it
for the rest of `iters`. Then it checks and prints the plan's success criteria, one line each:
every rank joined with the expected world size; every rank loaded real data from the synced
dataset (the dataset hash each rank saw equals the local manifest's); a checkpoint landed and
verifies; validation ran; the resume continued the step count. Trainer artifacts land in
runs/<RUN>/smoke/; the verdict in runs/<RUN>/smoke.json. Exit 0 only when all hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, launch, paths  # noqa: E402
from lib import checkpoint as ckpt  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launch.add_common_args(p)
    return p


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.time()
    try:
        hf, cfg = launch.load_inputs(args)
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    iters, save_every = int(cfg["iters"]), int(cfg["save_every"])
    if not 0 < save_every < iters:
        return die(RunbookError(f"{args.config}: smoke needs 0 < save_every ({save_every}) < iters ({iters}) "
                                "so that a checkpoint lands and a resume follows", "smoke"), 2)
    run_dir = paths.run_dir(args.run)
    run_rel = f"runs/{args.run}/smoke"
    v = launch.variables(args)
    launch.write_manifest(run_dir, "smoke", v, hf, {"world_size": hf.size})

    res1, ev1, argv1 = launch.launch_and_collect(args, hf, run_rel, launch.trainer_args(args, run_rel, args.config, iters=save_every), "launch-1.log")
    cat, why = launch.categorize(res1, ev1, hf.size)
    argv2, res2, ev2 = None, None, {"joined": {}, "failures": {}}
    if cat is None:
        res2, ev2, argv2 = launch.launch_and_collect(args, hf, run_rel, launch.trainer_args(args, run_rel, args.config, iters=iters, resume=True), "launch-2.log")
        cat, why = launch.categorize(res2, ev2, hf.size)
    launch.write_reproduce(run_dir, "smoke", launch.make_cmd("smoke", v), [a for a in (argv1, argv2) if a])

    # The plan's criteria, each from what the ranks and the run folder say.
    local_dataset = launch.dataset_sha256(args.dataset)
    joined = {**ev1["joined"], **ev2["joined"]}
    crit = {}
    ok_join = len(joined) == hf.size and all(int(j.get("world_size", -1)) == hf.size for j in joined.values())
    crit["joined"] = (ok_join, f"{len(joined)}/{hf.size} ranks joined with world size "
                      f"{sorted({j.get('world_size') for j in joined.values()})}")
    data_ok = bool(joined) and all(int(j.get("records", 0)) > 0 and j.get("dataset_sha256") == local_dataset
                                   for j in joined.values())
    crit["real_data"] = (data_ok and len(joined) == hf.size,
                         "; ".join(f"rank {r}: {j.get('records')} records, dataset {str(j.get('dataset_sha256'))[:12]}"
                                   for r, j in sorted(joined.items())) + f" (local {local_dataset[:12]})")
    ckpts = ckpt.listing(paths.ROOT / run_rel / "checkpoints")
    checks = [(c.name, *ckpt.verify(c)) for c in ckpts]
    ck_ok = bool(checks) and all(ok for _, ok, _ in checks)
    ck_msg = "; ".join(f"{n}: {'verified' if ok else why}" for n, ok, why in checks) or "no checkpoint under checkpoints/"
    crit["checkpoint"] = (ck_ok, ck_msg)
    mets = launch.metrics(paths.ROOT / run_rel)
    vals = [m for m in mets if m.get("kind") == "val"]
    crit["validation"] = (bool(vals), f"{len(vals)} validation events" + (f", last loss {vals[-1]['loss']:.4f}" if vals else ""))
    train_steps = [int(m["step"]) for m in mets if m.get("kind") == "train"]
    resumed = res2 is not None and res2.steps and min(res2.steps) > save_every and max(res2.steps) == iters
    crit["resume"] = (bool(resumed), f"phase 1 to step {save_every}, phase 2 steps "
                      f"{(min(res2.steps), max(res2.steps)) if res2 and res2.steps else None}; metrics steps "
                      f"{min(train_steps) if train_steps else None}..{max(train_steps) if train_steps else None}")
    all_ok = cat is None and all(ok for ok, _ in crit.values())
    for name, (ok, detail) in crit.items():
        event("smoke-check", name=name, status="ok" if ok else "FAIL", detail=detail)
    summary = launch.summarize(res2 or res1, cat, why, {
        "stage": "smoke", "run_dir": run_rel, "world_size": hf.size,
        "criteria": {k: {"ok": ok, "detail": d} for k, (ok, d) in crit.items()},
        "smoke_key": launch.smoke_key(args.hostfile, args.dataset, args.model) if all_ok else None,
        "launches": [{"returncode": r.returncode, "wall_s": round(r.wall_s, 3)} for r in (res1, res2) if r],
        "swept": ev1.get("swept"), "total_wall_s": round(time.time() - t0, 3),
    })
    summary["ok"] = all_ok
    atomic.write_json(run_dir / "smoke.json", summary)
    launch.finish_manifest(run_dir, "smoke", summary)
    if cat:
        launch.print_category(cat, why)
    if cat == "out of memory":
        print("fallback ladder (paste one; each keeps the global batch):", file=sys.stderr)
        for line in launch.oom_ladder(cfg, (argv2 or argv1), hf.size):
            print(line, file=sys.stderr)
    if all_ok:
        key_dir = paths.ROOT / ".stamps" / "smoke-ok"
        atomic.write_json(key_dir / f"{summary['smoke_key']}.json", {"run": args.run, "ts": time.time()})
    event("smoke", run=args.run, status="PASS" if all_ok else "FAIL", wall_s=summary["total_wall_s"])
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
