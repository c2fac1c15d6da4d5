"""bin/train.py with real mlx, the real mlx.launch ring backend (two ranks on 127.0.0.1,
hostfile.local.json) and real mlx-lm.

What is proven here:
- exact resume: a run stopped (--stop-at-step) or SIGKILLed mid-run and resumed gives the
  same per-step losses, reported losses and final adapter as an uninterrupted run;
  tolerance max abs diff <= 1e-5 on every tensor (on CPU it is 0, and that is printed);
- a damaged newest checkpoint is skipped with its reason and the previous one is used;
- the same maths as `mlx_lm lora` under the same launch with `batching: mlx_lm`: reported train
  losses within 1e-3 relative, and the per-rank batches equal mlx-lm's iterate_batches over epochs;
  the resumes run on the default batcher (`batching: length`, lib/batching.py);
- the adapter loads with `mlx_lm generate --adapter-path` and `mlx_lm fuse`;
- failure categories: NaN learning rate, a diverging one, a missing dataset, a global batch
  the world size does not divide; every rank writes its failure file and exit code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, make, run

from lib import checkpoint as ckpt
from lib import config as C
from lib.log import CATEGORIES, FAILURES, OOM_RE

LAUNCH = str(Path(PY).with_name("mlx.launch"))
HOSTFILE = str(ROOT / "hostfile.local.json")
MODEL = ROOT / "models" / "tiny-gemma4"
TOL = 1e-5  # max abs difference allowed on every adapter tensor after a resume

CONFIG = """\
fine_tune_type: lora
num_layers: -1
lora_parameters: {rank: 4, dropout: 0.1, scale: 20.0}   # dropout: the mx.random state matters
learning_rate: 3e-3
batch_size: 4
iters: 12                # 36 train records / batch 4 = 9 batches: crosses an epoch
steps_per_report: 3
steps_per_eval: 4
save_every: 4
val_batches: 2
test: true
test_batches: 2
max_seq_length: 96
chat_template_args: {enable_thinking: true}   # what raw mlx_lm lora renders (it takes no arguments): comparable
seed: 3
keep_last_k: 2
"""

pytestmark = [pytest.mark.slow, pytest.mark.beside]  # beside the rest (tests/conftest.py)


# ---- fixtures ----------------------------------------------------------------------------------
def write_dataset(out: Path, n_train: int = 36, n_valid: int = 8, n_test: int = 8) -> Path:
    """mlx-lm chat records from CPython's pydoc topics, with an export-style manifest.json."""
    import pydoc_data.topics as topics

    items = sorted(topics.topics.items())
    recs = []
    for i in range(n_train + n_valid + n_test):  # past the ~80 topics they repeat, cut differently
        k, v = items[i % len(items)]
        body = " ".join(v.split())[: 60 + (i * 37) % 120]
        recs.append({"messages": [{"role": "user", "content": f"What is {k} in Python?"},
                                  {"role": "assistant", "content": body}],
                     "record_id": f"t{i:04d}", "weight": 1.0, "source": f"pydoc:{k}"})
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": recs[:n_train], "valid": recs[n_train:n_train + n_valid], "test": recs[n_train + n_valid:]}
    files = {}
    for name, rs in splits.items():
        data = "".join(json.dumps(r) + "\n" for r in rs).encode()
        (out / f"{name}.jsonl").write_bytes(data)
        files[f"{name}.jsonl"] = {"sha256": hashlib.sha256(data).hexdigest(), "records": len(rs)}
    from lib.hashing import digest_of

    (out / "manifest.json").write_text(json.dumps({
        "files": files, "dataset_sha256": digest_of({k: v["sha256"] for k, v in files.items()})}))
    return out


@pytest.fixture(scope="module")
def model() -> Path:
    if not (MODEL / "config.json").is_file():
        make("tiny-model", "ARCH=gemma4")
    return MODEL


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "chat")


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "train.yaml"
    p.write_text(CONFIG)
    return p


def free_port_pair() -> int:
    """A port p with p and p+1 free (mlx.launch's ring takes one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 65000:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair")


def launch_argv(*trainer_args, module=None) -> list[str]:
    cmd = ["-m", *module] if module else ["bin/train.py", *trainer_args]
    return [LAUNCH, "--hostfile", HOSTFILE, "--backend", "ring", "--starting-port", str(free_port_pair()),
            "--", PY, *cmd]


def train_args(cfg_path, model, data, run_dir, *extra) -> list[str]:
    return ["--config", str(cfg_path), "--model", str(model), "--data", str(data), "--run-dir", str(run_dir), *extra]


def launch(*trainer_args, timeout=300, check=True):
    p = run(launch_argv(*trainer_args), check=False, timeout=timeout)
    if check:
        # mlx.launch exits 0 even when a rank fails: the ranks' own markers are the truth.
        fails = list(Path(trainer_args[trainer_args.index("--run-dir") + 1]).glob("logs/rank-*.failure.json"))
        assert p.returncode == 0 and not fails, f"launch failed\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def events(run_dir: Path, kind: str) -> dict[int, dict]:
    return {e["step"]: e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == kind}


def tensors(path: Path) -> dict:
    import mlx.core as mx

    return mx.load(str(path))


def max_abs_diff(a: dict, b: dict) -> float:
    import mlx.core as mx

    assert sorted(a) == sorted(b)
    return max(mx.abs(a[k].astype(mx.float32) - b[k].astype(mx.float32)).max().item() for k in a)


def assert_same_run(base: Path, other: Path) -> None:
    """Per-step losses, reported losses, validation and the final adapter and optimizer."""
    for kind in ("step", "train", "val"):
        a, b = events(base, kind), events(other, kind)
        assert sorted(a) == sorted(b), f"{kind} steps differ: {sorted(a)} vs {sorted(b)}"
        worst = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
        assert worst == 0.0 or worst <= TOL, f"{kind} losses differ by {worst}"
    final = ckpt.name_of(12)
    d_adapter = max_abs_diff(tensors(base / "adapters" / "adapters.safetensors"),
                             tensors(other / "adapters" / "adapters.safetensors"))
    d_opt = max_abs_diff(tensors(base / "checkpoints" / final / "optimizer.safetensors"),
                         tensors(other / "checkpoints" / final / "optimizer.safetensors"))
    print(f"resume exactness: adapter max abs diff {d_adapter}, optimizer {d_opt} (tolerance {TOL})")
    assert d_adapter <= TOL and d_opt <= TOL


@pytest.fixture(scope="module")
def mlx_lm_cfg_path(tmp_path_factory) -> Path:
    """The config with mlx-lm's batches and masks (`batching: mlx_lm`), to compare with raw mlx_lm lora."""
    p = tmp_path_factory.mktemp("cfg") / "mlx_lm.yaml"
    p.write_text(CONFIG + "batching: mlx_lm\n")
    return p


@pytest.fixture(scope="module")
def baseline(model, data, cfg_path, tmp_path_factory) -> Path:
    """The uninterrupted two-rank run every resume is compared with."""
    run_dir = tmp_path_factory.mktemp("runs") / "baseline"
    p = launch(*train_args(cfg_path, model, data, run_dir))
    assert "done step 12" in p.stdout
    return run_dir


# ---- the uninterrupted run -------------------------------------------------------------------------
def test_baseline_run_writes_the_contract(baseline, data):
    for r in (0, 1):
        j = json.loads((baseline / "logs" / f"rank-{r}.joined.json").read_text())
        assert (j["rank"], j["world_size"], j["backend"]) == (r, 2, "ring")
        assert j["records"] == 52 and j["records_by_split"] == {"train": 36, "valid": 8, "test": 8}
        assert j["dataset_sha256"] == json.loads((data / "manifest.json").read_text())["dataset_sha256"]
        log = (baseline / "logs" / f"rank-{r}.log").read_text()
        assert re.search(rf"rank-joined rank {r} world_size 2 host \S+ backend ring", log)
        assert len(re.findall(rf"Z iter \d+ rank {r} loss ", log)) == 12
        # Something is said before step 1, in this order: never a silent wait (a fresh machine
        # spends a minute in `compile`, with a line every 3 s).
        said = re.findall(rf"Z (?:progress rank {r} phase (\S+)|(iter) 1 rank {r} )", log)
        phases = [x for i, x in enumerate(a or b for a, b in said) if i == 0 or x != (said[i - 1][0] or said[i - 1][1])]
        assert phases[:phases.index("iter")] == ["start", "load-model", "tokenize", "val", "compile", "train"], phases
    kinds = [json.loads(line)["kind"] for line in (baseline / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("step") == 12 and kinds.count("train") == 4 and kinds.count("test") == 1
    assert "warning" not in kinds  # the validation loss fell: no no-improvement warning
    for e in map(json.loads, (baseline / "metrics.jsonl").read_text().splitlines()):
        assert {"step", "kind", "loss", "lr", "tokens", "tok_per_s", "peak_mem_gb", "wall_s"} <= set(e)
    assert sorted(events(baseline, "val")) == [0, 4, 8, 12]
    test = events(baseline, "test")[12]
    assert math.isclose(test["ppl"], math.exp(test["loss"]), rel_tol=1e-9)
    # checkpoints: keep_last_k 2 + best by val + final; every one verifies; latest is the final
    names = [p.name for p in ckpt.listing(baseline / "checkpoints")]
    best = min(((s, e["loss"]) for s, e in events(baseline, "val").items() if s), key=lambda x: x[1])[0]
    assert set(names) == {ckpt.name_of(8), ckpt.name_of(12), ckpt.name_of(best)}
    assert all(ckpt.verify(baseline / "checkpoints" / n)[0] for n in names)
    assert ckpt.latest_pointer(baseline / "checkpoints") == ckpt.name_of(12)
    st = ckpt.read_state(baseline / "checkpoints" / ckpt.name_of(12))
    assert st["final"] and st["data"]["epoch"] == 1 and st["world_size"] == 2
    cfg = json.loads((baseline / "adapters" / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == -1 and cfg["lora_parameters"]["rank"] == 4
    assert max_abs_diff(tensors(baseline / "adapters" / "adapters.safetensors"),
                        tensors(baseline / "checkpoints" / ckpt.name_of(12) / "adapters.safetensors")) == 0.0


# ---- exact resume ----------------------------------------------------------------------------------
def test_stop_corrupt_newest_then_resume_falls_back_and_is_exact(baseline, model, data, cfg_path, tmp_path):
    run_dir = tmp_path / "stopped"
    args = train_args(cfg_path, model, data, run_dir)
    p = launch(*args, "--stop-at-step", "9")
    assert "stopped rank 0 step 9" in p.stdout and "stopped rank 1 step 9" in p.stdout
    newest = run_dir / "checkpoints" / ckpt.name_of(9)
    assert ckpt.verify(newest) == (True, "ok")
    blob = bytearray((newest / "adapters.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (newest / "adapters.safetensors").write_bytes(bytes(blob))
    p = launch(*args, "--resume")
    assert re.search(r"checkpoint-skip rank 0 name step-0000009 reason \"sha256 mismatch in adapters.safetensors\"",
                     p.stdout), p.stdout
    assert re.search(r"resume rank 0 checkpoint \S+step-0000008 step 8 fell_back True", p.stdout), p.stdout
    assert list((run_dir / "checkpoints").glob("quarantine-step-0000009-*"))
    assert_same_run(baseline, run_dir)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigkill_mid_run_then_resume_is_exact(baseline, model, data, cfg_path, tmp_path):
    run_dir = tmp_path / "killed"
    args = train_args(cfg_path, model, data, run_dir)
    proc = subprocess.Popen(launch_argv(*args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= ckpt.name_of(4):
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pids = [json.loads(f.read_text())["pid"] for f in run_dir.glob("logs/rank-*.joined.json")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a rank outlived the SIGKILL of its launch"
    kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "done" not in kinds, "the run finished before the kill; the test did not test"
    killed_at = max(events(run_dir, "step"))
    resume_from = ckpt.find_resume(run_dir / "checkpoints")[0].name
    launch(*args, "--resume")
    print(f"killed after step {killed_at}; resumed from {resume_from}")
    assert_same_run(baseline, run_dir)


# ---- same maths as mlx-lm -------------------------------------------------------------------------
MLX_LM_ROW = re.compile(r"^\s*(\d+)\s+([0-9.]+) [▼▲]\s+([0-9,]+)\s+([0-9.]+)k\s*$")


def parse_mlx_lm(stdout: str) -> dict[int, float]:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stdout)
    return {int(m.group(1)): float(m.group(2)) for m in map(MLX_LM_ROW.match, plain.splitlines()) if m}


def test_reported_loss_matches_mlx_lm_lora_under_mlx_launch(model, data, mlx_lm_cfg_path, tmp_path):
    """Under `batching: mlx_lm` the trainer trains what raw `mlx_lm lora` trains."""
    launch(*train_args(mlx_lm_cfg_path, model, data, tmp_path / "ours"))
    argv = launch_argv(module=["mlx_lm", "lora", "-c", str(mlx_lm_cfg_path), "--train", "--model", str(model),
                               "--data", str(data), "--adapter-path", str(tmp_path / "mlx_lm_adapters")])
    p = run(argv, timeout=300)
    theirs = parse_mlx_lm(p.stdout)
    ours = {s: e["loss"] for s, e in events(tmp_path / "ours", "train").items()}
    assert sorted(theirs) == sorted(ours) == [3, 6, 9, 12], (theirs, p.stdout[-3000:])
    worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours)
    print(f"mlx_lm lora vs bin/train.py train loss: worst relative difference {worst:.2e} "
          f"(mlx-lm prints 3 decimals; tolerance 1e-3) {theirs} vs {ours}")
    assert worst <= 1e-3


def test_each_rank_gets_mlx_lms_batches(model, data):
    """The trainer's Batches against mlx-lm's own iterate_batches seeded as `mlx_lm lora` seeds it,
    for rank 0 and rank 1 of 2 and for a single rank, over three epochs; after a world change one
    rank's two shares are the two ranks' batches."""
    import types

    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import iterate_batches
    from mlx_lm.utils import load

    train = load_trainer()
    _, tok = load(str(model))
    ds = CacheDataset(load_local_dataset(data, tok, types.SimpleNamespace(mask_prompt=False))[0])
    cfg, n, seen = {"seed": 5, "batch_size": 4, "max_seq_length": 96, "steps_per_eval": 4}, len(ds) // 4, {}
    for rank, size in ((0, 2), (1, 2), (0, 1)):
        group = types.SimpleNamespace(rank=lambda r=rank: r, size=lambda s=size: s)
        theirs = iterate_batches(ds, 4, 96, loop=True, seed=5, comm_group=group)
        seen[rank, size] = [[x.tolist() for x in next(theirs)] for _ in range(3 * n)]
        ours = train.Batches(np, ds, cfg, [rank], size, 0)
        for it in range(1, 3 * n + 1):
            assert [x.tolist() for x in ours.next(it)[0].arrays] == seen[rank, size][it - 1], (rank, size, it)
    both = train.Batches(np, ds, cfg, [0, 1], 2, 0)  # one rank resumed after a world change from 2
    for it in range(1, 3 * n + 1):
        got = [[x.tolist() for x in b.arrays] for b in both.next(it)]
        assert got == [seen[0, 2][it - 1], seen[1, 2][it - 1]], it


def test_data_order_follows_mlx_lm_train_with_validation_draws(model, data, tmp_path):
    """mlx-lm's own train() (one rank) with a recording iterate_batches and a trivial model:
    the batches it trains on, over three epochs with validation every 4 iterations drawing
    from the same numpy stream, are the trainer's Batches, step for step."""
    import types

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches
    from mlx_lm.tuner.trainer import train as mlx_lm_train
    from mlx_lm.utils import load

    train = load_trainer()
    _, tok = load(str(model))
    tr, va, _ = load_local_dataset(data, tok, types.SimpleNamespace(mask_prompt=False))
    tr, va = CacheDataset(tr), CacheDataset(va)
    seen = []

    def recording(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        for b in iterate_batches(dataset, batch_size, max_seq_length, loop, seed, comm_group):
            if loop:
                seen.append(b[0].tolist())
            yield b

    def loss(m, batch, lengths):
        return m(batch[:, :1].astype(mx.float32)).mean(), mx.array(1)

    iters, seed = 30, 11
    np.random.seed(seed)  # what mlx_lm lora's run() does first
    mlx_lm_train(model=nn.Linear(1, 1), optimizer=optim.SGD(learning_rate=0.0), train_dataset=tr, val_dataset=va,
                 args=TrainingArgs(batch_size=4, iters=iters, val_batches=1, steps_per_report=10, steps_per_eval=4,
                                   steps_per_save=10_000, adapter_file=str(tmp_path / "a.safetensors")),
                 loss=loss, iterate_batches=recording)
    cfg = {"seed": seed, "batch_size": 4, "max_seq_length": 2048, "steps_per_eval": 4}
    order = train.Batches(np, tr, cfg, [0], 1, len(va) // 4)
    ours = [order.next(it)[0].arrays[0].tolist() for it in range(1, iters + 1)]
    assert len(seen) == iters and iters > 3 * (len(tr) // 4)  # over three epochs
    assert ours == seen
    # and without the validation draws the order would differ: the test can fail
    plain = train.Batches(np, tr, cfg, [0], 1, 0)
    assert [plain.next(it)[0].arrays[0].tolist() for it in range(1, iters + 1)] != seen


# ---- the adapter in mlx-lm's layout ----------------------------------------------------------------
def test_adapter_loads_with_mlx_lm_generate_and_fuse(baseline, model, tmp_path):
    """adapters/ and the best-by-validation checkpoint folder, as they are (no copying), load
    with `mlx_lm generate --adapter-path` and `mlx_lm fuse`."""
    done = events(baseline, "done")[12]
    best = Path(done["best_adapter"])
    assert best.parent == baseline / "checkpoints" and best.name == done["best"]
    assert {"adapters.safetensors", "adapter_config.json"} <= {f.name for f in best.iterdir()}
    for adapters in (baseline / "adapters", best):
        p = run([PY, "-m", "mlx_lm", "generate", "--model", str(model), "--adapter-path", str(adapters),
                 "--prompt", "What is a list?", "--max-tokens", "4", "--temp", "0"], timeout=120)
        assert "Generation:" in p.stdout or "tokens-per-sec" in p.stdout, p.stdout
    fused = tmp_path / "fused"
    run([PY, "-m", "mlx_lm", "fuse", "--model", str(model), "--adapter-path", str(best),
         "--save-path", str(fused)], timeout=120)
    assert (fused / "config.json").is_file() and list(fused.glob("*.safetensors"))
    # The fused weights are the base plus this checkpoint's LoRA, not the base model's.
    base, merged = tensors(model / "model.safetensors"), tensors(fused / "model.safetensors")
    changed = [k for k in merged if k in base and k.endswith("q_proj.weight")
               and max_abs_diff({k: base[k]}, {k: merged[k]}) > 0]
    assert changed, "mlx_lm fuse did not apply the checkpoint's adapter"


# ---- the watchdog sees progress, not just steps ------------------------------------------------
WATCHDOG_S = 8


@pytest.fixture(scope="module")
def long_test_run(model, tmp_path_factory):
    """bin/run.py (the orchestrator, its real watchdog) on hostfile.local.json with a whole-split
    test evaluation that lasts several watchdog windows: a dataset in datasets/, a config."""
    name = f"wd-test-{os.getpid()}"
    write_dataset(ROOT / "datasets" / name, n_test=600)  # 300 took 6.8 s once mlx.launch stopped spinning
    cfg = tmp_path_factory.mktemp("wd") / "wd.yaml"
    cfg.write_text(CONFIG.replace("iters: 12", "iters: 4").replace("test_batches: 2", "test_batches: -1")
                   .replace("val_batches: 2", "val_batches: 1"))
    yield name, cfg
    import shutil
    shutil.rmtree(ROOT / "datasets" / name, ignore_errors=True)
    for d in (ROOT / "runs").glob(f"{name}*"):
        shutil.rmtree(d, ignore_errors=True)


def run_stage(dataset, cfg, run_id, **kw):
    return subprocess.Popen([PY, "bin/run.py", "--stage", "train", "--run", run_id,
                             "--hostfile", HOSTFILE, "--config", str(cfg), "--model", str(MODEL), "--dataset", dataset,
                             "--remote-root", str(ROOT), "--python", PY, "--watchdog", str(WATCHDOG_S),
                             "--port", str(free_port_pair())],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_final_evaluation_longer_than_the_watchdog_window_passes(long_test_run):
    dataset, cfg = long_test_run
    p = run_stage(dataset, cfg, f"{dataset}-long")
    out, err = p.communicate(timeout=900)
    summary = json.loads((ROOT / "runs" / f"{dataset}-long" / "train.json").read_text())
    assert p.returncode == 0 and summary["ok"] and not summary["watchdog_fired"], (summary, err[-3000:])
    test_s = float(re.search(r"^test step 4 .* test_s (\S+)", out, re.M).group(1))
    print(f"final evaluation {test_s:.1f} s under a {WATCHDOG_S} s watchdog window: PASS")
    assert test_s > WATCHDOG_S, "the evaluation was too short to test the watchdog"
    # Mac1's terminal shows the ranks' phases until the steps start, then only a line per report (#28);
    # the launch log keeps every phase line.
    log = (ROOT / "runs" / f"{dataset}-long" / "logs" / "launch-train.log").read_text()
    assert re.search(r"progress rank [01] phase test", log) and re.search(r"progress rank [01] phase load-model", out)
    assert not re.search(r"progress rank", out.split("\nstep ", 1)[1]), out
    # The summary names the best-by-validation adapter, a checkpoint folder mlx-lm loads as it is.
    best = ROOT / summary["best_adapter"]
    assert best.parent.name == "checkpoints" and (best / "adapter_config.json").is_file()
    assert f"best_adapter {summary['best_adapter']}" in out


def test_a_rank_frozen_in_the_final_evaluation_is_a_hang(long_test_run):
    dataset, cfg = long_test_run
    run_id = f"{dataset}-frozen"
    p = run_stage(dataset, cfg, run_id)
    log = ROOT / "runs" / run_id / "logs" / "launch-train.log"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (log.is_file() and "progress rank 1 phase test" in log.read_text()):
        time.sleep(0.2)
    pid = json.loads((ROOT / "runs" / run_id / "logs" / "rank-1.joined.json").read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    summary = json.loads((ROOT / "runs" / run_id / "train.json").read_text())
    assert p.returncode == 1 and summary["watchdog_fired"], (summary, err[-3000:])
    assert summary["category"] == "hang / link partition" and "RUNBOOK.md#hang-or-link-partition" in err
    assert not alive(pid), "the sweep left the frozen rank behind"


# ---- failure categories -------------------------------------------------------------------------------
def test_a_process_that_does_not_track_skips_the_wandb_import():
    """mlx-lm's tuner imports wandb wherever it is installed; a rank that does not track hides it first
    (lib/tracking.without_wandb), and mlx-lm's callbacks take it as absent."""
    code = ("import sys; from lib import tracking; tracking.without_wandb(); from mlx_lm.tuner import callbacks, "
            "trainer; assert callbacks.wandb is None and sys.modules['wandb'] is None; print('ok')")
    assert run([PY, "-c", code]).stdout.strip() == "ok"


def test_tracking_never_stops_a_run(model, data, tmp_path):
    """#28: report_to: wandb with no API key goes offline, without a prompt on the terminal that mlx.launch's
    `ssh -tt` gives a remote rank (stdin and stderr a pty here: wandb asked, and read mlx.launch's newlines,
    forever); W&B's service process killed at step 3 (a crash of wandb-core) is a warning, and the run goes
    on to the end with every event in metrics.jsonl (what the dead service had not written to disk is lost
    to W&B: metrics.jsonl is the record)."""
    import pty
    import threading

    cfg = tmp_path / "tracked.yaml"
    cfg.write_text(CONFIG + "report_to: wandb\n")
    run_dir = tmp_path / "tracked"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    tty, term = pty.openpty()
    p = subprocess.Popen([PY, "bin/train.py", *train_args(cfg, model, data, run_dir)], cwd=ROOT, env=env,
                         stdin=term, stdout=subprocess.PIPE, stderr=term, text=True)
    os.close(term)
    said = []  # what reached the terminal: a prompt would be here

    def drain():
        with contextlib.suppress(OSError):
            while chunk := os.read(tty, 4096):
                said.append(chunk.decode(errors="replace"))

    threading.Thread(target=drain, daemon=True).start()
    out, killed = [], []
    for line in p.stdout:
        out.append(line)
        if line.startswith("iter 3 rank 0 ") and not killed:
            kids = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "wandb-core"], capture_output=True, text=True)
            killed = kids.stdout.split()
            for pid in killed:
                os.kill(int(pid), signal.SIGKILL)
    assert p.wait(timeout=60) == 0 and killed, "".join(out[-40:])
    assert "Enter your choice" not in "".join(said + out), said
    assert "done step 12" in "".join(out)
    assert sorted(events(run_dir, "step")) == list(range(1, 13)), "metrics.jsonl lost a step"
    (t,) = events(run_dir, "tracking").values()
    assert t["mode"] == "offline" and t["dir"].endswith(t["id"])
    warned = [e["message"] for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if e["kind"] == "warning"]
    assert any("UsageError: No API key configured" in w for w in warned), warned
    assert any(re.match(r"W&B log failed at step \d+ .*tracking stops, metrics.jsonl goes on", w) for w in warned)


def failure(run_dir: Path, rank: int = 0) -> dict:
    return json.loads((run_dir / "logs" / f"rank-{rank}.failure.json").read_text())


def test_nan_learning_rate_is_a_stability_failure(model, data, cfg_path, tmp_path):
    run_dir = tmp_path / "nan"
    p = run([PY, "bin/train.py", *train_args(cfg_path, model, data, run_dir, "--learning-rate", "nan")], check=False)
    f = failure(run_dir)
    assert p.returncode == 12 and f["category"] == "learning rate or quantized LoRA stability"
    assert f["anchor"] == CATEGORIES[f["category"]] and "learning_rate is nan" in f["message"]
    assert "see RUNBOOK.md#learning-rate-or-lora-stability" in p.stderr


def test_absurd_learning_rate_stops_every_rank_with_the_category(model, data, tmp_path):
    cfg = tmp_path / "absurd.yaml"
    cfg.write_text(CONFIG.replace("learning_rate: 3e-3", "learning_rate: 1e4"))
    run_dir = tmp_path / "absurd"
    launch(*train_args(cfg, model, data, run_dir), check=False)
    fs = [failure(run_dir, r) for r in (0, 1)]
    assert {f["category"] for f in fs} == {"learning rate or quantized LoRA stability"}
    assert {f["exit_code"] for f in fs} == {12} and fs[0]["step"] == fs[1]["step"] > 1
    assert re.search(r"loss (is nan|is inf|diverged)", fs[0]["message"]), fs[0]["message"]


def test_global_batch_not_divisible_by_world_size(model, data, cfg_path, tmp_path):
    run_dir = tmp_path / "odd"
    launch(*train_args(cfg_path, model, data, run_dir, "--batch-size", "3"), check=False)
    for r in (0, 1):
        f = failure(run_dir, r)
        assert f["exit_code"] == 2 and f["kind"] == "config"
        assert "batch_size 3 is the global batch and must be divisible by the world size 2" in f["message"]
        assert "use 2 or 4" in f["message"]


def test_missing_dataset_single_host_launch(model, cfg_path, tmp_path):
    """mlx.launch with one host hands the rank an empty MLX_HOSTFILE: the trainer runs as a
    world of one, and a dataset path that does not exist is the export/path category."""
    run_dir = tmp_path / "nodata"
    argv = [LAUNCH, "--hosts", "127.0.0.1", "--", PY, "bin/train.py",
            *train_args(cfg_path, model, tmp_path / "no-such-dataset", run_dir)]
    run(argv, check=False, timeout=120)
    j = json.loads((run_dir / "logs" / "rank-0.joined.json").read_text())
    assert j["world_size"] == 1
    f = failure(run_dir)
    assert f["category"] == "export format or path consistency" and f["exit_code"] == 11
    assert "no-such-dataset not found" in f["message"]


def test_a_record_that_is_not_an_object_is_a_data_error_naming_its_line(model, data, cfg_path, tmp_path):
    bad, run_dir = tmp_path / "data", tmp_path / "notobj"
    shutil.copytree(data, bad)
    lines = (bad / "valid.jsonl").read_text().splitlines(keepends=True)
    (bad / "valid.jsonl").write_text("".join(lines[:2] + ['["a", "list"]\n'] + lines[2:]))
    run([LAUNCH, "--hosts", "127.0.0.1", "--", PY, "bin/train.py", *train_args(cfg_path, model, bad, run_dir)],
        check=False, timeout=120)
    f = failure(run_dir)
    assert f["category"] == "export format or path consistency" and f["exit_code"] == 11, f
    assert f"{bad / 'valid.jsonl'}:3: a JSON list, not an object" in f["message"], f["message"]


# ---- config ---------------------------------------------------------------------------------------
def test_config_floats_precedence_and_strictness(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("learning_rate: 1e-5\nbatch_size: 8\niters: 10\nsave_every: 5\n")
    cfg = C.resolve(y, {"batch_size": 2, "model": "m", "data": "d", "seed": None})
    assert cfg["learning_rate"] == 1e-5 and isinstance(cfg["learning_rate"], float)
    assert cfg["batch_size"] == 2 and cfg["iters"] == 10 and cfg["seed"] == 0
    y.write_text("learning_rate: 1e-5\nbatchsize: 8\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml:2: unknown config key 'batchsize' \(did you mean 'batch_size'\?\)"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("iters: ten\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml:1: iters must be an integer >= 1, got 'ten'"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("keep_last_k: 1\n")
    with pytest.raises(C.ConfigError, match="optimizer_config must be a mapping of optimizer name"):
        C.validate({"optimizer_config": {"adamW": {"weight_decay": 0.1}}})  # a misspelling would be ignored
    with pytest.raises(C.ConfigError, match="lr_schedule must be null or a mapping with name"):
        C.validate({"lr_schedule": {"name": "cosine_decay", "arguments": []}})
    with pytest.raises(C.ConfigError, match="keep_last_k must be an integer >= 2"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("lora_parameters: {rank: 8, alpha: 16, dropout: 0.0}\n")
    with pytest.raises(C.ConfigError, match="not 'alpha'"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("adapter_path: adapters\n")
    with pytest.raises(C.ConfigError, match="RUN_DIR/adapters"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("report_to: swanlab\n")  # mlx-lm takes it; the runbook tracks with W&B only
    with pytest.raises(C.ConfigError, match=r"c\.yaml:1: report_to must be null or wandb \(swanlab is not wired"):
        C.resolve(y, {"model": "m", "data": "d"})
    y.write_text("report_to: null\nproject_name: null\nhf_dataset: null\n")  # as mlx-lm writes them
    assert C.resolve(y, {"model": "m", "data": "d"})["report_to"] is None
    y.write_text("report_to: wandb\nproject_name: thunder\n")  # tracking is not the maths: a resume may add it
    assert C.config_hash(C.resolve(y, {"model": "m", "data": "d"})) == C.config_hash(C.resolve(None, {
        "model": "m", "data": "d"}))
    y.write_text("learning_rate: .inf\n")
    with pytest.raises(C.ConfigError) as e:
        C.resolve(y, {"model": "m", "data": "d"})
    assert e.value.category == "learning rate or quantized LoRA stability"
    y.write_text("save_every: 3\ngrad_accumulation_steps: 2\niters: 6\n")
    with pytest.raises(C.ConfigError, match="save_every \\(3\\) must be a multiple of grad_accumulation_steps"):
        C.resolve(y, {"model": "m", "data": "d"})


def test_shipped_configs_resolve_and_run_under_mlx_lm_names():
    for name in ("smoke", "stage1"):
        cfg = C.resolve(ROOT / "configs" / f"{name}.yaml", {"model": "m", "data": "d"})
        assert cfg["fine_tune_type"] == "lora" and cfg["keep_last_k"] >= 2
        assert cfg["batch_size"] % 2 == 0 and cfg["learning_rate"] <= 1e-4
    smoke = C.load_config(ROOT / "configs" / "smoke.yaml")
    assert 0 < smoke["save_every"] < smoke["iters"] and smoke["batch_size"] % 3 == 0


def test_resume_config_hash_ignores_only_resumable_keys():
    a = C.resolve(None, {"model": "m", "data": "d"})
    b = dict(a, iters=a["iters"] * 2, model="elsewhere/m", steps_per_report=1)
    assert C.config_hash(a) == C.config_hash(b) and C.diff_keys(a, b) == []
    c = dict(a, learning_rate=1e-3)
    assert C.config_hash(a) != C.config_hash(c) and C.diff_keys(a, c) == ["learning_rate"]


def load_trainer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train", ROOT / "bin" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


METAL_OOM = ("[METAL] Command buffer execution failed: Insufficient Memory "
             "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)")


def test_out_of_memory_is_its_own_failure(tmp_path):
    """MLX's Metal out-of-memory text (recorded on a Mac; no Metal here) through the trainer's
    failure path: exit 13, failure.json kind oom with its anchor (the orchestrator prints the
    fallback ladder: tests/test_launch_unit.py)."""
    from lib import rank

    rep = rank.Reporter(tmp_path / "run", 0)
    rep.step = 7
    code = rank.fail(rank.as_error(RuntimeError(METAL_OOM)), rep, "L1")
    f = failure(tmp_path / "run")
    assert code == 13 and (f["kind"], f["step"], f["anchor"], f["launch_id"]) == ("oom", 7, "out-of-memory", "L1")
    assert f["category"] is None and code == FAILURES["oom"][1]


def test_a_lost_peer_is_a_hang_that_restarts(tmp_path):
    """The rank that notices a dead peer first may fail before mlx.launch stops it (seen on 4 fabric hosts with
    a rank killed): its ring error is a hang / link partition, which RESTARTS resumes, not a trainer error."""
    from lib import launch, rank

    rep = rank.Reporter(tmp_path / "run", 2)
    rep.step = 4
    code = rank.fail(rank.as_error(RuntimeError("[ring] connection to a peer was lost")), rep, "L1")
    f = failure(tmp_path / "run", 2)
    assert (f["category"], f["anchor"], code) == ("hang / link partition", "hang-or-link-partition", 1), f
    ev = {"failures": {0: {"kind": "error", "category": None, "message": "rank 2 failed"}, 2: f},
          "joined": [0, 1, 2, 3]}
    cat, why = launch.categorize(launch.LaunchResult(returncode=0, wall_s=50.0), ev, 4)
    assert cat == "hang / link partition" and why.startswith("rank 2: [ring] connection to a peer was lost"), why
    assert rank.as_error(RuntimeError("[ring] Rank cannot be larger than the size of the group")).kind == "error"


def test_out_of_memory_ladder_keeps_the_global_batch():
    assert OOM_RE.search(METAL_OOM) and OOM_RE.search("kIOGPUCommandBufferCallbackErrorTimeout")
    assert not OOM_RE.search("ValueError: shapes do not match")
    cfg = C.resolve(ROOT / "configs" / "stage1.yaml", {"model": "m", "data": "d"})
    argv = ["python", "bin/train.py", "--config", "configs/stage1.yaml", "--run-dir", "runs/x"]
    rungs = C.fallback_ladder(cfg, argv, world_size=2)
    assert len(rungs) == 2
    train = load_trainer()
    for n, (_, rung) in enumerate(rungs):
        args = train.build_parser().parse_args(rung[2:])
        r = C.resolve(args.config, {**{k: getattr(args, k) for k, _ in train.FLAGS}, "model": "m", "data": "d"})
        assert r["batch_size"] == 2 and r["batch_size"] // 2 == 1  # one sequence per rank
        assert r["batch_size"] * r["grad_accumulation_steps"] == cfg["batch_size"]
        assert r["iters"] == cfg["iters"] * 4  # an mlx-lm iteration is one micro-batch
        assert r["max_seq_length"] == cfg["max_seq_length"] // (2 if n == 1 else 1)
    # a flag of the launch (smoke's --iters 3) wins over the config's value
    (_, rung), _ = C.fallback_ladder(cfg, [*argv, "--iters", "3"], world_size=2)
    assert rung[rung.index("--iters") + 1] == "12" and rung.count("--iters") == 1, rung


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
