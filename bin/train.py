#!/usr/bin/env python3
"""The rank-side LoRA trainer: runs on every rank under mlx.launch, or alone as one rank.

Usage:
    mlx.launch --hostfile HOSTFILE --backend ring -- PYTHON bin/train.py --config CONFIG --model MODEL \
        --data datasets/NAME --run-dir runs/RUN [--resume [--allow-world-change]] [--iters N] [--seed S] \
        [--expect-world-size W] [--launch-id ID] [--stop-at-step K]
Example (one rank, on the demo's export):
    .venv/bin/python bin/train.py --config configs/demo.yaml --model models/tiny-gemma4 \
        --data datasets/demo --run-dir runs/try

mlx-lm's LoRA training (its load, LoRA layers, datasets, iterate_batches, default_loss or lib/loss.py's
chunked loss, evaluate, compiled step) with exact resume: weights, optimizer, RNG key and report window
in each checkpoint (lib/checkpoint.py), the data order replayed from the seed. batch_size is the global
batch; `grad_average: tokens` weights each rank by its tokens; --allow-world-change resumes on fewer ranks.
Without --resume an earlier run moves to superseded-<time>-<pid>/.

The contract with lib/launch.py: rank R writes logs/rank-R.joined.json when the group is up (then the
records and dataset hashes), logs/rank-R.failure.json (category, kind, anchor, step, exit_code, launch_id;
a failure before training is agreed by every rank) and logs/rank-R.log (its stdout, timestamped); rank 0
metrics.jsonl (step, train, val, test, checkpoint, world-change, warning, done events; a resume moves later
ones to metrics.superseded.jsonl), checkpoints/step-NNNNNNN/ and adapters/ (mlx-lm adapter folders).
Stdout: `rank-joined`, `progress rank R phase P` (the watchdog's signal), `iter N rank R loss X`, `iter N
train_loss X ...`, `val`, `checkpoint`, `test`, `warning`, `done step N ... best_adapter PATH`, `failed`.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from contextlib import contextmanager, redirect_stdout
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl  # noqa: E402
from lib import checkpoint as ckpt  # noqa: E402
from lib import config as C  # noqa: E402
from lib.dataset import read_manifest  # noqa: E402
from lib.hashing import digest_of, sha256_file  # noqa: E402
from lib.log import DATA, OOM_RE, PARITY, STABILITY, RunbookError, error_of_code, event, failure  # noqa: E402

SPLITS = ("train", "valid", "test")
CAFFEINATE = "/usr/bin/caffeinate"  # macOS; absent on Linux (tests point it at a fake)
# The config keys the launcher, smoke and the OOM ladder override (over the YAML), by mlx-lm's flag names.
FLAGS = (("model", str), ("data", str), ("iters", int), ("seed", int), ("batch_size", int),
         ("optimizer", str), ("learning_rate", float), ("save_every", int), ("steps_per_eval", int),
         ("steps_per_report", int), ("max_seq_length", int), ("grad_accumulation_steps", int))


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
    for key, typ in FLAGS:
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None)
    return p


# ---- per-rank output ------------------------------------------------------------------------------
class Reporter:
    """The rank's lines on stdout and in logs/rank-R.log; rank 0's metrics.jsonl; the step a failure names."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank, self.step, self.metrics = run_dir, rank, None, None
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "logs" / f"rank-{rank}.log", "a", encoding="utf-8")
        self.t0 = self.last_beat = time.monotonic()

    def line(self, name: str, /, **fields) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {event(name, **fields)}\n")
        self.log.flush()

    def warn(self, message: str) -> None:
        self.line("warning", rank=self.rank, message=json.dumps(message))

    def beat(self, phase: str, every_s: float = 1.0) -> None:
        """A progress line for the orchestrator's watchdog (at most one per every_s)."""
        if time.monotonic() - self.last_beat >= every_s:
            self.last_beat = time.monotonic()
            self.line("progress", rank=self.rank, phase=phase)

    @contextmanager
    def beating(self, phase: str):
        """Progress lines every 3 s around one long local call without collectives; they stop first."""
        self.beat(phase, 0.0)
        done, t0 = threading.Event(), time.monotonic()

        def beats() -> None:
            while not done.wait(3.0):
                self.line("progress", rank=self.rank, phase=phase, elapsed_s=round(time.monotonic() - t0))

        thread = threading.Thread(target=beats, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def event(self, kind: str, step: int, **fields) -> None:
        """Rank 0: one metrics event (JSON has no NaN/inf: those are null and named in `nonfinite`)."""
        if self.metrics is None:
            return
        ev = {"step": step, "kind": kind, "loss": None, "lr": None, "tokens": None, "tok_per_s": None,
              "peak_mem_gb": None, "wall_s": round(time.monotonic() - self.t0, 3), **fields}
        if bad := {k: str(v) for k, v in ev.items() if isinstance(v, float) and not math.isfinite(v)}:
            ev.update({k: None for k in bad}, nonfinite=bad)
        self.metrics.write(jsonl.dumps(ev) + "\n")
        self.metrics.flush()


def marker(run_dir: Path, rank: int, name: str) -> Path:
    return run_dir / "logs" / f"rank-{rank}.{name}.json"


def as_error(e: BaseException) -> RunbookError:
    """An exception as the RunbookError it stands for (out of memory by MLX's error text)."""
    if isinstance(e, RunbookError):
        return e
    if isinstance(e, (RuntimeError, MemoryError)) and OOM_RE.search(str(e)):
        return RunbookError(f"out of memory or GPU timeout: {e}; retry with the orchestrator's fallback "
                            "ladder (per-rank batch 1 with gradient accumulation)", "out-of-memory")
    traceback.print_exc()
    return RunbookError(f"{type(e).__name__}: {e}", "trainer")


def fail(err: RunbookError, rep: Reporter, launch_id: str) -> int:
    """Write logs/rank-R.failure.json and say why; returns the exit code."""
    atomic.write_json(marker(rep.run_dir, rep.rank, "failure"), {
        "rank": rep.rank, "category": err.category, "anchor": err.anchor, "kind": err.kind,
        "message": err.args[0], "step": rep.step, "exit_code": err.exit_code, "launch_id": launch_id,
        "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    rep.line("failed", rank=rep.rank, exit_code=err.exit_code, category=json.dumps(err.category),
             step=rep.step, message=json.dumps(str(err)))
    print(f"error: {err}", file=sys.stderr, flush=True)
    return err.exit_code


def keep_awake(rep: Reporter):
    """macOS: `caffeinate -i -w PID` keeps this Mac from idle sleep while this rank lives."""
    if not os.path.isfile(CAFFEINATE):
        return None
    p = subprocess.Popen([CAFFEINATE, "-i", "-w", str(os.getpid())], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rep.line("caffeinate", rank=rep.rank, pid=p.pid)
    return p


# ---- distributed group --------------------------------------------------------------------------
class Group:
    """mlx's group (strict under mlx.launch; alone, or with its empty MLX_HOSTFILE for one host, a world
    of one) and the collectives besides the gradient all-reduce, on the CPU stream."""

    def __init__(self):
        import mlx.core as mx  # check-parity made sure every host's interpreter has it

        env, hostfile = os.environ.get, Path(os.environ.get("MLX_HOSTFILE") or "/nonexistent")
        if hostfile.is_file() and not hostfile.read_text().strip():  # mlx.launch with a single host
            os.environ.pop("MLX_HOSTFILE")
            os.environ.pop("MLX_RANK", None)
        backend = ("jaccl" if env("MLX_IBV_DEVICES") or env("MLX_JACCL_COORDINATOR") else "ring"
                   if env("MLX_HOSTFILE") else "mpi" if env("OMPI_COMM_WORLD_SIZE") else "none")
        try:
            group = mx.distributed.init(strict="MLX_RANK" in os.environ)
        except Exception as e:
            raise failure(PARITY, f"the distributed group did not form ({backend}): {e}") from e
        self.mx, self.rank, self.size = mx, group.rank(), group.size()
        self.backend = backend if self.size > 1 else "none"

    def sum(self, x):
        return self.mx.distributed.all_sum(x, stream=self.mx.cpu)

    def run(self, fn, *a, **kw):
        """Run one local phase (fn None: nothing); if any rank fails, all stop with its exit code."""
        out, err, codes = None, None, [0] * self.size
        try:
            out = fn(*a, **kw) if fn else None
        except Exception as e:
            err = as_error(e)
            codes[self.rank] = err.exit_code
        codes = self.sum(self.mx.array(codes)).tolist()
        if err:
            raise err
        if failed := [r for r, c in enumerate(codes) if c]:
            raise error_of_code(codes[failed[0]], f"rank(s) {failed} failed (exit {codes[failed[0]]}); "
                                                  "see their logs/rank-R.failure.json")
        return out

    def bcast(self, flat: dict | None, like: dict) -> dict:
        """Rank 0's arrays to every rank (the others add zeros shaped like `like`)."""
        out = {k: self.sum(flat[k] if self.rank == 0 else self.mx.zeros(v.shape, v.dtype))
               for k, v in sorted(like.items())}
        self.mx.eval(list(out.values()))
        return out

    def bcast_json(self, obj):
        mx, data = self.mx, json.dumps(obj).encode() if self.rank == 0 else b""
        like = {"b": mx.zeros((int(self.sum(mx.array(len(data))).item()),), mx.int32)}
        return json.loads(bytes(self.bcast({"b": mx.array(list(data), mx.int32)}, like)["b"].tolist()))


# ---- data ----------------------------------------------------------------------------------------
def check_data_files(cfg: dict) -> tuple[str, str]:
    """(dataset_sha256: its manifest's, else the files', files_sha256: of the split files present)."""
    d = Path(cfg["data"])
    if not (d / "train.jsonl").is_file():
        raise failure(DATA, f"dataset {d / 'train.jsonl' if d.is_dir() else d} not found on "
                            f"{socket.gethostname()} (cwd {os.getcwd()}); run `make export` and `make sync`")
    present = {f"{s}.jsonl": sha256_file(d / f"{s}.jsonl") for s in SPLITS if (d / f"{s}.jsonl").is_file()}
    man = read_manifest(d) if (d / "manifest.json").is_file() else {}
    return str(man.get("dataset_sha256") or digest_of(present)), digest_of(present)


def load_data(cfg: dict, tokenizer, rep: Reporter):
    """The splits as mlx-lm datasets (None if empty), tokenized now so a bad record fails naming file
    and line: (sets, records by split, tokens by split)."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    d, bs, sets, counts, tokens, long = Path(cfg["data"]), cfg["batch_size"], {}, {}, {}, 0
    for split in SPLITS:
        path, lengths = d / f"{split}.jsonl", []
        try:
            recs = list(jsonl.read(path)) if path.is_file() else []
            ds = CacheDataset(create_dataset(recs, tokenizer, types.SimpleNamespace(**cfg))) if recs else None
        except (ValueError, UnicodeDecodeError) as e:
            raise failure(DATA, str(e) if str(path) in str(e) else f"{path}: {e}") from e
        for i in range(len(recs)):
            rep.beat("tokenize")
            try:
                lengths.append(len(ds[i][0]))
            except Exception as e:
                raise failure(DATA, f"{path}:{i + 1} (record_id {recs[i].get('record_id', '?')}) does not "
                                    f"tokenize: {type(e).__name__}: {e}") from e
        sets[split], counts[split], tokens[split] = ds, len(recs), sum(lengths)
        long += sum(n > cfg["max_seq_length"] for n in lengths)
        needed = {"train": True, "valid": cfg["val_batches"] != 0, "test": cfg["test"]}[split]
        if needed and 0 < len(recs) < bs:
            raise failure(DATA, f"{path} has {len(recs)} records, fewer than batch_size {bs}: export more "
                                "records or lower batch_size")
    if not counts["train"] or (cfg["test"] and not counts["test"]):
        raise failure(DATA, f"{d}/train.jsonl has no records" if not counts["train"] else
                      f"test: true but {d}/test.jsonl is missing or empty")
    if long:
        rep.warn(f"{long} records are longer than max_seq_length {cfg['max_seq_length']} and are truncated")
    return sets, counts, tokens


class Batches:
    """This rank's train batches: mlx-lm's iterate_batches (looping) for each of its shares of the global
    batch (after a world change, the old ranks' several), drawing from one numpy stream seeded with the
    seed as `mlx_lm lora` does, where validation (iteration 1 and every steps_per_eval; here not at the
    last, so the order does not depend on `iters`) draws a permutation too. Resume replays next(1..k)."""

    def __init__(self, np, dataset, cfg: dict, shares, shards: int, n_val: int):
        from mlx_lm.tuner.trainer import iterate_batches

        self.np, self.rs, self.n_val = np, np.random.RandomState(cfg["seed"]), n_val
        self.spe = cfg["steps_per_eval"]
        groups = [types.SimpleNamespace(rank=lambda j=j: j, size=lambda: shards) for j in shares]
        self.gens = [iterate_batches(dataset, cfg["batch_size"], cfg["max_seq_length"], True, comm_group=g)
                     for g in groups]

    def next(self, it: int) -> list:
        out = []
        for gen in self.gens:  # every share draws the same permutation when an epoch starts
            self.np.random.set_state(self.rs.get_state())
            with redirect_stdout(io.StringIO()):  # its truncation warning per batch: load_data warned once
                out.append(next(gen))
        self.rs.set_state(self.np.random.get_state())
        if self.n_val and (it == 1 or it % self.spe == 0):
            self.rs.permutation(self.n_val)
        return out


# ---- model ---------------------------------------------------------------------------------------
def load_model(cfg: dict, rep: Reporter):
    """mlx-lm's load (its import alone takes seconds), with progress lines while it reads the weights."""
    m, host = cfg["model"], socket.gethostname()
    if (m.startswith((".", "/", "~", "models/")) or Path(m).exists()) and not Path(m).expanduser().is_dir():
        raise failure(DATA, f"model folder {m} not found on {host} (cwd {os.getcwd()}); run "
                            "`make tiny-model` or `make sync SYNC_MODEL=1`")
    with rep.beating("load-model"):
        try:
            from mlx_lm.utils import load

            return load(m, tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                        trust_remote_code=cfg["trust_remote_code"])
        except (FileNotFoundError, ValueError, OSError) as e:
            raise failure(DATA, f"model {m} does not load on {host} ({type(e).__name__}: {e}); run "
                                "`make sync SYNC_MODEL=1`") from e


def prepare_model(mx, model, cfg: dict):
    """mlx-lm's train_model up to training: seed, freeze, LoRA/DoRA or full layers; the optimizer."""
    import mlx.optimizers as optim
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


# ---- setup: the group, config, data, model and checkpoint, each agreed by every rank -----------------
def main() -> int:
    args = build_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as mlx_lm lora sets it
    run_dir, rank = Path(args.run_dir), int(os.environ.get("MLX_RANK", "0") or 0)
    for name in ("failure", "joined"):
        marker(run_dir, rank, name).unlink(missing_ok=True)
    rep = Reporter(run_dir, rank)
    rep.beat("start", 0.0)
    try:
        keep_awake(rep)
        coll = Group()
        if coll.rank != rank:  # MLX_RANK was dropped for a lone host
            rep = Reporter(run_dir, coll.rank)
        return train(setup(args, coll, rep))
    except Exception as e:
        return fail(as_error(e), rep, args.launch_id)


def resolve_config(args, world: int) -> dict:
    cfg = C.resolve(args.config, {key: getattr(args, key) for key, _ in FLAGS})
    C.check_world(cfg, world)
    return cfg


def setup(args, coll: Group, rep: Reporter):
    """The run: its config, the data files (cheap, before the slow imports), the model, the records,
    then where it starts."""
    from importlib.metadata import version

    import numpy as np

    mx, backend = coll.mx, coll.backend
    coll.sum(mx.array(1)).item()  # every rank reached this point: the group works both ways
    joined = {"rank": coll.rank, "world_size": coll.size, "host": socket.gethostname(), "backend": backend,
              "pid": os.getpid(), "launch_id": args.launch_id, "python": sys.executable,
              "platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
              "cwd": os.getcwd(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phase": "initialized"}
    atomic.write_json(marker(rep.run_dir, coll.rank, "joined"), joined)
    rep.line("rank-joined", rank=coll.rank, world_size=coll.size, host=joined["host"], backend=backend,
             pid=os.getpid())
    if args.expect_world_size and args.expect_world_size != coll.size:
        raise failure(PARITY, f"the group has {coll.size} ranks, expected {args.expect_world_size}: check "
                              "the hostfile and that every host's launcher reached the others")
    cfg, run_dir = coll.run(resolve_config, args, coll.size), rep.run_dir
    r = types.SimpleNamespace(args=args, mx=mx, np=np, coll=coll, rep=rep, cfg=cfg, chash=C.config_hash(cfg),
                              run_dir=run_dir, ckroot=run_dir / "checkpoints", adapters=run_dir / "adapters")
    r.ds_sha, r.files_sha = coll.run(check_data_files, cfg)
    r.model, tokenizer = coll.run(load_model, cfg, rep)
    rep.beat("tokenize", 0.0)
    sets, counts, tokens = coll.run(load_data, cfg, tokenizer, rep)
    joined.update(phase="data-loaded", records=sum(counts.values()), records_by_split=counts,
                  tokens_by_split=tokens, dataset_sha256=r.ds_sha, files_sha256=r.files_sha, data=cfg["data"])
    atomic.write_json(marker(run_dir, coll.rank, "joined"), joined)
    rep.line("data", rank=coll.rank, **counts, train_tokens=tokens["train"], dataset_sha256=r.ds_sha)
    r.train_set, r.val_set, r.test_set = sets["train"], sets["valid"], sets["test"]
    if r.val_set is None and cfg["val_batches"] != 0:
        rep.warn(f"{cfg['data']}/valid.jsonl missing or empty: training proceeds without validation")
    r.optimizer = coll.run(prepare_model, mx, r.model, cfg)
    # ---- a fresh start (rank 0 moves an earlier run aside) or rank 0's checkpoint on every rank ----
    bs = cfg["batch_size"]
    r.n_batches = len(r.train_set) // bs
    picked = coll.run(pick_checkpoint if coll.rank == 0 else None, r)
    st = coll.bcast_json(picked and picked[1]) if r.args.resume else {}
    r.shards, r.world_change = (ckpt.shards_for(st, coll.size, r.args.allow_world_change, cfg["grad_average"])
                                if st else (coll.size, None))
    if r.world_change:
        r.rep.line("world-change", rank=coll.rank, **r.world_change)
    n_val = len(r.val_set) // bs if r.val_set is not None and cfg["val_batches"] != 0 else 0
    r.batches = Batches(r.np, r.train_set, cfg, range(coll.rank, r.shards, coll.size), r.shards, n_val)
    if st:
        resume(r, picked and picked[0], st)
    # mlx-lm's report window (mean losses, tokens and steps since the last report), over every rank
    w = st.get("window", {"loss": 0.0, "tokens": 0, "steps": 0})
    if isinstance(w["loss"], list):  # a checkpoint of the trainer before 2026-11-24: a window per rank
        w = {"loss": sum(w["loss"]) / len(w["loss"]), "tokens": sum(w["tokens"]), "steps": w["steps"]}
    r.window, r.start, r.trained_tokens = w, st.get("step", 0), st.get("trained_tokens", 0)
    r.initial_loss, r.val0, r.last_val = st.get("initial_loss"), st.get("val0"), None
    r.train_time, r.ckpt_time, r.grad = 0.0, 0.0, None
    mx.eval(r.model.parameters(), r.optimizer.state)
    return r


# ---- checkpoints -----------------------------------------------------------------------------------
def pick_checkpoint(r) -> tuple[Path, dict] | None:
    """Rank 0: a fresh start moves an earlier run aside; a resume takes the newest verified checkpoint."""
    if r.args.resume:
        return ckpt.pick(r.ckroot, r.cfg, r.files_sha, r.n_batches, partial(r.rep.line, rank=0))
    if dest := ckpt.archive_run(r.run_dir):
        r.rep.line("fresh-start", rank=0, archived=dest)
    return None


def resume(r, path: Path | None, st: dict) -> None:
    """Every rank takes rank 0's checkpoint (`path`): weights, optimizer, RNG key; the data order replayed."""
    from mlx.utils import tree_flatten, tree_unflatten

    own_w, own_o = dict(tree_flatten(r.model.trainable_parameters())), dict(tree_flatten(r.optimizer.state))
    w = r.coll.run(ckpt.read_fitting, r.mx.load, path, own_w, "adapters")
    o = r.coll.run(ckpt.read_fitting, r.mx.load, path, own_o, "optimizer")
    r.model.load_weights(list(r.coll.bcast(w, own_w).items()), strict=False)
    r.optimizer.state, k = tree_unflatten(list(r.coll.bcast(o, own_o).items())), st["rng"]["mx_key"]
    r.mx.random.seed((int(k[0]) << 32) | int(k[1]))
    for it in range(1, st["step"] + 1):  # a function of the seed and n_batches (ckpt.pick checked it)
        r.batches.next(it)
    if r.coll.rank == 0 and (moved := ckpt.supersede_metrics(r.run_dir, st["step"])):
        r.rep.line("metrics-superseded", rank=0, events=moved, after_step=st["step"])


def adapter_config(r, path: Path) -> dict:
    """What mlx-lm writes as adapter_config.json (its lora args), plus our provenance."""
    return {**{k: v for k, v in r.cfg.items() if k in C.DEFAULTS}, "adapter_path": str(path), "runbook": {
        "config_sha256": r.chash, "dataset_sha256": r.ds_sha, "files_sha256": r.files_sha,
        "seed": r.cfg["seed"], "world_size": r.coll.size, "launch_id": r.args.launch_id}}


def save_checkpoint(r, step: int, final: bool = False) -> None:
    """Rank 0 writes the checkpoint (write_checkpoint), every rank agrees it was written."""
    tic = time.perf_counter()
    val_loss = r.last_val[1] if r.last_val and r.last_val[0] == step else None
    writer = write_checkpoint if r.coll.rank == 0 else None
    path, pruned = r.coll.run(writer, r, step, final, val_loss) or (None, [])
    dt = time.perf_counter() - tic
    r.ckpt_time += dt
    if r.coll.rank == 0:
        r.rep.line("checkpoint", step=step, path=path, seconds=dt, val_loss=json.dumps(val_loss),
                   pruned=",".join(pruned) or "-")
        r.rep.event("checkpoint", step, path=str(path), seconds=round(dt, 4), final=final, loss=val_loss)


def write_checkpoint(r, step: int, final: bool, val_loss: float | None) -> tuple[Path, list[str]]:
    """checkpoints/step-N (weights, optimizer, state, adapter_config.json), pruning, adapters/ updated."""
    from mlx.utils import tree_flatten

    mx, meta, k, n = r.mx, {"format": "mlx", "step": str(step)}, r.mx.random.state[0].tolist(), r.n_batches
    weights, opt = dict(tree_flatten(r.model.trainable_parameters())), dict(tree_flatten(r.optimizer.state))
    config = atomic.dumps_json(adapter_config(r, r.ckroot / ckpt.name_of(step)))
    state = {"config": r.cfg, "config_sha256": r.chash, "dataset_sha256": r.ds_sha,
             "files_sha256": r.files_sha, "world_size": r.coll.size, "shards": r.shards, "final": final,
             "iters": r.cfg["iters"], "launch_id": r.args.launch_id, "time": time.strftime("%FT%T%z"),
             "rng": {"mx_key": [int(k[0]), int(k[1])]}, "val_loss": val_loss, "window": r.window,
             "data": {"n_batches": n, "epoch": (step - 1) // n, "pos": (step - 1) % n + 1},
             "trained_tokens": r.trained_tokens, "initial_loss": r.initial_loss, "val0": r.val0}
    path = ckpt.save(r.ckroot, step, {
        "adapters.safetensors": lambda p: mx.save_safetensors(str(p), weights, metadata=meta),
        "optimizer.safetensors": lambda p: mx.save_safetensors(str(p), opt, metadata=meta),
        "adapter_config.json": lambda p: p.write_text(config, encoding="utf-8")}, state)
    pruned = ckpt.prune(r.ckroot, r.cfg["keep_last_k"])
    atomic.write_bytes(r.adapters / "adapters.safetensors", (path / "adapters.safetensors").read_bytes())
    return path, pruned


# ---- the step -------------------------------------------------------------------------------------
def losses(cfg: dict):
    """(train loss, eval loss) of the config: mlx-lm's default_loss, or lib/loss.py's chunked one."""
    from mlx_lm.tuner.trainer import default_loss

    from lib.loss import make_loss

    if cfg["loss"] == "default":
        return default_loss, default_loss
    return make_loss(cfg["loss_chunk_tokens"]), make_loss(cfg["loss_chunk_tokens"], grad=False)


def compiled_step(r):
    """mlx-lm's compiled step (tuner/trainer.py train()) with the config's loss, the all-reduce on the
    CPU stream, the token-weighted average (grad_average: tokens: gradients of the summed token losses,
    over the global token count) and max_grad_norm. step(batch, acc, do_update) -> (loss, ntoks, acc):
    acc the accumulated (gradient, tokens), after an update the global gradient norm (pre-clip)."""
    import mlx.nn as nn
    import mlx.nn.utils as nu
    from mlx.optimizers import clip_grad_norm
    from mlx.utils import tree_map

    mx, model, optimizer, cfg = r.mx, r.model, r.optimizer, r.cfg
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
        grad, norm = clip_grad_norm(grad, clip) if clip else (grad, clip_grad_norm(grad, 1.0)[1])
        optimizer.update(model, grad)
        return lvalue, toks, norm

    return partial(mx.compile, inputs=r.state, outputs=r.state)(step)


def train_step(r, step, it: int) -> tuple:
    """One iteration on this rank's share(s), accumulated; the loss over every rank: token-weighted with
    grad_average: tokens, else mlx-lm's mean of the ranks' means. (loss, tokens, rank loss, grad norm)."""
    mx, cfg, batches = r.mx, r.cfg, r.batches.next(it)
    update, k, lv, nt = it % cfg["grad_accumulation_steps"] == 0, len(batches), [], []
    for j, batch in enumerate(batches):
        lvalue, toks, out = step(batch, r.grad, update and j == k - 1)
        r.grad = None if update and j == k - 1 else out
        mx.eval(r.state, lvalue, toks, out)
        lv, nt = lv + [lvalue], nt + [toks.astype(mx.float32)]
    both = r.coll.sum(mx.stack([sum(lv), sum(a * b for a, b in zip(lv, nt, strict=True)), sum(nt)])).tolist()
    mean, tokens, w = both[0] / (r.coll.size * k), int(both[2]), r.window
    w.update(loss=w["loss"] + mean, tokens=w["tokens"] + tokens, steps=w["steps"] + 1)
    loss = both[1] / both[2] if cfg["grad_average"] == "tokens" else mean
    return loss, tokens, (sum(lv) / k).item(), out.item() if update else None


# ---- reporting and evaluation ---------------------------------------------------------------------
def report(r, it: int, lr: float) -> None:
    """mlx-lm's train report: the window's mean loss over every rank, tokens, tok/s."""
    w, t = r.window, r.train_time
    r.trained_tokens += w["tokens"]
    loss, tps, peak = w["loss"] / w["steps"], w["tokens"] / t if t else 0.0, r.mx.get_peak_memory() / 1e9
    if r.coll.rank == 0:
        r.rep.line(f"iter {it}", train_loss=loss, lr=lr, **{"tok/s": tps}, peak_mem_gb=peak,
                   trained_tokens=r.trained_tokens, **{"it/s": w["steps"] / t if t else 0.0})
    r.rep.event("train", it, loss=loss, lr=lr, tokens=w["tokens"], tok_per_s=tps, peak_mem_gb=peak,
                trained_tokens=r.trained_tokens, train_s=round(t, 4))
    r.window, r.train_time = {"loss": 0.0, "tokens": 0, "steps": 0}, 0.0


def run_eval(r, dataset, num_batches: int, phase: str) -> float:
    """mlx-lm's evaluate, with a progress line per batch (at most one a second) for the watchdog."""
    from mlx_lm.tuner.trainer import evaluate, iterate_batches

    r.rep.beat(phase, 0.0)
    loss = evaluate(model=r.model, dataset=dataset, batch_size=r.cfg["batch_size"], num_batches=num_batches,
                    max_seq_length=r.cfg["max_seq_length"], loss=losses(r.cfg)[1],
                    iterate_batches=partial(iterate_batches, seed=r.cfg["seed"]),
                    progress_callback=partial(r.rep.beat, phase))
    r.model.train()
    return loss


def validate(r, step: int) -> None:
    if r.val_set is None or r.cfg["val_batches"] == 0:
        return
    tic = time.perf_counter()
    r.last_val = (step, run_eval(r, r.val_set, r.cfg["val_batches"], "val"))
    r.val0, dt = r.last_val[1] if step == 0 else r.val0, time.perf_counter() - tic
    if r.coll.rank == 0:
        r.rep.line("val", step=step, val_loss=r.last_val[1], val_s=dt)
        r.rep.event("val", step, loss=r.last_val[1], val_s=round(dt, 4),
                    peak_mem_gb=r.mx.get_peak_memory() / 1e9)


# ---- the training loop ----------------------------------------------------------------------------
def train(r) -> int:
    """mlx-lm's train() loop on this run's data order, with a checkpoint at every save_every."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import _clear_cache, grad_checkpoint, iterate_batches
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    mx, cfg, coll, rep, iters = r.mx, r.cfg, r.coll, r.rep, r.cfg["iters"]
    rep.step = r.start
    if coll.rank == 0:
        rep.metrics = open(r.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        ckpt.sweep_temporaries(r.ckroot)
        atomic.write_json(r.adapters / "adapter_config.json", adapter_config(r, r.adapters))
        if r.world_change:
            rep.event("world-change", r.start, **r.world_change)
    rep.line("model", rank=coll.rank, model=cfg["model"], fine_tune_type=cfg["fine_tune_type"],
             trainable_params=sum(v.size for _, v in tree_flatten(r.model.trainable_parameters())),
             config_sha256=r.chash[:16], per_rank_batch=cfg["batch_size"] // coll.size, start_step=r.start)
    maybe_set_recommended_wired_limit()
    if cfg["grad_checkpoint"]:
        grad_checkpoint(r.model.layers[0])
    r.state = [r.model.state, r.optimizer.state, mx.random.state]
    step, t_wall = compiled_step(r), time.perf_counter()
    # ---- before step 1: the step-0 validation; the compiled step's kernels (over a minute on a fresh
    # machine) built on one local batch with beats (no all-reduce hides behind them), the RNG put back ----
    if r.start == 0:
        validate(r, 0)
    r.model.train()
    if r.start < iters:
        key, one = mx.random.state[0].tolist(), types.SimpleNamespace(rank=lambda: 0, size=lambda: r.shards)
        with rep.beating("compile"):
            mx.eval(step(next(iterate_batches(r.train_set, cfg["batch_size"], cfg["max_seq_length"],
                                              comm_group=one)), None, False))
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
                  step_s=round(dt, 5), grad_norm=norm)
        # ---- stability: NaN/inf at any step, or divergence early on, stops every rank (global loss) ----
        if not math.isfinite(loss):
            raise failure(STABILITY, f"the loss is {loss} at step {it} (learning_rate "
                                     f"{cfg['learning_rate']}): lower the learning rate, check the data and "
                                     "the LoRA scale")
        if it <= cfg["divergence_window"] and loss > cfg["divergence_factor"] * r.initial_loss:
            raise failure(STABILITY, f"the loss diverged: {loss:.4g} at step {it} is more than "
                                     f"{cfg['divergence_factor']}x the first step's {r.initial_loss:.4g} "
                                     f"(learning_rate {cfg['learning_rate']}): lower the learning rate")
        # ---- report, validate, checkpoint: mlx-lm's cadence ----
        if it % cfg["steps_per_report"] == 0 or it == iters:
            report(r, it, lr)
        if it % cfg["steps_per_eval"] == 0 or it == iters:
            validate(r, it)
        stop = r.args.stop_at_step is not None and r.args.stop_at_step <= it < iters  # a clean preemption
        if it % cfg["save_every"] == 0 or it == iters or stop:
            save_checkpoint(r, it, final=it == iters)
        if stop:
            rep.line("stopped", rank=coll.rank, step=it, reason="--stop-at-step")
            rep.event("done", it, stopped=True, checkpoint_s=round(r.ckpt_time, 4),
                      train_wall_s=round(time.perf_counter() - t_wall, 4))
            return 0
    return finish(r, time.perf_counter() - t_wall)


def finish(r, wall: float) -> int:
    """The whole-split test evaluation, a warning if validation did not improve on step 0, then `done`
    naming the best-by-validation checkpoint (an mlx-lm adapter folder as it is)."""
    iters, rep = r.cfg["iters"], r.rep
    if r.cfg["test"]:  # load_data made sure the split is there
        tic = time.perf_counter()
        test_loss = run_eval(r, r.test_set, r.cfg["test_batches"], "test")
        ppl = math.exp(test_loss) if test_loss < 700 else float("inf")
        if r.coll.rank == 0:
            rep.line("test", step=iters, test_loss=test_loss, test_ppl=ppl, test_s=time.perf_counter() - tic)
            rep.event("test", iters, loss=test_loss, ppl=ppl)
    if r.coll.rank != 0:
        return 0
    if r.last_val and r.val0 is not None and not r.last_val[1] < r.val0:
        msg = (f"the final validation loss {r.last_val[1]:.4f} (step {r.last_val[0]}) is not below step 0's "
               f"{r.val0:.4f}: this adapter does not improve on the base model")
        rep.warn(msg)
        rep.event("warning", iters, what="no-improvement", loss=r.last_val[1], val_loss_step0=r.val0,
                  message=msg)
    name, val_loss = ckpt.best(r.ckroot) or (None, None)
    best = str(r.ckroot / name) if name else None
    rep.line("done", step=iters, wall_s=wall, checkpoint_s=r.ckpt_time, adapter=r.adapters, best=name or "-",
             best_adapter=best or "-")
    rep.event("done", iters, checkpoint_s=round(r.ckpt_time, 4), train_wall_s=round(wall, 4), best=name,
              best_val_loss=val_loss, best_adapter=best, world_change=r.world_change)
    return 0


if __name__ == "__main__":
    sys.exit(main())
