"""chat: every chat-template rendering a run does (training, validation, test, compare) with the config's
chat_template_args, and mask_prompt's offset the longest common token prefix of a record's prompt and the
whole record. mlx-lm's datasets pass no arguments (so a thinking tokenizer such as Gemma 4's renders thinking
on) and take the prompt's length, which over-masks where the prompt ends in tokens the record lacks (Gemma 4's
launch template: an empty thought channel).
    ds = chat.dataset(records, tokenizer, cfg)  # mlx-lm's CacheDataset: ds[i] = (tokens, loss_from)
    chat.check_choice(tokenizer, cfg); chat.template_facts(tokenizer)  # {sha256, has_thinking, variant}
"""

from __future__ import annotations

import hashlib
import types

from lib.log import RunbookError

ANCHOR = "chat-format"


def check_choice(tokenizer, cfg: dict) -> None:
    """A tokenizer with a thinking mode trains in the format the config chose, not mlx-lm's default (on)."""
    if tokenizer.has_thinking and "enable_thinking" not in (cfg["chat_template_args"] or {}):
        raise RunbookError(f"the tokenizer of {cfg['model']} has a thinking mode and the config does not "
                           "choose it (mlx-lm would render thinking on): set `chat_template_args: "
                           "{enable_thinking: false}` (as served elsewhere) or `{enable_thinking: true}`",
                           ANCHOR)


def common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def split(tok, messages: list, args: dict, mask: bool, tools=None) -> tuple[list, int]:
    """(the record's tokens, the first in the loss): with mask, the common prefix with its prompt."""
    def render(m, **kw):
        return tok.apply_chat_template(m, tools=tools, return_dict=False, **{**args, **kw})

    full = render(messages)
    if not mask:
        return full, 0
    prompt = render(messages[:-1], add_generation_prompt=messages[-1].get("role") == "assistant")
    history = render(messages[:-1]) if (k := common(prompt, full)) < len(prompt) else prompt[:k]
    if k < len(history) or common(history, prompt) < len(history):  # the prompt is not history + a suffix
        raise ValueError(f"the prompt and the record part at token {k}, before the generation prompt: prompt "
                         f"{tok.decode(prompt[k:k + 8])!r} vs record {tok.decode(full[k:k + 8])!r} (ids "
                         f"{prompt[k:k + 8]} vs {full[k:k + 8]}); mask_prompt cannot tell the answer from "
                         "the prompt: fix the chat template or set mask_prompt: false")
    return full, k


def dataset(records: list, tokenizer, cfg: dict):
    """mlx-lm's dataset of the records (its create_dataset picks the kind), rendered by split()."""
    from mlx_lm.tuner.datasets import CacheDataset, ChatDataset, CompletionsDataset, create_dataset

    ds = create_dataset(records, tokenizer, types.SimpleNamespace(**cfg))
    args = cfg["chat_template_args"] or {}
    if isinstance(ds, ChatDataset):
        ds.process = lambda d: split(tokenizer, d[ds.chat_key], args, ds.mask_prompt, d.get("tools"))
    elif isinstance(ds, CompletionsDataset):
        ds.process = lambda d: split(tokenizer, [{"role": "user", "content": d[ds.prompt_key]}, {
            "role": "assistant", "content": d[ds.completion_key]}], args, ds.mask_prompt, d.get("tools"))
    return CacheDataset(ds)


def chat_format(tokenizer, ds, cfg: dict) -> dict:
    """smoke.json's chat_format: the arguments, the thinking mode, the first record (decoded) and its mask."""
    tokens, k = ds[0]
    return {"chat_template_args": cfg["chat_template_args"], "has_thinking": bool(tokenizer.has_thinking),
            "first_record": {"text": tokenizer.decode(tokens), "tokens": len(tokens), "loss_from": k}}


def template_facts(tokenizer) -> dict:
    """The chat template's sha256, thinking mode and generation-prompt variant: `launch` when the thinking-off
    prompt ends in text the record lacks (an empty thought channel), else `current`."""
    if not tokenizer.has_chat_template:
        return None
    conv = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    full, prompt = (tokenizer.apply_chat_template(conv[:n], tokenize=False, add_generation_prompt=n == 1,
                                                  enable_thinking=False) for n in (2, 1))
    text = str(getattr(tokenizer, "chat_template", None) or "")
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "has_thinking": bool(tokenizer.has_thinking),
            "variant": "current" if full.startswith(prompt) else "launch"}
