"""Event lines on stdout and errors that name their fix.

An event is one grep-able line, `event k1 v1 k2 v2`, e.g.
`iter 120 train_loss 2.314 tok/s 1830`. A failure prints its category and
ends with `see RUNBOOK.md#anchor`; that heading exists in RUNBOOK.md.
"""

from __future__ import annotations

import sys
from typing import Any

# Failure categories of DESIGN.md, each with its RUNBOOK anchor.
CATEGORIES = {
    "runtime parity": "runtime-parity",
    "export format or path consistency": "export-format-or-path-consistency",
    "learning rate or quantized LoRA stability": "learning-rate-or-lora-stability",
    "the Thunder path itself": "thunder-path",
    "hang / link partition": "hang-or-link-partition",
}


# Failures that are none of DESIGN.md's categories: a rank stopped for its own reason
# (its failure.json `kind`), named with the anchor of the fix.
OTHER_FAILURES = {
    "config": ("config error", "run-configs"),
    "resume": ("resume impossible", "resume"),
    "oom": ("out of memory", "out-of-memory"),
    "error": ("trainer error", "trainer"),
}


def anchor_of(category: str) -> str:
    """The RUNBOOK anchor of a category of CATEGORIES or of OTHER_FAILURES."""
    if category in CATEGORIES:
        return CATEGORIES[category]
    for name, anchor in OTHER_FAILURES.values():
        if name == category:
            return anchor
    return "failure-table"


class RunbookError(Exception):
    """An operator-facing failure: what went wrong, and the RUNBOOK anchor with the fix."""

    def __init__(self, message: str, anchor: str, category: str | None = None):
        super().__init__(message)
        self.anchor = anchor
        self.category = category

    def __str__(self) -> str:
        head = f"[{self.category}] " if self.category else ""
        return f"{head}{self.args[0]}; see RUNBOOK.md#{self.anchor}"


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def event(name: str, /, **fields: Any) -> str:
    """Print `name k v k v ...` on stdout, flushed, and return the line."""
    line = " ".join([name] + [f"{k} {fmt(v)}" for k, v in fields.items()])
    print(line, flush=True)
    return line


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def die(err: RunbookError | str, code: int = 1) -> int:
    """Print an error on stderr and return the exit code (scripts: `return die(...)`)."""
    error(str(err))
    return code
