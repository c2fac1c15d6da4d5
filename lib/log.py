"""Event lines on stdout (`iter 120 train_loss 2.314 tok/s 1830`), errors that name their fix and end
with `see RUNBOOK.md#anchor`, and the one table of failures (FAILURES):
    raise failure(DATA, "datasets/x/train.jsonl not found on mac5")   # category + anchor
    raise RunbookError("no verified checkpoint under runs/x", "resume")  # kind by anchor
"""

from __future__ import annotations

import re
import sys

# kind: (category, bin/train.py exit code, RUNBOOK anchor). The first five are DESIGN.md's failure categories
# (the orchestrator decides thunder and hang: no exit code); the rest are a stop for any other reason.
FAILURES = {
    "parity": ("runtime parity", 10, "runtime-parity"),
    "data": ("export format or path consistency", 11, "export-format-or-path-consistency"),
    "stability": ("learning rate or quantized LoRA stability", 12, "learning-rate-or-lora-stability"),
    "thunder": ("the Thunder path itself", None, "thunder-path"),
    "hang": ("hang / link partition", None, "hang-or-link-partition"),
    "config": ("config error", 2, "run-configs"),
    "oom": ("out of memory", 13, "out-of-memory"),
    "resume": ("resume impossible", 14, "resume"),
    "error": ("trainer error", 1, "trainer"),
    "worse": ("worse than the base model", None, "compare-worse-than-base"),  # bin/compare.py's verdict
    "stopped": ("stopped on request", None, "stopped-on-request"),  # Ctrl-C or make stop (lib/supervisor.py)
}
CATEGORIES = {name: anchor for name, _, anchor in list(FAILURES.values())[:5]}  # category -> anchor
OTHER_FAILURES = {k: (name, anchor) for k, (name, _, anchor) in list(FAILURES.items())[5:]}
PARITY, DATA, STABILITY, THUNDER, HANG = CATEGORIES

# The one out-of-memory pattern: an MLX allocation failure or a Metal GPU fault, as printed.
OOM_RE = re.compile(r"Insufficient Memory|OutOfMemory|out of memory|Unable to allocate|\[metal::malloc\]|"
                    r"\[malloc\]|greater than the maximum allowed buffer size|std::bad_alloc|"
                    r"kIOGPUCommandBufferCallbackError(?:OutOfMemory|Timeout|ImpactingInteractivity)", re.I)

# A peer's rank, host or cable went away mid-collective, as MLX's ring backend says it (the rank that notices
# first may say so before mlx.launch stops it): a hang / link partition, which RESTARTS resumes.
PEER_LOST_RE = re.compile(r"\[ring\] connection to a peer was lost|was closed by the peer")


def anchor_of(category: str) -> str:
    """The RUNBOOK anchor of a category of CATEGORIES or of OTHER_FAILURES."""
    return next((anchor for name, _, anchor in FAILURES.values() if name == category), "failure-table")


class RunbookError(Exception):
    """An operator-facing failure: what went wrong, and the RUNBOOK anchor with the fix."""

    def __init__(self, message: str, anchor: str, category: str | None = None):
        super().__init__(message)
        self.anchor = anchor
        self.category = category

    def __str__(self) -> str:
        head = f"[{self.category}] " if self.category else ""
        return f"{head}{self.args[0]}; see RUNBOOK.md#{self.anchor}"

    @property
    def kind(self) -> str:
        """Its FAILURES key: by category, else by anchor; any other bad input is "config"."""
        return next((kind for kind, (name, _, anchor) in FAILURES.items() if self.category == name
                     or (self.category is None and self.anchor == anchor)), "config")

    @property
    def exit_code(self) -> int:
        return FAILURES[self.kind][1] or 1


def error_of_code(code: int, message: str) -> RunbookError:
    """The RunbookError of a trainer exit code (another rank's failure, agreed by all_sum)."""
    name, _, anchor = next((v for v in FAILURES.values() if v[1] == code), FAILURES["error"])
    return RunbookError(message, anchor, name if name in CATEGORIES else None)


def failure(category: str, message: str) -> RunbookError:  # one of DESIGN.md's categories, with its anchor
    return RunbookError(message, CATEGORIES[category], category)


def event(name: str, /, **fields: object) -> str:
    """Print `name k v k v ...` on stdout (floats to 6 significant digits), flushed; returns the line."""
    pairs = [f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()]
    line = " ".join([name, *pairs])
    print(line, flush=True)
    return line


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def die(err: RunbookError | str, code: int = 1) -> int:
    """Print an error on stderr and return the exit code (scripts: `return die(...)`)."""
    error(str(err))
    return code
