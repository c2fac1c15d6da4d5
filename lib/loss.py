"""loss: a LoRA loss over the final hidden states that never holds more than one chunk of logits.

mlx-lm's `default_loss` builds the whole [batch, tokens, vocab] logits and their gradient: GBs at
Gemma 4's 262,144-token vocabulary. Here the frozen head (tied embedding or lm_head, plain or quantized)
is applied to `chunk_tokens` rows of the final hidden states h at a time, and each chunk's cross-entropy
and its gradient with respect to h are computed together in the forward pass (the idea of Cut
Cross-Entropy / Liger's fused linear cross-entropy; our own code):

    z = h_c W^T,   y = cap * tanh(z / cap)  (Gemma's final logit soft-capping; y = z without)
    loss_i = logsumexp(y_i) - y_i[t_i]                 (times mlx-lm's mask, summed)
    dL/dh_c = (softmax(y) * (1 - (y / cap)^2)) W - (1 - (y[t] / cap)^2) W[t]   (masked rows 0)

An `mx.custom_function` returns the stored dL/dh as its vjp, so nothing is recomputed backwards.
Mask, loss (float32 sum / ntoks) and ntoks are exactly default_loss's, under mx.compile, gradient
accumulation and checkpointing. Models: mlx-lm's gemma4_text, gemma4, llama; a trainable head is refused.

    train_loss, eval_loss = make_loss(64), make_loss(64, grad=False)  # bin/train.py, `loss: chunked`
    .venv/bin/python bench/bench_loss.py   # against default_loss: 4 x 128 tokens, 262,144-token vocabulary
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from lib.log import OTHER_FAILURES, RunbookError

CHUNK_TOKENS = 64  # rows of hidden states per chunk (config key loss_chunk_tokens)
ANCHOR = OTHER_FAILURES["config"][1]
MODULES = ("mlx_lm.models.gemma4_text", "mlx_lm.models.gemma4", "mlx_lm.models.llama")
DEFAULT = "set `loss: default` in the run config"
EMPTY = 1e-9  # the weighted losses' least denominator: 0 / EMPTY = 0 for a micro-batch without targets


def parts(model) -> tuple:
    """(backbone, head, softcap) of a supported model as its __call__ uses them, else a RunbookError."""
    kind = type(model).__module__
    if kind not in MODULES:
        raise RunbookError(f"loss: chunked supports mlx-lm's "
                           f"{', '.join(m.rsplit('.', 1)[1] for m in MODULES)} models, not "
                           f"{kind}.{type(model).__name__}: {DEFAULT}", ANCHOR)
    lm = model.language_model if kind.endswith(".gemma4") else model
    tied = lm.args.tie_word_embeddings
    head, name = (lm.model.embed_tokens, "model.embed_tokens (tied)") if tied else (lm.lm_head, "lm_head")
    if tree_flatten(head.trainable_parameters()):
        raise RunbookError(f"loss: chunked computes no gradient for the output head, but {name} is trainable "
                           f"(full fine-tuning, or LoRA keys naming the head): freeze it (LoRA) or {DEFAULT}",
                           ANCHOR)
    if type(head) not in (nn.Embedding, nn.QuantizedEmbedding, nn.Linear,
                          nn.QuantizedLinear) or "bias" in head:
        raise RunbookError(f"loss: chunked needs a plain or quantized head without bias, but {name} is "
                           f"{type(head).__name__}: {DEFAULT}", ANCHOR)
    return lm.model, head, getattr(lm, "final_logit_softcapping", None)


def head_ops(head) -> tuple:
    """(logits(h) = h W^T, back(g) = g W, rows(t) = W[t]) of a plain or quantized head."""
    if isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
        w, s, b = head["weight"], head["scales"], head.get("biases")
        q = {"group_size": head.group_size, "bits": head.bits, "mode": head.mode}
        return (lambda h: mx.quantized_matmul(h, w, s, b, transpose=True, **q),
                lambda g: mx.quantized_matmul(g, w, s, b, transpose=False, **q),
                lambda t: mx.dequantize(w[t], s[t], None if b is None else b[t], **q))
    w = head.weight
    return lambda h: h @ w.T, lambda g: g @ w, lambda t: w[t]


def chunk_ce(h: mx.array, t: mx.array, m: mx.array, ops, cap, grad: bool) -> mx.array:
    """One chunk's masked per-token cross-entropy [n] (float32); with grad [n, hidden + 1]: d(sum of the
    chunk's losses)/dh, then the loss, in one array so the logits are computed once."""
    logits, back, rows = ops
    r = rows(t)
    y, yt = logits(h).astype(mx.float32), (h.astype(mx.float32) * r.astype(mx.float32)).sum(-1)
    if cap is not None:
        y, yt = cap * mx.tanh(y / cap), cap * mx.tanh(yt / cap)
    lse = mx.logsumexp(y, axis=-1)
    if not grad:
        return (lse - yt) * m
    g, dt = mx.exp(y - lse[:, None]) * m[:, None], m  # softmax, masked rows 0
    if cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - (y / cap)^2
        g, dt = g * (1 - mx.square(y / cap)), m * (1 - mx.square(yt / cap))
    dh = back(g.astype(r.dtype)).astype(mx.float32) - dt[:, None] * r.astype(mx.float32)
    return mx.concatenate([dh, ((lse - yt) * m)[:, None]], axis=1)


def chunks(h: mx.array, t: mx.array, m: mx.array, ops, cap, size: int, grad: bool) -> mx.array:
    """chunk_ce over consecutive `size` rows, each after the one before (not all chunks' logits at once)."""
    out = []
    for a in range(0, h.shape[0], size):
        hc = h[a:a + size] if not out else mx.depends(h[a:a + size], out[-1])
        out.append(chunk_ce(hc, t[a:a + size], m[a:a + size], ops, cap, grad))
    return mx.concatenate(out)


def mlx_lm_mask(targets: mx.array, lengths: mx.array) -> mx.array:
    """mlx-lm's default_loss mask (`batching: mlx_lm`): one pad past each record is a target."""
    steps = mx.arange(1, targets.shape[1] + 1)
    return mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])


def weighted_default_loss(model, batch, weights):
    """default_loss with per-target weights (`batching: lib/batching.py`): the weighted mean of the
    targets' cross-entropy; a micro-batch without targets gives 0 and a zero gradient, never NaN."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    ce = nn.losses.cross_entropy(logits, targets) * weights
    ntoks = weights.sum()
    return ce.astype(mx.float32).sum() / mx.maximum(ntoks, EMPTY), ntoks


def make_loss(chunk_tokens: int = CHUNK_TOKENS, grad: bool = True, weighted: bool = False):
    """A loss(model, batch, lengths) -> (loss, ntoks) equal to mlx-lm's default_loss
    (grad=False: evaluation); weighted: loss(model, batch, weights) equal to weighted_default_loss."""
    def loss(model, batch, lengths):
        backbone, head, cap = parts(model)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # default_loss's mask and ntoks, as it builds them
        mask = lengths if weighted else mlx_lm_mask(targets, lengths)
        ntoks = mask.sum()
        # one sum node: mx.compile merges equal nodes, and an output left on a merged one fails
        denominator = mx.maximum(ntoks, EMPTY) if weighted else ntoks
        h = backbone(inputs)
        h, t, m = h.reshape(-1, h.shape[-1]), targets.reshape(-1), mask.reshape(-1).astype(mx.float32)
        ops = head_ops(head)
        if not grad:
            return chunks(h, t, m, ops, cap, chunk_tokens, False).sum() / denominator, ntoks

        @mx.custom_function
        def ce_sum(h):
            both = chunks(h, t, m, ops, cap, chunk_tokens, True)
            return both[:, -1].sum(), both[:, :-1].astype(h.dtype)

        @ce_sum.vjp
        def ce_sum_vjp(h, cotangents, outputs):
            return (outputs[1] * cotangents[0]).astype(h.dtype)

        return ce_sum(h)[0] / denominator, ntoks

    return loss


def row_losses(model, batch: mx.array, weights: mx.array, chunk_tokens: int = CHUNK_TOKENS) -> tuple:
    """Each row's summed target cross-entropy and its weight (scoring: compare), never holding more
    than one chunk of logits: ([rows] float32 loss sums, [rows] float32 weights)."""
    backbone, head, cap = parts(model)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    h = backbone(inputs)
    rows, width = targets.shape
    flat = h.reshape(-1, h.shape[-1])
    m = weights.reshape(-1).astype(mx.float32)
    per_token = chunks(flat, targets.reshape(-1), m, head_ops(head), cap, chunk_tokens, False)
    return per_token.reshape(rows, width).sum(axis=1), weights.astype(mx.float32).sum(axis=1)
