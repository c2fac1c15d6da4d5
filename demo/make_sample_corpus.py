#!/usr/bin/env python3
"""sample-corpus: real prose from CPython's own language reference, cut into corpus records.

Usage:
    python demo/make_sample_corpus.py --out FILE [--max-chars N] [--min-records N]

Example:
    .venv/bin/python demo/make_sample_corpus.py --out datasets/sample/corpus.jsonl

Source: `pydoc_data.topics` (what `help("assert")` prints). One record a line in export's input format:
{"record_id": "pydoc-assert-0001", "source": "cpython-3.11.7/pydoc_data.topics/assert", "weight": 1.0,
"text": "..."} (3 in 5 "prompt"/"response" instead; weight 0.5 with code). Same CPython, same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics  # the language reference that ships with every CPython

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl, paths  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

DEFAULT_MAX_CHARS, HARD_MAX_CHARS, MIN_RECORDS = 200, 1500, 1000
ANCHOR = "generated-inputs"
HEADING_RULE = re.compile(r'^([*=\-~^"#+])\1{2,}$')
TABLE_START = ("+-", "+=", "|", "===", "---")
CODE_STARTS = (">>>", "...", "(Pdb)", "$ ", "@", "#")
WORD = re.compile(r"[\"'(*“‘]*[A-Za-z][A-Za-z’'-]*[.,;:!?)\"'*”’]*")
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "cf.", "vs.", "Mr.", "Dr.", "No.")  # no sentence ends after these
SENTENCE_END = re.compile(r"(?<=[.!?])" + "".join(f"(?<!{re.escape(a)})" for a in ABBREVIATIONS) + r"\s+(?=[A-Z\"'(*])")
PROMPTS = ("Explain {subject} in Python.", "What does the Python language reference say about {subject}?",
           "Describe {subject}.", "Summarize the documentation on {subject}.", "How does Python handle {subject}?")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="corpus file to write (JSONL)")
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="cut longer units on sentence boundaries")
    p.add_argument("--min-records", type=int, default=MIN_RECORDS, help="fail when fewer records come out")
    return p


def reflow(lines: list[str]) -> str:
    return re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()


def looks_like_prose(lines: list[str]) -> bool:
    """An indented block that reads as sentences (a list item's continuation, a note), not code."""
    text = reflow(lines)
    if "::=" in text or any(line.lstrip().startswith(CODE_STARTS) for line in lines):
        return False
    tokens = text.split()
    return sum(bool(WORD.fullmatch(tok)) for tok in tokens) / len(tokens) >= 0.6 and text[-1] in ".:?)\"'"


def units(text: str) -> Iterator[tuple[str, str, bool]]:
    """(subject, unit text, has_code) for each prose unit of one topic, in order: subject is the
    innermost heading above it; a code block joins the paragraph before it when that ends with ':'."""
    subject, pending = "", []  # the innermost heading; the current unit: a paragraph, then any code it introduces
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        first = lines[0].strip()
        heading = len(lines) == 2 and HEADING_RULE.match(lines[1].strip())
        table = first.startswith(TABLE_START)
        code = not (heading or table) and lines[0].startswith(" ") and not looks_like_prose(lines)
        if code and pending and pending[-1].endswith(":"):
            pending.append(textwrap.indent(textwrap.dedent("\n".join(lines)), "    "))
            continue
        if pending:  # any other block ends the unit before it
            yield subject, "\n\n".join(pending), len(pending) > 1
            pending = []
        if heading:
            subject = first
        elif code:  # a code block on its own
            yield subject, textwrap.dedent("\n".join(lines)), True
        elif not table:
            pending = [reflow(lines)]
    if pending:
        yield subject, "\n\n".join(pending), len(pending) > 1


def cut(unit: str, has_code: bool, max_chars: int) -> list[str]:
    """Pieces of at most max_chars on sentence boundaries; a unit with code whole up to HARD_MAX_CHARS."""
    if len(unit) <= max_chars or (has_code and len(unit) <= HARD_MAX_CHARS):
        return [unit]
    if has_code:
        if unit.startswith(" ") or "\n\n" not in unit:
            return []
        unit = unit.split("\n\n", 1)[0]
    pieces: list[str] = []
    for s in SENTENCE_END.split(unit):
        if pieces and len(pieces[-1]) + 1 + len(s) <= max_chars:
            pieces[-1] = f"{pieces[-1]} {s}"
        else:
            pieces.append(s)
    return [p for p in pieces if len(p) <= HARD_MAX_CHARS]


def pick(record_id: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big") % n


def records(max_chars: int, version: str) -> Iterator[dict]:
    """Records in topic order; a piece already written under an earlier topic (pydoc repeats some) is skipped."""
    seen: set[str] = set()  # pieces written
    for topic in sorted(topics):
        n = 0
        for subject, unit, has_code in units(topics[topic]):
            for piece in cut(unit, has_code, max_chars):
                if len(piece.strip()) < 40 or piece in seen:
                    continue
                seen.add(piece)
                n += 1
                rid = f"pydoc-{topic}-{n:04d}"
                rec = {"record_id": rid, "source": f"cpython-{version}/pydoc_data.topics/{topic}",
                       "weight": 0.5 if has_code and "\n" in piece else 1.0}
                if pick(rid, 5) < 3:
                    s = subject or topic
                    s = s[0].lower() + s[1:] if s.startswith(("The ", "A ", "An ")) else s
                    rec.update(prompt=PROMPTS[pick(rid + "/prompt", len(PROMPTS))].format(subject=s), response=piece)
                else:
                    rec["text"] = piece
                yield rec


def main() -> int:
    args = build_parser().parse_args()
    try:
        if not 80 <= args.max_chars <= HARD_MAX_CHARS:
            raise RunbookError(f"--max-chars {args.max_chars} is out of range: use 80..{HARD_MAX_CHARS}", ANCHOR)
        version = platform.python_version()
        recs = list(records(args.max_chars, version))
        if len(recs) < args.min_records:
            raise RunbookError(f"only {len(recs)} records came out of pydoc_data.topics of CPython {version} (expected "
                               f">= {args.min_records}): run with the project's .venv/bin/python", ANCHOR)
        with atomic.atomic_open(args.out, "w", encoding="utf-8", newline="\n") as f:
            jsonl.write(f, recs)
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder exists and is writable", ANCHOR))
    event("sample-corpus", records=len(recs), text=sum("text" in r for r in recs), topics=len(topics),
          source=f"cpython-{version}", bytes=args.out.stat().st_size, out=paths.rel(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
