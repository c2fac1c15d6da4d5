"""bin/train.py's exactness and stability machinery, with real mlx, mlx-lm and mlx.launch (ring).

What is proven here (tolerances named where they apply):
- `loss: chunked` (lib/loss.py) is wired into the compiled step: its step-1 loss is the
  default loss's within 1e-5 relative;
- `grad_average: tokens`: 2 ranks under mlx.launch and 1 rank on the same global batch give
  per-step losses within 1e-5 relative and final adapters within 1e-5 absolute (float
  summation order only); with `mlx_lm` (each rank's mean, averaged) they differ by > 1e-3;
- a 2-rank run stopped at step 3 and resumed on 1 rank with --allow-world-change follows the
  uninterrupted 2-rank run: losses within 1e-4 relative;
- the gradient all-reduce is given the CPU stream, and the losses equal mlx-lm's own step;
- gradient checkpointing gives the same LoRA gradients on Gemma 4's KV-shared layers (1e-6);
- `max_grad_norm` clips the global norm and the step events log `grad_norm`;
- a run whose final validation loss is not below step 0's ends with a `warning` event;
- each rank starts `caffeinate -i -w <its pid>` where /usr/bin/caffeinate exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import types
from pathlib import Path

import pytest
from conftest import ROOT
from test_train import MODEL, events, launch, max_abs_diff, tensors, train_args, write_dataset

from lib import config as C

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

CONFIG = """\
fine_tune_type: lora
num_layers: -1
lora_parameters: {rank: 4, dropout: 0.0, scale: 20.0}
# SGD at a small rate: on this random tiny model the gradient is so sensitive to the weights that
# at 1e-3 a rounding-level difference grows ~50x per step (two single-host runs whose maths differ
# only in rounding part by 0.4% after 3 steps); Adam's first steps are sign(g), noise made lr-sized.
optimizer: sgd
learning_rate: 1e-5
batch_size: 4
iters: 6
steps_per_report: 2
steps_per_eval: 3
save_every: 3
val_batches: 2
test: false
max_seq_length: 96
chat_template_args: {enable_thinking: false}
seed: 3
keep_last_k: 2
"""
REL = 1e-5  # per-step losses, dual vs control, with grad_average: tokens
ADAPTER_REL = 1e-4  # |difference| / |adapter| over every LoRA B tensor (L2; they start at 0)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "chat", n_train=24, n_valid=4, n_test=4)


def config(tmp: Path, name: str, **keys) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text(CONFIG + "".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    return p


def trainer():
    spec = importlib.util.spec_from_file_location("thunder_train_exact", ROOT / "bin" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_rank(cfg_path, data, run_dir, *extra):
    from conftest import PY, run

    p = run([PY, "bin/train.py", *train_args(cfg_path, MODEL, data, run_dir, *extra)], check=False, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def adapter_rel(a: Path, b: Path) -> float:
    x, y = tensors(a / "adapters" / "adapters.safetensors"), tensors(b / "adapters" / "adapters.safetensors")
    assert sorted(x) == sorted(y)
    x, y = ({k: v for k, v in t.items() if "lora_b" in k} for t in (x, y))  # lora_a starts random, lora_b at 0
    return (sum(((x[k] - y[k]) ** 2).sum() for k in x) ** 0.5 / sum((y[k] ** 2).sum() for k in y) ** 0.5).item()


def step_losses(run_dir: Path) -> dict[int, float]:
    return {s: e["loss"] for s, e in events(run_dir, "step").items()}


# ---- token-weighted averaging: dual == control ---------------------------------------------------
@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact")
    out = {}
    for avg in ("tokens", "mlx_lm"):
        cfg = config(tmp, avg, grad_average=avg)
        launch(*train_args(cfg, MODEL, data, tmp / f"dual-{avg}"))
        one_rank(cfg, data, tmp / f"control-{avg}")
        out[avg] = (tmp / f"dual-{avg}", tmp / f"control-{avg}")
    return tmp, out


def test_token_weighted_dual_equals_control(runs):
    _, out = runs
    (dual, control), (dual_m, control_m) = out["tokens"], out["mlx_lm"]
    a, b = step_losses(dual), step_losses(control)
    assert sorted(a) == list(range(1, 7)) == sorted(b)
    worst = max(rel(a[s], b[s]) for s in a)
    d_ad, d_abs = adapter_rel(dual, control), max_abs_diff(tensors(dual / "adapters" / "adapters.safetensors"),
                                                           tensors(control / "adapters" / "adapters.safetensors"))
    am, bm = step_losses(dual_m), step_losses(control_m)
    worst_m, d_ad_m = max(rel(am[s], bm[s]) for s in am), adapter_rel(dual_m, control_m)
    print(f"dual vs control: tokens: loss rel {worst:.2e}, adapter rel {d_ad:.2e} (max abs {d_abs:.2e}); "
          f"mlx_lm: loss rel {worst_m:.2e}, adapter rel {d_ad_m:.2e}")
    assert worst <= REL and d_ad <= ADAPTER_REL
    assert worst_m > 10 * max(worst, 1e-7) and d_ad_m > 1e-2  # mlx-lm's mean of the ranks' means: other maths  # mlx-lm's mean of the ranks' means is other maths
    ev = events(dual, "step")[1]
    assert ev["grad_norm"] > 0 and "grad_norm" in events(control, "step")[6]


def test_uneven_shares_dual_equals_control(runs, data):
    """#29: rank_shares [3, 1] (rank 0 three records of each global batch of 4, rank 1 one) computes what
    the single-host control computes, as even shares do: per-step losses and adapters to float error."""
    tmp, out = runs
    cfg = config(tmp, "shares", grad_average="tokens", rank_shares=[3, 1])
    dual, control = tmp / "dual-shares", out["tokens"][1]
    launch(*train_args(cfg, MODEL, data, dual))
    for r, n in ((0, 3), (1, 1)):
        assert json.loads((dual / "logs" / f"rank-{r}.joined.json").read_text())["rank_batch"] == n
    a, b = step_losses(dual), step_losses(control)
    assert sorted(a) == list(range(1, 7)) and max(rel(a[s], b[s]) for s in a) <= REL, (a, b)
    assert adapter_rel(dual, control) <= ADAPTER_REL
    even = step_losses(out["tokens"][0])  # the rank losses differ from the even split's: another split
    rank0 = [float(x.split(" rank_loss ")[1].split()[0]) for x in (dual / "logs" / "rank-0.log").read_text()
             .splitlines() if " iter 1 rank 0 " in x]
    assert rank0 and rank0[0] != a[1] and even[1] == pytest.approx(a[1], rel=REL)
    bad = config(tmp, "shares-mlx", grad_average="mlx_lm", rank_shares=[3, 1])
    with pytest.raises(C.ConfigError, match=r"rank_shares \[3, 1\] needs `grad_average: tokens`"):
        C.resolve(bad, {"model": "m", "data": "d"})
    with pytest.raises(C.ConfigError, match=r"rank_shares \[3, 1\] is not one share per rank: the hostfile has 3"):
        C.rank_batches(C.resolve(cfg, {"model": "m", "data": "d"}), 3)


def test_resume_on_one_rank_follows_the_two_rank_run(runs, data):
    tmp, out = runs
    cfg, full, run_dir = tmp / "tokens.yaml", out["tokens"][0], tmp / "world-change"
    launch(*train_args(cfg, MODEL, data, run_dir, "--stop-at-step", "3"))
    from conftest import PY, run

    refused = run([PY, "bin/train.py", *train_args(cfg, MODEL, data, run_dir, "--resume")], check=False, timeout=300)
    assert refused.returncode != 0 and "--allow-world-change" in refused.stdout + refused.stderr
    p = one_rank(cfg, data, run_dir, "--resume", "--allow-world-change")
    assert "world-change rank 0 shards 2 world_size_from 2 world_size 1 micro_batches 2" in p.stdout
    a, b = step_losses(run_dir), step_losses(full)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    worst = max(rel(a[s], b[s]) for s in a)
    d_ad = adapter_rel(run_dir, full)
    print(f"2 -> 1 rank resume at step 3: loss rel {worst:.2e}, adapter rel {d_ad:.2e}")
    assert worst <= 1e-4 and d_ad <= ADAPTER_REL
    done = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"done"' in x][-1]
    assert done["world_change"] == {"shards": 2, "world_size_from": 2, "world_size": 1, "micro_batches": 2}
    assert events(run_dir, "world-change")[3]["micro_batches"] == 2


# ---- in-process: the compiled step ---------------------------------------------------------------
def setup_model(cfg: dict):
    import mlx.core as mx
    from mlx_lm.utils import load

    train = trainer()
    model, _ = load(str(MODEL))
    opt = train.prepare_model(mx, model, cfg)
    mx.eval(model.parameters(), opt.state)
    state = [model.state, opt.state, mx.random.state]
    r = types.SimpleNamespace(mx=mx, model=model, optimizer=opt, cfg=cfg, state=state)
    return train, r


def batch():
    import mlx.core as mx

    x = mx.random.randint(0, 200, (2, 33), key=mx.random.key(1)).astype(mx.int32)
    return x, mx.array([[0, 33], [0, 20]], dtype=mx.int32)


def cfg_of(**keys) -> dict:
    """mlx-lm's batches (`batching: mlx_lm`): these tests compare the step with mlx-lm's own."""
    return C.resolve(None, {"model": str(MODEL), "data": "unused", "num_layers": -1, "learning_rate": 1e-2,
                            "batching": "mlx_lm", **keys})


def test_all_reduce_on_cpu_stream_and_losses_equal_mlx_lm(monkeypatch):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.nn.utils as nu
    from mlx_lm.tuner.trainer import default_loss

    seen, real = [], nu.average_gradients
    monkeypatch.setattr(nu, "average_gradients", lambda g, **kw: seen.append(kw) or real(g, **kw))
    train, r = setup_model(cfg_of())
    step, b = train.compiled_step(r), batch()
    ours = []
    for _ in range(3):
        loss, _, norm = step(b, None, True)
        mx.eval(r.state, loss, norm)
        ours.append(loss.item())
    assert seen and all(kw.get("communication_stream") == mx.cpu for kw in seen), seen
    _, r2 = setup_model(cfg_of())
    vg, theirs = nn.value_and_grad(r2.model, default_loss), []
    for _ in range(3):  # mlx-lm's own step (trainer.py), uncompiled
        (lv, _), g = vg(r2.model, *b)
        r2.optimizer.update(r2.model, real(g))
        mx.eval(r2.model.parameters(), r2.optimizer.state, lv)
        theirs.append(lv.item())
    assert max(rel(a, c) for a, c in zip(ours, theirs, strict=True)) <= 1e-5, (ours, theirs)


def test_chunked_loss_is_wired_and_equal_at_step_one():
    import mlx.core as mx

    out = {}
    for loss in ("default", "chunked"):
        train, r = setup_model(cfg_of(loss=loss, loss_chunk_tokens=16))
        assert train.losses(r.cfg)[0].__module__ == ("lib.loss" if loss == "chunked" else "mlx_lm.tuner.trainer")
        lv, toks, _ = train.compiled_step(r)(batch(), None, True)
        mx.eval(r.state, lv)
        out[loss] = lv.item()
    print(f"step-1 loss default {out['default']} chunked {out['chunked']}")
    assert rel(out["chunked"], out["default"]) <= 1e-5


def test_max_grad_norm_clips_the_global_norm():
    import mlx.core as mx
    from mlx.utils import tree_flatten

    after = {}
    for clip in (None, 1e-3):
        train, r = setup_model(cfg_of(max_grad_norm=clip, optimizer="sgd", learning_rate=1.0))
        before = dict(tree_flatten(r.model.trainable_parameters()))
        before = {k: mx.array(v) for k, v in before.items()}
        _, _, norm = train.compiled_step(r)(batch(), None, True)
        mx.eval(r.state, norm)
        now = dict(tree_flatten(r.model.trainable_parameters()))
        moved = mx.sqrt(sum(((now[k] - before[k]) ** 2).sum() for k in now)).item()  # sgd, lr 1: the update's norm
        after[clip] = (norm.item(), moved)
    (n0, m0), (n1, m1) = after[None], after[1e-3]
    print(f"grad_norm {n0}, update norm unclipped {m0}, clipped {m1}")
    assert n0 > 1e-2 and abs(n0 - n1) <= 1e-5 * n0
    assert abs(m0 - n0) <= 1e-4 * n0 and abs(m1 - 1e-3) <= 1e-6


def test_grad_checkpoint_keeps_kv_shared_layers_lora_gradients():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint

    train, r = setup_model(cfg_of())
    args = r.model.args
    shared = getattr(args, "num_kv_shared_layers", 0)
    assert shared > 0, "tiny-gemma4 must have KV-shared layers for this test"
    vg, b = nn.value_and_grad(r.model, default_loss), batch()
    _, g0 = vg(r.model, *b)
    g0 = dict(tree_flatten(g0))
    mx.eval(g0)
    cls, call = type(r.model.layers[0]), type(r.model.layers[0]).__call__
    try:
        grad_checkpoint(r.model.layers[0])
        _, g1 = vg(r.model, *b)
        g1 = dict(tree_flatten(g1))
        mx.eval(g1)
    finally:
        cls.__call__ = call
    assert sorted(g0) == sorted(g1)
    first_shared = len(r.model.layers) - shared
    late = [k for k in g0 if int(k.split("layers.")[1].split(".")[0]) >= first_shared]
    assert late and all(mx.abs(g0[k]).max().item() > 0 for k in late if "lora_b" in k)
    worst = max(mx.abs(g0[k] - g1[k]).max().item() for k in g0)
    print(f"grad_checkpoint: {len(g0)} LoRA grads ({len(late)} on KV-shared layers), max abs diff {worst}")
    assert worst <= 1e-6


def test_caffeinate_watches_the_rank(tmp_path):
    fake, log = tmp_path / "caffeinate", tmp_path / "argv.json"
    fake.write_text(f"#!{os.sys.executable}\nimport json, sys\nopen({str(log)!r}, 'w').write(json.dumps(sys.argv))\n")
    fake.chmod(0o755)
    from lib import rank

    rep = rank.Reporter(tmp_path / "run", 0)
    rank.CAFFEINATE = str(tmp_path / "absent")
    assert rank.keep_awake(rep) is None  # Linux: no caffeinate, nothing started
    rank.CAFFEINATE = str(fake)
    p = rank.keep_awake(rep)
    p.wait(timeout=30)
    assert json.loads(log.read_text()) == [str(fake), "-i", "-w", str(os.getpid())]


def test_no_improvement_warns(tmp_path):
    """Trained on prose, validated on one repeated character: the model gets worse on validation."""
    bad = write_dataset(tmp_path / "bad", n_train=24, n_valid=4, n_test=4)
    (bad / "valid.jsonl").write_text("".join(json.dumps({"text": "!" * 80}) + "\n" for _ in range(8)))
    (bad / "manifest.json").unlink()
    cfg = config(tmp_path, "worse", steps_per_eval=3, divergence_factor=1000.0, batching="mlx_lm")
    p = one_rank(cfg, bad, tmp_path / "run", "--optimizer", "adam", "--learning-rate", "5e-2", "--iters", "3")
    w = events(tmp_path / "run", "warning")[3]
    assert w["what"] == "no-improvement" and w["loss"] >= w["val_loss_step0"], w
    assert "warning rank 0 message" in p.stdout and "does not improve on the base model" in p.stdout
