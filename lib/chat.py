"""chat: mlx-lm's datasets rendered with the config's chat_template_args (training, validation, test,
compare), mask_prompt masking the longest common token prefix of a record's prompt and the record. mlx-lm
passes no arguments (a thinking tokenizer, Gemma 4's, renders thinking on) and masks the prompt's length:
too much where the prompt ends in tokens the record lacks (Gemma 4's launch template: an empty thought).
    ds = chat.dataset(records, tokenizer, cfg)  # mlx-lm's CacheDataset: ds[i] = (tokens, loss_from)
"""

from __future__ import annotations

import types
from os.path import commonprefix  # of any sequences: here token lists


def split(tok, messages: list, args: dict, mask: bool, tools=None) -> tuple[list, int]:
    """(the record's tokens, the first in the loss): with mask, the common prefix with its prompt."""
    def render(m, **kw):
        return tok.apply_chat_template(m, tools=tools, return_dict=False, **{**args, **kw})

    full = render(messages)
    if not mask:
        return full, 0
    prompt = render(messages[:-1], add_generation_prompt=messages[-1].get("role") == "assistant")
    history = render(messages[:-1]) if (k := len(commonprefix([prompt, full]))) < len(prompt) else prompt[:k]
    if k < len(history) or prompt[:len(history)] != history:  # the prompt is not the history + a suffix
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
