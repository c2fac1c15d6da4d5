"""lib/loss.py's chunked LoRA loss against mlx-lm's default_loss, with real mlx on tiny models.

The tiny Gemma 4 (soft-capping, tied embeddings) comes from `make tiny-model` (conftest's session
fixture); Llama (untied or tied head) and the quantized heads are built in memory. LoRA is
applied as `mlx_lm lora` applies it (freeze, then linear_to_lora_layers).
"""

from __future__ import annotations

import json
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma4, llama
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load

from lib import loss as L
from lib.log import RunbookError

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0}


def with_lora(model, seed: int = 0):
    """LoRA on every layer as mlx-lm applies it, its B matrices made non-zero so every LoRA
    weight has a gradient from the first step."""
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), LORA)
    mx.random.seed(seed)
    model.update(tree_map(lambda p: 0.02 * mx.random.normal(p.shape), model.trainable_parameters()))
    mx.eval(model.parameters())
    return model


def gemma(root, softcap: float | None = 30.0, quantized: bool = False):
    model, _ = load(str(root / "models" / "tiny-gemma4"))
    model.final_logit_softcapping = softcap
    if quantized:
        nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p.endswith("embed_tokens"))
    return with_lora(model)


def tiny_llama(tied: bool, quantized: bool = False):
    mx.random.seed(3)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=1000,
                           tie_word_embeddings=tied)
    model = llama.Model(args)
    if quantized:
        nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p.endswith(("lm_head", "embed_tokens")))
    return with_lora(model)


def batch_of(vocab: int, prompts: bool, seed: int = 0):
    """mlx-lm's batch shape: ids padded with 0 past each length, (offset, length) per row;
    offsets are mask_prompt's prompt lengths, else 0."""
    mx.random.seed(seed)
    ids = mx.random.randint(1, vocab, (3, 33))
    lengths = [33, 20, 27]
    ids = ids * (mx.arange(33)[None] < mx.array(lengths)[:, None])
    offsets = [5, 12, 1] if prompts else [0, 0, 0]
    return ids, mx.array(list(zip(offsets, lengths, strict=True)))


def assert_trees_close(a, b, atol: float, rel: float = 0.0):
    worst = []
    for (k, x), (_, y) in zip(tree_flatten(a), tree_flatten(b), strict=True):
        d = mx.abs(x - y).max().item()
        assert d <= atol + rel * mx.abs(x).max().item(), f"{k}: max |difference| {d:.3e}"
        worst.append(d)
    assert worst


def check_same_loss(model, batch, chunk: int = 25):
    want, want_n = default_loss(model, *batch)
    for fn in (L.make_loss(chunk), L.make_loss(chunk, grad=False)):
        got, got_n = fn(model, *batch)
        assert got.dtype == want.dtype == mx.float32 and got_n.dtype == want_n.dtype
        assert got_n.item() == want_n.item()
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (got.item(), want.item())


@pytest.mark.parametrize("softcap", [30.0, None], ids=["softcap", "no-softcap"])
@pytest.mark.parametrize("prompts", [False, True], ids=["all-tokens", "mask-prompt"])
def test_loss_and_gradients_equal_default_loss(root, softcap, prompts):
    model = gemma(root, softcap)
    L.parts(model)  # supported: no RunbookError
    batch = batch_of(model.args.vocab_size, prompts)
    check_same_loss(model, batch)
    (_, n1), g1 = nn.value_and_grad(model, default_loss)(model, *batch)
    (_, n2), g2 = nn.value_and_grad(model, L.make_loss(25))(model, *batch)
    assert n1.item() == n2.item() == (28 + 9 + 27 if prompts else 32 + 20 + 27)
    assert_trees_close(g1, g2, atol=1e-7, rel=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "4bit"])
def test_llama_and_quantized_heads(root, tied, quantized):
    model = tiny_llama(tied, quantized)
    batch = batch_of(1000, prompts=True)
    check_same_loss(model, batch, chunk=16)
    (_, _), g1 = nn.value_and_grad(model, default_loss)(model, *batch)
    (_, _), g2 = nn.value_and_grad(model, L.make_loss(16))(model, *batch)
    assert_trees_close(g1, g2, atol=1e-7, rel=1e-4)
    if not tied and not quantized:
        return
    check_same_loss(gemma(root, quantized=True), batch_of(3072, prompts=True))


def test_gemma4_multimodal_wrapper(root):
    """The released E2B checkpoint loads as mlx-lm's `gemma4` wrapper: its language_model is used."""
    config = json.loads((root / "models" / "tiny-gemma4" / "config.json").read_text())
    mx.random.seed(4)
    model = with_lora(gemma4.Model(gemma4.ModelArgs(model_type="gemma4", text_config=config, vocab_size=3072)))
    assert L.parts(model)[0] is model.language_model.model and L.parts(model)[2] == 30.0
    check_same_loss(model, batch_of(3072, prompts=True))


def train(model, loss, steps: int, compiled: bool, accum: int = 1):
    """mlx-lm's training step (trainer.py train(), as bin/train.py runs it): value_and_grad of
    the loss, gradient accumulation, Adam; compiled with the model and optimizer state. (At a
    learning rate much above 1e-4 Adam's sign-like first steps turn float-rounding differences
    of 1e-6 in the gradients into different adapters, for any two ways of computing the loss.)"""
    optimizer = optim.Adam(learning_rate=1e-4)
    vg = nn.value_and_grad(model, loss)
    state = [model.state, optimizer.state]

    def step(batch, prev, do_update):
        (value, ntoks), grad = vg(model, *batch)
        if prev is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev)
        if do_update:
            if accum > 1:
                grad = tree_map(lambda x: x / accum, grad)
            optimizer.update(model, grad)
            grad = None
        return value, ntoks, grad

    step = partial(mx.compile, inputs=state, outputs=state)(step) if compiled else step
    grad, losses, batch = None, [], batch_of(3072, prompts=True)
    for it in range(1, steps * accum + 1):
        value, ntoks, grad = step(batch, grad, it % accum == 0)
        mx.eval(state, value, ntoks, grad)
        losses.append(value.item())
    return model.trainable_parameters(), losses


@pytest.mark.parametrize("compiled,accum,checkpoint", [(False, 1, False), (True, 1, False), (True, 2, True)],
                         ids=["eager", "compiled", "compiled-accum2-checkpoint"])
def test_adapter_after_5_steps_equals_default_loss(root, compiled, accum, checkpoint):
    layer_call = None
    try:
        want, want_losses = train(gemma(root), default_loss, 5, compiled, accum)
        model = gemma(root)
        if checkpoint:  # mlx-lm's grad_checkpoint patches the layer class: undone below
            layer_call = type(model.layers[0]).__call__
            grad_checkpoint(model.layers[0])
        got, got_losses = train(model, L.make_loss(25), 5, compiled, accum)
    finally:
        if layer_call is not None:
            type(model.layers[0]).__call__ = layer_call
    assert want_losses[-1] < want_losses[0] - 0.1  # it trained: the adapter moved 20x the tolerance
    moved = max(mx.abs(a - b).max().item() for (_, a), (_, b) in
                zip(tree_flatten(want), tree_flatten(gemma(root).trainable_parameters()), strict=True))
    assert moved > 2e-3
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    assert_trees_close(want, got, atol=1e-4)


def test_holds_one_chunk_of_logits():
    """At a vocabulary where the logits dominate, the chunked step's peak memory above the
    weights is a fraction of default_loss's (it would not be if every chunk ran at once)."""
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=16384,
                           tie_word_embeddings=True)
    model = with_lora(llama.Model(args))
    ids = mx.random.randint(0, 16384, (4, 65))
    batch = (ids, mx.array([[0, 65]] * 4))
    peaks = {}
    for name, fn in (("default", default_loss), ("chunked", L.make_loss(16))):
        vg = nn.value_and_grad(model, fn)
        mx.eval(vg(model, *batch))
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(vg(model, *batch))
        peaks[name] = mx.get_peak_memory() - base
    logits = 4 * 64 * 16384 * 4  # bytes of float32 logits
    assert peaks["default"] > 2 * logits
    assert peaks["chunked"] < peaks["default"] / 5, peaks


def test_refuses_a_trainable_head_and_other_models(root):
    model = gemma(root)
    model.model.embed_tokens.unfreeze()  # full fine-tuning or LoRA on the head: no gradient for it here
    with pytest.raises(RunbookError, match=r"model.embed_tokens \(tied\) is trainable.*see RUNBOOK.md#run-configs"):
        L.make_loss()(model, *batch_of(3072, prompts=False))
    model = tiny_llama(tied=False)
    model.lm_head = LoRALinear.from_base(model.lm_head, r=4)  # LoRA on the head
    with pytest.raises(RunbookError, match=r"lm_head is trainable"):
        L.parts(model)
    with pytest.raises(RunbookError, match=r"not mlx.nn.layers.linear.Linear: set `loss: default`"):
        L.parts(nn.Linear(4, 4))


# ---- batching: length: per-target weights (lib/batching.py) ------------------------------------------
def weights_of(batch, spans: list, record_weights: list) -> mx.array:
    """The weight of each target position, built by hand: a record's weight on its target tokens."""
    w = [[0.0] * (batch.shape[1] - 1) for _ in spans]
    for row, (row_spans, weight) in enumerate(zip(spans, record_weights, strict=True)):
        for a, b in row_spans:
            for j in range(a, b):
                w[row][j - 1] = weight
    return mx.array(w)


def reference_weighted_loss(model, batch, weights) -> float:
    """Sum of weight x cross-entropy over the targets, over the sum of weights, with plain numpy-side
    arithmetic on mlx-lm's logits: the independent path for the trainer's weighted losses."""
    logits = model(batch[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
    total, weight = 0.0, 0.0
    for row, wrow in zip((-picked).tolist(), weights.tolist(), strict=True):
        for ce, w in zip(row, wrow, strict=True):
            total += ce * w
            weight += w
    return total / weight


def test_weighted_losses_count_only_the_targets_with_their_weights(root):
    model = gemma(root)
    batch, _ = batch_of(model.args.vocab_size, False)
    weights = weights_of(batch, [[(5, 33)], [(3, 8), (12, 20)], [(1, 27)]], [1.0, 0.5, 2.0])
    want = reference_weighted_loss(model, batch, weights)
    for fn in (L.weighted_default_loss, L.make_loss(25, weighted=True), L.make_loss(25, grad=False, weighted=True)):
        got, n = fn(model, batch, weights)
        assert abs(got.item() - want) <= 1e-5 * want and n.item() == 28 * 1.0 + 13 * 0.5 + 26 * 2.0
    (_, _), g1 = nn.value_and_grad(model, L.weighted_default_loss)(model, batch, weights)
    (_, _), g2 = nn.value_and_grad(model, L.make_loss(25, weighted=True))(model, batch, weights)
    assert_trees_close(g1, g2, atol=1e-7, rel=1e-4)


def test_a_micro_batch_without_targets_adds_nothing_and_is_never_nan(root):
    """With answers only as targets a rank's micro-batch can hold none: 0 / 0 would be NaN and the
    all-reduce would spread it. The loss is 0 and every gradient 0."""
    model = gemma(root)
    batch, _ = batch_of(model.args.vocab_size, False)
    none = mx.zeros((batch.shape[0], batch.shape[1] - 1))
    for fn in (L.weighted_default_loss, L.make_loss(25, weighted=True)):
        (value, n), grads = nn.value_and_grad(model, fn)(model, batch, none)
        assert value.item() == 0.0 and n.item() == 0.0
        assert all(mx.all(g == 0).item() for _, g in tree_flatten(grads))
