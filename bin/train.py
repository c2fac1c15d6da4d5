#!/usr/bin/env python3
"""The rank-side LoRA trainer: runs on every rank under mlx.launch, or alone for one rank.

Usage:
    mlx.launch --hostfile HOSTFILE --backend ring -- PYTHON bin/train.py \
        --config CONFIG --model MODEL --data datasets/NAME --run-dir runs/RUN \
        [--resume] [--iters N] [--seed S] [--expect-world-size W] [--launch-id ID]
    PYTHON bin/train.py ... (the same flags: one rank, no launcher)

Example (two ranks on this machine):
    .venv/bin/mlx.launch --hostfile hostfile.local.json --backend ring -- \
        .venv/bin/python bin/train.py --config configs/smoke.yaml --model models/tiny-gemma4 \
        --data datasets/domain_sft_v1_high_signal_thunder --run-dir runs/demo/smoke

What it is: mlx-lm's LoRA training (its model loading, LoRA conversion, datasets,
`default_loss`, `average_gradients`, `evaluate`, the same compiled step) with what
mlx-lm lacks: exact resume, atomic verified checkpoints, plain per-rank logs, a
metrics file, failure categories. With the same config and seed the train loss
reported every steps_per_report equals `mlx_lm lora`'s under the same launch and
every rank sees the same batches (batch_size is the global batch). The data order
follows mlx-lm's numpy stream (np.random.seed(seed), one permutation per epoch,
one per validation); the trainer replays that stream in its own RandomState and
saves it, the current permutation and the position in it with every checkpoint,
so a run stopped at step k and resumed is bit-identical to one that was not.
Validation here uses a fixed subset of the valid split (seeded), after steps 0,
every steps_per_eval, and the last, so checkpoints can be ranked by it.

Contract with the orchestrator (lib/launch.py), all paths under --run-dir:
    logs/rank-R.joined.json  written by rank R as soon as the distributed group is up
                             (rank, world_size, host, backend, pid, launch_id, versions);
                             rewritten after data loading with records, records_by_split,
                             dataset_sha256 (the dataset manifest's, else the split files'),
                             files_sha256. No file from a launch => that rank failed before
                             rank initialization ("runtime parity").
    logs/rank-R.failure.json rank R stopped: category (a lib.log.CATEGORIES key, or null
                             when none applies), anchor, kind, message, step, exit_code,
                             launch_id. Both files are removed by rank R at start; pass
                             --launch-id and compare it to tell a stale file from this launch.
    logs/rank-R.log          every line the rank printed, with a UTC timestamp.
    metrics.jsonl            rank 0: one JSON object per event; kind step (every step),
                             train (every steps_per_report, mlx-lm's loss), val, test,
                             checkpoint, done; each with step, kind, loss, lr, tokens,
                             tok_per_s, peak_mem_gb, wall_s. On resume, events after the
                             resumed step move to metrics.superseded.jsonl.
    checkpoints/step-NNNNNNN/ and checkpoints/latest    see lib/checkpoint.py.
    adapters/                adapter_config.json (written first) + adapters.safetensors
                             (every checkpoint and the end): mlx-lm's layout.
Stdout lines (grep-able): `rank-joined ...`, `data ...`, `iter N rank R loss ...` every
step on every rank (the watchdog's progress signal), `iter N train_loss X lr Y tok/s Z
peak_mem_gb W` on rank 0 every steps_per_report, `val ...`, `checkpoint ...`, `test ...`,
`done ...`, `failed ...`.

Exit codes (every rank):
    0  finished (or stopped at --stop-at-step after its checkpoint)
    1  unexpected error (traceback on stderr; failure.json kind "error")
    2  bad command line or config (unknown key, wrong type, batch not divisible by world)
    10 runtime parity: mlx does not import, the group does not form, wrong world size
    11 export format or path consistency: dataset or model missing/unreadable/malformed,
       dataset bytes differ between ranks or from the checkpoint's
    12 learning rate or quantized LoRA stability: NaN/inf loss, or a loss above
       divergence_factor x the first step's within divergence_window steps
    13 out of memory or GPU timeout (the fallback ladder is printed as commands)
    14 resume impossible: no verified checkpoint, or the config changed
Before training, a failure on one rank (config, data, model, checkpoint pick) is agreed
with the others, so every rank exits with the failing rank's code and writes its own
failure.json (naming the rank that failed). In the loop, NaN/divergence is judged on the
globally averaged loss, so all ranks stop at the same step with code 12; any other death
of a rank leaves the others blocked in a collective until mlx.launch stops them (SIGTERM:
no failure file, exit -15) -- the dead rank's own failure file (if it could write one)
names the cause.

Run folder reuse: without --resume, rank 0 moves an earlier run's checkpoints/,
metrics.jsonl and adapters/ to superseded-<time>-<pid>/ before training (nothing is
deleted). --stop-at-step K ends a run cleanly after step K with a checkpoint at K (a
preemption, and how the resume tests stop a run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import socket
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl  # noqa: E402
from lib import checkpoint as ckpt  # noqa: E402
from lib import config as C  # noqa: E402
from lib.hashing import digest_of, sha256_file  # noqa: E402
from lib.log import CATEGORIES, RunbookError, fmt  # noqa: E402

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_PARITY, EXIT_DATA, EXIT_STABILITY, EXIT_OOM, EXIT_RESUME = 10, 11, 12, 13, 14
PARITY = "runtime parity"
DATA = "export format or path consistency"
STABILITY = "learning rate or quantized LoRA stability"
CODE_OF = {PARITY: EXIT_PARITY, DATA: EXIT_DATA, STABILITY: EXIT_STABILITY}
KINDS = ("error", "config", "parity", "data", "stability", "oom", "resume")
SPLITS = ("train", "valid", "test")


class Failure(Exception):
    """A categorized stop: every rank exits with `code` and writes its failure.json."""

    def __init__(self, message: str, code: int, category: str | None = None, kind: str = "error",
                 anchor: str | None = None):
        super().__init__(message)
        self.code, self.category, self.kind = code, category, kind
        self.anchor = anchor or (CATEGORIES[category] if category else "trainer")

    def __str__(self) -> str:
        head = f"[{self.category}] " if self.category else ""
        return f"{head}{self.args[0]}; see RUNBOOK.md#{self.anchor}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config YAML (mlx-lm lora keys + runbook keys)")
    p.add_argument("--run-dir", required=True, help="the run folder (runs/RUN or runs/RUN/smoke)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--expect-world-size", type=int, help="fail (runtime parity) unless the group has this size")
    p.add_argument("--launch-id", default="", help="written into the marker files, to tell them from stale ones")
    p.add_argument("--stop-at-step", type=int, help="stop after this step, with a checkpoint (a clean preemption)")
    # Command-line overrides (precedence over the YAML), mlx-lm's flag names.
    for flag, typ in (("--model", str), ("--data", str), ("--iters", int), ("--seed", int),
                      ("--batch-size", int), ("--learning-rate", float), ("--num-layers", int),
                      ("--save-every", int), ("--steps-per-eval", int), ("--steps-per-report", int),
                      ("--max-seq-length", int), ("--grad-accumulation-steps", int),
                      ("--val-batches", int), ("--test-batches", int), ("--keep-last-k", int),
                      ("--optimizer", str), ("--fine-tune-type", str)):
        p.add_argument(flag, type=typ, default=None)
    return p


def overrides(args) -> dict:
    keys = ("model", "data", "iters", "seed", "batch_size", "learning_rate", "num_layers", "save_every",
            "steps_per_eval", "steps_per_report", "max_seq_length", "grad_accumulation_steps",
            "val_batches", "test_batches", "keep_last_k", "optimizer", "fine_tune_type")
    return {k: getattr(args, k) for k in keys}


# ---- per-rank output ----------------------------------------------------------------
class RankLog:
    """One plain line per event to stdout and to logs/rank-R.log (timestamped); rank 0
    also appends metrics events to metrics.jsonl."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.f = open(run_dir / "logs" / f"rank-{rank}.log", "a", encoding="utf-8")
        self.metrics = None
        self.t0 = time.monotonic()

    def line(self, name: str, /, **fields) -> None:
        text = " ".join([name] + [f"{k} {fmt(v)}" for k, v in fields.items()])
        print(text, flush=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.f.write(f"{stamp} {text}\n")
        self.f.flush()

    def warn(self, message: str) -> None:
        self.line("warning", rank=self.rank, message=json.dumps(message))

    def open_metrics(self) -> None:
        self.metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def metric(self, kind: str, step: int, **fields) -> dict:
        ev = {"step": step, "kind": kind, "loss": None, "lr": None, "tokens": None, "tok_per_s": None,
              "peak_mem_gb": None, "wall_s": round(time.monotonic() - self.t0, 3)}
        ev.update(fields)
        bad = [k for k, v in ev.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:  # JSON has no NaN/inf: null, and name what was not finite
            ev.update({k: None for k in bad}, nonfinite={k: str(ev[k]) for k in bad})
        if self.metrics is not None:
            self.metrics.write(jsonl.dumps(ev) + "\n")
            self.metrics.flush()
        return ev


def marker(run_dir: Path, rank: int, name: str) -> Path:
    return run_dir / "logs" / f"rank-{rank}.{name}.json"


def write_failure(run_dir: Path, rank: int, f: Failure, step, launch_id: str) -> None:
    atomic.write_json(marker(run_dir, rank, "failure"), {
        "rank": rank, "category": f.category, "anchor": f.anchor, "kind": f.kind, "message": f.args[0],
        "step": step, "exit_code": f.code, "launch_id": launch_id, "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


# ---- distributed group --------------------------------------------------------------
def init_group():
    """mlx and the global group. Under mlx.launch (MLX_RANK set) the group must form
    (strict); a lone rank, or mlx.launch's empty MLX_HOSTFILE for one host, is size 1."""
    try:
        import mlx.core as mx
    except Exception as e:  # wrong interpreter or broken install
        raise Failure(f"{sys.executable} cannot import mlx ({type(e).__name__}: {e}); every host must run "
                      "the same interpreter with the locked packages", EXIT_PARITY, PARITY, "parity") from e
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file() and not Path(hostfile).read_text().strip():
        os.environ.pop("MLX_HOSTFILE")  # mlx.launch with a single host
        os.environ.pop("MLX_RANK", None)
    launched = "MLX_RANK" in os.environ
    backend = ("jaccl" if os.environ.get("MLX_IBV_DEVICES") or os.environ.get("MLX_JACCL_COORDINATOR")
               else "ring" if os.environ.get("MLX_HOSTFILE") else "mpi" if os.environ.get("OMPI_COMM_WORLD_SIZE")
               else "none")
    try:
        group = mx.distributed.init(strict=launched)
    except Exception as e:
        raise Failure(f"the distributed group did not form ({backend}): {e}", EXIT_PARITY, PARITY, "parity") from e
    return mx, group, backend if group.size() > 1 else "none"


class Collective:
    """The few collectives the trainer needs besides the gradient all-reduce."""

    def __init__(self, mx, group):
        self.mx, self.group = mx, group
        self.rank, self.size = group.rank(), group.size()

    def sum(self, x):
        if self.size == 1:
            return x
        return self.mx.distributed.all_sum(x, stream=self.mx.cpu)

    def agree(self, failure: Failure | None) -> None:
        """Every rank learns whether any rank failed here; all stop with that code."""
        import numpy as np

        mx = self.mx
        if self.size == 1:
            if failure:
                raise failure
            return
        codes = [EXIT_ERROR, EXIT_USAGE, EXIT_PARITY, EXIT_DATA, EXIT_STABILITY, EXIT_OOM, EXIT_RESUME]
        vec = np.zeros(self.size + len(codes), np.int32)
        if failure:
            vec[self.rank] = 1
            vec[self.size + codes.index(failure.code)] = 1
        out = np.array(self.sum(mx.array(vec)))
        if failure:
            raise failure
        if out[: self.size].any():
            ranks = [int(r) for r in np.nonzero(out[: self.size])[0]]
            code = codes[int(np.nonzero(out[self.size:])[0][0])]
            category = {v: k for k, v in CODE_OF.items()}.get(code)
            kind = {EXIT_USAGE: "config", EXIT_OOM: "oom", EXIT_RESUME: "resume"}.get(
                code, {PARITY: "parity", DATA: "data", STABILITY: "stability"}.get(category, "error"))
            raise Failure(f"rank(s) {ranks} failed (exit {code}); see their logs/rank-R.failure.json",
                          code, category, kind)

    def gather(self, x):
        if self.size == 1:
            return x
        return self.mx.distributed.all_gather(x, stream=self.mx.cpu)

    def bcast_bytes(self, data: bytes | None) -> bytes:
        import numpy as np

        mx = self.mx
        if self.size == 1:
            return data
        n = int(self.sum(mx.array([len(data) if self.rank == 0 else 0], mx.int32)).item())
        arr = np.frombuffer(data, np.uint8).astype(np.int32) if self.rank == 0 else np.zeros(n, np.int32)
        return bytes(np.array(self.sum(mx.array(arr))).astype(np.uint8))

    def bcast_arrays(self, flat: dict | None, like: dict) -> dict:
        """Rank 0's tensors to every rank (others pass zeros shaped like their own)."""
        mx = self.mx
        if self.size == 1:
            return flat
        out = {}
        for k in sorted(like):
            x = flat[k] if self.rank == 0 else mx.zeros(like[k].shape, like[k].dtype)
            out[k] = self.sum(x)
        mx.eval(list(out.values()))
        return out

    def gather_bytes(self, data: bytes) -> list[bytes]:
        import numpy as np

        mx = self.mx
        if self.size == 1:
            return [data]
        out = np.array(mx.distributed.all_gather(mx.array(np.frombuffer(data, np.uint8)), stream=mx.cpu))
        n = len(data)
        return [bytes(out[i * n:(i + 1) * n]) for i in range(self.size)]


# ---- data -----------------------------------------------------------------------------
def dataset_identity(data_dir: Path) -> tuple[str, str, list[str]]:
    """(dataset_sha256, files_sha256, problems): the export manifest's dataset_sha256 (or
    the split files' digest when there is no manifest), the digest of the split files
    actually present, and any split file whose bytes disagree with the manifest."""
    present = {f"{s}.jsonl": sha256_file(data_dir / f"{s}.jsonl") for s in SPLITS if (data_dir / f"{s}.jsonl").is_file()}
    files_sha = digest_of(present)
    problems = []
    mpath = data_dir / "manifest.json"
    if not mpath.is_file():
        return files_sha, files_sha, problems
    try:
        man = json.loads(mpath.read_text(encoding="utf-8"))
    except ValueError as e:
        raise Failure(f"{mpath}: invalid JSON ({e}); re-run `make export`", EXIT_DATA, DATA, "data") from e
    listed = man.get("files") if isinstance(man, dict) else None
    if isinstance(listed, dict):
        for name, sha in present.items():
            meta = listed.get(name)
            want = meta.get("sha256") if isinstance(meta, dict) else meta
            if isinstance(want, str) and want != sha:
                problems.append(f"{name} does not match {mpath.name} (sha256 {sha[:12]} != {want[:12]})")
    return str(man.get("dataset_sha256") or files_sha), files_sha, problems


def check_data_files(cfg: dict) -> tuple[str, str]:
    """The dataset folder and its train split exist and agree with its manifest:
    (dataset_sha256, files_sha256)."""
    data_dir = Path(cfg["data"])
    if not data_dir.is_dir():
        raise Failure(f"dataset folder {data_dir} not found on {socket.gethostname()} (cwd {os.getcwd()}); "
                      "run `make export` and `make sync`", EXIT_DATA, DATA, "data")
    if not (data_dir / "train.jsonl").is_file():
        raise Failure(f"{data_dir}/train.jsonl not found on {socket.gethostname()}", EXIT_DATA, DATA, "data")
    ds_sha, files_sha, problems = dataset_identity(data_dir)
    if problems:
        raise Failure(f"{data_dir}: " + "; ".join(problems) + "; re-run `make sync`", EXIT_DATA, DATA, "data")
    return ds_sha, files_sha


def load_data(cfg: dict, tokenizer, log: RankLog):
    """mlx-lm's datasets (ChatDataset & co via create_dataset, wrapped in CacheDataset),
    every record tokenized up front so a bad record fails here, naming file and line."""
    import types

    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    data_dir = Path(cfg["data"])
    ns = types.SimpleNamespace(**cfg)
    out, counts, tokens, long = {}, {}, {}, 0
    for split in SPLITS:
        path = data_dir / f"{split}.jsonl"
        if not path.is_file():
            out[split], counts[split], tokens[split] = None, 0, 0
            continue
        try:
            records = list(jsonl.read(path))
        except (ValueError, UnicodeDecodeError) as e:
            raise Failure(f"{e}", EXIT_DATA, DATA, "data") from e
        if not records:
            out[split], counts[split], tokens[split] = None, 0, 0
            continue
        for n, r in enumerate(records, 1):
            if not isinstance(r, dict):
                raise Failure(f"{path}:{n}: a record is a JSON object, got {type(r).__name__}", EXIT_DATA, DATA, "data")
        try:
            ds = CacheDataset(create_dataset(records, tokenizer, ns))
        except ValueError as e:
            raise Failure(f"{path}: {e}".strip(), EXIT_DATA, DATA, "data") from e
        total = 0
        for i in range(len(ds)):
            try:
                toks, _ = ds[i]
            except Exception as e:
                rid = records[i].get("record_id", "?")
                raise Failure(f"{path}:{i + 1} (record_id {rid}) does not tokenize: {type(e).__name__}: {e}",
                              EXIT_DATA, DATA, "data") from e
            total += len(toks)
            long += len(toks) > cfg["max_seq_length"]
        out[split], counts[split], tokens[split] = ds, len(ds), total
    if not counts["train"]:
        raise Failure(f"{data_dir}/train.jsonl has no records", EXIT_DATA, DATA, "data")
    for split in ("valid", "test"):
        needed = split == "valid" and cfg["val_batches"] != 0 or split == "test" and cfg["test"]
        if needed and counts[split] and counts[split] < cfg["batch_size"]:
            raise Failure(f"{data_dir}/{split}.jsonl has {counts[split]} records, fewer than batch_size "
                          f"{cfg['batch_size']}: export more records or lower batch_size", EXIT_DATA, DATA, "data")
    if counts["train"] < cfg["batch_size"]:
        raise Failure(f"{data_dir}/train.jsonl has {counts['train']} records, fewer than batch_size "
                      f"{cfg['batch_size']}", EXIT_DATA, DATA, "data")
    if cfg["test"] and not counts["test"]:
        raise Failure(f"test: true but {data_dir}/test.jsonl is missing or empty", EXIT_DATA, DATA, "data")
    if long:
        log.warn(f"{long} records are longer than max_seq_length {cfg['max_seq_length']} and are truncated")
    return out, counts, tokens


def batch_plan(dataset, batch_size: int, rank: int, size: int) -> list[list[int]]:
    """mlx-lm's iterate_batches, the part before the loop: records sorted by
    CacheDataset.itemlen, cut into global batches, each rank taking every size-th."""
    idx = sorted(range(len(dataset)), key=dataset.itemlen)
    return [idx[i + rank: i + rank + batch_size: size] for i in range(0, len(idx) - batch_size + 1, batch_size)]


def make_batch(mx, np, dataset, indices: list[int], max_seq_length: int):
    """mlx-lm's iterate_batches, the body of its loop (padding to 1 + a multiple of 32)."""
    batch = [dataset[j] for j in indices]
    if len(batch[0]) == 2:
        batch, offsets = zip(*batch, strict=True)
    else:
        offsets = [0] * len(batch)
    lengths = [len(x) for x in batch]
    pad_to = 32
    width = min(1 + pad_to * ((max(lengths) + pad_to - 1) // pad_to), max_seq_length)
    arr = np.zeros((len(indices), width), np.int32)
    for j in range(len(indices)):
        n = min(lengths[j], max_seq_length)
        arr[j, :n] = batch[j][:n]
        lengths[j] = n
    return mx.array(arr), mx.array(list(zip(offsets, lengths, strict=True)))


class DataOrder:
    """The train batch order of mlx-lm's lora, with its state.

    mlx-lm seeds numpy's global RNG with the seed, then draws one permutation of
    the batches at the start of every epoch and one permutation of the validation
    batches whenever it validates (iteration 1 and every steps_per_eval), in that
    order. This replays the same stream in a RandomState (identical to the global
    one after np.random.seed) whose state, the current permutation and the position
    in it go into every checkpoint. The draw mlx-lm makes when it validates at its
    last iteration is left out: no train batch follows it within the run, and
    leaving it out keeps the order independent of `iters` (a run can be extended)."""

    def __init__(self, np, seed: int, n_batches: int, n_val_batches: int, steps_per_eval: int):
        self.np = np
        self.rs = np.random.RandomState(seed)
        self.n, self.n_val, self.spe = n_batches, n_val_batches, steps_per_eval
        self.perm: list[int] = []
        self.pos, self.epoch = 0, -1

    def next(self, it: int) -> int:
        if self.pos >= len(self.perm):
            self.perm = [int(i) for i in self.rs.permutation(self.n)]
            self.pos, self.epoch = 0, self.epoch + 1
        b = self.perm[self.pos]
        self.pos += 1
        if self.n_val and (it == 1 or it % self.spe == 0):
            self.rs.permutation(self.n_val)
        return b

    def state(self) -> dict:
        name, keys, pos, has_gauss, gauss = self.rs.get_state()
        return {"n_batches": self.n, "epoch": self.epoch, "pos": self.pos, "perm": self.perm,
                "rng": {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}

    def load(self, st: dict) -> None:
        if st["n_batches"] != self.n:
            raise Failure(f"the checkpoint's data order has {st['n_batches']} batches per epoch, this "
                          f"dataset and batch_size give {self.n}", EXIT_DATA, DATA, "data")
        r = st["rng"]
        self.rs.set_state((r["name"], self.np.array(r["keys"], dtype=self.np.uint32), r["pos"],
                           r["has_gauss"], r["cached_gaussian"]))
        self.perm, self.pos, self.epoch = list(st["perm"]), st["pos"], st["epoch"]


# ---- model ------------------------------------------------------------------------------
def load_model(cfg: dict):
    from mlx_lm.utils import load

    m = cfg["model"]
    looks_local = m.startswith((".", "/", "~", "models/")) or Path(m).exists()
    if looks_local and not Path(m).expanduser().is_dir():
        raise Failure(f"model folder {m} not found on {socket.gethostname()} (cwd {os.getcwd()}); run "
                      "`make tiny-model` or `make sync SYNC_MODEL=1`", EXIT_DATA, DATA, "data")
    try:
        return load(m, tokenizer_config={"trust_remote_code": cfg["trust_remote_code"]},
                    trust_remote_code=cfg["trust_remote_code"])
    except (FileNotFoundError, ValueError, OSError) as e:
        raise Failure(f"model {m} does not load on {socket.gethostname()}: {type(e).__name__}: {e}",
                      EXIT_DATA, DATA, "data") from e


def prepare_model(mx, model, cfg: dict) -> None:
    """mlx-lm's train_model up to the optimizer: seed, freeze, LoRA/DoRA or full layers."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(cfg["seed"])
    model.freeze()
    if cfg["num_layers"] > len(model.layers):
        raise Failure(f"num_layers {cfg['num_layers']} but the model has {len(model.layers)} layers",
                      EXIT_USAGE, None, "config", C.ANCHOR)
    if cfg["fine_tune_type"] == "full":
        for layer in model.layers[-max(cfg["num_layers"], 0):]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"],
                              use_dora=cfg["fine_tune_type"] == "dora")
    if cfg["resume_adapter_file"]:
        model.load_weights(cfg["resume_adapter_file"], strict=False)


def build_optimizer(cfg: dict):
    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import build_schedule

    try:
        lr = build_schedule(cfg["lr_schedule"]) if cfg["lr_schedule"] else cfg["learning_rate"]
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise Failure(f"lr_schedule {cfg['lr_schedule']!r} does not build: {e}", EXIT_USAGE, None, "config",
                      C.ANCHOR) from e
    name = cfg["optimizer"]
    cls = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
           "adafactor": optim.Adafactor}[name]
    try:
        return cls(learning_rate=lr, **cfg["optimizer_config"].get(name, {}))
    except TypeError as e:
        raise Failure(f"optimizer_config.{name}: {e}", EXIT_USAGE, None, "config", C.ANCHOR) from e


def adapter_config(cfg: dict, extra: dict) -> dict:
    """What mlx-lm writes as adapter_config.json (its lora args), plus our provenance."""
    out = {k: v for k, v in cfg.items() if k in C.DEFAULTS}
    out["adapter_path"] = extra.get("adapter_path")
    out["runbook"] = extra
    return out


# ---- checkpoints --------------------------------------------------------------------------
def save_checkpoint(mx, root: Path, step: int, model, optimizer, state: dict, adapters_dir: Path) -> Path:
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.trainable_parameters()))
    opt_state = dict(tree_flatten(optimizer.state))
    meta = {"format": "mlx", "step": str(step)}
    writers = {
        "adapters.safetensors": lambda p: mx.save_safetensors(str(p), weights, metadata=meta),
        "optimizer.safetensors": lambda p: mx.save_safetensors(str(p), opt_state, metadata=meta),
    }
    path = ckpt.save(root, step, writers, state)
    write_adapter(mx, adapters_dir, weights)
    return path


def write_adapter(mx, adapters_dir: Path, weights: dict) -> None:
    """adapters/adapters.safetensors, replaced atomically (mlx-lm's file name and format)."""
    adapters_dir.mkdir(parents=True, exist_ok=True)
    tmp = adapters_dir / f".adapters.{os.getpid()}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        atomic.fsync_fd(fd)
    finally:
        os.close(fd)
    os.replace(tmp, adapters_dir / "adapters.safetensors")
    atomic.fsync_dir(adapters_dir)


def archive_previous(run_dir: Path) -> Path | None:
    """A fresh start in a used run folder: move its checkpoints, metrics and adapter aside."""
    names = [n for n in ("checkpoints", "metrics.jsonl", "metrics.superseded.jsonl", "adapters")
             if (run_dir / n).exists()]
    if not names:
        return None
    dest = run_dir / f"superseded-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    dest.mkdir()
    for n in names:
        os.replace(run_dir / n, dest / n)
    return dest


def supersede_metrics(run_dir: Path, step: int) -> int:
    """On resume: events after the resumed step move to metrics.superseded.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, moved = [], []
    for ev in jsonl.read(path):
        (moved if isinstance(ev.get("step"), int) and ev["step"] > step or ev.get("kind") == "done" else keep).append(ev)
    if moved:
        with open(run_dir / "metrics.superseded.jsonl", "a", encoding="utf-8") as f:
            jsonl.write(f, moved)
        with atomic.atomic_open(path, "w", encoding="utf-8") as f:
            jsonl.write(f, keep)
    return len(moved)


# ---- reporting ---------------------------------------------------------------------------------
class Wandb:
    """Optional `report_to: wandb` on rank 0: online, else offline, else off; never stops training."""

    def __init__(self, cfg: dict, run_dir: Path, log: RankLog):
        self.run, self.log = None, log
        try:
            import wandb
        except ImportError:
            log.warn("report_to: wandb but wandb is not installed; metrics stay in metrics.jsonl")
            return
        kw = dict(project=cfg["project_name"] or "thunder-runbook", name=run_dir.name, config=cfg,
                  dir=str(run_dir), resume="allow")
        for mode in ("online", "offline"):
            try:
                self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=60), **kw)
                log.line("wandb", mode=mode)
                return
            except Exception as e:  # unreachable service, bad key, ...
                log.warn(f"wandb {mode} init failed ({type(e).__name__}: {e})")

    def __call__(self, ev: dict) -> None:
        if self.run is None:
            return
        try:
            self.run.log({f"{ev['kind']}/{k}": v for k, v in ev.items() if isinstance(v, (int, float))},
                         step=ev["step"])
        except Exception as e:
            self.log.warn(f"wandb log failed, disabling it ({type(e).__name__}: {e})")
            self.run = None

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception:
                pass


def print_ladder(cfg: dict, world: int, log: RankLog) -> None:
    """The out-of-memory fallback ladder as trainer command lines, ready to paste after
    the same `mlx.launch --hostfile ... --` (each rung in its own run folder)."""
    argv = [sys.executable, "bin/train.py"] + [a for a in sys.argv[1:] if a != "--resume"]
    log.line("oom", rank=log.rank, message=json.dumps(
        "out of memory or GPU timeout: retry one rung at a time, every rank through the same "
        "launcher (mlx.launch --hostfile HOSTFILE --backend ring -- <rung>)"))
    for n, (what, rung) in enumerate(C.fallback_ladder(cfg, argv, world), 1):
        rung = C.set_flag(rung, "--run-dir", f"{str(log.run_dir).rstrip('/')}-oom{n}")
        log.line("oom-fallback", rung=n, what=json.dumps(what))
        print("    " + shlex.join(rung), flush=True)
        log.f.write("    " + shlex.join(rung) + "\n")
    log.f.flush()


# ---- the run ---------------------------------------------------------------------------------
def main() -> int:
    args = build_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as mlx_lm lora sets it
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for name in ("failure", "joined"):
        marker(run_dir, rank, name).unlink(missing_ok=True)
    log = RankLog(run_dir, rank)
    ctx = {"step": None, "cfg": None, "world": 1}
    try:
        mx, group, backend = init_group()
        rank = group.rank()
        if rank != log.rank:  # MLX_RANK was dropped for a lone host
            log = RankLog(run_dir, rank)
        ctx["world"] = group.size()
        return train(args, mx, group, backend, run_dir, log, ctx)
    except Exception as e:
        return fail(as_failure(e), run_dir, log, ctx, args)


def as_failure(e: Exception) -> Failure:
    """An exception as the Failure it stands for (out of memory by MLX's error text)."""
    if isinstance(e, Failure):
        return e
    if isinstance(e, RunbookError):  # config errors
        kind = "stability" if e.category == STABILITY else "config"
        return Failure(e.args[0], CODE_OF.get(e.category, EXIT_USAGE), e.category, kind, e.anchor)
    if isinstance(e, (RuntimeError, MemoryError)) and C.OOM_RE.search(str(e)):
        return Failure(f"out of memory or GPU timeout: {e}", EXIT_OOM, None, "oom", "out-of-memory")
    traceback.print_exc()
    return Failure(f"{type(e).__name__}: {e}", EXIT_ERROR)


def fail(f: Failure, run_dir: Path, log: RankLog, ctx: dict, args) -> int:
    write_failure(run_dir, log.rank, f, ctx["step"], args.launch_id)
    log.line("failed", rank=log.rank, exit_code=f.code, category=json.dumps(f.category), step=ctx["step"],
             message=json.dumps(str(f)))
    print(f"error: {f}", file=sys.stderr, flush=True)
    if f.code == EXIT_OOM and ctx["cfg"]:
        print_ladder(ctx["cfg"], ctx["world"], log)
    return f.code


def guarded(coll: Collective, fn, *a, **kw):
    """Run one local phase; any failure is agreed with the other ranks."""
    out, err = None, None
    try:
        out = fn(*a, **kw)
    except Exception as e:
        err = as_failure(e)
    coll.agree(err)
    return out


def train(args, mx, group, backend: str, run_dir: Path, log: RankLog, ctx: dict) -> int:
    from importlib.metadata import version

    coll = Collective(mx, group)
    rank, world = coll.rank, coll.size
    host = socket.gethostname()
    joined = {"rank": rank, "world_size": world, "host": host, "backend": backend, "pid": os.getpid(),
              "launch_id": args.launch_id, "python": sys.executable, "platform": platform.platform(),
              "mlx": mx.__version__, "mlx_lm": version("mlx-lm"), "cwd": os.getcwd(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phase": "initialized"}
    coll.sum(mx.array(1)).item()  # every rank reached this point: the group works both ways
    atomic.write_json(marker(run_dir, rank, "joined"), joined)
    log.line("rank-joined", rank=rank, world_size=world, host=host, backend=backend, pid=os.getpid())
    if args.expect_world_size and args.expect_world_size != world:
        raise Failure(f"the group has {world} ranks, expected {args.expect_world_size}: check the hostfile and "
                      "that every host's launcher reached the others", EXIT_PARITY, PARITY, "parity")

    # ---- config ----
    def resolve():
        cfg = C.resolve(args.config, overrides(args))
        C.check_world(cfg, world)
        return cfg

    cfg = guarded(coll, resolve)
    ctx["cfg"] = cfg
    chash = C.config_hash(cfg)
    log.line("config", rank=rank, file=args.config, config_sha256=chash[:16], seed=cfg["seed"],
             batch_size=cfg["batch_size"], per_rank_batch=cfg["batch_size"] // world, iters=cfg["iters"],
             learning_rate=cfg["learning_rate"])

    # ---- data files (cheap, before the slow imports), model, then the records ----
    ds_sha, files_sha = guarded(coll, check_data_files, cfg)

    import mlx.nn as nn
    import numpy as np
    from mlx.nn.utils import average_gradients
    from mlx.utils import tree_flatten, tree_map, tree_unflatten
    from mlx_lm.tuner.trainer import _clear_cache, default_loss, evaluate, grad_checkpoint, iterate_batches
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    model, tokenizer = guarded(coll, load_model, cfg)
    sets, counts, tokens = guarded(coll, load_data, cfg, tokenizer, log)
    shas = coll.gather_bytes(bytes.fromhex(files_sha))
    joined.update(phase="data-loaded", records=sum(counts.values()), records_by_split=counts,
                  tokens_by_split=tokens, dataset_sha256=ds_sha, files_sha256=files_sha, data=cfg["data"])
    atomic.write_json(marker(run_dir, rank, "joined"), joined)
    log.line("data", rank=rank, records=sum(counts.values()), train=counts["train"], valid=counts["valid"],
             test=counts["test"], train_tokens=tokens["train"], dataset_sha256=ds_sha, files_sha256=files_sha[:16])
    if len(set(shas)) > 1:
        by_rank = ", ".join(f"rank {r}: {s.hex()[:12]}" for r, s in enumerate(shas))
        raise Failure(f"the ranks loaded different dataset bytes ({by_rank}); re-run `make sync`",
                      EXIT_DATA, DATA, "data")
    train_set, val_set, test_set = sets["train"], sets["valid"], sets["test"]
    if val_set is None and cfg["val_batches"] != 0:
        log.warn(f"{cfg['data']}/valid.jsonl missing or empty: training proceeds without validation")

    guarded(coll, prepare_model, mx, model, cfg)
    optimizer = guarded(coll, build_optimizer, cfg)
    optimizer.init(model.trainable_parameters())
    plan = batch_plan(train_set, cfg["batch_size"], rank, world)
    n_val = (len(val_set) // cfg["batch_size"]) if (val_set is not None and cfg["val_batches"] != 0) else 0
    order = DataOrder(np, cfg["seed"], len(plan), n_val, cfg["steps_per_eval"])
    ckroot = run_dir / "checkpoints"
    adapters_dir = run_dir / "adapters"

    # ---- resume: rank 0 picks and verifies, every rank receives ----
    start, extra_state = 0, {}

    def pick():
        if not args.resume:
            moved = archive_previous(run_dir)
            if moved:
                log.line("fresh-start", rank=rank, archived=moved)
            return None
        chosen, skipped, notes = ckpt.find_resume(ckroot)
        for name, why in skipped:
            log.line("checkpoint-skip", rank=rank, name=name, reason=json.dumps(why))
            ckpt.quarantine(ckroot, name)
        for note in notes:
            log.warn(note)
        if chosen is None:
            raise Failure(f"--resume but no verified checkpoint under {ckroot}"
                          + (f" (skipped: {'; '.join(f'{n}: {w}' for n, w in skipped)})" if skipped else "")
                          + "; start fresh without --resume (RESUME unset)",
                          EXIT_RESUME, None, "resume", "resume")
        st = ckpt.read_state(chosen)
        changed = C.diff_keys(st["config"], cfg)
        if changed:
            was = ", ".join(f"{k}: {st['config'].get(k)!r} -> {cfg.get(k)!r}" for k in changed)
            raise Failure(f"the config changed since {chosen.name} ({was}); restore it or start a new RUN",
                          EXIT_RESUME, None, "resume", "resume")
        if st["files_sha256"] != files_sha:
            raise Failure(f"the dataset bytes changed since {chosen.name} (files sha256 {st['files_sha256'][:12]} "
                          f"-> {files_sha[:12]}); restore the dataset or start a new RUN", EXIT_DATA, DATA, "data")
        log.line("resume", rank=rank, checkpoint=chosen, step=st["step"],
                 fell_back=len(skipped) > 0)
        return chosen, st

    picked = guarded(coll, pick) if rank == 0 else guarded(coll, lambda: None)
    if args.resume:
        st_bytes = coll.bcast_bytes(json.dumps(picked[1]).encode() if rank == 0 else None)
        st = json.loads(st_bytes)
        own_w = dict(tree_flatten(model.trainable_parameters()))
        own_o = dict(tree_flatten(optimizer.state))
        w = o = None
        if rank == 0:
            w = mx.load(str(picked[0] / "adapters.safetensors"))
            o = mx.load(str(picked[0] / "optimizer.safetensors"))

        def check_shapes():
            if rank != 0:
                return
            for name, have, own in (("adapters", w, own_w), ("optimizer", o, own_o)):
                if set(have) != set(own):
                    diff = sorted(set(have) ^ set(own))[:3]
                    raise Failure(f"{picked[0].name}/{name}.safetensors does not fit this model ({diff} ...)",
                                  EXIT_RESUME, None, "resume", "resume")
                bad = [k for k in own if tuple(have[k].shape) != tuple(own[k].shape) or have[k].dtype != own[k].dtype]
                if bad:
                    raise Failure(f"{picked[0].name}/{name}.safetensors: {bad[0]} has shape/dtype "
                                  f"{tuple(have[bad[0]].shape)}/{have[bad[0]].dtype}, the model wants "
                                  f"{tuple(own[bad[0]].shape)}/{own[bad[0]].dtype}", EXIT_RESUME, None, "resume", "resume")

        guarded(coll, check_shapes)
        w = coll.bcast_arrays(w, own_w)
        o = coll.bcast_arrays(o, own_o)
        model.load_weights(list(w.items()), strict=False)
        optimizer.state = tree_unflatten(list(o.items()))
        k = st["rng"]["mx_key"]
        mx.random.seed((int(k[0]) << 32) | int(k[1]))
        order.load(st["data"])
        start = st["step"]
        extra_state = st
        if st["world_size"] != world:
            log.warn(f"resuming a world of {st['world_size']} with {world} ranks: the global batch is the same, "
                     "the per-rank split is not, so the losses are not bit-identical to an uninterrupted run")
        if rank == 0:
            moved = supersede_metrics(run_dir, start)
            if moved:
                log.line("metrics-superseded", rank=rank, events=moved, after_step=start)
    mx.eval(model.parameters(), optimizer.state)

    if rank == 0:
        log.open_metrics()
        ckpt.sweep_temporaries(ckroot)
        write_adapter_config = adapter_config(cfg, {
            "adapter_path": str(adapters_dir), "config_sha256": chash, "dataset_sha256": ds_sha,
            "files_sha256": files_sha, "seed": cfg["seed"], "world_size": world, "launch_id": args.launch_id})
        adapters_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_json(adapters_dir / "adapter_config.json", write_adapter_config)
    reporter = Wandb(cfg, run_dir, log) if (rank == 0 and cfg["report_to"] == "wandb") else None

    n_params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    log.line("model", rank=rank, model=cfg["model"], fine_tune_type=cfg["fine_tune_type"],
             trainable_params=n_params, layers=len(model.layers), start_step=start)

    # ---- mlx-lm's compiled step (mlx_lm/tuner/trainer.py train()), unchanged ----
    _ = maybe_set_recommended_wired_limit()
    if cfg["grad_checkpoint"]:
        grad_checkpoint(model.layers[0])
    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    accum = cfg["grad_accumulation_steps"]
    state = [model.state, optimizer.state, mx.random.state]

    def step_fn(batch, prev_grad, do_update):
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            if accum > 1:
                grad = tree_map(lambda x: x / accum, grad)
            optimizer.update(model, grad)
            grad = None
        return lvalue, toks, grad

    from functools import partial

    step = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    def validate(split_set, num_batches):
        out = evaluate(model=model, dataset=split_set, batch_size=cfg["batch_size"], num_batches=num_batches,
                       max_seq_length=cfg["max_seq_length"], loss=default_loss,
                       iterate_batches=partial(iterate_batches, seed=cfg["seed"]))
        model.train()
        return out

    def emit(kind, step_no, **fields):
        if rank != 0:
            return
        ev = log.metric(kind, step_no, **fields)
        if reporter:
            reporter(ev)

    iters, spr, spe, save_every = cfg["iters"], cfg["steps_per_report"], cfg["steps_per_eval"], cfg["save_every"]
    stop_at = args.stop_at_step
    # The report window (mlx-lm's `losses`, `n_tokens`, `steps`) is per rank: each rank
    # gets its own back on resume (rank 0 the whole sum when the world size changed).
    win = extra_state.get("window", {"loss": [0.0] * world, "tokens": [0] * world, "steps": 0})
    if len(win["loss"]) == world:
        my_loss, my_tokens = win["loss"][rank], win["tokens"][rank]
    else:
        scale = world / len(win["loss"])
        my_loss = sum(win["loss"]) * scale if rank == 0 else 0.0
        my_tokens = sum(win["tokens"]) if rank == 0 else 0
    win_loss = mx.array(my_loss, dtype=mx.float32)
    win_tokens = mx.array(my_tokens, dtype=mx.int32)
    win_steps = win["steps"]
    trained_tokens = extra_state.get("trained_tokens", 0)
    initial_loss = extra_state.get("initial_loss")
    last_val = None
    train_time = 0.0
    grad_accum = None
    t_ckpt = 0.0
    t_train_wall = time.perf_counter()

    def run_val(step_no):
        nonlocal last_val
        if val_set is None or cfg["val_batches"] == 0:
            return None
        tic = time.perf_counter()
        last_val = (step_no, validate(val_set, cfg["val_batches"]))
        dt = time.perf_counter() - tic
        if rank == 0:
            log.line("val", step=step_no, val_loss=last_val[1], val_s=dt)
        emit("val", step_no, loss=last_val[1], val_s=round(dt, 4), peak_mem_gb=mx.get_peak_memory() / 1e9)
        return last_val[1]

    def checkpoint(step_no, final=False):
        nonlocal t_ckpt
        tic = time.perf_counter()
        losses = coll.gather(win_loss.astype(mx.float32).reshape(1)).tolist()
        toks = coll.gather(win_tokens.astype(mx.int32).reshape(1)).tolist()

        def write():
            if rank != 0:
                return None
            k = mx.random.state[0].tolist()
            st = {
                "config": cfg, "config_sha256": chash, "dataset_sha256": ds_sha, "files_sha256": files_sha,
                "world_size": world, "final": final, "iters": iters, "launch_id": args.launch_id,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "val_loss": last_val[1] if last_val and last_val[0] == step_no else None,
                "rng": {"mx_key": [int(k[0]), int(k[1])]}, "data": order.state(),
                "window": {"loss": losses, "tokens": toks, "steps": win_steps},
                "trained_tokens": trained_tokens, "initial_loss": initial_loss,
            }
            path = save_checkpoint(mx, ckroot, step_no, model, optimizer, st, adapters_dir)
            deleted = ckpt.prune(ckroot, cfg["keep_last_k"])
            return path, deleted

        out = guarded(coll, write)
        dt = time.perf_counter() - tic
        t_ckpt += dt
        if rank == 0:
            path, deleted = out
            log.line("checkpoint", step=step_no, path=path, seconds=dt, val_loss=json.dumps(
                last_val[1] if last_val and last_val[0] == step_no else None), pruned=",".join(deleted) or "-")
            emit("checkpoint", step_no, path=str(path), seconds=round(dt, 4), final=final,
                 loss=last_val[1] if last_val and last_val[0] == step_no else None)

    if start == 0:
        run_val(0)
    model.train()
    ctx["step"] = start
    stopped = False
    for it in range(start + 1, iters + 1):
        b = order.next(it)
        batch = make_batch(mx, np, train_set, plan[b], cfg["max_seq_length"])
        tic = time.perf_counter()
        lvalue, toks, grad_accum = step(batch, grad_accum, it % accum == 0)
        win_loss = win_loss + lvalue
        win_tokens = win_tokens + toks
        win_steps += 1
        mx.eval(state, win_loss, win_tokens, grad_accum)
        both = coll.sum(mx.stack([lvalue, toks.astype(mx.float32)]))
        mx.eval(both)
        _clear_cache(cfg["clear_cache_threshold"])
        dt = time.perf_counter() - tic
        train_time += dt
        ctx["step"] = it
        g_loss, g_tokens = both.tolist()
        g_loss /= world
        local = lvalue.item()
        if initial_loss is None:
            initial_loss = g_loss
        lr = optimizer.learning_rate.item()
        log.line(f"iter {it}", rank=rank, loss=g_loss, rank_loss=local, tokens=int(g_tokens), step_s=dt)
        emit("step", it, loss=g_loss, lr=lr, tokens=int(g_tokens), tok_per_s=g_tokens / dt if dt else None,
             step_s=round(dt, 5))
        if not math.isfinite(g_loss):
            raise Failure(f"the loss is {g_loss} at step {it} (learning_rate {cfg['learning_rate']}): lower the "
                          "learning rate, check the data and the LoRA scale", EXIT_STABILITY, STABILITY, "stability")
        if it <= cfg["divergence_window"] and g_loss > cfg["divergence_factor"] * initial_loss:
            raise Failure(f"the loss diverged: {g_loss:.4g} at step {it} is more than {cfg['divergence_factor']}x "
                          f"the first step's {initial_loss:.4g} (learning_rate {cfg['learning_rate']}): lower the "
                          "learning rate", EXIT_STABILITY, STABILITY, "stability")

        if it % spr == 0 or it == iters:
            w_loss = coll.sum(win_loss).item() / (win_steps * world)
            w_tokens = int(coll.sum(win_tokens).item())
            trained_tokens += w_tokens
            peak = mx.get_peak_memory() / 1e9
            tps = w_tokens / train_time if train_time else 0.0
            if rank == 0:
                log.line(f"iter {it}", train_loss=w_loss, lr=lr, **{"tok/s": tps}, peak_mem_gb=peak,
                         trained_tokens=trained_tokens, **{"it/s": win_steps / train_time if train_time else 0.0})
            emit("train", it, loss=w_loss, lr=lr, tokens=w_tokens, tok_per_s=tps, peak_mem_gb=peak,
                 trained_tokens=trained_tokens, train_s=round(train_time, 4))
            win_loss, win_tokens, win_steps, train_time = mx.array(0.0), mx.array(0, dtype=mx.int32), 0, 0.0

        if it % spe == 0 or it == iters:
            run_val(it)
        if stop_at is not None and it >= stop_at and it < iters:
            checkpoint(it)
            stopped = True
            break
        if it % save_every == 0 or it == iters:
            checkpoint(it, final=it == iters)

    wall = time.perf_counter() - t_train_wall
    if stopped:
        log.line("stopped", rank=rank, step=ctx["step"], reason="--stop-at-step")
        emit("done", ctx["step"], stopped=True, checkpoint_s=round(t_ckpt, 4), train_wall_s=round(wall, 4))
        return EXIT_OK

    if cfg["test"] and test_set is not None:
        tic = time.perf_counter()
        test_loss = validate(test_set, cfg["test_batches"])
        ppl = math.exp(test_loss) if test_loss < 700 else float("inf")
        if rank == 0:
            log.line("test", step=iters, test_loss=test_loss, test_ppl=ppl, test_s=time.perf_counter() - tic)
        emit("test", iters, loss=test_loss, ppl=ppl if math.isfinite(ppl) else None)
    if reporter:
        reporter.finish()
    best = ckpt.best(ckroot) if rank == 0 else None
    if rank == 0:
        log.line("done", step=iters, wall_s=wall, checkpoint_s=t_ckpt,
                 checkpoint_pct=100 * t_ckpt / wall if wall else 0.0, adapter=adapters_dir,
                 best=best[0] if best else "-")
    emit("done", iters, checkpoint_s=round(t_ckpt, 4), train_wall_s=round(wall, 4),
         best=best[0] if best else None, best_val_loss=best[1] if best else None)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
