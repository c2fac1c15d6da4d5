#!/usr/bin/env python3
"""The rank-side LoRA trainer: runs on every rank under mlx.launch, or alone as one rank.

Usage:
    mlx.launch --hostfile HOSTFILE --backend ring -- PYTHON bin/train.py --config CONFIG --model MODEL \
        --data datasets/NAME --run-dir runs/RUN [--resume [--allow-world-change]] [--iters N] [--seed S] \
        [--expect-world-size W] [--launch-id ID] [--stop-at-step K]
Example (two ranks on this machine; without mlx.launch it runs as one rank):
    .venv/bin/mlx.launch --hostfile hostfile.local.json --backend ring -- .venv/bin/python bin/train.py \
        --config configs/smoke.yaml --model models/tiny-gemma4 --data datasets/domain_sft_v1_high_signal_thunder \
        --run-dir runs/demo/smoke

mlx-lm's LoRA training (loading, LoRA layers, datasets, default_loss or lib/loss.py's chunked loss,
evaluate, compiled step; batch_size is the global batch; `grad_average: tokens` weights each rank
by its tokens so a dual run computes the single-host control's maths), exact resume (the mx RNG key
and report window in every checkpoint, mlx-lm's numpy data order replayed from the seed; on another
world size with --allow-world-change, the old ranks' shares accumulated), atomic verified checkpoints
(lib/checkpoint.py), per-rank logs, metrics and failure categories. On macOS each rank runs
/usr/bin/caffeinate -i -w PID so its Mac does not sleep.

Files under --run-dir (the contract with lib/launch.py):
    logs/rank-R.joined.json   the group is up (rank, world_size, host, backend, pid, launch_id, versions);
                              after loading also records(_by_split), dataset_sha256, files_sha256.
    logs/rank-R.failure.json  category (lib.log.CATEGORIES or null), kind, anchor, message, step,
                              exit_code (lib.log.FAILURES), launch_id.
    logs/rank-R.log           every line the rank printed, timestamped.
    metrics.jsonl             rank 0: step (grad_norm), train, val, test, checkpoint, world-change,
                              warning, done events (step, loss, lr, tokens, tok_per_s, peak_mem_gb,
                              wall_s); a resume moves later ones to metrics.superseded.jsonl.
    checkpoints/step-NNNNNNN/ each an mlx-lm adapter folder too (--adapter-path as is); adapters/ the newest.
Stdout: `rank-joined`, `progress rank R phase P` (the watchdog's signal between steps), `iter N rank R
loss X` (every step, every rank), `iter N train_loss X`, `val`, `checkpoint`, `test`, `warning`, `done ...
best_adapter PATH`, `failed`. A failure before training is agreed between the ranks; NaN/divergence is
judged on the global loss. Without --resume an earlier run moves to superseded-<time>-<pid>/.
"""

from __future__ import annotations

import argparse
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
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl  # noqa: E402
from lib import checkpoint as ckpt  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import digest_of, sha256_file  # noqa: E402
from lib.log import DATA, OOM_RE, PARITY, STABILITY, RunbookError, error_of_code, failure, fmt  # noqa: E402

SPLITS = ("train", "valid", "test")
# Command-line overrides of config keys (precedence over the YAML), with mlx-lm's flag names.
FLAGS = (("model", str), ("data", str), ("iters", int), ("seed", int), ("batch_size", int),
         ("learning_rate", float), ("num_layers", int), ("save_every", int), ("steps_per_eval", int),
         ("steps_per_report", int), ("max_seq_length", int), ("grad_accumulation_steps", int),
         ("val_batches", int), ("test_batches", int), ("keep_last_k", int), ("optimizer", str),
         ("fine_tune_type", str))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config YAML (mlx-lm lora keys + runbook keys)")
    p.add_argument("--run-dir", required=True, help="the run folder (runs/RUN or runs/RUN/smoke)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--expect-world-size", type=int, help="fail (runtime parity) unless the group has this size")
    p.add_argument("--launch-id", default="", help="written into the marker files, to tell them from stale ones")
    p.add_argument("--stop-at-step", type=int, help="stop after this step, with a checkpoint (a clean preemption)")
    p.add_argument("--allow-world-change", action="store_true", help="--resume on another world size, the global "
                   "batch cut as before (gradient accumulation; needs grad_average: tokens)")
    for key, typ in FLAGS:
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None)
    return p


def overrides(args) -> dict:
    return {key: getattr(args, key) for key, _ in FLAGS}


# ---- per-rank output ------------------------------------------------------------------------------
class Reporter:
    """The rank's output, a callback object as mlx-lm's TrainingCallback: one plain line per event
    on stdout and in logs/rank-R.log; on rank 0 metrics.jsonl (and mlx-lm's WandBCallback with
    `report_to: wandb`). `step` is what a failure report names."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank, self.step, self.metrics, self.wandb = run_dir, rank, None, None, None
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "logs" / f"rank-{rank}.log", "a", encoding="utf-8")
        self.t0 = self.last_beat = time.monotonic()

    def line(self, name: str, /, **fields) -> None:
        text = " ".join([name] + [f"{k} {fmt(v)}" for k, v in fields.items()])
        print(text, flush=True)
        self.log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {text}\n")
        self.log.flush()

    def warn(self, message: str) -> None:
        self.line("warning", rank=self.rank, message=json.dumps(message))

    def beat(self, phase: str, every_s: float = 1.0) -> None:
        """A progress line for the orchestrator's watchdog (at most one per every_s)."""
        if time.monotonic() - self.last_beat >= every_s:
            self.last_beat = time.monotonic()
            self.line("progress", rank=self.rank, phase=phase)

    def beat_while(self, phase: str, done: threading.Event) -> None:
        """Beat every 3 s until `done`: only around one long local call with no collective in it."""
        t0 = time.monotonic()
        while not done.wait(3.0):
            self.last_beat = time.monotonic()
            self.line("progress", rank=self.rank, phase=phase, elapsed_s=round(self.last_beat - t0))

    def start_metrics(self, cfg: dict) -> None:
        self.metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg["report_to"] == "wandb":
            try:
                from mlx_lm.tuner.callbacks import WandBCallback

                self.wandb = WandBCallback(cfg["project_name"] or "thunder-runbook", str(self.run_dir), cfg)
            except Exception as e:  # not installed, service unreachable, bad key: training goes on
                self.warn(f"report_to: wandb is off ({e}); the metrics stay in metrics.jsonl")

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
        if self.wandb is not None and kind in ("train", "val"):
            try:  # mlx-lm's report dicts
                report = self.wandb.on_train_loss_report if kind == "train" else self.wandb.on_val_loss_report
                report({"iteration": step, f"{kind}_loss": ev["loss"], **{k: v for k, v in fields.items() if k != "loss"}})
            except Exception as e:
                self.warn(f"wandb log failed, disabling it ({type(e).__name__}: {e})")
                self.wandb = None


def marker(run_dir: Path, rank: int, name: str) -> Path:
    return run_dir / "logs" / f"rank-{rank}.{name}.json"


def as_error(e: BaseException) -> RunbookError:
    """An exception as the RunbookError it stands for (out of memory by MLX's error text)."""
    if isinstance(e, RunbookError):
        return e
    if isinstance(e, (RuntimeError, MemoryError)) and OOM_RE.search(str(e)):
        return RunbookError(f"out of memory or GPU timeout: {e}; retry with the fallback ladder the "
                            "orchestrator prints (per-rank batch 1 with gradient accumulation)", "out-of-memory")
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


CAFFEINATE = "/usr/bin/caffeinate"  # macOS; absent on Linux (tests point it at a fake)


def keep_awake(rep: Reporter):
    """macOS: `caffeinate -i -w PID` keeps this Mac from idle sleep while this rank lives."""
    if not os.path.isfile(CAFFEINATE):
        return None
    p = subprocess.Popen([CAFFEINATE, "-i", "-w", str(os.getpid())], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rep.line("caffeinate", rank=rep.rank, pid=p.pid)
    return p


# ---- distributed group --------------------------------------------------------------------------
def init_group():
    """mlx and the global group. Under mlx.launch (MLX_RANK set) the group must form (strict);
    a lone rank, or mlx.launch's empty MLX_HOSTFILE for one host, is a world of 1."""
    try:
        import mlx.core as mx
    except Exception as e:  # wrong interpreter or broken install
        raise failure(PARITY, f"{sys.executable} cannot import mlx ({type(e).__name__}: {e}); every host "
                              "must run the same interpreter with the locked packages") from e
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file() and not Path(hostfile).read_text().strip():
        os.environ.pop("MLX_HOSTFILE")  # mlx.launch with a single host
        os.environ.pop("MLX_RANK", None)
    env = os.environ.get
    backend = ("jaccl" if env("MLX_IBV_DEVICES") or env("MLX_JACCL_COORDINATOR") else "ring" if env("MLX_HOSTFILE")
               else "mpi" if env("OMPI_COMM_WORLD_SIZE") else "none")
    try:
        group = mx.distributed.init(strict="MLX_RANK" in os.environ)
    except Exception as e:
        raise failure(PARITY, f"the distributed group did not form ({backend}): {e}") from e
    return mx, group, backend if group.size() > 1 else "none"


class Group:
    """The collectives the trainer needs besides the gradient all-reduce (CPU stream)."""

    def __init__(self, mx, group):
        self.mx, self.rank, self.size = mx, group.rank(), group.size()

    def sum(self, x):
        return x if self.size == 1 else self.mx.distributed.all_sum(x, stream=self.mx.cpu)

    def gather(self, x):
        return x if self.size == 1 else self.mx.distributed.all_gather(x, stream=self.mx.cpu)

    def agree(self, err: RunbookError | None) -> None:
        """Every rank learns whether any rank failed here; all stop with that rank's exit code."""
        codes = [0] * self.size
        codes[self.rank] = err.exit_code if err else 0
        codes = self.sum(self.mx.array(codes)).tolist()
        if err:
            raise err
        if failed := [r for r, c in enumerate(codes) if c]:
            raise error_of_code(codes[failed[0]], f"rank(s) {failed} failed (exit {codes[failed[0]]}); see their "
                                                  "logs/rank-R.failure.json")

    def run(self, fn, *a, **kw):
        """Run one local phase (fn None: nothing here); any failure is agreed with the other ranks."""
        out, err = None, None
        try:
            out = fn(*a, **kw) if fn else None
        except Exception as e:
            err = as_error(e)
        self.agree(err)
        return out

    def bcast_bytes(self, data: bytes | None) -> bytes:
        mx = self.mx
        if self.size == 1:
            return data
        n = int(self.sum(mx.array([len(data) if self.rank == 0 else 0])).item())
        mine = mx.array(list(data)) if self.rank == 0 else mx.zeros((n,), mx.int32)
        return bytes(self.sum(mine.astype(mx.int32)).tolist())

    def bcast_arrays(self, flat: dict | None, like: dict) -> dict:
        """Rank 0's tensors to every rank (the others add zeros shaped like their own)."""
        if self.size == 1:
            return flat
        out = {k: self.sum(flat[k] if self.rank == 0 else self.mx.zeros(v.shape, v.dtype)) for k, v in sorted(like.items())}
        self.mx.eval(list(out.values()))
        return out


# ---- data ----------------------------------------------------------------------------------------
def check_data_files(cfg: dict) -> tuple[str, str]:
    """The dataset's split files exist and agree with its manifest: (dataset_sha256 (the
    manifest's, else the files'), files_sha256 (of the split files present))."""
    d = Path(cfg["data"])
    if not (d / "train.jsonl").is_file():
        raise failure(DATA, f"dataset {d if not d.is_dir() else d / 'train.jsonl'} not found on {socket.gethostname()} "
                            f"(cwd {os.getcwd()}); run `make export` and `make sync`")
    present = {f"{s}.jsonl": sha256_file(d / f"{s}.jsonl") for s in SPLITS if (d / f"{s}.jsonl").is_file()}
    try:
        man = json.loads((d / "manifest.json").read_text(encoding="utf-8")) if (d / "manifest.json").is_file() else {}
    except ValueError as e:
        raise failure(DATA, f"{d}/manifest.json: invalid JSON ({e}); re-run `make export`") from e
    for name, sha in present.items():
        want = (man.get("files") or {}).get(name)
        want = want.get("sha256") if isinstance(want, dict) else want
        if isinstance(want, str) and want != sha:
            raise failure(DATA, f"{d}/{name} does not match manifest.json (sha256 {sha[:12]} != {want[:12]}); "
                                "re-run `make sync`")
    return str(man.get("dataset_sha256") or digest_of(present)), digest_of(present)


def load_split(path: Path, cfg: dict, tokenizer, rep: Reporter):
    """One split as mlx-lm's dataset (create_dataset in a CacheDataset), every record tokenized
    now so that a bad one fails here, naming file and line: (dataset or None, tokens, too long)."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    try:
        records = list(jsonl.read(path)) if path.is_file() else []
    except (ValueError, UnicodeDecodeError) as e:
        raise failure(DATA, str(e)) from e
    if not records:
        return None, 0, 0
    if bad := next((n for n, rec in enumerate(records, 1) if not isinstance(rec, dict)), None):
        raise failure(DATA, f"{path}:{bad}: a record is a JSON object, got {type(records[bad - 1]).__name__}")
    try:
        ds = CacheDataset(create_dataset(records, tokenizer, types.SimpleNamespace(**cfg)))
    except ValueError as e:
        raise failure(DATA, f"{path}: {e}".strip()) from e
    lengths = []
    for i in range(len(ds)):
        rep.beat("tokenize")
        try:
            lengths.append(len(ds[i][0]))
        except Exception as e:
            raise failure(DATA, f"{path}:{i + 1} (record_id {records[i].get('record_id', '?')}) does not "
                                f"tokenize: {type(e).__name__}: {e}") from e
    return ds, sum(lengths), sum(n > cfg["max_seq_length"] for n in lengths)


def load_data(cfg: dict, tokenizer, rep: Reporter):
    """train/valid/test as mlx-lm datasets: (sets, records by split, tokens by split)."""
    d, bs = Path(cfg["data"]), cfg["batch_size"]
    out = {split: load_split(d / f"{split}.jsonl", cfg, tokenizer, rep) for split in SPLITS}
    sets = {split: ds for split, (ds, _, _) in out.items()}
    counts = {split: len(ds) if ds else 0 for split, ds in sets.items()}
    if not counts["train"]:
        raise failure(DATA, f"{d}/train.jsonl has no records")
    if cfg["test"] and not counts["test"]:
        raise failure(DATA, f"test: true but {d}/test.jsonl is missing or empty")
    for split, needed in (("train", True), ("valid", cfg["val_batches"] != 0), ("test", cfg["test"])):
        if needed and 0 < counts[split] < bs:
            raise failure(DATA, f"{d}/{split}.jsonl has {counts[split]} records, fewer than batch_size {bs}: "
                                "export more records or lower batch_size")
    if long := sum(n for _, _, n in out.values()):
        rep.warn(f"{long} records are longer than max_seq_length {cfg['max_seq_length']} and are truncated")
    return sets, counts, {split: t for split, (_, t, _) in out.items()}


def batch_plan(dataset, batch_size: int, rank: int, size: int) -> list[list[int]]:
    """mlx-lm's iterate_batches before its loop: records sorted by CacheDataset.itemlen, cut
    into global batches, each rank taking every size-th record of each."""
    idx = sorted(range(len(dataset)), key=dataset.itemlen)
    return [idx[i + rank: i + rank + batch_size: size] for i in range(0, len(idx) - batch_size + 1, batch_size)]


def make_batch(mx, np, dataset, indices: list[int], max_seq_length: int):
    """mlx-lm's iterate_batches, the body of its loop (padding to 1 + a multiple of 32)."""
    batch = [dataset[j] for j in indices]
    batch, offsets = zip(*batch, strict=True) if len(batch[0]) == 2 else (batch, [0] * len(batch))
    lengths = [min(len(x), max_seq_length) for x in batch]
    arr = np.zeros((len(indices), min(1 + 32 * ((max(len(x) for x in batch) + 31) // 32), max_seq_length)), np.int32)
    for j, n in enumerate(lengths):
        arr[j, :n] = batch[j][:n]
    return mx.array(arr), mx.array(list(zip(offsets, lengths, strict=True)))


class DataOrder:
    """The train batch order of mlx-lm's lora. mlx-lm seeds numpy with the seed, then draws one
    permutation of the batches per epoch and one of the validation batches whenever it validates
    (iteration 1 and every steps_per_eval), in that order; this replays that stream in its own
    RandomState, so a resume at step k replays next(1..k) and continues exactly. The draw mlx-lm
    makes when it validates at its last iteration is left out: no train batch follows it, and
    leaving it out keeps the order independent of `iters` (a run can be extended)."""

    def __init__(self, np, seed: int, n_batches: int, n_val_batches: int, steps_per_eval: int):
        self.rs, self.n, self.n_val, self.spe = np.random.RandomState(seed), n_batches, n_val_batches, steps_per_eval
        self.perm, self.pos, self.epoch = [], 0, -1

    def next(self, it: int) -> int:
        if self.pos >= len(self.perm):
            self.perm, self.pos, self.epoch = [int(i) for i in self.rs.permutation(self.n)], 0, self.epoch + 1
        self.pos += 1
        if self.n_val and (it == 1 or it % self.spe == 0):
            self.rs.permutation(self.n_val)
        return self.perm[self.pos - 1]


# ---- model ---------------------------------------------------------------------------------------
def load_model(cfg: dict, rep: Reporter):
    """mlx-lm's load (its import alone takes seconds), with progress lines while it reads (or
    downloads) the weights."""
    m = cfg["model"]
    if (m.startswith((".", "/", "~", "models/")) or Path(m).exists()) and not Path(m).expanduser().is_dir():
        raise failure(DATA, f"model folder {m} not found on {socket.gethostname()} (cwd {os.getcwd()}); run "
                            "`make tiny-model` or `make sync SYNC_MODEL=1`")
    done = threading.Event()
    beats = threading.Thread(target=rep.beat_while, args=("load-model", done), daemon=True)
    beats.start()
    try:
        from mlx_lm.utils import load

        return load(m, tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                    trust_remote_code=cfg["trust_remote_code"])
    except (FileNotFoundError, ValueError, OSError) as e:
        raise failure(DATA, f"model {m} does not load on {socket.gethostname()}: {type(e).__name__}: {e}") from e
    finally:
        done.set()
        beats.join()  # its last line before anything this rank says next


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
        linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"], use_dora=cfg["fine_tune_type"] == "dora")
    if cfg["resume_adapter_file"]:
        model.load_weights(cfg["resume_adapter_file"], strict=False)
    name = cfg["optimizer"]
    try:
        lr = build_schedule(cfg["lr_schedule"]) if cfg["lr_schedule"] else cfg["learning_rate"]
        opt = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
               "adafactor": optim.Adafactor}[name](learning_rate=lr, **cfg["optimizer_config"].get(name, {}))
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise C.ConfigError(f"lr_schedule {cfg['lr_schedule']!r} / optimizer_config.{name} do not build: {e}") from e
    opt.init(model.trainable_parameters())
    return opt


# ---- checkpoints -----------------------------------------------------------------------------------
def adapter_config(r, path: Path) -> dict:
    """What mlx-lm writes as adapter_config.json (its lora args), plus our provenance."""
    return {**{k: v for k, v in r.cfg.items() if k in C.DEFAULTS}, "adapter_path": str(path), "runbook": {
        "config_sha256": r.chash, "dataset_sha256": r.ds_sha, "files_sha256": r.files_sha, "seed": r.cfg["seed"],
        "world_size": r.coll.size, "launch_id": r.args.launch_id}}


def save_checkpoint(r, step: int, final: bool = False) -> None:
    """Every rank hands rank 0 its report window; rank 0 writes the checkpoint; all agree."""
    tic = time.perf_counter()
    losses = r.coll.gather(r.win_loss.astype(r.mx.float32).reshape(1)).tolist()
    tokens = r.coll.gather(r.win_tokens.astype(r.mx.int32).reshape(1)).tolist()
    window = {"loss": losses, "tokens": tokens, "steps": r.win_steps}
    val_loss = r.last_val[1] if r.last_val and r.last_val[0] == step else None
    path, pruned = r.coll.run(write_checkpoint if r.coll.rank == 0 else None, r, step, final, window, val_loss) or (None, [])
    dt = time.perf_counter() - tic
    r.ckpt_time += dt
    if r.coll.rank == 0:
        r.rep.line("checkpoint", step=step, path=path, seconds=dt, val_loss=json.dumps(val_loss), pruned=",".join(pruned) or "-")
        r.rep.event("checkpoint", step, path=str(path), seconds=round(dt, 4), final=final, loss=val_loss)


def write_checkpoint(r, step: int, final: bool, window: dict, val_loss: float | None) -> tuple[Path, list[str]]:
    """Rank 0: checkpoints/step-N (weights, optimizer, state, adapter_config.json), pruning,
    then adapters/adapters.safetensors replaced by the checkpoint's copy."""
    from mlx.utils import tree_flatten

    mx, meta, k = r.mx, {"format": "mlx", "step": str(step)}, r.mx.random.state[0].tolist()
    weights, opt = dict(tree_flatten(r.model.trainable_parameters())), dict(tree_flatten(r.optimizer.state))
    config = atomic.dumps_json(adapter_config(r, r.ckroot / ckpt.name_of(step)))
    state = {"config": r.cfg, "config_sha256": r.chash, "dataset_sha256": r.ds_sha, "files_sha256": r.files_sha,
             "world_size": r.coll.size, "final": final, "iters": r.cfg["iters"], "launch_id": r.args.launch_id,
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rng": {"mx_key": [int(k[0]), int(k[1])]},
             "val_loss": val_loss, "window": window,
             "data": {"n_batches": len(r.plans[0]), "epoch": r.order.epoch, "pos": r.order.pos}, "shards": r.shards,
             "trained_tokens": r.trained_tokens, "initial_loss": r.initial_loss, "val0": r.val0}
    path = ckpt.save(r.ckroot, step, {
        "adapters.safetensors": lambda p: mx.save_safetensors(str(p), weights, metadata=meta),
        "optimizer.safetensors": lambda p: mx.save_safetensors(str(p), opt, metadata=meta),
        "adapter_config.json": lambda p: p.write_text(config, encoding="utf-8")}, state)
    pruned = ckpt.prune(r.ckroot, r.cfg["keep_last_k"])
    atomic.write_bytes(r.adapters / "adapters.safetensors", (path / "adapters.safetensors").read_bytes())
    return path, pruned


def pick_checkpoint(r) -> tuple[Path, dict] | None:
    """Rank 0: a fresh start moves an earlier run aside; a resume takes the newest verified checkpoint."""
    if not r.args.resume:
        if dest := ckpt.archive_run(r.run_dir):
            r.rep.line("fresh-start", rank=0, archived=dest)
        return None
    return ckpt.pick(r.ckroot, r.cfg, r.files_sha, len(r.train_set) // r.cfg["batch_size"], partial(r.rep.line, rank=0))


def resume(r, picked: tuple[Path, dict] | None, st: dict) -> None:
    """Every rank takes rank 0's checkpoint: weights, optimizer, RNG key, data position."""
    from mlx.utils import tree_flatten, tree_unflatten

    own_w, own_o = dict(tree_flatten(r.model.trainable_parameters())), dict(tree_flatten(r.optimizer.state))
    w = r.coll.run(ckpt.read_fitting, r.mx.load, picked and picked[0], own_w, "adapters")
    o = r.coll.run(ckpt.read_fitting, r.mx.load, picked and picked[0], own_o, "optimizer")
    r.model.load_weights(list(r.coll.bcast_arrays(w, own_w).items()), strict=False)
    r.optimizer.state = tree_unflatten(list(r.coll.bcast_arrays(o, own_o).items()))
    k = st["rng"]["mx_key"]
    r.mx.random.seed((int(k[0]) << 32) | int(k[1]))
    for it in range(1, st["step"] + 1):  # the data order is a function of the seed: replay it
        r.order.next(it)
    if (r.order.epoch, r.order.pos) != (st["data"]["epoch"], st["data"]["pos"]):
        raise failure(DATA, f"the replayed data order is at epoch {r.order.epoch} position {r.order.pos}, the "
                            f"checkpoint says {st['data']['epoch']}/{st['data']['pos']}: start a new RUN")
    if r.coll.rank == 0 and (moved := ckpt.supersede_metrics(r.run_dir, st["step"])):
        r.rep.line("metrics-superseded", rank=0, events=moved, after_step=st["step"])


# ---- setup ----------------------------------------------------------------------------------------
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
        mx, group, backend = init_group()
        if group.rank() != rank:  # MLX_RANK was dropped for a lone host
            rep = Reporter(run_dir, group.rank())
        return train(setup(args, mx, Group(mx, group), backend, rep))
    except Exception as e:
        return fail(as_error(e), rep, args.launch_id)


def resolve_config(args, world: int) -> dict:
    cfg = C.resolve(args.config, overrides(args))
    C.check_world(cfg, world)
    return cfg


def setup(args, mx, coll: Group, backend: str, rep: Reporter):
    """The group, config, data and model, each agreed by every rank; then the starting point."""
    from importlib.metadata import version

    import numpy as np

    coll.sum(mx.array(1)).item()  # every rank reached this point: the group works both ways
    joined = {"rank": coll.rank, "world_size": coll.size, "host": socket.gethostname(), "backend": backend,
              "pid": os.getpid(), "launch_id": args.launch_id, "python": sys.executable,
              "platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
              "cwd": os.getcwd(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phase": "initialized"}
    atomic.write_json(marker(rep.run_dir, coll.rank, "joined"), joined)
    rep.line("rank-joined", rank=coll.rank, world_size=coll.size, host=joined["host"], backend=backend, pid=os.getpid())
    if args.expect_world_size and args.expect_world_size != coll.size:
        raise failure(PARITY, f"the group has {coll.size} ranks, expected {args.expect_world_size}: check the "
                              "hostfile and that every host's launcher reached the others")
    cfg = coll.run(resolve_config, args, coll.size)
    r = types.SimpleNamespace(args=args, mx=mx, np=np, coll=coll, rep=rep, cfg=cfg, chash=C.config_hash(cfg),
                              run_dir=rep.run_dir, ckroot=rep.run_dir / "checkpoints", adapters=rep.run_dir / "adapters")
    rep.line("config", rank=coll.rank, file=args.config, config_sha256=r.chash[:16], seed=cfg["seed"],
             batch_size=cfg["batch_size"], per_rank_batch=cfg["batch_size"] // coll.size, iters=cfg["iters"],
             learning_rate=cfg["learning_rate"])
    # ---- data files (cheap, before the slow imports), the model, the records ----
    r.ds_sha, r.files_sha = coll.run(check_data_files, cfg)
    rep.beat("load-model", 0.0)
    r.model, tokenizer = coll.run(load_model, cfg, rep)
    rep.beat("tokenize", 0.0)
    sets, counts, tokens = coll.run(load_data, cfg, tokenizer, rep)
    shas = coll.gather(mx.array(list(bytes.fromhex(r.files_sha))).reshape(1, -1)).tolist()
    joined.update(phase="data-loaded", records=sum(counts.values()), records_by_split=counts, tokens_by_split=tokens,
                  dataset_sha256=r.ds_sha, files_sha256=r.files_sha, data=cfg["data"])
    atomic.write_json(marker(rep.run_dir, coll.rank, "joined"), joined)
    rep.line("data", rank=coll.rank, records=sum(counts.values()), train=counts["train"], valid=counts["valid"],
             test=counts["test"], train_tokens=tokens["train"], dataset_sha256=r.ds_sha, files_sha256=r.files_sha[:16])
    if any(sha != shas[0] for sha in shas):
        by_rank = ", ".join(f"rank {i}: {bytes(sha).hex()[:12]}" for i, sha in enumerate(shas))
        raise failure(DATA, f"the ranks loaded different dataset bytes ({by_rank}); re-run `make sync`")
    r.train_set, r.val_set, r.test_set = sets["train"], sets["valid"], sets["test"]
    if r.val_set is None and cfg["val_batches"] != 0:
        rep.warn(f"{cfg['data']}/valid.jsonl missing or empty: training proceeds without validation")
    r.optimizer = coll.run(prepare_model, mx, r.model, cfg)
    return start(r)


def start(r):
    """The data order, then a fresh start or rank 0's checkpoint on every rank; each rank gets its
    own report window back (mlx-lm's losses, n_tokens, steps since the last report)."""
    cfg, mx, coll = r.cfg, r.mx, r.coll
    picked = coll.run(pick_checkpoint if coll.rank == 0 else None, r)
    st = json.loads(coll.bcast_bytes(json.dumps(picked[1]).encode() if picked else None)) if r.args.resume else {}
    r.shards, r.world_change = ckpt.shards_for(st, coll.size, r.args.allow_world_change, cfg["grad_average"]) if st else (coll.size, None)
    if r.world_change:
        r.rep.line("world-change", rank=coll.rank, **r.world_change)
    r.plans = [batch_plan(r.train_set, cfg["batch_size"], j, r.shards) for j in range(coll.rank, r.shards, coll.size)]
    n_val = len(r.val_set) // cfg["batch_size"] if r.val_set is not None and cfg["val_batches"] != 0 else 0
    r.order = DataOrder(r.np, cfg["seed"], len(r.plans[0]), n_val, cfg["steps_per_eval"])
    if st:
        resume(r, picked, st)
    win = st.get("window", {"loss": [0.0] * coll.size, "tokens": [0] * coll.size, "steps": 0})
    if len(win["loss"]) != coll.size:  # a world change: rank 0 carries the window, scaled to the new size
        win = {"loss": [sum(win["loss"]) * coll.size / len(win["loss"])] + [0.0] * (coll.size - 1),
               "tokens": [sum(win["tokens"])] + [0] * (coll.size - 1), "steps": win["steps"]}
    r.win_loss = mx.array(win["loss"][coll.rank], dtype=mx.float32)
    r.win_tokens = mx.array(win["tokens"][coll.rank], dtype=mx.int32)
    r.start, r.win_steps, r.trained_tokens, r.initial_loss = st.get("step", 0), win["steps"], st.get("trained_tokens", 0), st.get("initial_loss")
    r.val0 = st.get("val0")
    r.last_val, r.train_time, r.ckpt_time, r.grad = None, 0.0, 0.0, None
    mx.eval(r.model.parameters(), r.optimizer.state)
    return r


# ---- training -------------------------------------------------------------------------------------
def losses(cfg: dict):
    """(train loss, eval loss) of the config: mlx-lm's default_loss, or lib/loss.py's chunked one."""
    from mlx_lm.tuner.trainer import default_loss

    from lib.loss import make_loss

    n = cfg.get("loss_chunk_tokens")
    return (default_loss, default_loss) if cfg.get("loss", "default") == "default" else (make_loss(n), make_loss(n, grad=False))


def compiled_step(r):
    """mlx-lm's compiled training step (mlx_lm/tuner/trainer.py train()) with the config's loss,
    the all-reduce on the CPU stream, and optionally the token-weighted average (each rank's
    gradient of its summed token losses; all-reduced with the token count, divided by it) and
    the global norm clipped. step(batch, acc, do_update) -> (loss, ntoks, acc), acc being the
    accumulated (gradient, tokens) or, after an update, the global gradient norm (pre-clip)."""
    import mlx.nn as nn
    import mlx.nn.utils as nu
    from mlx.optimizers import clip_grad_norm
    from mlx.utils import tree_map

    mx, model, optimizer, cfg = r.mx, r.model, r.optimizer, r.cfg
    accum, by_tokens, clip = cfg["grad_accumulation_steps"], cfg.get("grad_average") == "tokens", cfg.get("max_grad_norm")
    loss_fn, size = losses(cfg)[0], mx.distributed.init().size()

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
            total = mx.distributed.all_sum(n, stream=mx.cpu) if size > 1 else n
            grad = tree_map(lambda x: x * (size / total), grad)
        elif accum > 1:
            grad = tree_map(lambda x: x / accum, grad)
        grad, norm = clip_grad_norm(grad, clip) if clip else (grad, clip_grad_norm(grad, 1.0)[1])
        optimizer.update(model, grad)
        return lvalue, toks, norm

    return partial(mx.compile, inputs=r.state, outputs=r.state)(step)


def warm_up(r, step) -> None:
    """The compiled step's first call builds its kernels (over a minute on a fresh machine, cached after):
    build them on one local batch, without the all-reduce so no collective hides behind the beats, and
    with the random state put back, so the run computes exactly what it would have."""
    mx, done, key = r.mx, threading.Event(), r.mx.random.state[0].tolist()
    r.rep.beat("compile", 0.0)
    beats = threading.Thread(target=r.rep.beat_while, args=("compile", done), daemon=True)
    beats.start()
    try:
        mx.eval(step(make_batch(mx, r.np, r.train_set, r.plans[0][0], r.cfg["max_seq_length"]), None, False))
    finally:
        done.set()
        beats.join()
    mx.random.seed((int(key[0]) << 32) | int(key[1]))  # as a resume restores it


def run_eval(r, dataset, num_batches: int, phase: str) -> float:
    """mlx-lm's evaluate, with a progress line per batch (at most one a second) for the watchdog."""
    from mlx_lm.tuner.trainer import evaluate, iterate_batches

    r.rep.beat(phase, 0.0)
    loss = evaluate(model=r.model, dataset=dataset, batch_size=r.cfg["batch_size"], num_batches=num_batches,
                    max_seq_length=r.cfg["max_seq_length"], loss=losses(r.cfg)[1],
                    iterate_batches=partial(iterate_batches, seed=r.cfg["seed"]), progress_callback=partial(r.rep.beat, phase))
    r.model.train()
    return loss


def validate(r, step: int) -> None:
    if r.val_set is None or r.cfg["val_batches"] == 0:
        return
    tic = time.perf_counter()
    r.last_val = (step, run_eval(r, r.val_set, r.cfg["val_batches"], "val"))
    r.val0 = r.last_val[1] if step == 0 else r.val0
    dt = time.perf_counter() - tic
    if r.coll.rank == 0:
        r.rep.line("val", step=step, val_loss=r.last_val[1], val_s=dt)
    r.rep.event("val", step, loss=r.last_val[1], val_s=round(dt, 4), peak_mem_gb=r.mx.get_peak_memory() / 1e9)


def report(r, it: int, lr: float) -> None:
    """mlx-lm's train report: the window's mean loss over every rank, tokens, tok/s."""
    w_loss = r.coll.sum(r.win_loss).item() / (r.win_steps * r.coll.size)
    w_tokens = int(r.coll.sum(r.win_tokens).item())
    r.trained_tokens += w_tokens
    peak, tps = r.mx.get_peak_memory() / 1e9, w_tokens / r.train_time if r.train_time else 0.0
    if r.coll.rank == 0:
        r.rep.line(f"iter {it}", train_loss=w_loss, lr=lr, **{"tok/s": tps}, peak_mem_gb=peak,
                   trained_tokens=r.trained_tokens, **{"it/s": r.win_steps / r.train_time if r.train_time else 0.0})
    r.rep.event("train", it, loss=w_loss, lr=lr, tokens=w_tokens, tok_per_s=tps, peak_mem_gb=peak,
                trained_tokens=r.trained_tokens, train_s=round(r.train_time, 4))
    r.win_loss, r.win_tokens, r.win_steps, r.train_time = r.mx.array(0.0), r.mx.array(0, dtype=r.mx.int32), 0, 0.0


def train_step(r, step, it: int) -> tuple:
    """One iteration: this rank's micro-batch (after a world change, the old ranks' shares of the
    global batch, accumulated), then the loss over every rank: token-weighted with
    grad_average: tokens, else mlx-lm's mean of the ranks' means. (loss, tokens, rank loss, grad norm)."""
    mx, cfg, k = r.mx, r.cfg, len(r.plans)
    idx, update, lv, nt = r.order.next(it), it % cfg["grad_accumulation_steps"] == 0, [], []
    for j, plan in enumerate(r.plans):
        batch = make_batch(mx, r.np, r.train_set, plan[idx], cfg["max_seq_length"])
        lvalue, toks, out = step(batch, r.grad, update and j == k - 1)
        r.grad = None if update and j == k - 1 else out
        mx.eval(r.state, lvalue, toks, out)
        lv, nt = lv + [lvalue], nt + [toks.astype(mx.float32)]
    r.win_loss, r.win_tokens, r.win_steps = r.win_loss + sum(lv) / k, r.win_tokens + sum(nt).astype(mx.int32), r.win_steps + 1
    both = r.coll.sum(mx.stack([sum(lv), sum(a * b for a, b in zip(lv, nt, strict=True)), sum(nt)]))
    mx.eval(r.win_loss, r.win_tokens, both)
    loss = both[1].item() / both[2].item() if cfg["grad_average"] == "tokens" else both[0].item() / (r.coll.size * k)
    return loss, int(both[2].item()), (sum(lv) / k).item(), out.item() if update else None


def check_stability(r, it: int, loss: float) -> None:
    """NaN/inf at any step, or divergence_factor x the first step's loss early on, stops every rank."""
    cfg = r.cfg
    if not math.isfinite(loss):
        raise failure(STABILITY, f"the loss is {loss} at step {it} (learning_rate {cfg['learning_rate']}): lower "
                                 "the learning rate, check the data and the LoRA scale")
    if it <= cfg["divergence_window"] and loss > cfg["divergence_factor"] * r.initial_loss:
        raise failure(STABILITY, f"the loss diverged: {loss:.4g} at step {it} is more than {cfg['divergence_factor']}x "
                                 f"the first step's {r.initial_loss:.4g} (learning_rate {cfg['learning_rate']}): "
                                 "lower the learning rate")


def train(r) -> int:
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import _clear_cache, grad_checkpoint
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    mx, cfg, coll, rep, iters = r.mx, r.cfg, r.coll, r.rep, r.cfg["iters"]
    rep.step = r.start
    if coll.rank == 0:
        rep.start_metrics(cfg)
        ckpt.sweep_temporaries(r.ckroot)
        atomic.write_json(r.adapters / "adapter_config.json", adapter_config(r, r.adapters))
        if r.world_change:
            rep.event("world-change", r.start, **r.world_change)
    rep.line("model", rank=coll.rank, model=cfg["model"], fine_tune_type=cfg["fine_tune_type"], start_step=r.start,
             trainable_params=sum(v.size for _, v in tree_flatten(r.model.trainable_parameters())),
             layers=len(r.model.layers))
    _ = maybe_set_recommended_wired_limit()
    if cfg["grad_checkpoint"]:
        grad_checkpoint(r.model.layers[0])
    r.state = [r.model.state, r.optimizer.state, mx.random.state]
    step, t_wall = compiled_step(r), time.perf_counter()
    if r.start == 0:
        validate(r, 0)
    r.model.train()
    if r.start < iters:
        warm_up(r, step)
        rep.beat("train", 0.0)  # step 1 still builds the update's kernels: seconds on a fresh machine
    for it in range(r.start + 1, iters + 1):
        tic = time.perf_counter()
        loss, tokens, rank_loss, norm = train_step(r, step, it)
        _clear_cache(cfg["clear_cache_threshold"])
        dt = time.perf_counter() - tic
        r.train_time, rep.step, lr = r.train_time + dt, it, r.optimizer.learning_rate.item()
        r.initial_loss = loss if r.initial_loss is None else r.initial_loss
        rep.line(f"iter {it}", rank=coll.rank, loss=loss, rank_loss=rank_loss, tokens=tokens, step_s=dt, grad_norm=norm)
        rep.event("step", it, loss=loss, lr=lr, tokens=tokens, tok_per_s=tokens / dt if dt else None,
                  step_s=round(dt, 5), grad_norm=norm)
        check_stability(r, it, loss)
        # ---- report, validate, checkpoint: mlx-lm's cadence ----
        if it % cfg["steps_per_report"] == 0 or it == iters:
            report(r, it, lr)
        if it % cfg["steps_per_eval"] == 0 or it == iters:
            validate(r, it)
        if r.args.stop_at_step is not None and r.args.stop_at_step <= it < iters:  # a clean preemption
            save_checkpoint(r, it)
            rep.line("stopped", rank=coll.rank, step=it, reason="--stop-at-step")
            rep.event("done", it, stopped=True, checkpoint_s=round(r.ckpt_time, 4),
                      train_wall_s=round(time.perf_counter() - t_wall, 4))
            return 0
        if it % cfg["save_every"] == 0 or it == iters:
            save_checkpoint(r, it, final=it == iters)
    return finish(r, time.perf_counter() - t_wall)


def finish(r, wall: float) -> int:
    """The whole-split test evaluation (progress lines keep the watchdog fed), then `done`
    naming the best-by-validation checkpoint: an mlx-lm adapter folder as it is."""
    iters, rank = r.cfg["iters"], r.coll.rank
    if r.cfg["test"] and r.test_set is not None:
        tic = time.perf_counter()
        test_loss = run_eval(r, r.test_set, r.cfg["test_batches"], "test")
        ppl = math.exp(test_loss) if test_loss < 700 else float("inf")
        if rank == 0:
            r.rep.line("test", step=iters, test_loss=test_loss, test_ppl=ppl, test_s=time.perf_counter() - tic)
        r.rep.event("test", iters, loss=test_loss, ppl=ppl if math.isfinite(ppl) else None)
    if r.last_val and r.val0 is not None and not r.last_val[1] < r.val0:  # the run made the model no better
        msg = (f"the final validation loss {r.last_val[1]:.4f} (step {r.last_val[0]}) is not below step 0's "
               f"{r.val0:.4f}: this adapter does not improve on the base model")
        if rank == 0:
            r.rep.warn(msg)
        r.rep.event("warning", iters, what="no-improvement", loss=r.last_val[1], val_loss_step0=r.val0, message=msg)
    best = ckpt.best(r.ckroot) if rank == 0 else None
    best_path = r.ckroot / best[0] if best else None
    if rank == 0:
        r.rep.line("done", step=iters, wall_s=wall, checkpoint_s=r.ckpt_time,
                   checkpoint_pct=100 * r.ckpt_time / wall if wall else 0.0, adapter=r.adapters,
                   best=best[0] if best else "-", best_adapter=best_path or "-")
    r.rep.event("done", iters, checkpoint_s=round(r.ckpt_time, 4), train_wall_s=round(wall, 4),
                best=best[0] if best else None, best_val_loss=best[1] if best else None,
                best_adapter=str(best_path) if best_path else None, world_change=r.world_change)
    return 0


if __name__ == "__main__":
    sys.exit(main())
