"""evaluate: compare's scoring of the base model and each adapter on one test split, in the format the
adapters trained in (lib/chat): the test loss on the same seeded batches (mlx-lm's evaluate), the loss
per record `source`, and greedy answers to a seeded draw of the split's prompts.
    ev = models("models/tiny-gemma4", {"control": "runs/x-control/adapters", "dual": ...}, data_dir, cfg)
    ev["models"]["dual"]["loss"], ev["by_source"][0], ev["samples"][0]["dual"]
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from pathlib import Path

from lib import chat, config, jsonl, paths, tracking
from lib.log import RunbookError, event

SAMPLE_SEED, TOP_SOURCES = 0, 5  # the draw is the same for every run of a dataset; the rest is "other"


def models(model: str, adapters: dict, data_dir: Path, cfg: dict, test_batches: int, samples: int = 4,
           max_tokens: int = 128) -> dict:
    """Test loss, loss by source and sample answers of the base model and each adapter (fingerprinted:
    every model must see the same test batches)."""
    tracking.without_wandb()
    from mlx_lm.utils import load

    records = list(jsonl.read(data_dir / "test.jsonl"))  # export refuses an empty split
    cfg, local = {**config.DEFAULTS, **cfg}, paths.ROOT / model  # a local folder, or a Hugging Face id
    bs, seed, msl = min(int(cfg["batch_size"]), len(records)), int(cfg["seed"]), int(cfg["max_seq_length"])
    drawn = sorted(random.Random(SAMPLE_SEED).sample(range(len(records)), min(samples, len(records))))
    refs = {i: ref for i in drawn if (ref := reference(records[i]))[0] is not None}  # a text record has none
    out, test_set = {}, None
    answers = [{"prompt": ref[1], "reference": ref[2]} for ref in refs.values()]
    groups = defaultdict(list)
    for i, r in enumerate(records):
        groups[str(r.get("source") or "unknown")].append(i)
    sources = {src: {"records": len(idx)} for src, idx in groups.items()}
    for name, adapter in [("base", None), *((k, a) for k, a in adapters.items() if a)]:
        mdl, tokenizer = load(str(local) if local.exists() else model,
                              adapter_path=str(paths.ROOT / adapter) if adapter else None)
        if test_set is None:  # rendered once: an adapter leaves the tokenizer as it is
            test_set = chat.dataset(records, tokenizer, cfg)  # the format the adapters trained in
        out[name], seen = loss(mdl, test_set, bs, test_batches, msl, seed)
        event("compare-eval", model=name, test_loss=out[name]["loss"], batches=out[name]["batches"],
              tokens=out[name]["tokens"])
        each = per_record(mdl, test_set, msl, seen)
        for src, idx in groups.items():
            tokens = sum(each[i][1] for i in idx)
            sources[src][name] = {"loss": sum(each[i][0] for i in idx) / max(tokens, 1), "tokens": tokens}
        for (i, ref), a in zip(refs.items(), answers, strict=True):
            a[name] = answer(mdl, tokenizer, ref[0], records[i].get("tools"), cfg, max_tokens)
    if len({m["batches_sha256"] for m in out.values()}) != 1:
        raise RunbookError("the models saw different test batches: a bug in compare; report it",
                           "compare-not-comparable")
    return {"records": len(records), "batch_size": bs, "seed": seed, "max_seq_length": msl,
            "test_batches": test_batches, "models": out, "batches": out["base"]["batches"],
            "tokens": out["base"]["tokens"], "same_batches": True, "by_source": by_source(sources),
            "samples": answers,
            "sampling": {"seed": SAMPLE_SEED, "max_tokens": max_tokens, "decoding": "greedy"}}


def loss(mdl, dataset, batch_size: int, batches: int, msl: int, seed: int) -> tuple[dict, dict]:
    """mlx-lm's evaluate() on seeded batches: the token-weighted loss, its batches, tokens and their hash;
    and each row's (cross-entropy sum, tokens), keyed by the row's tokens."""
    import numpy as np
    from mlx_lm.tuner.trainer import evaluate, iterate_batches

    h, ntoks, seen = hashlib.sha256(), [], {}

    def counted(m, batch, lengths):  # mlx-lm's default_loss, row by row
        h.update(np.array(batch).tobytes() + np.array(lengths).tobytes())
        ce, n = row_losses(m, batch, lengths)
        rows = zip(np.array(batch), np.array(lengths)[:, 1], ce.tolist(), n.tolist(), strict=True)
        seen.update({tuple(row[:end].tolist()): (c, int(k)) for row, end, c, k in rows})
        ntoks.append(n.sum())
        return ce.sum() / ntoks[-1], ntoks[-1]

    value = evaluate(model=mdl, dataset=dataset, batch_size=batch_size, num_batches=batches, loss=counted,
                     max_seq_length=msl, iterate_batches=lambda **kw: iterate_batches(seed=seed, **kw))
    return {"loss": value, "batches": len(ntoks), "batches_sha256": h.hexdigest(),
            "tokens": int(sum(n.item() for n in ntoks))}, seen


def row_losses(mdl, batch, lengths):
    """Each row's cross-entropy sum and token count, masked as mlx-lm's default_loss masks its batch."""
    import mlx.core as mx
    import mlx.nn as nn

    steps = mx.arange(1, batch.shape[1])
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    ce = (nn.losses.cross_entropy(mdl(batch[:, :-1]), batch[:, 1:]) * mask).astype(mx.float32).sum(axis=1)
    return ce, mask.sum(axis=1)


def per_record(mdl, test_set, msl: int, seen: dict) -> list[tuple[float, int]]:
    """(cross-entropy sum, tokens) of every record: from the evaluation's rows, or alone for a record its
    batches left out (mlx-lm drops a split's last partial batch, and test_batches may stop sooner)."""
    import mlx.core as mx

    out = []
    for tokens, first in (test_set[i] for i in range(len(test_set))):
        key = tuple(tokens[:msl])
        if key not in seen:  # padded as mlx-lm pads (its mask counts one target past the record's end)
            width = min(1 + 32 * -(-len(key) // 32), msl)
            row = list(key) + [0] * (width - len(key))
            ce, n = row_losses(mdl, mx.array([row]), mx.array([[first, len(key)]]))
            seen[key] = (ce.item(), int(n.item()))
        out.append(seen[key])
    return out


def by_source(sources: dict) -> list[dict]:
    """The TOP_SOURCES largest sources by tokens, then the rest as one "other" row."""
    order = sorted(sources, key=lambda src: (-sources[src]["base"]["tokens"], src))
    groups = [(src, [sources[src]]) for src in order[:TOP_SOURCES]]
    if rest := order[TOP_SOURCES:]:
        groups.append((f"other ({len(rest)} sources)", [sources[src] for src in rest]))
    return [row(name, parts) for name, parts in groups]


def row(name: str, parts: list[dict]) -> dict:
    """One by-source row: its records and tokens, and each model's token-weighted mean loss over them."""
    tokens, models = sum(p["base"]["tokens"] for p in parts), [m for m in parts[0] if m != "records"]
    return {"source": name, "tokens": tokens, "records": sum(p["records"] for p in parts),
            **{m: sum(p[m]["loss"] * p[m]["tokens"] for p in parts) / max(tokens, 1) for m in models}}


def reference(record: dict) -> tuple[list | None, str | None, str | None]:
    """The record's prompt messages (those before its last answer), the last of them, and that answer."""
    msgs = record.get("messages")
    if "prompt" in record:
        msgs = [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record.get("completion", record.get("response"))}]
    if not (isinstance(msgs, list) and len(msgs) > 1 and msgs[-1].get("role") == "assistant"):
        return None, None, record.get("text")
    return msgs[:-1], msgs[-2].get("content"), msgs[-1].get("content")


def answer(mdl, tokenizer, prompt: list, tools, cfg: dict, max_tokens: int) -> str:
    """The model's greedy answer to a record's prompt messages, rendered in the run's chat format."""
    from mlx_lm.generate import generate

    tokens = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False,
                                           tools=tools, **(cfg["chat_template_args"] or {}))
    return generate(mdl, tokenizer, tokens, max_tokens=max_tokens)
