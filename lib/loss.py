"""loss: a LoRA loss over the final hidden states that never holds more than one chunk of logits.

mlx-lm's `default_loss` (mlx_lm/tuner/trainer.py) builds the whole [batch, tokens, vocab]
logits, their soft-capped copy and their gradient: at Gemma 4's 262,144-token vocabulary
that is GBs for the loss alone. Here the model's backbone gives the final hidden states h
[batch, tokens, hidden]; the head (tied embedding or untied lm_head, plain or quantized)
is applied to `chunk_tokens` rows of h at a time, and each chunk's cross-entropy and its
gradient with respect to h are computed together in the forward pass (the idea of Apple's
Cut Cross-Entropy and Liger Kernel's fused linear cross-entropy; our own code):

    z = h_c W^T,   y = cap * tanh(z / cap)  (Gemma's final logit soft-capping; y = z without)
    loss_i = logsumexp(y_i) - y_i[t_i]                 (times mlx-lm's mask, summed)
    dL/dh_c = (softmax(y) * (1 - (y / cap)^2)) W - (1 - (y[t] / cap)^2) W[t]   (masked rows 0)

An `mx.custom_function` returns the stored dL/dh scaled by the cotangent as its vjp, so
nothing is recomputed in the backward pass. The head is frozen under LoRA, so no gradient
is computed for it; a trainable head (full fine-tuning, LoRA on lm_head) is refused. The
mask (mask_prompt offsets, lengths), the reported loss (float32 sum / ntoks) and ntoks are
exactly default_loss's; it works under mx.compile, gradient accumulation and gradient
checkpointing (they act outside the loss). Models: mlx-lm's gemma4_text, gemma4 (its
text part) and llama.

Usage:
    from lib import loss as L
    train_loss = L.make_loss(chunk_tokens=64)              # default_loss's signature
    eval_loss = L.make_loss(chunk_tokens=64, grad=False)   # forward only (evaluate)
    L.supported(model)                                     # True for the models above
    L.logits_bytes("chunked", 4 * 2048, 262144)            # the loss's own memory, for plan

Example (the bench: 4 x 128 tokens at a 262,144-token vocabulary):
    .venv/bin/python bench/bench_loss.py
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from lib.log import OTHER_FAILURES, RunbookError

CHUNK_TOKENS = 64  # rows of hidden states per chunk (config key loss_chunk_tokens)
# Measured with bench/bench_loss.py (CPU, float32): at its peak default_loss holds about 5
# [tokens, vocab] float32 arrays; the chunked loss about 7 [chunk, vocab] ones (3 per chunk, and
# MLX allocates a few ops ahead of the one running).
DEFAULT_ARRAYS, CHUNKED_ARRAYS = 5, 7
ANCHOR = OTHER_FAILURES["config"][1]
MODULES = ("mlx_lm.models.gemma4_text", "mlx_lm.models.gemma4", "mlx_lm.models.llama")
HEADS = (nn.Embedding, nn.QuantizedEmbedding, nn.Linear, nn.QuantizedLinear)


def logits_bytes(loss: str, tokens: int, vocab: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """The loss's own peak memory beyond weights and activations, for `tokens` = per-rank batch x
    sequence length and loss "default" (mlx-lm's) or "chunked" (for plan and calibrate)."""
    if loss == "chunked":
        return CHUNKED_ARRAYS * min(chunk_tokens, tokens) * vocab * 4
    return DEFAULT_ARRAYS * tokens * vocab * 4


def parts(model) -> tuple:
    """(backbone, head, softcap) of a supported mlx-lm model, the way its __call__ uses them;
    a RunbookError naming the fix for any other model or a trainable head."""
    kind = type(model).__module__
    if kind not in MODULES:
        raise RunbookError(f"loss: chunked supports mlx-lm's {', '.join(m.rsplit('.', 1)[1] for m in MODULES)} "
                           f"models, not {kind}.{type(model).__name__}: set `loss: default` in the run config", ANCHOR)
    lm = model.language_model if kind.endswith(".gemma4") else model
    tied = getattr(lm, "tie_word_embeddings", None)
    tied = lm.args.tie_word_embeddings if tied is None else tied
    head = lm.model.embed_tokens if tied else lm.lm_head
    name = "model.embed_tokens (tied)" if tied else "lm_head"
    if tree_flatten(head.trainable_parameters()):
        raise RunbookError(f"loss: chunked computes no gradient for the output head, but {name} is trainable "
                           "(full fine-tuning, or LoRA keys naming the head): freeze it (LoRA) or set "
                           "`loss: default` in the run config", ANCHOR)
    if type(head) not in HEADS or "bias" in head:
        raise RunbookError(f"loss: chunked needs a plain or quantized head without bias, but {name} is "
                           f"{type(head).__name__}: set `loss: default` in the run config", ANCHOR)
    return lm.model, head, getattr(lm, "final_logit_softcapping", None)


def supported(model) -> bool:
    """Whether make_loss's functions can train this model (else `parts` says why)."""
    try:
        parts(model)
    except RunbookError:
        return False
    return True


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


def softcapped(x: mx.array, cap) -> mx.array:
    return x if cap is None else cap * mx.tanh(x / cap)


def chunk_loss(h: mx.array, t: mx.array, m: mx.array, ops, cap) -> mx.array:
    """The masked per-token cross-entropy [n] (float32) of one chunk of hidden rows, forward only."""
    logits, _, rows = ops
    y = softcapped(logits(h).astype(mx.float32), cap)
    yt = softcapped((h.astype(mx.float32) * rows(t).astype(mx.float32)).sum(-1), cap)
    return (mx.logsumexp(y, axis=-1) - yt) * m


def chunk_loss_and_grad(h: mx.array, t: mx.array, m: mx.array, ops, cap) -> mx.array:
    """[n, hidden + 1] float32: d(sum of the chunk's masked losses)/dh, then the per-token loss.

    One array, so that evaluating either half computes the chunk's logits once. Under
    mx.compile its [n, vocab] float32 arrays are z, y and g (CHUNKED_ARRAYS for the peak)."""
    logits, back, rows = ops
    r = rows(t)
    y = softcapped(logits(h).astype(mx.float32), cap)
    yt = softcapped((h.astype(mx.float32) * r.astype(mx.float32)).sum(-1), cap)
    lse = mx.logsumexp(y, axis=-1)
    g = mx.exp(y - lse[:, None]) * m[:, None]  # softmax, masked rows 0
    dt = m
    if cap is not None:  # d(cap * tanh(z / cap))/dz = 1 - (y / cap)^2
        g = g * (1 - mx.square(y / cap))
        dt = m * (1 - mx.square(yt / cap))
    dh = back(g.astype(r.dtype)).astype(mx.float32) - dt[:, None] * r.astype(mx.float32)
    return mx.concatenate([dh, ((lse - yt) * m)[:, None]], axis=1)


def chunks(fn, h: mx.array, t: mx.array, m: mx.array, ops, cap, size: int) -> list:
    """fn over consecutive `size` rows, each chunk after the one before: without the explicit
    dependency MLX's scheduler may start every chunk's logits at once."""
    out = []
    for a in range(0, h.shape[0], size):
        hc = h[a:a + size] if not out else mx.depends(h[a:a + size], out[-1])
        out.append(fn(hc, t[a:a + size], m[a:a + size], ops, cap))
    return out


def batch_parts(batch: mx.array, lengths: mx.array) -> tuple:
    """default_loss's inputs, targets, mask and ntoks, built exactly as it builds them."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    return inputs, targets, mask, mask.sum()


def make_loss(chunk_tokens: int = CHUNK_TOKENS, grad: bool = True):
    """A loss(model, batch, lengths) -> (loss, ntoks) equal to mlx-lm's default_loss. With
    grad=False it skips the gradient work (for evaluation: no vjp through it)."""
    if chunk_tokens < 1:
        raise RunbookError(f"loss_chunk_tokens is {chunk_tokens}: use a positive number such as "
                           f"{CHUNK_TOKENS}", ANCHOR)

    def loss(model, batch, lengths):
        backbone, head, cap = parts(model)
        inputs, targets, mask, ntoks = batch_parts(batch, lengths)
        h = backbone(inputs)
        n = h.shape[0] * h.shape[1]
        h, t, m = h.reshape(n, h.shape[-1]), targets.reshape(n), mask.reshape(n).astype(mx.float32)
        ops = head_ops(head)
        if not grad:
            return mx.concatenate(chunks(chunk_loss, h, t, m, ops, cap, chunk_tokens)).sum() / ntoks, ntoks

        @mx.custom_function
        def ce_sum(h):
            both = mx.concatenate(chunks(chunk_loss_and_grad, h, t, m, ops, cap, chunk_tokens))
            return both[:, -1].sum(), both[:, :-1].astype(h.dtype)

        @ce_sum.vjp
        def ce_sum_vjp(h, cotangents, outputs):
            return (outputs[1] * cotangents[0]).astype(h.dtype)

        return ce_sum(h)[0] / ntoks, ntoks

    return loss
