#!/usr/bin/env python3
"""smoke: a tiny run through the real launcher, a checkpoint, a resume; the plan's gate.

Usage:
    python bin/smoke.py --run R --hostfile H --config C --model M --dataset D --remote-root DIR --python PY \
        [--train-config CONFIG]

Example (what `make smoke` runs after sync and check-parity):
    python bin/smoke.py --run stage1 --hostfile hostfile.json --config configs/smoke.yaml \
        --model models/tiny-gemma4 --dataset domain_sft_v1_high_signal_thunder \
        --remote-root "$PWD" --python "$PWD/.venv/bin/python"

Launch 1 trains to save_every, launch 2 resumes to iters. Then one line per criterion (every rank
joined with the expected world size on the synced dataset; the checkpoints verify; validation ran;
the resume continued the step count), runs/<RUN>/smoke.json, and exit 0 only when all hold. With
--train-config (make passes CONFIG), also the epochs the real run's iters make of the train split.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import checkpoint as ckpt  # noqa: E402
from lib import config as C  # noqa: E402
from lib import launch, paths, supervisor  # noqa: E402
from lib.dataset import read_manifest  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

EPOCHS_LOW, EPOCHS_HIGH = 0.5, 10  # below: most records never trained; above: each memorized


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launch.add_common_args(p)
    p.add_argument("--train-config", help="the real run's config: print the epochs its iters make")
    return p


def train_epochs(args) -> dict | None:
    """The epochs the real run's iters x batch_size make of this dataset's train split, printed, and a
    warning outside EPOCHS_LOW..EPOCHS_HIGH (the trainer's smoke run itself is a few steps by design)."""
    if not args.train_config:
        return None
    cfg = C.resolve(args.train_config, {"model": args.model, "data": f"datasets/{args.dataset}"})
    records = read_manifest(paths.DATASETS / args.dataset)["files"]["train.jsonl"]["records"]
    epochs = cfg["iters"] * cfg["batch_size"] / records
    out = {"config": args.train_config, "iters": cfg["iters"], "batch_size": cfg["batch_size"],
           "train_records": records, "epochs": round(epochs, 4)}
    event("smoke-epochs", **out)
    if not EPOCHS_LOW <= epochs <= EPOCHS_HIGH:
        message = (f"{args.train_config}: iters {cfg['iters']} x batch_size {cfg['batch_size']} is "
                   f"{epochs:.2f} epochs of the {records} train records: set iters for "
                   f"{EPOCHS_LOW} to {EPOCHS_HIGH} epochs before make train")
        event("warning", stage="smoke", what="epochs", message=json.dumps(message))
        out["warning"] = message
    return out


def main() -> int:
    args, t0 = build_parser().parse_args(), time.time()
    try:
        hf, cfg = launch.load_inputs(args, "smoke")
        iters, save_every = cfg["iters"], cfg["save_every"]
        if not 0 < save_every < iters:
            raise RunbookError(f"{args.config}: smoke needs 0 < save_every ({save_every}) < iters ({iters}): "
                               "a checkpoint, then a resume", "smoke")
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    run_dir, run_rel, v = paths.run_dir(args.run), f"runs/{args.run}/smoke", launch.variables(args, "smoke")
    man = launch.write_manifest(run_dir, "smoke", v, hf, {"world_size": hf.size,
                                                           "rank_batches": args.rank_batches,
                                                           "chat_template_args": cfg["chat_template_args"]})
    quiet = ["--no-tracking", "--no-epochs-warning"]  # a few steps by design; `make plan` checks epochs
    targs = [*launch.trainer_args(args, run_rel, args.config, iters=save_every), *quiet]  # a gate
    res, ev, argv, cat, why = launch.launch_and_collect(args, hf, run_rel, targs, "launch-1.log", save_every)
    res2, ev2, argv2 = None, {"joined": {}}, None
    if cat is None:
        targs = [*launch.trainer_args(args, run_rel, args.config, iters=iters, resume=True), *quiet]
        res2, ev2, argv2, cat, why = launch.launch_and_collect(args, hf, run_rel, targs, "launch-2.log",
                                                               iters)
    launch.write_reproduce(run_dir, "smoke", launch.make_cmd("smoke", v), [a for a in (argv, argv2) if a])
    # the plan's success criteria, each (ok, detail), from what the ranks and the run folder say
    joined, n, local = {**ev["joined"], **ev2["joined"]}, hf.size, man["dataset_sha256"]
    sizes = sorted({j.get("world_size") for j in joined.values()})
    data = {r: (int(j.get("records") or 0), str(j.get("dataset_sha256"))) for r, j in sorted(joined.items())}
    checks = [(c.name, *ckpt.verify(c)) for c in ckpt.listing(paths.ROOT / run_rel / "checkpoints")]
    vals = [m for m in launch.metrics(paths.ROOT / run_rel) if m.get("kind") == "val"]
    steps = (min(res2.steps), max(res2.steps)) if res2 and res2.steps else None
    crit = {
        "joined": (len(data) == n and sizes == [n], f"{len(data)}/{n} ranks joined with world size {sizes}"),
        "real_data": (len(data) == n and all(rec > 0 and sha == local for rec, sha in data.values()),
                      f"local dataset {local[:12]}; " + "; ".join(
                          f"rank {r}: {rec} records, dataset {sha[:12]}" for r, (rec, sha) in data.items())),
        "checkpoint": (bool(checks) and all(ok for _, ok, _ in checks),
                       "; ".join(f"{c}: {'verified' if ok else why}" for c, ok, why in checks) or "none"),
        "validation": (bool(vals), f"{len(vals)} validation events, last loss {vals[-1]['loss']:.4f}"
                       if vals else "no validation event"),
        "resume": (bool(steps) and steps[0] > save_every and steps[1] == iters,
                   f"phase 1 to step {save_every}, phase 2 steps {steps}"),
    }
    for name, (ok, detail) in crit.items():
        event("smoke-check", name=name, status="ok" if ok else "FAIL", detail=detail)
    try:
        epochs = train_epochs(args)
    except (RunbookError, ValueError, KeyError) as e:  # the train config is train's to refuse
        event("warning", stage="smoke", what="epochs", message=json.dumps(f"epochs not known: {e}"))
        epochs = None
    if fmt := joined.get(0, {}).get("chat_format"):  # rank 0's first train record, as the trainer rendered it
        rec = fmt["first_record"]
        event("smoke-chat-format", chat_template_args=json.dumps(fmt["chat_template_args"]),
              has_thinking=fmt["has_thinking"], tokens=rec["tokens"], text=json.dumps(rec["text"][:100]))
        for target in rec["targets"]:  # exactly what the adapter learns from the first record
            event("smoke-target", text=json.dumps(target[:100]))
    summary = launch.summarize(res2 or res, cat, why, {
        "stage": "smoke", "run": args.run, "run_dir": run_rel, "world_size": hf.size, "swept": ev["swept"],
        "criteria": {k: {"ok": c, "detail": d} for k, (c, d) in crit.items()}, "chat_format": fmt,
        "train_epochs": epochs,
        "launches": [{"returncode": r.returncode, "wall_s": round(r.wall_s, 3)} for r in (res, res2) if r],
        "total_wall_s": round(time.time() - t0, 3), "ok": cat is None and all(ok for ok, _ in crit.values())})
    return supervisor.release(args, launch.conclude(run_dir, "smoke", summary, cfg, argv2 or argv, hf.size))


if __name__ == "__main__":
    sys.exit(main())
