#!/usr/bin/env python3
"""export: a corpus to mlx-lm chat JSONL with stable splits, provenance, rejects and a manifest.

Usage:
    python bin/export.py CORPUS [CORPUS ...] (--dataset NAME | --out DIR) [--config YAML]
        [--field CANONICAL=NAME ...] [--role FROM=TO ...] [--ratios TRAIN,VALID,TEST]
        [--max-reject-ratio R] [--max-chars N] [--text-system-prompt S] [--text-user-prompt S]
        [--workers N]

Example:
    .venv/bin/python bin/export.py datasets/sample/corpus.jsonl \
        --dataset domain_sft_v1_high_signal_thunder --config configs/export.yaml

CORPUS is one or more JSONL files (plain or gzip'd, detected by content) or glob patterns
('data/*.jsonl.gz', 'data/**/*.jsonl'). Files are read in sorted path order, each line in
order, so the output does not depend on the order of the arguments.

Each line is one JSON object in one of these shapes (precedence top to bottom; field names
are remapped with --field or `fields:` in the config, e.g. --field text=body):
    {"messages": [{"role": ..., "content": ...}, ...]}           already chat
    {"prompt": ..., "completion": ...} or {"prompt": ..., "response": ...}
    {"instruction": ..., "input": ... (optional), "output": ...}
    {"text": ...}                     the text-to-chat rule: [system], user prompt, assistant text
plus optional provenance: "record_id" (string or integer; derived from the content hash when
absent), "weight" (non-negative finite number; 1.0 when absent), "source" (string; the
corpus file's path when absent).

Writes DIR (datasets/NAME) atomically: train.jsonl, valid.jsonl, test.jsonl (records
{"messages", "record_id", "weight", "source"}, which `mlx_lm lora --data DIR` reads as is),
rejects.jsonl (file, line, reason, detail, raw prefix of every rejected line) and
manifest.json (counts, per-file sha256 and bytes, split rule, source hashes, exporter
version, dataset_sha256). Splits come from a hash of record_id; exact-duplicate content is
kept once (first occurrence wins). The export fails, leaving the previous dataset in place,
when rejects exceed the threshold (default 0.1% of input lines) or a split would be empty.
It streams: per record only two 16-byte digests are kept (about 48 bytes with their index);
N worker processes (`--worker`; chunks and output lines pass through shared memory on Linux,
else pipes) validate and shape lines while this process
deduplicates and writes; the output does not depend on N. See RUNBOOK.md#export.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import gzip
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import zlib
from collections import deque
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where used: pool workers never load it
    import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import digest_of  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

EXPORTER_VERSION = "1.0.0"
CATEGORY = "export format or path consistency"
SPLITS = ("train", "valid", "test")
ROLES = ("system", "user", "assistant")
# Canonical field names; each can be remapped to the corpus's own name.
RECORD_FIELDS = ("messages", "prompt", "completion", "response", "instruction", "input",
                 "output", "text", "record_id", "weight", "source")
MESSAGE_FIELDS = ("role", "content")
RAW_PREFIX = 500           # bytes of a rejected line kept in rejects.jsonl
BLOCK = 1 << 19            # bytes read at a time: one chunk of lines for a worker
TAKE_BATCH = 8             # chunks deduplicated together (vectorized index work per batch)
DERIVED_ID_PREFIX = "content:"

# Every reject reason, in the order the report lists them; RUNBOOK.md has a heading
# "reject: <reason>" (anchor reject-<reason>) for each.
REASONS = {
    "blank_line": "the line is empty or whitespace only",
    "non_utf8": "the line (or a string in it) is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the line is valid JSON but not an object",
    "missing_content": "no recognized record shape, or a needed field is absent or null",
    "empty_content": "a content string (or the messages list) is empty or whitespace only",
    "non_string_content": "a content value is not a string",
    "bad_messages": "messages is not a list of objects",
    "role_order": "roles out of order: unknown role, system not first, user/assistant not "
                  "alternating, or no final assistant turn",
    "bad_weight": "weight is not a non-negative finite number",
    "bad_record_id": "record_id is not a non-empty string or an integer",
    "bad_source": "source is not a non-empty string",
    "record_id_conflict": "the same record_id was seen earlier with different content",
    "too_long": "the record's content is over max_chars (or the line over max_line_bytes)",
}

DEFAULTS = {
    "fields": {},
    "roles": {},
    "ratios": {"train": 0.9, "valid": 0.05, "test": 0.05},
    "max_reject_ratio": 0.001,
    "max_chars": 50000,
    "text_system_prompt": "",
    "text_user_prompt": "Write a passage from the reference documentation.",
}

_MISSING = object()


class Reject(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail


def fail(message: str, anchor: str) -> RunbookError:
    return RunbookError(message, anchor, CATEGORY)


# ---- settings: command line, then the YAML config, then defaults --------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Export a corpus to mlx-lm chat JSONL (train/valid/test) with a manifest.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("corpus", nargs="+", help="JSONL files (plain or .gz) or glob patterns")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--dataset", help="write datasets/NAME/")
    where.add_argument("--out", help="write this folder instead of datasets/NAME/")
    p.add_argument("--config", help="YAML with fields, roles, ratios, max_reject_ratio, "
                   "max_chars, text_system_prompt, text_user_prompt")
    p.add_argument("--field", action="append", default=[], metavar="CANONICAL=NAME",
                   help="read canonical field CANONICAL from the corpus key NAME "
                   f"(CANONICAL in {', '.join(RECORD_FIELDS + MESSAGE_FIELDS)}); repeatable")
    p.add_argument("--role", action="append", default=[], metavar="FROM=TO",
                   help="map a corpus role to system|user|assistant (e.g. human=user); repeatable")
    p.add_argument("--ratios", help="train,valid,test split ratios, e.g. 0.9,0.05,0.05 or 90,5,5")
    p.add_argument("--max-reject-ratio", type=float,
                   help="fail when rejected > this fraction of input lines (default 0.001)")
    p.add_argument("--max-chars", type=int, help="reject records whose content is longer (chars)")
    p.add_argument("--text-system-prompt", help="system message for `text` records ('' = none)")
    p.add_argument("--text-user-prompt", help="user message for `text` records")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="processes that validate and shape lines (default: CPUs, at most 3; each holds ~25 MB; "
                   "1 = all in this process); the output does not depend on it")
    return p


def default_workers() -> int:
    return max(1, min(3, os.cpu_count() or 1))


def _as_float(value, key: str, where: str) -> float:
    # PyYAML reads 1e-3 as a string; resolve numbers the way mlx-lm does.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(f"{where}: {key} must be a number, got {value!r}", "export-bad-settings")
    return float(value)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise fail(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} text=body",
                       "export-bad-settings")
        out[k] = v
    return out


def check_settings(s: dict, where: str) -> dict:
    """Validate types and values; returns the settings with ratios as Fractions."""
    unknown = sorted(set(s) - set(DEFAULTS))
    if unknown:
        raise fail(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})",
                   "export-bad-settings")
    fields = s["fields"]
    if not isinstance(fields, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                               for k, v in fields.items()):
        raise fail(f"{where}: fields must map canonical names to corpus names, e.g. "
                   "{text: body}", "export-bad-settings")
    bad = sorted(set(fields) - set(RECORD_FIELDS + MESSAGE_FIELDS))
    if bad:
        raise fail(f"{where}: unknown canonical field(s) {', '.join(bad)} (known: "
                   f"{', '.join(RECORD_FIELDS + MESSAGE_FIELDS)})", "export-bad-settings")
    roles = s["roles"]
    if not isinstance(roles, dict) or not all(isinstance(k, str) and v in ROLES
                                              for k, v in roles.items()):
        raise fail(f"{where}: roles must map corpus roles to system|user|assistant, e.g. "
                   "{human: user, gpt: assistant}", "export-bad-settings")
    ratios = s["ratios"]
    if not isinstance(ratios, dict) or set(ratios) != set(SPLITS):
        raise fail(f"{where}: ratios must have exactly train, valid, test", "export-bad-settings")
    fr = {}
    for k in SPLITS:
        v = _as_float(ratios[k], f"ratios.{k}", where)
        if v <= 0:
            raise fail(f"{where}: ratios.{k} must be > 0 (every split must get records), got {v}",
                       "export-bad-settings")
        fr[k] = Fraction(repr(v))
    total = sum(fr.values())
    s["ratios"] = {k: fr[k] / total for k in SPLITS}
    s["max_reject_ratio"] = _as_float(s["max_reject_ratio"], "max_reject_ratio", where)
    if not 0 <= s["max_reject_ratio"] <= 1:
        raise fail(f"{where}: max_reject_ratio must be within 0..1", "export-bad-settings")
    mc = s["max_chars"]
    if isinstance(mc, bool) or not isinstance(mc, int) or mc <= 0:
        raise fail(f"{where}: max_chars must be a positive integer, got {mc!r}",
                   "export-bad-settings")
    for k in ("text_system_prompt", "text_user_prompt"):
        if not isinstance(s[k], str):
            raise fail(f"{where}: {k} must be a string", "export-bad-settings")
    if not s["text_user_prompt"].strip():
        raise fail(f"{where}: text_user_prompt must not be empty (the user turn of `text` "
                   "records)", "export-bad-settings")
    return s


def resolve_settings(args) -> dict:
    s = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    where = "the command line"
    if args.config:
        import yaml

        where = args.config
        try:
            with open(args.config, encoding="utf-8") as f:
                loaded = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise fail(f"cannot read config {args.config}: {e}", "export-bad-settings") from e
        if not isinstance(loaded, dict):
            raise fail(f"{args.config}: expected a mapping of settings", "export-bad-settings")
        s.update(loaded)
        where = f"{args.config} or the command line"
    if args.field:
        s["fields"] = {**(s["fields"] if isinstance(s["fields"], dict) else {}),
                       **_pairs(args.field, "--field")}
    if args.role:
        s["roles"] = {**(s["roles"] if isinstance(s["roles"], dict) else {}),
                      **_pairs(args.role, "--role")}
    if args.ratios:
        parts = args.ratios.split(",")
        if len(parts) != 3:
            raise fail(f"--ratios {args.ratios!r}: expected TRAIN,VALID,TEST e.g. 0.9,0.05,0.05",
                       "export-bad-settings")
        s["ratios"] = dict(zip(SPLITS, parts, strict=True))
    for key in ("max_reject_ratio", "max_chars", "text_system_prompt", "text_user_prompt"):
        v = getattr(args, key)
        if v is not None:
            s[key] = v
    return check_settings(s, where)


# ---- input files ----------------------------------------------------------------------------


def expand_corpus(patterns: list[str], out: Path) -> list[Path]:
    """Sorted, de-duplicated regular files for the given paths and glob patterns."""
    found: dict[Path, Path] = {}
    for pat in patterns:
        if glob.has_magic(pat):
            matches = [Path(m) for m in glob.glob(pat, recursive=True) if Path(m).is_file()]
            if not matches:
                raise fail(f"corpus pattern {pat!r} matches no file: check the path, or pass "
                           "CORPUS=<file or glob> (make export CORPUS='data/*.jsonl.gz')",
                           "export-no-input")
        else:
            p = Path(pat)
            if p.is_dir():
                raise fail(f"corpus {pat} is a folder: pass its files or a glob, e.g. "
                           f"CORPUS='{pat.rstrip('/')}/*.jsonl'", "export-no-input")
            if not p.is_file():
                raise fail(f"corpus file {pat} not found: create it (make sample-corpus for the "
                           "sample) or pass CORPUS=<file or glob>", "export-no-input")
            matches = [p]
        for m in matches:
            found.setdefault(m.resolve(), m)
    outr = out.resolve()
    for r in found:
        if r.is_relative_to(outr):
            raise fail(f"corpus file {found[r]} is inside the output folder {out}: the export "
                       "would read what it replaces; export to another DATASET",
                       "export-no-input")
    return sorted(found.values(), key=lambda p: paths.rel(p))


class _HashingRaw(io.RawIOBase):
    """A raw reader that sha256-hashes and counts every byte it passes on."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        if n:
            self.sha.update(memoryview(b)[:n])
            self.bytes += n
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def open_corpus(path: Path):
    """(reader, buffered file, hashing raw file, is_gzip): gzip is detected by its magic
    bytes, not the name; the sha256 covers the file's own (compressed) bytes."""
    raw = _HashingRaw(open(path, "rb", buffering=0))
    buf = io.BufferedReader(raw, buffer_size=1 << 20)
    is_gz = buf.peek(2)[:2] == b"\x1f\x8b"
    reader = gzip.GzipFile(fileobj=buf, mode="rb") if is_gz else buf
    return reader, buf, raw, is_gz


# ---- one record ------------------------------------------------------------------------------

# Output JSON is pure ASCII (non-ASCII as \uXXXX escapes): mlx-lm opens the files with the
# locale's encoding, and ASCII reads the same under every locale. It is also the faster encoder.
_ENC = json.encoder.encode_basestring_ascii
_USER = '{"role": "user", "content": '
_ASSISTANT = '{"role": "assistant", "content": '
_ROLE_HEAD = {r: '{"role": ' + _ENC(r) + ', "content": ' for r in ROLES}


def _text(v, what: str) -> str:
    """v if it is a non-empty string, else the matching Reject."""
    if v is _MISSING or v is None:
        raise Reject("missing_content", f"{what} is absent or null")
    if type(v) is not str:
        raise Reject("non_string_content", f"{what} is {type(v).__name__}, not a string")
    if not v or v.isspace():
        raise Reject("empty_content", f"{what} is empty or whitespace only")
    return v


def messages_json(pairs: list[tuple[str, str]]) -> str:
    """Exactly json.dumps([{"role": r, "content": c} ...], separators=(", ", ": "))."""
    return "[" + ", ".join([_ROLE_HEAD[r] + _ENC(c) + "}" for r, c in pairs]) + "]"


class Shaper:
    """Turns one parsed corpus object into its messages JSON (the record's content)."""

    def __init__(self, s: dict):
        f = {k: k for k in RECORD_FIELDS + MESSAGE_FIELDS}
        f.update(s["fields"])
        self.f = f
        self.roles = {r: r for r in ROLES}
        self.roles.update(s["roles"])
        head = []
        if s["text_system_prompt"]:
            head.append(("system", s["text_system_prompt"]))
        head.append(("user", s["text_user_prompt"]))
        # [system,] user, then the assistant turn holds the text.
        self.text_prefix = messages_json(head)[:-1] + ", " + _ASSISTANT
        self.text_chars = sum(len(c) for _, c in head)
        # Role sequences the fast path accepts: [system,] then user/assistant pairs.
        pairs = [("user", "assistant") * k for k in range(1, 33)]
        self.valid_orders = {p for q in pairs for p in (q, ("system", *q))}
        self.shape = self._make_shape()

    def _make_shape(self):
        """shape(obj) -> (messages JSON, content chars) or raise Reject; field names and
        constants are bound as closure variables (this runs once per line)."""
        f, chat = self.f, self.chat_json
        k_msg, k_prompt, k_compl, k_resp = f["messages"], f["prompt"], f["completion"], f["response"]
        k_ins, k_input, k_out, k_text = f["instruction"], f["input"], f["output"], f["text"]
        text_prefix, text_chars = self.text_prefix, self.text_chars
        missing, enc, user_h, asst_h = _MISSING, _ENC, _USER, _ASSISTANT

        def shape(obj: dict) -> tuple[str, int]:
            get = obj.get
            m = get(k_msg, missing)
            if m is not missing:
                return chat(m)
            p = get(k_prompt, missing)
            if p is not missing:
                c = get(k_compl, missing)
                if c is missing:
                    c = get(k_resp, missing)
                    if c is missing:
                        raise Reject("missing_content",
                                     f"'{k_prompt}' without '{k_compl}' or '{k_resp}'")
                    if type(c) is not str or not c or c.isspace():
                        _text(c, k_resp)
                elif type(c) is not str or not c or c.isspace():
                    _text(c, k_compl)
                if type(p) is not str or not p or p.isspace():
                    _text(p, k_prompt)
                return f"[{user_h}{enc(p)}}}, {asst_h}{enc(c)}}}]", len(p) + len(c)
            ins = get(k_ins, missing)
            if ins is missing:
                t = get(k_text, missing)
                if t is missing:
                    raise Reject("missing_content", f"no '{k_msg}', '{k_prompt}', '{k_ins}' or "
                                 f"'{k_text}' field (remap names with --field)")
                if type(t) is not str or not t or t.isspace():
                    _text(t, k_text)
                return f"{text_prefix}{enc(t)}}}]", text_chars + len(t)
            user = _text(ins, k_ins)
            inp = get(k_input, None)
            if inp is not None:
                if type(inp) is not str:
                    raise Reject("non_string_content",
                                 f"{k_input} is {type(inp).__name__}, not a string")
                if inp and not inp.isspace():
                    user = user + "\n\n" + inp
            out = _text(get(k_out, missing), k_out)
            return f"[{user_h}{enc(user)}}}, {asst_h}{enc(out)}}}]", len(user) + len(out)

        return shape

    def chat_json(self, m) -> tuple[str, int]:
        """(messages JSON, content chars) of a `messages` list, or raise Reject. The usual
        case (a list of {role, content} strings in a valid order) takes no Python loop."""
        fr, fc = self.f["role"], self.f["content"]
        if type(m) is list:
            try:
                roles = tuple([self.roles[x[fr]] for x in m])
                contents = [x[fc] for x in m]
            except (KeyError, TypeError, IndexError):
                roles = None
            if (roles in self.valid_orders and set(map(type, contents)) == {str}
                    and all(contents) and not any(map(str.isspace, contents))):
                return ("[" + ", ".join([f"{_ROLE_HEAD[r]}{_ENC(c)}}}" for r, c in zip(roles, contents, strict=True)])
                        + "]", sum(map(len, contents)))
        pairs = self._chat(m)  # the slow path: finds and names what is wrong
        return messages_json(pairs), sum(len(c) for _, c in pairs)

    def _chat(self, m) -> list[tuple[str, str]]:
        name = self.f["messages"]
        if m is None:
            raise Reject("missing_content", f"{name} is null")
        if type(m) is not list:
            raise Reject("bad_messages", f"{name} is {type(m).__name__}, not a list")
        if not m:
            raise Reject("empty_content", f"{name} is an empty list")
        fr, fc, roles = self.f["role"], self.f["content"], self.roles
        out = []
        for i, msg in enumerate(m):
            if type(msg) is not dict:
                raise Reject("bad_messages", f"message {i} is {type(msg).__name__}, not an object")
            r = msg.get(fr)
            if type(r) is not str:
                raise Reject("role_order", f"message {i} has no '{fr}' string")
            role = roles.get(r)
            if role is None:
                raise Reject("role_order", f"message {i} has role {r!r}, not system/user/assistant "
                             "(map it with --role FROM=TO)")
            out.append((role, _text(msg.get(fc, _MISSING), f"message {i} {fc}")))
        start = 1 if out[0][0] == "system" else 0
        for i in range(start, len(out)):
            want = "user" if (i - start) % 2 == 0 else "assistant"
            if out[i][0] != want:
                raise Reject("role_order", f"message {i} is {out[i][0]!r}, expected {want!r} "
                             "(optional system first, then user/assistant alternating)")
        if out[-1][0] != "assistant":
            raise Reject("role_order", "no final assistant turn (the last message must be "
                         "the assistant's)")
        return out


def parse_slow(text: str, lineno: int):
    """json.loads for what the fast scanner refused: its exact error, a leading BOM or spaces."""
    if lineno == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte-order mark at the start of a file
    try:
        return json.loads(text)
    except ValueError as e:
        raise Reject("invalid_json", str(e)) from None


def has_lone_surrogate(obj) -> bool:
    """JSON may escape half a UTF-16 pair (\\ud800); such a string has no UTF-8 form."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def record_id_of(v) -> str | None:
    """The slow path for a record_id that is not a plain non-empty string: None when absent
    (derived later from the content), str(int) for an integer, else a Reject."""
    if v is _MISSING:
        return None
    if type(v) is int:
        return str(v)
    raise Reject("bad_record_id", f"record_id {v!r} is not a non-empty string or an integer")


def weight_text(w, cache: dict) -> str:
    """', "weight": <float>' for a valid weight (cached by value), else a Reject."""
    ok = False
    if (type(w) is float or type(w) is int) and 0 <= w < math.inf:
        try:
            wf = float(w) + 0.0  # + 0.0 turns -0.0 into 0.0
            ok = True
        except OverflowError:  # an integer too big for a float
            pass
    if not ok:
        raise Reject("bad_weight", f"weight {w!r} is not a non-negative finite number")
    text = ', "weight": ' + repr(wf)
    if len(cache) < 4096:
        cache[w] = text
    return text


def source_text(src, cache: dict) -> str:
    """', "source": "<src>"}\\n' for a valid source (cached), else a Reject."""
    if type(src) is not str or not src or src.isspace():
        raise Reject("bad_source", f"source {src!r} is not a non-empty string")
    text = f', "source": {_ENC(src)}}}\n'
    if len(cache) < 4096:
        cache[src] = text
    return text


# ---- exact digest index with bounded memory ------------------------------------------------


def as_u64(ds: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Joined 16-byte digests -> (first 8 bytes, last 8 bytes) as uint64 arrays."""
    import numpy as np

    a = np.frombuffer(ds, dtype=">u8").reshape(-1, 2)
    return a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64)


def adjacent_equal(sorted_hi: np.ndarray) -> np.ndarray:
    """For sorted keys: True where a neighbour has the same top 64 bits (a superset of exact
    repeats within the batch; the caller treats these one by one)."""
    import numpy as np

    rep = np.zeros(len(sorted_hi), bool)
    if len(sorted_hi) > 1:
        eq = sorted_hi[1:] == sorted_hi[:-1]
        rep[1:] |= eq
        rep[:-1] |= eq
    return rep


class DigestIndex:
    """An exact set of 16-byte keys, or a map key -> 16-byte value, at 16 or 32 bytes per entry.

    Two levels of sorted uint64 columns (top 64 bits of the key sorted, the rest beside it):
    `small` takes each batch's new keys, and is merged into `big` when it passes SMALL_MAX,
    so a batch costs O(SMALL_MAX) and the big merge O(n) every SMALL_MAX keys. Lookups are
    vectorized per batch, with the batch's keys sorted (searchsorted walks the arrays in order).
    """

    SMALL_MAX = 1 << 15

    def __init__(self, with_values: bool):
        import numpy as np

        self.ncols = 4 if with_values else 2
        self.big = [np.empty(0, np.uint64) for _ in range(self.ncols)]
        self.small = [np.empty(0, np.uint64) for _ in range(self.ncols)]

    def __len__(self) -> int:
        return len(self.big[0]) + len(self.small[0])

    @staticmethod
    def _lookup(cols: list[np.ndarray], keys: list[np.ndarray], res: np.ndarray) -> None:
        import numpy as np

        hi = cols[0]
        n = len(hi)
        if n == 0:
            return
        q = keys[0]
        left = np.searchsorted(hi, q)
        idx = np.minimum(left, n - 1)
        eq = hi[idx] == q
        nxt = np.minimum(idx + 1, n - 1)
        multi = eq & (nxt != idx) & (hi[nxt] == q)
        hit = eq & ~multi & (cols[1][idx] == keys[1])
        if len(cols) == 4:
            same = (cols[2][idx] == keys[2]) & (cols[3][idx] == keys[3])
            res[hit & same] = 1
            res[hit & ~same] = 2
        else:
            res[hit] = 1
        # Several stored keys share the top 64 bits (about never): check them one by one.
        for i in np.nonzero(multi)[0].tolist():
            j = int(idx[i])
            while j < n and hi[j] == q[i]:
                if cols[1][j] == keys[1][i]:
                    same = len(cols) == 2 or all(cols[k][j] == keys[k][i] for k in (2, 3))
                    res[i] = 1 if same else 2
                    break
                j += 1

    def lookup(self, keys: list[np.ndarray]) -> np.ndarray:
        """keys = [hi, lo] (or [hi, lo, value hi, value lo]), sorted by hi; per key 0 absent,
        1 present (with the same value), 2 present with a different value."""
        import numpy as np

        res = np.zeros(len(keys[0]), np.int8)
        self._lookup(self.big, keys, res)  # a key lives in one level only
        self._lookup(self.small, keys, res)
        return res

    @staticmethod
    def _merge(cols: list[np.ndarray], new: list[np.ndarray]) -> None:
        """Insert `new` into the sorted columns in place of the old ones, one column at a
        time, so the merge needs one column's worth of extra memory, not the index's."""
        import numpy as np

        order = np.argsort(new[0], kind="stable")
        n, k = len(cols[0]), len(order)
        # Where each new key lands in the merged column; the old keys fill the rest in order.
        at = np.searchsorted(cols[0], new[0][order]) + np.arange(k)
        is_old = np.ones(n + k, bool)
        is_old[at] = False
        for i, x in enumerate(new):
            merged = np.empty(n + k, np.uint64)
            merged[at] = x[order]
            merged[is_old] = cols[i]
            cols[i] = merged

    def add(self, new: list[np.ndarray]) -> None:
        """Insert keys known to be absent."""
        if len(new[0]):
            self._merge(self.small, new)
        if len(self.small[0]) > self.SMALL_MAX:
            import numpy as np

            self._merge(self.big, self.small)
            self.small = [np.empty(0, np.uint64) for _ in range(self.ncols)]


# ---- the export ------------------------------------------------------------------------------


class Writer:
    """One background thread that appends to the output files, hashing as it goes, and
    flushes them to disk every SYNC_EVERY bytes, so the final fsync has little left to do.
    Writing and hashing release the GIL: this overlaps with the main thread's work."""

    SYNC_EVERY = 64 << 20

    def __init__(self):
        import queue
        import threading

        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="export-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while True:
            item = self.q.get()
            if item is None:
                return
            out, data = item
            if self.error is not None:
                continue
            try:
                out.f.write(data)
                out.sha.update(data)
                out.unsynced += len(data)
                if out.unsynced >= self.SYNC_EVERY:
                    out.f.flush()
                    sync(out.f.fileno())
                    out.unsynced = 0
            except BaseException as e:  # handed to the main thread by put() / close()
                self.error = fail(f"writing {out.path} failed: {e}: free disk space "
                                  f"(`df -h {out.path.parent.parent}`) and export again",
                                  "export-crashed")

    def put(self, out: Out, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.q.put((out, data))

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class Out:
    """One output file: its records and bytes counted here, written by the Writer."""

    def __init__(self, path: Path, writer: Writer):
        self.path = path
        self.writer = writer
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.unsynced = 0
        self.bytes = 0
        self.records = 0

    def write(self, data: bytes, records: int) -> None:
        if data:
            self.bytes += len(data)
            self.records += records
            self.writer.put(self, data)

    def close(self) -> dict:
        """After the Writer is closed."""
        self.f.close()
        return {"sha256": self.sha.hexdigest(), "bytes": self.bytes, "records": self.records}


def split_thresholds(ratios: dict) -> tuple[int, int]:
    """Bounds on u = the first 8 bytes of sha256(record_id) as a big-endian uint64: train if
    u < t1, else valid if u < t2, else test (exact rational arithmetic, no float rounding)."""
    t1 = math.floor(ratios["train"] * 2**64)
    t2 = math.floor((ratios["train"] + ratios["valid"]) * 2**64)
    return t1, t2


def reject_line(fname: str, lineno: int, raw: bytes, reason: str, detail: str) -> bytes:
    rec = {"file": fname, "line": lineno, "reason": reason, "detail": detail,
           "raw_bytes": len(raw),
           "raw": raw[:RAW_PREFIX].rstrip(b"\r\n").decode("utf-8", "backslashreplace"),
           "see": f"RUNBOOK.md#reject-{reason}"}
    return (json.dumps(rec, ensure_ascii=False, separators=(", ", ": ")) + "\n").encode()


def read_chunks(reader, limit: int):
    """Yield chunks of whole lines (joined by '\\n', without the last one) from a binary
    reader, BLOCK bytes at a time. A line longer than `limit` is cut to limit + 1 bytes and
    its rest skipped without holding it, so memory stays within BLOCK + limit."""
    carry = b""
    skipping = False
    read = reader.read
    while True:
        block = read(BLOCK)
        if not block:
            break
        if skipping:
            k = block.find(b"\n")
            if k < 0:
                continue
            block = block[k + 1:]
            skipping = False
        data = carry + block if carry else block
        k = data.rfind(b"\n")
        if k < 0:
            chunk, carry = None, data
        else:
            chunk, carry = data[:k], data[k + 1:]
        if len(carry) > limit:
            cut = carry[:limit + 1]
            chunk = cut if chunk is None else chunk + b"\n" + cut
            carry = b""
            skipping = True
        if chunk is not None:
            yield chunk
    if carry:
        yield carry


# ---- worker side: lines -> output lines and digests (also run in-process with --workers 1) ---

_W: dict = {}  # per-process state: the Shaper and settings, set by init_worker


def init_worker(s: dict) -> None:
    t1, t2 = split_thresholds(s["ratios"])
    _W.clear()
    _W.update(shaper=Shaper(s), max_chars=s["max_chars"], line_limit=line_limit(s),
              wcache={_MISSING: ', "weight": 1.0'}, scache={},
              bounds=(t1.to_bytes(8, "big"), t2.to_bytes(8, "big")))


def line_limit(s: dict) -> int:
    return 8 * s["max_chars"] + (1 << 16)  # JSON escapes and UTF-8 widen text by at most 6x


def process_chunk(chunk: bytes, fname: str, base: int) -> tuple:
    """Validate, shape and split every line of a chunk (the order of its lines kept).

    Returns (lines in the chunk, per split: its output lines joined and their end offsets,
    per output line: its split (a byte), record_id and content digests (16 bytes each,
    joined), flags (bit 1 derived record_id, 2 default weight, 4 default source) and line
    index; rejects as (line index, reason, reject line)). The main process decides what a
    duplicate drops; a split's bytes go to the file as they are when nothing is dropped.
    """
    from array import array
    from itertools import accumulate

    shaper = _W["shaper"]
    shape = shaper.shape
    f_rid, f_weight, f_source = (shaper.f[k] for k in ("record_id", "weight", "source"))
    max_chars, limit = _W["max_chars"], _W["line_limit"]
    b1, b2 = _W["bounds"]
    wcache = _W["wcache"]
    scache = _W["scache"].setdefault(fname, {_MISSING: f', "source": {_ENC(fname)}}}\n'})
    sha = hashlib.sha256
    scan = _SCAN
    raw_lines: list[bytes] | None = None
    try:  # one decode for the whole chunk; line by line only when it has bad UTF-8
        lines: list = chunk.decode("utf-8").split("\n")
        is_text = True
    except UnicodeDecodeError:
        lines = raw_lines = chunk.split(b"\n")
        is_text = False
    maybe_surrogates = b"\\ud" in chunk or b"\\uD" in chunk  # one scan for the chunk
    outs: tuple[list, list, list] = ([], [], [])
    split = bytearray()
    rds: list[bytes] = []
    cds: list[bytes] = []
    flags = bytearray()
    pos: list[int] = []
    rejects: list[tuple] = []
    out_append = [o.append for o in outs]  # bound once: this loop runs per line
    split_append, flag_append, pos_append = split.append, flags.append, pos.append
    rd_append, cd_append = rds.append, cds.append
    for i, line in enumerate(lines):
        try:
            if is_text:
                text = line
                if len(text) > limit or (4 * len(text) > limit and len(text.encode()) > limit):
                    raise Reject("too_long", f"line is over max_line_bytes {limit} "
                                 "(8 x max_chars + 64 KiB)")
                if not text or text[0] != "{" and text.isspace():
                    raise Reject("blank_line", "empty or whitespace-only line")
            else:
                if len(line) > limit:
                    raise Reject("too_long", f"line is over max_line_bytes {limit} "
                                 "(8 x max_chars + 64 KiB)")
                if not line or line[0] != 123 and line.isspace():  # 123 is '{'
                    raise Reject("blank_line", "empty or whitespace-only line")
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise Reject("non_utf8", f"byte {e.start}: {e.reason}") from None
            try:  # the C scanner json.loads uses, without its per-call overhead
                obj, end = scan(text, 0)
                if end != len(text) and not text[end:].isspace():
                    raise ValueError
            except (StopIteration, ValueError):
                obj = parse_slow(text, base + i + 1)
            if type(obj) is not dict:
                raise Reject("not_an_object", f"a JSON {type(obj).__name__}, not an object")
            mj, n = shape(obj)
            if n > max_chars:
                raise Reject("too_long", f"content is {n} chars, over max_chars {max_chars}")
            if maybe_surrogates and ("\\ud" in text or "\\uD" in text) and has_lone_surrogate(obj):
                raise Reject("non_utf8", "a string holds half a UTF-16 surrogate pair "
                             "(a lone \\ud800-\\udfff escape)")
            get = obj.get
            fl = 0
            rid = get(f_rid, _MISSING)
            if type(rid) is not str or not rid or rid.isspace():
                rid = record_id_of(rid)
                if rid is None:
                    fl = 1
            w = get(f_weight, _MISSING)
            if w is True or w is False:
                weight_text(w, wcache)  # raises: a bool is no weight
            try:
                wt = wcache[w]
            except (KeyError, TypeError):
                wt = weight_text(w, wcache)
            if w is _MISSING:
                fl |= 2
            src = get(f_source, _MISSING)
            try:
                st = scache[src]
            except (KeyError, TypeError):
                st = source_text(src, scache)
            if src is _MISSING:
                fl |= 4
            mb = mj.encode()
            cd = sha(mb).digest()[:16]
            if fl & 1:
                rid = DERIVED_ID_PREFIX + cd.hex()
            rd = sha(rid.encode()).digest()[:16]
            # The split: rd's first 8 bytes against the bounds (bytes compare as big-endian).
            sp = 0 if rd < b1 else 1 if rd < b2 else 2
            # Every piece is ASCII (escaped by _ENC): str lengths are byte lengths, and each
            # split's lines are encoded once, joined.
            out_append[sp](f'{{"messages": {mj}, "record_id": {_ENC(rid)}{wt}{st}')
            split_append(sp)
            rd_append(rd)
            cd_append(cd)
            flag_append(fl)
            pos_append(i)
        except Reject as r:
            if raw_lines is None:
                raw_lines = chunk.split(b"\n")
            rejects.append((i, r.reason, reject_line(fname, base + i + 1, raw_lines[i],
                                                      r.reason, r.detail)))
    return (len(lines), ["".join(o).encode("ascii") for o in outs],
            [array("Q", accumulate(map(len, o))) for o in outs], bytes(split),
            b"".join(rds), b"".join(cds), bytes(flags), array("I", pos), rejects)


_SCAN = json.decoder.JSONDecoder().scan_once


# ---- main side: dedup, split, write -------------------------------------------------------


class Exporter:
    """Takes process_chunk results in input order; keeps the digest indexes and the files."""

    def __init__(self, tmp: Path, s: dict):
        # numpy here does vector lookups only: no BLAS thread pool (spinning threads, memory).
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        import numpy as np

        self.np = np
        self.t1, self.t2 = split_thresholds(s["ratios"])
        self.u1, self.u2 = np.uint64(self.t1), np.uint64(self.t2)
        self.writer = Writer()
        self.outs = {k: Out(tmp / f"{k}.jsonl", self.writer) for k in (*SPLITS, "rejects")}
        self.rids = DigestIndex(with_values=True)       # digest(record_id) -> digest(content)
        self.contents = DigestIndex(with_values=False)  # digest(content) of every kept record
        self.by_reason = dict.fromkeys(REASONS, 0)
        self.duplicates = 0
        self.derived = {"record_id": 0, "weight": 0, "source": 0}

    def _state(self, index: DigestIndex, keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(lookup state, repeated within the batch) per key, in batch order."""
        np = self.np
        order = np.argsort(keys[0])
        sk = [a[order] for a in keys]
        state = np.empty(len(order), np.int8)
        state[order] = index.lookup(sk)
        rep = np.empty(len(order), bool)
        rep[order] = adjacent_equal(sk[0])
        return state, rep

    def take(self, items: list[tuple]) -> None:
        """Dedup and write the results of consecutive chunks, as one batch (the index work
        is per batch, so fewer, larger batches cost less). items: (chunk, file name, line
        number before the chunk, process_chunk's result), in input order."""
        np = self.np
        results = [it[3] for it in items]
        counts = [len(r[7]) for r in results]
        rds = b"".join(r[4] for r in results)
        cds = b"".join(r[5] for r in results)
        conflicts: list[int] = []
        keep = split = None
        if rds:
            rk = as_u64(rds)
            ck = as_u64(cds)
            g_r, rep_r = self._state(self.rids, [*rk, *ck])
            g_c, rep_c = self._state(self.contents, list(ck))
            fast = (g_r == 0) & (g_c == 0) & ~rep_r & ~rep_c
            keep = fast.copy()
            new_r: dict[bytes, bytes] = {}
            new_c: set[bytes] = set()
            # Lines that share a record_id or content with anything seen: one by one, in order.
            for j in np.nonzero(~fast)[0].tolist():
                rd, cd = rds[16 * j:16 * j + 16], cds[16 * j:16 * j + 16]
                g = g_r[j]
                if g == 0:
                    prev = new_r.get(rd)
                    if prev is None:
                        new_r[rd] = cd
                    elif prev != cd:
                        g = 2
                if g == 2:
                    conflicts.append(j)
                elif g_c[j] or cd in new_c:
                    self.duplicates += 1
                else:
                    new_c.add(cd)
                    keep[j] = True
            # New keys: every fast line's, plus the first sightings among the others.
            new = [a[fast] for a in (*rk, *ck)]
            if new_r:
                more = [*as_u64(b"".join(new_r)), *as_u64(b"".join(new_r.values()))]
                new = [np.concatenate([a, b]) for a, b in zip(new, more, strict=True)]
            self.rids.add(new)
            new = [a[fast] for a in ck]
            if new_c:
                new = [np.concatenate([a, b]) for a, b in zip(new, as_u64(b"".join(new_c)), strict=True)]
            self.contents.add(new)
            split = np.frombuffer(b"".join(r[3] for r in results), np.uint8)
            fl = np.frombuffer(b"".join(r[6] for r in results), np.uint8)[keep]
            if fl.any():
                for bit, key in ((1, "record_id"), (2, "weight"), (4, "source")):
                    self.derived[key] += int(np.count_nonzero(fl & bit))
        off = 0
        for (chunk, fname, base, r), n in zip(items, counts, strict=True):
            _, blobs, ends, _, _, _, _, pos, rejects = r
            if n:
                kk_all, sp = keep[off:off + n], split[off:off + n]
                for k, name in enumerate(SPLITS):
                    kk = kk_all[sp == k]
                    if kk.all():  # nothing dropped: the worker's bytes as they are
                        self.outs[name].write(blobs[k], len(kk))
                    else:  # cut the dropped lines out: one slice per run of kept lines
                        e = np.frombuffer(ends[k], np.uint64)
                        blob, pieces, at = blobs[k], [], 0
                        for d in np.nonzero(~kk)[0].tolist():
                            pieces.append(blob[at:int(e[d - 1]) if d else 0])
                            at = int(e[d])
                        pieces.append(blob[at:])
                        self.outs[name].write(b"".join(pieces), int(kk.sum()))
            mine = [j - off for j in conflicts if off <= j < off + n]
            if mine:
                raw = chunk.split(b"\n")
                for j in mine:
                    i = pos[j]
                    rejects.append((i, "record_id_conflict", reject_line(
                        fname, base + i + 1, raw[i], "record_id_conflict",
                        "this record_id was seen earlier with different content; give one "
                        "of them its own record_id")))
                rejects.sort(key=lambda x: x[0])
            for _, reason, _ in rejects:
                self.by_reason[reason] += 1
            if rejects:
                self.outs["rejects"].write(b"".join(x[2] for x in rejects), len(rejects))
            off += n

    def close(self) -> dict:
        self.writer.close()
        return {f"{k}.jsonl": o.close() for k, o in self.outs.items()}

    def abort(self) -> None:
        try:
            self.writer.close()
        except BaseException:
            pass
        for o in self.outs.values():
            o.f.close()


def reader_thread(files: list[Path], limit: int, depth: int):
    """Read the files in a background thread (reading, gunzip and sha256 release the GIL):
    returns (queue, stop event). Items: ("chunk", fname, base, chunk), ("file", source
    entry), ("end",) or ("error", exception)."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        try:
            for path in files:
                fname = paths.rel(path)
                try:
                    reader, buf, raw_f, is_gz = open_corpus(path)
                except OSError as e:
                    raise fail(f"cannot read corpus file {fname}: {e}", "export-no-input") from e
                base = 0
                try:
                    for chunk in read_chunks(reader, limit):
                        if not put(("chunk", fname, base, chunk)):
                            return
                        base += chunk.count(b"\n") + 1
                    while buf.read(1 << 20):  # hash the whole file, also past a gzip stream's end
                        pass
                except (OSError, EOFError, zlib.error) as e:
                    raise fail(f"{fname}: cannot read past line {base}: {e}; re-create or "
                               "re-download the file (`gzip -t` checks a .gz)",
                               "export-no-input") from e
                finally:
                    reader.close()
                    buf.close()
                if not put(("file", {"path": fname, "sha256": raw_f.sha.hexdigest(),
                                     "bytes": raw_f.bytes, "lines": base, "gzip": is_gz})):
                    return
            put(("end",))
        except BaseException as e:
            put(("error", e))

    threading.Thread(target=run, name="export-reader", daemon=True).start()
    return q, stop


class Pool:
    """`--workers N`: N `bin/export.py --worker` processes, fed chunks round-robin and
    answering in submission order, so the output never depends on N. Two chunks in flight
    per worker (SLOTS): one is queued while this process takes the other's result. On
    Linux each worker shares a memfd with this process (one region per slot): the chunk
    and the output lines travel through it (a memcpy each way), and the pipes carry only small
    pickles (what went through a pipe cost more CPU than the shaping it fed); a chunk or
    result too big for it, or a system without memfd, goes through the pipes as pickled
    bytes. A worker reads until its stdin closes: when the exporter exits, or is killed,
    its workers end too.
    """

    IN_CAP = 2 << 20   # bytes of a chunk passed in shared memory (BLOCK is 512 KiB)
    OUT_CAP = 6 << 20  # bytes of output lines passed back in shared memory
    SLOTS = 2          # chunks in flight per worker, each with its own IN_CAP + OUT_CAP

    def __init__(self, n: int, s: dict):
        import mmap
        import pickle
        import subprocess

        self.pickle = pickle
        self.procs = []
        self.shm: list = []
        for _ in range(n):
            fd, mm = -1, None
            if hasattr(os, "memfd_create"):
                try:
                    fd = os.memfd_create("export.worker")
                    os.ftruncate(fd, self.SLOTS * (self.IN_CAP + self.OUT_CAP))
                    mm = mmap.mmap(fd, self.SLOTS * (self.IN_CAP + self.OUT_CAP))
                except OSError:
                    if fd >= 0:
                        os.close(fd)
                    fd, mm = -1, None
            try:
                p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     pass_fds=(fd,) if fd >= 0 else ())
            finally:
                if fd >= 0:
                    os.close(fd)  # the mapping (and the worker's copy) keep it alive
            if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: a chunk per pipe fill, fewer switches
                for f in (p.stdin, p.stdout):
                    try:
                        fcntl.fcntl(f.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
                    except OSError:
                        pass
            self.procs.append(p)
            self.shm.append(mm)
            self._send(p, (s, fd if mm is not None else -1, self.SLOTS, self.IN_CAP,
                           self.OUT_CAP))

    def _send(self, p, obj) -> None:
        self.pickle.dump(obj, p.stdin, protocol=self.pickle.HIGHEST_PROTOCOL)
        p.stdin.flush()

    def submit(self, k: int, slot: int, task: tuple) -> None:
        chunk, fname, base = task
        mm = self.shm[k]
        task = (chunk, fname, base, slot)
        if mm is not None and len(chunk) <= self.IN_CAP:
            at = slot * (self.IN_CAP + self.OUT_CAP)
            mm[at:at + len(chunk)] = chunk
            task = (len(chunk), fname, base, slot)
        try:
            self._send(self.procs[k], task)
        except OSError:  # a broken pipe: the worker is gone
            self._died(self.procs[k])

    def _died(self, p) -> None:
        raise fail(f"export worker {p.pid} died (exit {p.wait()}; -9 is usually the "
                   "out-of-memory killer): export again with fewer --workers",
                   "export-crashed") from None

    def result(self, k: int, slot: int) -> tuple:
        p = self.procs[k]
        try:
            kind, value = self.pickle.load(p.stdout)
        except EOFError:
            self._died(p)
        if kind == "error":
            raise fail(f"export worker {p.pid} failed (a bug: please report it with this "
                       f"traceback):\n{value}", "export-crashed")
        if kind == "shm":  # the output lines are in shared memory: sizes in place of bytes
            mm, blobs = self.shm[k], []
            at = slot * (self.IN_CAP + self.OUT_CAP) + self.IN_CAP
            for size in value[1]:
                blobs.append(mm[at:at + size])
                at += size
            value = (value[0], blobs, *value[2:])
        return value

    def close(self) -> None:
        for p in self.procs:  # EOF for a waiting worker, a broken pipe for a writing one
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except Exception:
                p.kill()
                p.wait()
        for mm in self.shm:
            if mm is not None:
                mm.close()


def worker_main() -> int:
    """The loop of one `bin/export.py --worker` process (see Pool)."""
    import mmap
    import pickle
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the exporter; it ends us
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        s, fd, slots, in_cap, out_cap = pickle.load(inp)
        init_worker(s)
        mm = None
        if fd >= 0:
            mm = mmap.mmap(fd, slots * (in_cap + out_cap))
            os.close(fd)
        while True:
            try:
                task = pickle.load(inp)
            except EOFError:
                return 0
            try:
                chunk, fname, base, slot = task
                start = slot * (in_cap + out_cap)
                if type(chunk) is int:  # the chunk is in shared memory
                    chunk = mm[start:start + chunk]
                r = process_chunk(chunk, fname, base)
                sizes = [len(b) for b in r[1]]
                if mm is not None and sum(sizes) <= out_cap:
                    at = start + in_cap
                    for b in r[1]:
                        mm[at:at + len(b)] = b
                        at += len(b)
                    answer = ("shm", (r[0], sizes, *r[2:]))
                else:
                    answer = ("ok", r)
            except Exception:
                answer = ("error", traceback.format_exc())
            pickle.dump(answer, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
    except (BrokenPipeError, EOFError):  # the exporter is gone
        return 1


def run_export(files: list[Path], tmp: Path, s: dict, workers: int = 1) -> dict:
    """Stream every line of `files` into tmp/{train,valid,test,rejects}.jsonl; return the facts.

    A reader thread reads the files in chunks of whole lines (hashing their bytes);
    `workers` processes (or this one) validate, shape and split each chunk's lines; this
    process takes the results in input order, deduplicates them as a batch (vectorized
    lookups; lines sharing a key with anything go one by one, in line order) and hands the
    bytes to a writer thread. Only the two digest indexes grow with the input; about
    2 x workers + TAKE_BATCH + 3 chunks are in memory at a time.
    """
    ex = Exporter(tmp, s)
    sources = []
    pool = None
    q, stop = reader_thread(files, line_limit(s), depth=2)
    try:
        if workers > 1:
            pool = Pool(workers, s)
            inflight: deque = deque()  # (worker, slot, chunk, fname, base), oldest first
        else:
            init_worker(s)
        i = 0
        batch: list[tuple] = []  # results waiting to be taken together

        def take_some(final: bool = False) -> None:
            if batch and (final or len(batch) >= TAKE_BATCH):
                ex.take(batch)
                batch.clear()

        while True:
            item = q.get()
            if item[0] == "chunk":
                _, fname, base, chunk = item
                if pool is None:
                    batch.append((chunk, fname, base, process_chunk(chunk, fname, base)))
                    take_some()
                    continue
                # Chunk i goes to worker i % N, slot (i // N) % 2: two in flight per worker,
                # so a worker has its next chunk queued while this process takes a result.
                k, slot = i % workers, (i // workers) % Pool.SLOTS
                if len(inflight) == Pool.SLOTS * workers:  # chunk i - 2N: same worker, slot
                    k0, slot0, *task = inflight.popleft()
                    batch.append((*task, pool.result(k0, slot0)))
                    take_some()
                pool.submit(k, slot, (chunk, fname, base))
                inflight.append((k, slot, chunk, fname, base))
                i += 1
            elif item[0] == "file":
                sources.append(item[1])
            elif item[0] == "error":
                raise item[1]
            else:
                break
        if pool is not None:
            while inflight:
                k0, slot0, *task = inflight.popleft()
                batch.append((*task, pool.result(k0, slot0)))
        take_some(final=True)
        files_meta = ex.close()
    except BaseException:
        ex.abort()
        raise
    finally:
        stop.set()
        if pool is not None:
            pool.close()

    c = {"input": sum(x["lines"] for x in sources), "rejected": sum(ex.by_reason.values()),
         "duplicates": ex.duplicates}
    for k in SPLITS:
        c[k] = files_meta[f"{k}.jsonl"]["records"]
    c["exported"] = c["train"] + c["valid"] + c["test"]
    return {"counts": c, "by_reason": ex.by_reason, "derived": ex.derived, "sources": sources,
            "files": files_meta, "t1": ex.t1, "t2": ex.t2}


def build_manifest(name: str, r: dict, s: dict) -> dict:
    c = r["counts"]
    split_files = {k: r["files"][k]["sha256"] for k in ("train.jsonl", "valid.jsonl", "test.jsonl")}
    return {
        "dataset": name,
        "format": "mlx-lm chat JSONL: {messages, record_id, weight, source} per line",
        "exporter": {"script": "bin/export.py", "version": EXPORTER_VERSION,
                     "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()},
        "counts": {k: c[k] for k in ("input", "exported", "rejected", "duplicates",
                                     "train", "valid", "test")},
        "rejects_by_reason": {k: v for k, v in r["by_reason"].items() if v},
        "derived": r["derived"],
        "files": r["files"],
        "dataset_sha256": digest_of(split_files),
        "dataset_sha256_rule": "sha256 of the lines '<sha256>  <name>\\n' of test.jsonl, "
                               "train.jsonl, valid.jsonl in that (sorted) order, i.e. "
                               "`sha256sum test.jsonl train.jsonl valid.jsonl | sha256sum`",
        "split": {
            "key": "record_id",
            "rule": "h = the first 16 hex digits of sha256(record_id as UTF-8); train if "
                    "h < train_below, else valid if h < valid_below, else test "
                    "(`printf %s \"$ID\" | sha256sum | cut -c1-16`)",
            "ratios": {k: float(v) for k, v in s["ratios"].items()},
            "train_below": f"{r['t1']:016x}",
            "valid_below": f"{r['t2']:016x}",
        },
        "dedup": "exact content: the first 16 bytes of sha256 of the record's messages JSON; "
                 "the first occurrence in (sorted file path, line) order is kept, later ones "
                 "are counted as duplicates; a record_id seen again with other content is "
                 "rejected (record_id_conflict)",
        "sources": r["sources"],
        "corpus_sha256": digest_of({x["path"]: x["sha256"] for x in r["sources"]}),
        "settings": {**s, "ratios": {k: float(v) for k, v in s["ratios"].items()}},
    }


def report(name: str, out: Path, r: dict, s: dict, wall: float, dataset_sha: str | None) -> None:
    c = r["counts"]
    event("export_sources", files=len(r["sources"]), bytes=sum(x["bytes"] for x in r["sources"]),
          gzip=sum(x["gzip"] for x in r["sources"]))
    event("export_counts", input=c["input"], exported=c["exported"], rejected=c["rejected"],
          duplicates=c["duplicates"], train=c["train"], valid=c["valid"], test=c["test"])
    ok1 = c["input"] == c["exported"] + c["rejected"] + c["duplicates"]
    ok2 = c["exported"] == c["train"] + c["valid"] + c["test"]
    print(f"accounting input {c['input']} = exported {c['exported']} + rejected {c['rejected']} "
          f"+ duplicates {c['duplicates']} {'ok' if ok1 else 'MISMATCH'}; exported "
          f"{c['exported']} = train {c['train']} + valid {c['valid']} + test {c['test']} "
          f"{'ok' if ok2 else 'MISMATCH'}", flush=True)
    ratios = "/".join(f"{float(s['ratios'][k]):g}" for k in SPLITS)
    event("export_split", rule="sha256(record_id)", ratios=ratios)
    rej = " ".join(f"{k} {v}" for k, v in r["by_reason"].items() if v) or "none"
    print(f"export_rejects {rej}", flush=True)
    d = r["derived"]
    event("export_derived", record_id=d["record_id"], weight=d["weight"], source=d["source"])
    if dataset_sha:
        event("export_done", dataset=name, out=paths.rel(out), dataset_sha256=dataset_sha,
              wall_s=round(wall, 2))


# ---- folder handling: one exporter per dataset, stale temp folders removed -----------------


def lock_dataset(out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    f = open(out.parent / f".{out.name}.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise fail(f"another export of {paths.rel(out)} is running: wait for it, or find it "
                   f"with `fuser {paths.rel(out.parent)}/.{out.name}.lock`",
                   "export-locked") from None
    return f


def clean_stale(out: Path) -> None:
    """Remove what a killed export left beside `out` (we hold the lock, so nobody owns it)."""
    tmp_re = re.compile(r"^\." + re.escape(out.name) + r"\.[A-Za-z0-9_]{8}\.tmp$")
    old_re = re.compile(r"^\." + re.escape(out.name) + r"\.old\.\d+$")
    for p in sorted(out.parent.iterdir()):
        if p.is_dir() and tmp_re.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
            event("export_cleanup", removed=paths.rel(p), why="left by an interrupted export")
        elif p.is_dir() and old_re.match(p.name):
            if not out.exists():  # killed between the two renames of the swap: put it back
                os.replace(p, out)
                event("export_cleanup", restored=paths.rel(out), source=paths.rel(p))
            else:
                shutil.rmtree(p, ignore_errors=True)
                event("export_cleanup", removed=paths.rel(p), why="previous dataset left aside")


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through atomic_dir, which removes its temp folder


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        return worker_main()
    args = build_parser().parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    t0 = time.monotonic()
    try:
        if args.dataset is not None:
            if not paths.is_safe_name(args.dataset):
                raise fail(f"DATASET {args.dataset!r} is not a safe folder name: use letters, "
                           "digits, '.', '_', '-'", "export-bad-settings")
            out = paths.DATASETS / args.dataset
        else:
            out = Path(args.out)
        s = resolve_settings(args)
        if args.workers < 1:
            raise fail(f"--workers {args.workers}: give 1 or more", "export-bad-settings")
        files = expand_corpus(args.corpus, out)
        lock = lock_dataset(out)
        try:
            clean_stale(out)
            failed_rejects = out.parent / f"{out.name}.failed-rejects.jsonl"
            with atomic.atomic_dir(out) as tmp:
                r = run_export(files, tmp, s, workers=args.workers)
                c = r["counts"]
                errors = []
                if c["input"] == 0:
                    errors.append(fail(f"the corpus has no lines ({', '.join(paths.rel(f) for f in files)})"
                                       ": pass the right CORPUS", "export-no-input"))
                limit = s["max_reject_ratio"] * c["input"]
                if c["input"] and c["rejected"] > limit:
                    os.replace(tmp / "rejects.jsonl", failed_rejects)
                    errors.append(fail(
                        f"{c['rejected']} of {c['input']} lines rejected, over the threshold "
                        f"{s['max_reject_ratio']:g} x input = {limit:g}; every rejected line "
                        f"(file, line, reason) is in {paths.rel(failed_rejects)}: fix the corpus, "
                        "remap fields (--field), or raise max_reject_ratio knowingly",
                        "export-too-many-rejects"))
                empty = [k for k in SPLITS if c[k] == 0]
                if c["exported"] and empty:
                    errors.append(fail(
                        f"split(s) {', '.join(empty)} would be empty with {c['exported']} "
                        f"exported records and ratios "
                        f"{'/'.join(f'{float(v):g}' for v in s['ratios'].values())}: add records "
                        "or raise those ratios", "export-empty-split"))
                elif c["input"] and not c["exported"]:
                    errors.append(fail("no record was exported: every line was rejected or a "
                                       "duplicate", "export-empty-split"))
                if errors:
                    report(out.name, out, r, s, time.monotonic() - t0, None)
                    for e in errors[:-1]:
                        die(e)
                    raise errors[-1]
                manifest = build_manifest(out.name, r, s)
                (tmp / "manifest.json").write_text(atomic.dumps_json(manifest), encoding="utf-8")
            failed_rejects.unlink(missing_ok=True)
        finally:
            lock.close()
    except RunbookError as e:
        return die(e)
    except KeyboardInterrupt:
        return die("interrupted: the previous dataset (if any) is unchanged", 130)
    report(out.name, out, r, s, time.monotonic() - t0, manifest["dataset_sha256"])
    print(f"wrote {paths.rel(out)}/{{train,valid,test}}.jsonl manifest.json rejects.jsonl",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
