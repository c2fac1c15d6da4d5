#!/usr/bin/env python3
"""The rank-side LoRA trainer: runs on every rank under mlx.launch, or alone as one rank.

Usage:
    mlx.launch --hostfile HOSTFILE --backend ring -- PYTHON bin/train.py --config CONFIG --model MODEL \
        --data datasets/NAME --run-dir runs/RUN [--resume [--allow-world-change]] [--iters N] [--seed S] \
        [--expect-world-size W] [--launch-id ID] [--stop-at-step K]
Example (one rank, on the demo's export):
    .venv/bin/python bin/train.py --config configs/demo.yaml --model models/tiny-gemma4 \
        --data datasets/demo --run-dir runs/try

mlx-lm's LoRA training (batch_size the global batch) with exact resume (lib/checkpoint.py; the data order
replayed from the seed); without --resume an earlier run moves to superseded-<time>-<pid>/. Rank R writes
logs/rank-R.joined.json (when the group is up, then its records and dataset hash), rank-R.failure.json and
rank-R.log; rank 0 metrics.jsonl (a resume moves later events to metrics.superseded.jsonl), checkpoints/ and
adapters/ (mlx-lm adapter folders). lib/launch.py reads `progress`, `iter N train_loss` and `done` lines.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import socket
import sys
import time
import types
from contextlib import redirect_stdout
from functools import partial
from pathlib import Path

import mlx.core as mx  # check-parity made sure every host's interpreter has mlx (mlx-lm loads later: slow)
import mlx.nn as nn
import mlx.nn.utils as nu
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, batching, chat, jsonl, tracking  # noqa: E402
from lib import checkpoint as ckpt  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import digest_of, sha256_file  # noqa: E402
from lib.log import DATA, PARITY, STABILITY, RunbookError, error_of_code, failure  # noqa: E402
from lib.loss import make_loss, weighted_default_loss  # noqa: E402
from lib.rank import Reporter, as_error, fail, keep_awake  # noqa: E402
from lib.tracking import Tracker  # noqa: E402

SPLITS = ("train", "valid", "test")
# The config keys a caller overrides (launcher, smoke, the OOM ladder, bench), by mlx-lm's flag names.
FLAGS = (("model", str), ("data", str), ("iters", int), ("seed", int), ("batch_size", int),
         ("optimizer", str), ("learning_rate", float), ("save_every", int), ("steps_per_eval", int),
         ("steps_per_report", int), ("max_seq_length", int), ("grad_accumulation_steps", int),
         ("val_batches", int), ("test_batches", int), ("rank_shares", json.loads))  # shares: `[5, 3]`


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config YAML (mlx-lm lora keys + runbook keys)")
    p.add_argument("--run-dir", required=True, help="the run folder (runs/RUN or runs/RUN/smoke)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--expect-world-size", type=int, help="fail (runtime parity) unless the group is this big")
    p.add_argument("--launch-id", default="", help="written into the marker files (vs stale ones)")
    p.add_argument("--stop-at-step", type=int, help="stop after this step, with a checkpoint")
    p.add_argument("--allow-world-change", action="store_true", help="--resume on another world size, the "
                   "global batch cut as before (gradient accumulation; needs grad_average: tokens)")
    p.add_argument("--no-tracking", action="store_true", help="ignore the config's report_to (smoke)")
    p.add_argument("--no-epochs-warning", action="store_true",
                   help="no warning on the epochs iters makes (smoke: a few steps by design)")
    for key, typ in FLAGS:
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None)
    return p


# ---- distributed group --------------------------------------------------------------------------
class Group:
    """mlx's group (strict under mlx.launch, else a world of one) and its collectives, on the CPU stream."""

    def __init__(self):
        env, hostfile = os.environ.get, Path(os.environ.get("MLX_HOSTFILE") or "/nonexistent")
        if hostfile.is_file() and not hostfile.read_text().strip():  # mlx.launch with a single host
            os.environ.pop("MLX_HOSTFILE")
            os.environ.pop("MLX_RANK", None)
        backend = ("jaccl" if env("MLX_IBV_DEVICES") or env("MLX_JACCL_COORDINATOR") else "ring"
                   if env("MLX_HOSTFILE") else "mpi" if env("OMPI_COMM_WORLD_SIZE") else "none")
        try:
            g = mx.distributed.init(strict="MLX_RANK" in os.environ)
        except Exception as e:
            raise failure(PARITY, f"the distributed group did not form ({backend}): {e}") from e
        self.rank, self.size, self.backend = g.rank(), g.size(), backend if g.size() > 1 else "none"

    def sum(self, x):
        return mx.distributed.all_sum(x, stream=mx.cpu)

    def run(self, fn, *a, **kw):
        """Run one local phase (fn None: nothing); if any rank fails, all stop with its exit code."""
        out, err, codes = None, None, [0] * self.size
        try:
            out = fn(*a, **kw) if fn else None
        except Exception as e:
            err = as_error(e)
            codes[self.rank] = err.exit_code
        codes = self.sum(mx.array(codes)).tolist()
        if err:
            raise err
        if failed := [r for r, c in enumerate(codes) if c]:
            raise error_of_code(codes[failed[0]], f"rank(s) {failed} failed (exit {codes[failed[0]]}); "
                                                  "see their logs/rank-R.failure.json")
        return out

    def bcast(self, flat: dict | None, like: dict) -> dict:
        """Rank 0's arrays to every rank (the others add zeros shaped like `like`)."""
        out = {k: self.sum(flat[k] if self.rank == 0 else mx.zeros(v.shape, v.dtype))
               for k, v in sorted(like.items())}
        mx.eval(list(out.values()))
        return out

    def bcast_json(self, obj):
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        like = {"b": mx.zeros((int(self.sum(mx.array(len(data))).item()),), mx.int32)}
        return json.loads(bytes(self.bcast({"b": mx.array(list(data), mx.int32)}, like)["b"].tolist()))


# ---- each rank's own: config, model, data, LoRA layers ------------------------------------------------
def load_all(r) -> None:
    """The config, mlx-lm's load, its datasets tokenized now (a bad record names its line), the optimizer."""
    cfg = r.cfg = C.resolve(r.args.config, {key: getattr(r.args, key) for key, _ in FLAGS})
    r.per_rank = C.rank_batches(cfg, r.coll.size)  # records per rank: even, or by rank_shares
    if not (r.coll.rank == 0 and cfg["report_to"] and not r.args.no_tracking):
        tracking.without_wandb()  # before mlx-lm's import: only rank 0 of a tracked run starts W&B
    d, m, host, rep = Path(cfg["data"]), cfg["model"], socket.gethostname(), r.rep
    if not (d / "train.jsonl").is_file():  # the cheap checks before the slow load
        raise failure(DATA, f"dataset {d / 'train.jsonl' if d.is_dir() else d} not found on {host} (cwd "
                            f"{os.getcwd()}); run `make export` and `make sync`")
    if (m.startswith((".", "/", "~", "models/")) or Path(m).exists()) and not Path(m).expanduser().is_dir():
        raise failure(DATA, f"model folder {m} not found on {host} (cwd {os.getcwd()}); run "
                            "`make tiny-model` or `make sync SYNC_MODEL=1`")
    with rep.beating("load-model"):  # mlx-lm's import alone takes seconds
        try:
            from mlx_lm.utils import load

            r.model, tokenizer = load(m, tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                                      trust_remote_code=cfg["trust_remote_code"])
        except (FileNotFoundError, ValueError, OSError) as e:
            raise failure(DATA, f"model {m} does not load on {host} ({type(e).__name__}: {e}); run "
                                "`make sync SYNC_MODEL=1`") from e
    if tokenizer.has_thinking and "enable_thinking" not in (cfg["chat_template_args"] or {}):
        raise RunbookError(f"the tokenizer of {m} has a thinking mode and the config does not choose it "
                           "(mlx-lm would render thinking on): set `chat_template_args: {enable_thinking: "
                           "false}` (as served elsewhere) or `{enable_thinking: true}`", "chat-format")
    rep.beat("tokenize", 0.0)
    r.sets, r.counts, r.tokens, r.data_report, hashes = {}, {}, {}, {}, {}
    for split in SPLITS:
        path = d / f"{split}.jsonl"
        try:
            recs = list(jsonl.read(path)) if path.is_file() else []
        except (ValueError, UnicodeDecodeError) as e:
            raise failure(DATA, str(e) if str(path) in str(e) else f"{path}: {e}") from e
        if cfg["batching"] == "length":
            loaded = load_split(path, recs, tokenizer, cfg, rep)
        else:
            loaded = load_split_mlx_lm(path, recs, tokenizer, cfg, rep)
        r.sets[split], r.tokens[split], r.data_report[split] = loaded
        r.counts[split] = len(recs)
        hashes.update({path.name: sha256_file(path)} if path.is_file() else {})
        check_enough(path, split, loaded[0], loaded[2], cfg)
    long = sum(x["truncated"] for x in r.data_report.values())
    if long:
        rep.warn(f"{long} records are longer than max_seq_length {cfg['max_seq_length']} and are truncated")
    if r.sets["valid"] is None and cfg["val_batches"] != 0:
        rep.warn(f"{d}/valid.jsonl missing or empty: training proceeds without validation")
    r.ds_sha = digest_of(hashes)  # export's dataset_sha256 (its manifest's, while the bytes are intact)
    r.chat_format = {"chat_template_args": cfg["chat_template_args"], "has_thinking": tokenizer.has_thinking,
                     "first_record": first_record(r.sets["train"], tokenizer)}
    r.optimizer = prepare_model(mx, r.model, cfg)


def load_split_mlx_lm(path: Path, recs: list, tokenizer, cfg: dict, rep) -> tuple:
    """(mlx-lm's dataset, tokens, report) of a split under `batching: mlx_lm`, tokenized now."""
    if not recs:
        return None, 0, {"records": 0, "truncated": 0}
    try:
        ds = chat.dataset(recs, tokenizer, cfg)
    except (ValueError, UnicodeDecodeError) as e:
        raise failure(DATA, f"{path}: {e}") from e
    lengths = []
    for i in range(len(recs)):
        rep.beat("tokenize")
        try:
            lengths.append(len(ds[i][0]))
        except Exception as e:
            raise failure(DATA, f"{path}:{i + 1} (record_id {recs[i].get('record_id', '?')}) does not "
                                f"tokenize: {type(e).__name__}: {e}") from e
    truncated = sum(n > cfg["max_seq_length"] for n in lengths)
    return ds, sum(lengths), {"records": len(recs), "truncated": truncated}


def load_split(path: Path, recs: list, tokenizer, cfg: dict, rep) -> tuple:
    """(the records to train or score, tokens, report) of a split under `batching: length`.

    Each record is rendered as served (lib/chat.py Renderer) and cut at max_seq_length. A record
    whose targets are all cut away is left out and counted (`lost_answers`), and so is one of
    weight 0 under record_weights; the report says when weights other than 1 were ignored."""
    renderer = chat.Renderer(tokenizer, cfg)
    kept, lost, weights = [], [], set()
    tokens, truncated, weight_zero = 0, 0, 0
    for i, rec in enumerate(recs):
        rep.beat("tokenize")
        where = f"{path}:{i + 1} (record_id {rec.get('record_id', '?')})"
        try:
            rendered = renderer.record(rec)
            weight = float(rec.get("weight", 1.0))
        except Exception as e:
            raise failure(DATA, f"{where} does not render: {type(e).__name__}: {e}") from e
        weights.add(weight)
        used = weight if cfg["record_weights"] else 1.0
        record = batching.truncated(rendered.tokens, rendered.spans, used, cfg["max_seq_length"])
        tokens += len(rendered.tokens)
        truncated += len(rendered.tokens) > cfg["max_seq_length"]
        if not record.spans:
            lost.append(where)
        elif record.weight == 0:
            weight_zero += 1
        else:
            kept.append(record)
    report = {"records": len(recs), "kept": len(kept), "truncated": truncated,
              "lost_answers": len(lost), "first_lost": lost[0] if lost else None,
              "weight_zero": weight_zero,
              "weights_ignored": not cfg["record_weights"] and bool(weights - {1.0})}
    return kept or None, tokens, report


def check_enough(path: Path, split: str, data, report: dict, cfg: dict) -> None:
    """Refuse a split too small for one global batch, or a train split that loses too many answers."""
    n = len(data) if data is not None else 0
    lost = report.get("lost_answers", 0)
    if split == "train" and lost > cfg["max_lost_answers"] * report["records"]:
        raise failure(DATA, f"{lost} of {report['records']} records of {path} lose their whole answer to "
                            f"max_seq_length {cfg['max_seq_length']} (more than max_lost_answers "
                            f"{cfg['max_lost_answers']}), the first {report['first_lost']}: raise "
                            "max_seq_length, or split such records at export")
    needed = {"train": True, "valid": n > 0 and cfg["val_batches"] != 0, "test": cfg["test"]}[split]
    if needed and n < cfg["batch_size"]:
        raise failure(DATA, f"{path} has {n} records to train or score, fewer than batch_size "
                            f"{cfg['batch_size']}: export more records or lower batch_size")


def first_record(data, tokenizer) -> dict:
    """smoke.json's chat_format.first_record: the first train record as trained, and its targets."""
    if isinstance(data, list):
        record = data[0]
        return {"text": tokenizer.decode(record.tokens), "tokens": len(record.tokens),
                "targets": chat.decoded_targets(tokenizer, record), "weight": record.weight}
    ids, k = data[0]
    return {"text": tokenizer.decode(ids), "tokens": len(ids), "loss_from": k,
            "targets": [tokenizer.decode(ids[max(k, 1):])]}


class Batches:
    """This rank's train batches: mlx-lm's looping iterate_batches per share of the global batch (after a
    world change, the old ranks' several) on one numpy stream seeded as `mlx_lm lora` seeds it, where each
    validation (iteration 1, every steps_per_eval; not the last) draws a permutation. Resume: next(1..k)."""

    def __init__(self, np, dataset, cfg: dict, shares, shards: int, n_val: int, merge: bool = False):
        from mlx_lm.tuner.trainer import iterate_batches

        self.np, self.rs, self.n_val, self.cfg = np, np.random.RandomState(cfg["seed"]), n_val, cfg
        self.merge = merge  # rank_shares: this rank's shares as one batch, padded to the longest (masked)
        self.groups = [types.SimpleNamespace(rank=lambda j=j: j, size=lambda: shards) for j in shares]
        self.gens = [iterate_batches(dataset, cfg["batch_size"], cfg["max_seq_length"], True, comm_group=g)
                     for g in self.groups]
        self.dataset = dataset
        self.shards = shards

    def next(self, it: int) -> list:
        out = []
        for gen in self.gens:  # every share draws the same permutation when an epoch starts
            self.np.random.set_state(self.rs.get_state())
            with redirect_stdout(io.StringIO()):  # its truncation warning per batch: load_all warned once
                out.append(next(gen))
        self.rs.set_state(self.np.random.get_state())
        if self.n_val and (it == 1 or it % self.cfg["steps_per_eval"] == 0):
            self.rs.permutation(self.n_val)
        batches = [merged(out)] if self.merge and len(out) > 1 else out
        return [mlx_lm_micro_batch(b) for b in batches]

    def skip(self, step: int) -> None:
        """Where a resume starts: the numpy stream replayed through `step` iterations."""
        for it in range(1, step + 1):
            self.next(it)

    def warmup(self):
        """One local micro-batch that compiles the step (the first global batch's first shard)."""
        from mlx_lm.tuner.trainer import iterate_batches

        one = types.SimpleNamespace(rank=lambda: 0, size=lambda: self.shards)
        cfg = self.cfg
        gen = iterate_batches(self.dataset, cfg["batch_size"], cfg["max_seq_length"], comm_group=one)
        with redirect_stdout(io.StringIO()):
            return mlx_lm_micro_batch(next(gen))


def mlx_lm_micro_batch(batch: tuple) -> batching.MicroBatch:
    """mlx-lm's (tokens, lengths) with its counts: real tokens are the lengths, not the padding."""
    tokens, lengths = batch
    real = int(lengths[:, 1].sum().item())
    return batching.MicroBatch(batch, tokens.shape[0], real, tokens.size)


class LengthBatches:
    """This rank's train micro-batches under `batching: length` (lib/batching.py): the global batch of
    iteration `it` is a function of the seed and `it`, so a resume starts without a replay."""

    def __init__(self, records: list, cfg: dict, shares, shards: int, merge: bool = False):
        self.records = records
        self.plan = batching.Plan([len(r.tokens) for r in records], cfg["batch_size"], cfg["seed"])
        self.shares = list(shares)
        self.shards = shards
        self.merge = merge

    def next(self, it: int) -> list:
        batch = self.plan.at_step(it)
        out = [self.micro_batch(batch, j) for j in self.shares]
        return [batching.merge(out)] if self.merge and len(out) > 1 else out

    def micro_batch(self, batch: list, j: int) -> batching.MicroBatch:
        return batching.collate([self.records[i] for i in batching.shard(batch, j, self.shards)])

    def skip(self, step: int) -> None:
        """Nothing to replay: iteration step + 1's batch is computed from the seed."""

    def warmup(self) -> batching.MicroBatch:
        return self.micro_batch(self.plan.at_step(1), 0)


def merged(batches) -> tuple:
    """Several shards' batches as one, each padded to the longest (the loss masks by length)."""
    n = max(b.shape[1] for b, _ in batches)
    return (mx.concatenate([mx.pad(b, [(0, 0), (0, n - b.shape[1])]) for b, _ in batches]),
            mx.concatenate([lengths for _, lengths in batches]))


def prepare_model(mx, model, cfg: dict):
    """mlx-lm's train_model up to training: seed, freeze, LoRA/DoRA or full layers; the optimizer."""
    from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers

    mx.random.seed(cfg["seed"])
    model.freeze()
    if cfg["num_layers"] > len(model.layers):
        raise C.ConfigError(f"num_layers {cfg['num_layers']} but the model has {len(model.layers)} layers")
    if cfg["fine_tune_type"] == "full":
        for layer in model.layers[-max(cfg["num_layers"], 0):]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"],
                              use_dora=cfg["fine_tune_type"] == "dora")
    if cfg["resume_adapter_file"]:
        model.load_weights(cfg["resume_adapter_file"], strict=False)
    name = cfg["optimizer"]
    try:
        lr = build_schedule(cfg["lr_schedule"]) if cfg["lr_schedule"] else cfg["learning_rate"]
        opt = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
               "adafactor": optim.Adafactor}[name](learning_rate=lr, **cfg["optimizer_config"].get(name, {}))
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise C.ConfigError(f"lr_schedule {cfg['lr_schedule']!r} / optimizer_config.{name} do not build "
                            f"({e}): fix them in the config") from e
    opt.init(model.trainable_parameters())
    return opt


# ---- setup: the group, each rank's own phase, then where the run starts, each agreed by every rank -------
def main() -> int:
    args = build_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as mlx_lm lora sets it
    rep = Reporter(Path(args.run_dir), int(os.environ.get("MLX_RANK", "0") or 0))
    for name in ("failure", "joined"):
        rep.marker(name).unlink(missing_ok=True)
    rep.beat("start", 0.0)
    try:
        keep_awake(rep)
        coll = Group()
        if coll.rank != rep.rank:  # MLX_RANK was dropped for a lone host
            rep = Reporter(rep.run_dir, coll.rank)
        return train(setup(args, coll, rep))
    except Exception as e:
        return fail(as_error(e), rep, args.launch_id)


def setup(args, coll: Group, rep: Reporter):
    """The joined marker, load_all on every rank, then a fresh start or rank 0's checkpoint on every rank."""
    run_dir, rank0 = rep.run_dir, coll.rank == 0
    coll.sum(mx.array(1)).item()  # every rank reached this point: the group works both ways
    joined = {"rank": coll.rank, "world_size": coll.size, "host": socket.gethostname(), "pid": os.getpid(),
              "backend": coll.backend, "launch_id": args.launch_id, "python": sys.executable}
    atomic.write_json(rep.marker("joined"), {**joined, "phase": "initialized"})
    rep.line("rank-joined", **{k: joined[k] for k in ("rank", "world_size", "host", "backend", "pid")})
    if args.expect_world_size and args.expect_world_size != coll.size:
        raise failure(PARITY, f"the group has {coll.size} ranks, expected {args.expect_world_size}: check "
                              "the hostfile and that every host's launcher reached the others")
    r = types.SimpleNamespace(args=args, coll=coll, rep=rep, run_dir=run_dir,
                              ckroot=run_dir / "checkpoints", adapters=run_dir / "adapters")
    coll.run(load_all, r)
    cfg, bs, val, r.chash = r.cfg, r.cfg["batch_size"], r.sets["valid"], C.config_hash(r.cfg)
    atomic.write_json(rep.marker("joined"), {**joined, "phase": "data-loaded", "data": cfg["data"],
                                             "records": sum(r.counts.values()), "records_by_split": r.counts,
                                             "tokens_by_split": r.tokens, "dataset_sha256": r.ds_sha,
                                             "chat_format": r.chat_format, "data_report": r.data_report,
                                             "rank_batch": r.per_rank[coll.rank]})
    rep.line("data", rank=coll.rank, **r.counts, train_tokens=r.tokens["train"], dataset_sha256=r.ds_sha,
             rank_batch=r.per_rank[coll.rank])
    # ---- a fresh start or a resume: rank 0 picks the checkpoint, every rank takes it ----
    r.n_batches, resume = len(r.sets["train"]) // bs, args.resume
    picked = coll.run(ckpt.pick if rank0 and resume else None, r.ckroot, cfg, r.ds_sha, r.n_batches,
                      partial(rep.line, rank=0))
    if not resume and (dest := coll.run(ckpt.archive_run if rank0 else None, run_dir)):
        rep.line("fresh-start", rank=0, archived=dest)
    st = coll.bcast_json(picked and picked[1]) if resume else {}
    n_val = len(val) // bs if val is not None and cfg["val_batches"] != 0 else 0
    if uneven := len(set(r.per_rank)) > 1:  # rank_shares: shards of gcd records, this rank's run of them as
        # one batch; token-weighted, any split of the global batch gives the same gradient
        g, at = math.gcd(*r.per_rank), sum(r.per_rank[:coll.rank])
        r.shards, mine = bs // g, range(at // g, (at + r.per_rank[coll.rank]) // g)
        r.world_change = {"world_size_from": st["world_size"], "world_size": coll.size,
                          "rank_batches": r.per_rank} if st and st["world_size"] != coll.size else None
    else:
        r.shards, r.world_change = ckpt.shards_for(st, coll.size, args.allow_world_change,
                                                   cfg["grad_average"])
        mine = range(coll.rank, r.shards, coll.size)
    if cfg["batching"] == "length":
        r.batches = LengthBatches(r.sets["train"], cfg, mine, r.shards, merge=uneven)
    else:
        r.batches = Batches(np, r.sets["train"], cfg, mine, r.shards, n_val, merge=uneven)
    if st:  # the weights, optimizer and RNG key of rank 0's checkpoint; the data order replayed
        own_w, own_o = (dict(tree_flatten(t)) for t in (r.model.trainable_parameters(), r.optimizer.state))
        w = coll.run(ckpt.read_fitting, mx.load, picked and picked[0], own_w, "adapters")
        o = coll.run(ckpt.read_fitting, mx.load, picked and picked[0], own_o, "optimizer")
        r.model.load_weights(list(coll.bcast(w, own_w).items()), strict=False)
        r.optimizer.state, k = tree_unflatten(list(coll.bcast(o, own_o).items())), st["rng"]["mx_key"]
        mx.random.seed((int(k[0]) << 32) | int(k[1]))
        r.batches.skip(st["step"])  # a function of the seed and n_batches (ckpt.pick checked it)
        if rank0 and (moved := ckpt.supersede_metrics(run_dir, st["step"])):
            rep.line("metrics-superseded", rank=0, events=moved, after_step=st["step"])
    r.window = st.get("window", {"loss": 0.0, "tokens": 0, "steps": 0})  # mlx-lm's report window, all ranks
    r.start = rep.step = st.get("step", 0)
    r.initial_loss, r.val0, r.last_val = st.get("initial_loss"), st.get("val0"), None
    r.train_time, r.ckpt_time, r.grad, r.trained_tokens = 0.0, 0.0, None, st.get("trained_tokens", 0)
    r.padding = st.get("padding", {"real": 0, "positions": 0})  # over the run's steps, every rank
    r.adapter_config = {**cfg, "adapter_path": str(r.adapters), "runbook": {"config_sha256": r.chash,
                        "dataset_sha256": r.ds_sha, "world_size": coll.size, "launch_id": args.launch_id}}
    if rank0:
        rep.metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg["report_to"] and not args.no_tracking:  # W&B's start: up to INIT_TIMEOUT_S when offline
            with rep.beating("tracking"):
                rep.tracker = Tracker(partial(rep.warn, what="tracking"))
                rep.tracker.start(cfg, run_dir, r.start)
            rep.event("tracking", r.start, **rep.tracker.info)
        rep.event("data", r.start, **data_summary(r))  # after the tracker starts: W&B gets it too
        warn_about_data(r)
        ckpt.sweep_temporaries(r.ckroot)
        atomic.write_json(r.adapters / "adapter_config.json", r.adapter_config)
        if r.world_change:
            rep.line("world-change", rank=0, **r.world_change)
            rep.event("world-change", r.start, **r.world_change)
    mx.eval(r.model.parameters(), r.optimizer.state)
    return r


def data_summary(r) -> dict:
    """What the run trains on: records kept and left out per split, and the epochs `iters` makes."""
    epochs = r.cfg["iters"] / r.n_batches
    return {"batching": r.cfg["batching"], "mask_prompt": r.cfg["mask_prompt"],
            "record_weights": r.cfg["record_weights"], "batches_per_epoch": r.n_batches,
            "epochs": round(epochs, 4), "splits": r.data_report}


def warn_about_data(r) -> None:
    """Warnings shown again above the stage's PASS/FAIL: ignored weights, answers lost, odd epochs."""
    cfg, rep = r.cfg, r.rep
    ignored = [split for split, report in r.data_report.items() if report.get("weights_ignored")]
    if ignored:
        rep.warn(f"records of {', '.join(ignored)} have a weight other than 1 and record_weights is "
                 "false: they train and score at weight 1 (set record_weights: true to use them)",
                 "weights-ignored", splits=ignored)
    for split, report in r.data_report.items():
        if report.get("lost_answers"):
            rep.warn(f"{report['lost_answers']} of {report['records']} {split} records lose their whole "
                     f"answer to max_seq_length {cfg['max_seq_length']} and are left out, the first "
                     f"{report['first_lost']}", "lost-answers", split=split, records=report["lost_answers"])
    epochs = cfg["iters"] / r.n_batches
    if not 0.5 <= epochs <= 10 and not r.args.no_epochs_warning:
        rep.warn(f"iters {cfg['iters']} x batch_size {cfg['batch_size']} is {epochs:.2f} epochs of the "
                 f"{len(r.sets['train'])} train records: set iters for 0.5 to 10 epochs "
                 f"({r.n_batches} iters an epoch)", "epochs", epochs=round(epochs, 4))


def padding_fraction(padding: dict) -> float | None:
    """Padded positions over all positions of every micro-batch trained, every rank."""
    if not padding["positions"]:
        return None
    return round(1 - padding["real"] / padding["positions"], 4)


def save_checkpoint(r, step: int, final: bool) -> None:
    """Rank 0: checkpoints/step-N (weights, optimizer, state, adapter_config.json), pruning, adapters/."""
    k, n, tic = mx.random.state[0].tolist(), r.n_batches, time.perf_counter()
    weights, opt = dict(tree_flatten(r.model.trainable_parameters())), dict(tree_flatten(r.optimizer.state))
    val_loss, meta = r.last_val[1] if r.last_val and r.last_val[0] == step else None, {"format": "mlx"}
    config = atomic.dumps_json({**r.adapter_config, "adapter_path": str(r.ckroot / ckpt.name_of(step))})
    state = {"config": r.cfg, "config_sha256": r.chash, "files_sha256": r.ds_sha, "world_size": r.coll.size,
             "shards": r.shards if len(set(r.per_rank)) == 1 else r.coll.size, "rank_batches": r.per_rank,
             "final": final, "launch_id": r.args.launch_id, "val_loss": val_loss,
             "rng": {"mx_key": [int(k[0]), int(k[1])]}, "time": time.strftime("%FT%T%z"), "window": r.window,
             "data": {"n_batches": n, "epoch": (step - 1) // n, "pos": (step - 1) % n + 1},
             "trained_tokens": r.trained_tokens, "initial_loss": r.initial_loss, "val0": r.val0,
             "padding": r.padding}
    path = ckpt.save(r.ckroot, step, {
        "adapters.safetensors": lambda p: mx.save_safetensors(str(p), weights, metadata=meta),
        "optimizer.safetensors": lambda p: mx.save_safetensors(str(p), opt, metadata=meta),
        "adapter_config.json": lambda p: p.write_text(config, encoding="utf-8")}, state)
    pruned = ckpt.prune(r.ckroot, r.cfg["keep_last_k"])
    atomic.write_bytes(r.adapters / "adapters.safetensors", (path / "adapters.safetensors").read_bytes())
    r.ckpt_time += (dt := time.perf_counter() - tic)
    r.rep.line("checkpoint", step=step, path=path, seconds=dt, val_loss=json.dumps(val_loss),
               pruned=",".join(pruned) or "-")
    r.rep.event("checkpoint", step, path=str(path), seconds=round(dt, 4), final=final, loss=val_loss)


# ---- the step -------------------------------------------------------------------------------------
def losses(cfg: dict):
    """(train loss, eval loss) of the config: mlx-lm's default_loss, or lib/loss.py's chunked one."""
    from mlx_lm.tuner.trainer import default_loss

    n, chunked = cfg["loss_chunk_tokens"], cfg["loss"] == "chunked"
    if cfg["batching"] == "length":  # the batches carry per-target weights (lib/batching.py)
        if chunked:
            return make_loss(n, weighted=True), make_loss(n, grad=False, weighted=True)
        return weighted_default_loss, weighted_default_loss
    return (make_loss(n), make_loss(n, grad=False)) if chunked else (default_loss, default_loss)


def compiled_step(r):
    """mlx-lm's compiled step with the config's loss, the all-reduce on the CPU stream, grad_average: tokens
    (the summed token losses' gradients over the global token count) and max_grad_norm. step(batch, acc,
    do_update) -> (loss, ntoks, acc): acc the accumulated (gradient, tokens), after an update the norm.
    Sets up as mlx-lm's train() does (wired limit, grad_checkpoint, r.state); calibrate measures this."""
    from mlx_lm.tuner.trainer import grad_checkpoint
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    model, optimizer, cfg = r.model, r.optimizer, r.cfg
    maybe_set_recommended_wired_limit()
    if cfg["grad_checkpoint"]:
        grad_checkpoint(model.layers[0])
    r.state = [model.state, optimizer.state, mx.random.state]
    accum, clip = cfg["grad_accumulation_steps"], cfg["max_grad_norm"]
    by_tokens, loss_fn, size = cfg["grad_average"] == "tokens", losses(cfg)[0], mx.distributed.init().size()

    def summed(model, batch, lengths):
        lvalue, toks = loss_fn(model, batch, lengths)
        return (lvalue * toks if by_tokens else lvalue), lvalue, toks

    loss_value_and_grad = nn.value_and_grad(model, summed)

    def step(batch, prev, do_update):
        (_, lvalue, toks), grad = loss_value_and_grad(model, *batch)
        n = toks.astype(mx.float32)
        if prev is not None:
            grad, n = tree_map(lambda x, y: x + y, grad, prev[0]), n + prev[1]
        if not do_update:
            return lvalue, toks, (grad, n)
        grad = nu.average_gradients(grad, communication_stream=mx.cpu)
        if by_tokens:  # average_gradients divides by the world size: the global sum over the global tokens
            grad = tree_map(lambda x: x * (size / mx.distributed.all_sum(n, stream=mx.cpu)), grad)
        elif accum > 1:
            grad = tree_map(lambda x: x / accum, grad)
        grad, norm = optim.clip_grad_norm(grad, clip) if clip else (grad, optim.clip_grad_norm(grad, 1.0)[1])
        optimizer.update(model, grad)
        return lvalue, toks, norm

    return partial(mx.compile, inputs=r.state, outputs=r.state)(step)


def train_step(r, step, it: int) -> tuple:
    """One iteration on this rank's share(s): (global loss, tokens, this rank's loss, grad norm or None); the
    global loss token-weighted with grad_average: tokens, else mlx-lm's mean of the ranks' means."""
    cfg, batches = r.cfg, r.batches.next(it)
    update, k, lv, nt = it % cfg["grad_accumulation_steps"] == 0, len(batches), [], []
    for j, batch in enumerate(batches):
        lvalue, toks, out = step(batch.arrays, r.grad, update and j == k - 1)
        r.grad = None if update and j == k - 1 else out
        mx.eval(r.state, lvalue, toks, out)
        lv, nt = lv + [lvalue], nt + [toks.astype(mx.float32)]
    real = sum(b.real_tokens for b in batches)
    positions = sum(b.positions for b in batches)
    weighted = sum(a * b for a, b in zip(lv, nt, strict=True))
    sums = mx.stack([sum(lv), weighted, sum(nt), mx.array(real, mx.float32), mx.array(positions, mx.float32)])
    both = r.coll.sum(sums).tolist()
    mean, tokens, w = both[0] / (r.coll.size * k), round(both[2]), r.window
    w.update(loss=w["loss"] + mean, tokens=w["tokens"] + tokens, steps=w["steps"] + 1)
    r.padding = {"real": r.padding["real"] + round(both[3]),
                 "positions": r.padding["positions"] + round(both[4])}
    r.real_tokens = round(both[3])
    loss = both[1] / max(both[2], 1e-9) if cfg["grad_average"] == "tokens" else mean
    return loss, tokens, (sum(lv) / k).item(), out.item() if update else None


def evaluate(r, step: int, split: str) -> None:
    """mlx-lm's evaluate on `valid` (if any) or `test`, a progress line per batch (at most one a second)."""
    cfg, rep, tic, phase = r.cfg, r.rep, time.perf_counter(), "val" if split == "valid" else "test"
    if r.sets[split] is None or (n := cfg[f"{phase}_batches"]) == 0:
        return
    rep.beat(phase, 0.0)
    if cfg["batching"] == "length":
        loss = evaluate_length(r, r.sets[split], n, partial(rep.beat, phase))
    else:
        loss = evaluate_mlx_lm(r, r.sets[split], n, partial(rep.beat, phase))
    r.model.train()
    dt, ppl = time.perf_counter() - tic, math.exp(loss) if loss < 700 else float("inf")
    if phase == "val":
        r.last_val, r.val0 = (step, loss), loss if step == 0 else r.val0
    if r.coll.rank == 0:
        rep.line(phase, step=step, **{f"{phase}_loss": loss, f"{phase}_ppl": ppl, f"{phase}_s": dt})
    rep.event(phase, step, loss=loss, ppl=ppl, peak_mem_gb=mx.get_peak_memory() / 1e9,
              **{f"{phase}_s": round(dt, 4)})


def evaluate_length(r, records: list, n: int, beat) -> float:
    """The weighted loss over `n` global batches (-1: all) of a split under `batching: length`: a seeded
    order cut by length, every record once (the last batch may be short), each global batch split
    into this rank's shards as a train step splits it; token-weighted over every rank."""
    plan = batching.Plan([len(x.tokens) for x in records], r.cfg["batch_size"], r.cfg["seed"],
                         drop_last=False)
    eval_loss = losses(r.cfg)[1]
    total = mx.array(0.0)
    weight = mx.array(0.0)
    chosen = plan.epoch(0) if n == -1 else plan.epoch(0)[:n]
    for batch in chosen:
        rows = [[records[i] for i in batching.shard(batch, j, r.batches.shards)] for j in r.batches.shares]
        rows = [x for x in rows if x]
        if r.batches.merge and rows:
            rows = [[x for part in rows for x in part]]
        for part in rows:
            micro = batching.collate(part)
            value, ntoks = eval_loss(r.model, *micro.arrays)
            total = total + value * ntoks
            weight = weight + ntoks
        mx.eval(total, weight)
        beat()
    both = r.coll.sum(mx.stack([total, weight])).tolist()
    return both[0] / max(both[1], 1e-9)


def evaluate_mlx_lm(r, dataset, n: int, beat) -> float:
    """mlx-lm's evaluate (`batching: mlx_lm`); rank_shares: this rank's shards merged."""
    from mlx_lm.tuner import trainer

    cfg = r.cfg
    iterate = plain = partial(trainer.iterate_batches, seed=cfg["seed"])
    if r.batches.merge:  # rank_shares: each global batch split as a train step splits it, this rank's shards
        # merged (an uneven batch need not divide by the world size); token-weighted: the control's loss
        def iterate(dataset, batch_size, max_seq_length, comm_group=None):
            gens = [plain(dataset, batch_size, max_seq_length, comm_group=g) for g in r.batches.groups]
            return map(merged, zip(*gens, strict=True))
    return trainer.evaluate(model=r.model, dataset=dataset, batch_size=cfg["batch_size"], num_batches=n,
                            max_seq_length=cfg["max_seq_length"], loss=losses(cfg)[1],
                            iterate_batches=iterate, progress_callback=beat)


# ---- the training loop ----------------------------------------------------------------------------
def train(r) -> int:
    """mlx-lm's train() loop on this run's data order, with a checkpoint at every save_every."""
    from mlx_lm.tuner.trainer import _clear_cache

    cfg, coll, rep, iters = r.cfg, r.coll, r.rep, r.cfg["iters"]
    step, t_wall = compiled_step(r), time.perf_counter()
    # ---- before step 1: the step-0 validation; the compiled step's kernels (over a minute on a fresh
    # machine) built on one local batch with beats (no all-reduce hides behind them), the RNG put back ----
    if r.start == 0:
        evaluate(r, 0, "valid")
    r.model.train()
    if r.start < iters:
        key = mx.random.state[0].tolist()
        with rep.beating("compile"):
            mx.eval(step(r.batches.warmup().arrays, None, False))
        mx.random.seed((int(key[0]) << 32) | int(key[1]))  # as a resume restores it
        rep.beat("train", 0.0)  # step 1 still builds the update's kernels: seconds on a fresh machine
    for it in range(r.start + 1, iters + 1):
        # ---- one global batch: forward, backward, all-reduce, update ----
        tic = time.perf_counter()
        loss, tokens, rank_loss, norm = train_step(r, step, it)
        _clear_cache(cfg["clear_cache_threshold"])
        dt = time.perf_counter() - tic
        r.train_time, rep.step, lr = r.train_time + dt, it, r.optimizer.learning_rate.item()
        r.initial_loss = loss if r.initial_loss is None else r.initial_loss
        rep.line(f"iter {it}", rank=coll.rank, loss=loss, rank_loss=rank_loss, tokens=tokens, step_s=dt,
                 grad_norm=norm)
        rep.event("step", it, loss=loss, lr=lr, tokens=tokens, tok_per_s=tokens / dt if dt else None,
                  real_tokens=r.real_tokens, real_tok_per_s=r.real_tokens / dt if dt else None,
                  step_s=round(dt, 5), grad_norm=norm)
        # ---- stability: NaN/inf at any step, or divergence early on, stops every rank (global loss) ----
        diverged = it <= cfg["divergence_window"] and loss > cfg["divergence_factor"] * r.initial_loss
        if diverged or not math.isfinite(loss):
            why = (f"diverged: {loss:.4g} at step {it} is more than {cfg['divergence_factor']}x the first "
                   f"step's {r.initial_loss:.4g}" if diverged else f"is {loss} at step {it}")
            raise failure(STABILITY, f"the loss {why} (learning_rate {cfg['learning_rate']}): lower the "
                                     "learning rate, check the data and the LoRA scale")
        # ---- report (mlx-lm's: the window's mean loss over every rank), validate, checkpoint ----
        if it % cfg["steps_per_report"] == 0 or it == iters:
            w, t, peak = r.window, r.train_time, mx.get_peak_memory() / 1e9
            mean, tps = w["loss"] / w["steps"], w["tokens"] / t if t else 0.0
            r.trained_tokens += w["tokens"]
            if coll.rank == 0:
                rep.line(f"iter {it}", train_loss=mean, lr=lr, **{"tok/s": tps}, peak_mem_gb=peak,
                         trained_tokens=r.trained_tokens, **{"it/s": w["steps"] / t if t else 0.0})
            rep.event("train", it, loss=mean, lr=lr, tokens=w["tokens"], tok_per_s=tps, peak_mem_gb=peak,
                      trained_tokens=r.trained_tokens, train_s=round(t, 4))
            r.window, r.train_time = {"loss": 0.0, "tokens": 0, "steps": 0}, 0.0
        if it % cfg["steps_per_eval"] == 0 or it == iters:
            evaluate(r, it, "valid")
        stop = r.args.stop_at_step is not None and r.args.stop_at_step <= it < iters  # a clean preemption
        if it % cfg["save_every"] == 0 or it == iters or stop:
            coll.run(save_checkpoint if coll.rank == 0 else None, r, it, it == iters)
        if stop:
            rep.line("stopped", rank=coll.rank, step=it, reason="--stop-at-step")
            rep.event("done", it, stopped=True, checkpoint_s=round(r.ckpt_time, 4),
                      train_wall_s=round(time.perf_counter() - t_wall, 4), **rep.tracker.cost())
            rep.tracker.finish(0)
            return 0
    return finish(r, time.perf_counter() - t_wall)


def finish(r, wall: float) -> int:
    """The test evaluation, a warning if validation did not improve, `done` naming the best checkpoint."""
    iters, rep = r.cfg["iters"], r.rep
    if r.cfg["test"]:  # load_all made sure the split is there
        evaluate(r, iters, "test")
    if r.coll.rank != 0:
        return 0
    if r.last_val and r.val0 is not None and not r.last_val[1] < r.val0:
        msg = (f"the final validation loss {r.last_val[1]:.4f} (step {r.last_val[0]}) is not below step 0's "
               f"{r.val0:.4f}: this adapter does not improve on the base model")
        rep.warn(msg, "no-improvement", loss=r.last_val[1], val_loss_step0=r.val0)
    name, val_loss = ckpt.best(r.ckroot) or (None, None)
    best = str(r.ckroot / name) if name else None
    rep.line("done", step=iters, wall_s=wall, checkpoint_s=r.ckpt_time, adapter=r.adapters, best=name or "-",
             best_adapter=best or "-")
    rep.event("done", iters, checkpoint_s=round(r.ckpt_time, 4), train_wall_s=round(wall, 4), best=name,
              best_val_loss=val_loss, best_adapter=best, world_change=r.world_change,
              padding_fraction=padding_fraction(r.padding), epochs=round(iters / r.n_batches, 4),
              **rep.tracker.cost())
    rep.tracker.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
