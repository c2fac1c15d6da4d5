#!/usr/bin/env python3
"""sample-corpus: real prose from CPython's own language reference, cut into corpus records.

Usage:
    python bin/make_sample_corpus.py --out FILE [--max-chars N] [--min-records N]

Example:
    .venv/bin/python bin/make_sample_corpus.py --out datasets/sample/corpus.jsonl

The text is `pydoc_data.topics`, the plain-text language reference inside every CPython (what
`help("assert")` prints). Each topic is split into blocks on blank lines: headings become the
subject of the records under them, tables are dropped, paragraphs and list items are reflowed
into one line each, and a code or grammar block that a paragraph introduces (it ends with ':')
is kept verbatim under it. A unit longer than --max-chars is cut on sentence boundaries.

One JSON object per line, in the corpus input format bin/export.py reads:
    {"record_id": "pydoc-assert-0001", "source": "cpython-3.11.7/pydoc_data.topics/assert",
     "weight": 1.0, "text": "..."}
or, for about 3 records in 5 (chosen by a hash of record_id), "prompt" and "response" in place of
"text". `weight` is 0.5 for records that carry a code block. The same CPython gives a
byte-identical file (the topics differ between CPython versions, so `source` names it), written
atomically: a reader sees the old file or the new one.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl, paths  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

DEFAULT_MAX_CHARS, HARD_MAX_CHARS, MIN_RECORDS = 200, 1500, 1000
ANCHOR = "generated-inputs"
HEADING_RULE = re.compile(r'^([*=\-~^"#+])\1{2,}$')
FOOTNOTE_MARK = re.compile(r"^-\[ .* \]-$")
TABLE_START = ("+-", "+=", "|", "===", "---")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(*])")
CODE_STARTS = (">>>", "...", "(Pdb)", "$ ", "@", "#")
WORD = re.compile(r"[\"'(*“‘]*[A-Za-z][A-Za-z’'-]*[.,;:!?)\"'*”’]*")
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "cf.", "vs.", "Mr.", "Dr.", "No.")
PROMPTS = ("Explain {subject} in Python.", "What does the Python language reference say about {subject}?",
           "Describe {subject}.", "Summarize the documentation on {subject}.", "How does Python handle {subject}?")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="corpus file to write (JSONL)")
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help=f"cut longer units on sentence boundaries (default {DEFAULT_MAX_CHARS})")
    p.add_argument("--min-records", type=int, default=MIN_RECORDS,
                   help=f"fail when fewer records come out (default {MIN_RECORDS})")
    return p


def load_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise RunbookError(f"this Python ({sys.executable}) has no pydoc_data.topics ({e}); run the script with the "
                           "project's interpreter (.venv/bin/python) or install the full standard library (Debian: "
                           "apt-get install libpython3-stdlib)", ANCHOR) from e
    return topics


def reflow(lines: list[str]) -> str:
    return re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()


def looks_like_prose(lines: list[str]) -> bool:
    """An indented block that reads as sentences (a list item's continuation, a note), not code,
    grammar or a console session."""
    text = reflow(lines)
    if "::=" in text or any(line.lstrip().startswith(CODE_STARTS) for line in lines):
        return False
    tokens = text.split()
    return sum(bool(WORD.fullmatch(tok)) for tok in tokens) / len(tokens) >= 0.6 and text[-1] in ".:?)\"'"


def dedent(lines: list[str], to: int = 4) -> str:
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    return "\n".join(" " * to + line[indent:] for line in lines)


def units(text: str) -> Iterator[tuple[str, str, bool]]:
    """(subject, unit text, has_code) for each prose unit of one topic, in order: subject is the
    innermost heading above it; a code block joins the paragraph before it when that ends with ':'."""
    subject = title = lead_in = ""  # the innermost heading, the topic's title, a short 'Notes:' line
    pending: list[str] = []  # the current unit: a paragraph, then any code it introduces
    has_code = False
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        first = lines[0].strip()
        heading = len(lines) == 2 and HEADING_RULE.match(lines[1].strip())
        footnote, table = FOOTNOTE_MARK.match(first), first.startswith(TABLE_START)
        code = not (heading or footnote or table) and lines[0].startswith(" ") and not looks_like_prose(lines)
        if code and pending and pending[-1].endswith(":"):
            pending.append(dedent(lines))
            has_code = True
            continue
        if pending:  # any other block ends the unit before it
            yield subject, "\n\n".join(pending), has_code
            pending, has_code = [], False
        if heading:
            subject, lead_in = first, ""
            title = title or subject
        elif footnote:  # footnotes belong to the whole topic
            subject, lead_in = title, ""
        elif code:  # a code block on its own
            yield subject, dedent(lines, 0), True
        elif not table:
            para = reflow(lines)
            if len(para) < 40 and para.endswith(":"):
                lead_in = para
            else:
                pending, lead_in = [f"{lead_in} {para}" if lead_in else para], ""
    if pending:
        yield subject, "\n\n".join(pending), has_code


def cut(unit: str, has_code: bool, max_chars: int) -> list[str]:
    """Pieces of at most max_chars, on sentence boundaries. A unit with code is kept whole when it
    fits HARD_MAX_CHARS; else a paragraph keeps its prose (cut) and drops the code, and a code
    block on its own is dropped."""
    if len(unit) <= max_chars or (has_code and len(unit) <= HARD_MAX_CHARS):
        return [unit]
    if has_code:
        if unit.startswith(" ") or "\n\n" not in unit:
            return []
        unit = unit.split("\n\n", 1)[0]
    sentences: list[str] = []
    for part in SENTENCE_END.split(unit):
        if sentences and sentences[-1].endswith(ABBREVIATIONS):
            sentences[-1] = f"{sentences[-1]} {part}"
        else:
            sentences.append(part)
    pieces: list[str] = []
    for s in sentences:
        if pieces and len(pieces[-1]) + 1 + len(s) <= max_chars:
            pieces[-1] = f"{pieces[-1]} {s}"
        else:
            pieces.append(s)
    return [p for p in pieces if len(p) <= HARD_MAX_CHARS]


def pick(record_id: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big") % n


def records(topics: dict[str, str], max_chars: int, version: str, stats: dict) -> Iterator[dict]:
    """Records in topic order. pydoc's index repeats some sections under several topics: a piece
    already written under an earlier topic is skipped (counted in stats)."""
    seen: set[str] = set()
    for topic in sorted(topics):
        n = 0
        for subject, unit, has_code in units(topics[topic]):
            for piece in cut(unit, has_code, max_chars):
                key = hashlib.sha256(piece.encode()).hexdigest()
                if len(piece.strip()) < 40 or key in seen:
                    stats["short" if len(piece.strip()) < 40 else "repeated"] += 1
                    continue
                seen.add(key)
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
    t0 = time.monotonic()
    try:
        if not 80 <= args.max_chars <= HARD_MAX_CHARS:
            raise RunbookError(f"--max-chars {args.max_chars} is out of range: use 80..{HARD_MAX_CHARS}", ANCHOR)
        topics, version, stats = load_topics(), platform.python_version(), {"short": 0, "repeated": 0}
        recs = list(records(topics, args.max_chars, version, stats))
        if len(recs) < args.min_records:
            raise RunbookError(f"only {len(recs)} records came out of pydoc_data.topics of CPython {version} (expected "
                               f">= {args.min_records}); this interpreter's topics look truncated: run with the "
                               "project's .venv/bin/python", ANCHOR)
        with atomic.atomic_open(args.out, "w", encoding="utf-8", newline="\n") as f:
            jsonl.write(f, recs)
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder exists and is writable", ANCHOR))
    n_text = sum("text" in r for r in recs)
    event("sample-corpus", records=len(recs), text=n_text, prompt_response=len(recs) - n_text, topics=len(topics),
          repeated_skipped=stats["repeated"], source=f"cpython-{version}", bytes=args.out.stat().st_size,
          out=paths.rel(args.out), seconds=round(time.monotonic() - t0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
