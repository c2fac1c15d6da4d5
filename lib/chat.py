"""chat: mlx-lm's datasets rendered with the config's chat_template_args (training, validation, test,
compare), mask_prompt masking the longest common token prefix of a record's prompt and the record. mlx-lm
passes no arguments (a thinking tokenizer, Gemma 4's, renders thinking on) and masks the prompt's length:
too much where the prompt ends in tokens the record lacks (Gemma 4's launch template: an empty thought).
    ds = chat.dataset(records, tokenizer, cfg)  # mlx-lm's CacheDataset: ds[i] = (tokens, loss_from)
"""

from __future__ import annotations

import types
from dataclasses import dataclass
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


# ---- the runbook's rendering (batching: length): targets as spans, the last answer as served --------
@dataclass(frozen=True)
class Rendered:
    """One record as trained: its tokens and the [start, end) token spans that are targets."""

    tokens: list[int]
    spans: list[tuple[int, int]]


class Renderer:
    """Renders records with the run's chat_template_args and mask_prompt (false, true or last).

    - The last assistant turn follows exactly the generation prompt that `mlx_lm generate` and
      `mlx_lm.server` produce with these arguments (Gemma 4's launch template: with the empty
      thought channel), so the adapter learns the format it is served in.
    - Earlier turns are rendered as the template renders history, which is what the served model
      sees of them on later turns.
    - A target is a trained assistant turn's content and the end-of-turn token that closes it
      (mask_prompt true: every assistant turn; last: the last one; false: every token).
    """

    def __init__(self, tokenizer, cfg: dict):
        self.tok = tokenizer
        self.args = cfg["chat_template_args"] or {}
        self.mask = cfg["mask_prompt"]
        self.chat_key = cfg["chat_feature"]
        self.prompt_key = cfg["prompt_feature"]
        self.completion_key = cfg["completion_feature"]
        self.text_key = cfg["text_feature"]
        self.ends = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])

    def record(self, rec: dict) -> Rendered:
        """The record's tokens and targets; a ValueError names what does not render."""
        if self.chat_key in rec:
            return self.chat(rec[self.chat_key], rec.get("tools"))
        if self.prompt_key in rec and self.completion_key in rec:
            messages = [{"role": "user", "content": rec[self.prompt_key]},
                        {"role": "assistant", "content": rec[self.completion_key]}]
            return self.chat(messages, rec.get("tools"))
        if self.text_key in rec:
            return self.text(rec[self.text_key])
        raise ValueError(f"a record has none of {self.chat_key!r}, {self.prompt_key!r}/"
                         f"{self.completion_key!r} or {self.text_key!r}")

    def text(self, text: str) -> Rendered:
        """A text record: every token after the first is a target (mlx-lm's TextDataset tokens)."""
        if self.mask:
            raise ValueError("mask_prompt has no prompt to mask in a text record: set mask_prompt: false")
        tokens = self.tok.encode(text)
        if tokens[-1] != self.tok.eos_token_id:
            tokens.append(self.tok.eos_token_id)
        return Rendered(tokens, [(1, len(tokens))])

    def render(self, messages: list, tools, generation_prompt: bool = False) -> list[int]:
        return self.tok.apply_chat_template(messages, tools=tools, return_dict=False,
                                            add_generation_prompt=generation_prompt, **self.args)

    def chat(self, messages: list, tools) -> Rendered:
        last = len(messages) - 1
        if messages[last].get("role") != "assistant":
            raise ValueError(f"the last message is {messages[last].get('role')!r}, not 'assistant': "
                             "a training record ends with the answer to learn")
        history = self.render(messages[:last], tools)
        prompt = self.render(messages[:last], tools, generation_prompt=True)
        full = self.render(messages, tools)
        answer = self.answer_tokens(history, prompt, full)
        tokens = prompt + answer
        if not self.mask:
            return Rendered(tokens, [(1, len(tokens))])
        spans = [] if self.mask == "last" else self.earlier_spans(messages, tools, prompt)
        spans.append((len(prompt), len(prompt) + self.target_end(answer)))
        return Rendered(tokens, spans)

    def answer_tokens(self, history: list, prompt: list, full: list) -> list[int]:
        """The last turn's tokens after the generation prompt: the full record less the history and
        the role header that the record shares with the generation prompt."""
        for name, other in (("generation prompt", prompt), ("record", full)):
            at = len(commonprefix([history, other]))
            if at < len(history):
                raise ValueError(f"the {name} does not start with the conversation before the answer "
                                 f"as rendered alone (they part at token {at}: "
                                 f"{self.tok.decode(other[at:at + 8])!r} vs "
                                 f"{self.tok.decode(history[at:at + 8])!r}): the chat template renders "
                                 "earlier turns differently when a turn follows; fix the chat template")
        turn = full[len(history):]
        header = len(commonprefix([prompt[len(history):], turn]))
        return turn[header:]

    def target_end(self, turn: list) -> int:
        """Where a turn's target ends: just after its end-of-turn token (not the newline after it)."""
        for i, token in enumerate(turn):
            if token in self.ends:
                return i + 1
        return len(turn)

    def earlier_spans(self, messages: list, tools, prompt: list) -> list[tuple[int, int]]:
        """The target spans of every assistant turn before the last, inside the history."""
        spans = []
        for i, message in enumerate(messages[:-1]):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], tools) if i else []
            upto = self.render(messages[: i + 1], tools)
            served = self.render(messages[:i], tools, generation_prompt=True) if i else []
            if prompt[: len(upto)] != upto or upto[: len(before)] != before:
                raise ValueError(f"assistant turn {i + 1} renders differently inside the history "
                                 "than alone: mask_prompt: true cannot find it; set "
                                 "mask_prompt: last (the last turn only)")
            turn = upto[len(before):]
            header = len(commonprefix([served[len(before):], turn]))
            start = len(before) + header
            spans.append((start, start + self.target_end(turn[header:])))
        return spans


def decoded_targets(tokenizer, rendered: Rendered) -> list[str]:
    """One string per target span: exactly what the adapter learns from the record."""
    return [tokenizer.decode(rendered.tokens[a:b]) for a, b in rendered.spans]
