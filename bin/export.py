#!/usr/bin/env python3
"""export: a corpus to mlx-lm chat JSONL with stable splits, provenance, rejects and a manifest.

    .venv/bin/python bin/export.py datasets/sample/corpus.jsonl --dataset sample --config configs/export.yaml

CORPUS: JSONL files (plain or gzip'd) or globs; a line is {"messages"}, {"prompt", "completion"|"response"},
{"instruction", "input", "output"} or {"text"}, plus optional "record_id", "weight", "source". Writes DIR
at once: train/valid/test.jsonl (`mlx_lm lora --data DIR`), rejects.jsonl, manifest.json. A
record's split follows its split_by field (source: a document's records stay together). The same
corpus and settings again change nothing; another corpus is refused unless --replace.
See RUNBOOK.md#export.
"""

import argparse
import fcntl
import glob
import gzip
import json
import os
import re
import shutil
import signal
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from hashlib import sha256
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.dataset import binding, describe, read_manifest  # noqa: E402
from lib.hashing import digest_of, sha256_file  # noqa: E402
from lib.log import DATA, RunbookError, die, event  # noqa: E402

EXPORTER_VERSION = "2.1.0"
SPLITS = ("train", "valid", "test")
FIELDS = ("messages", "prompt", "completion", "response", "instruction", "input", "output", "text",
          "record_id", "weight", "source", "role", "content")
REASONS = ("blank_line", "non_utf8", "invalid_json", "not_an_object", "missing_content", "empty_content",
           "non_string_content", "bad_messages", "role_order", "bad_weight", "bad_record_id", "bad_source",
           "record_id_conflict", "too_long")
DEFAULTS = {"fields": {}, "roles": {}, "ratios": {"train": 0.9, "valid": 0.05, "test": 0.05},
            "max_reject_ratio": 0.001, "max_chars": 50000, "text_system_prompt": "",
            "text_user_prompt": "Write a passage from the reference documentation.",
            "split_by": "source"}
# The settings that have a flag of their own, e.g. --max-chars, --split-by
FLAGS = {"ratios": str, "max_reject_ratio": float, "max_chars": int, "text_system_prompt": str,
         "text_user_prompt": str, "split_by": str}
BY_RECORD = "record"  # split_by's value for a split by record_id alone (exporter 2.0's only rule)
MISSING = object()
ENC = json.encoder.encode_basestring_ascii  # a string as json.dumps writes it (pure ASCII)
fail = partial(RunbookError, category=DATA)  # fail(message, anchor): the RUNBOOK heading names the fix


class Reject(Exception):
    """A line that is no record: (reason, detail)."""


# ---- settings: DEFAULTS, then the YAML config, then the command line ---------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", nargs="+", help="JSONL files (plain or gzip'd) or glob patterns")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--dataset", help="write datasets/NAME/")
    where.add_argument("--out", help="write this folder instead")
    p.add_argument("--config", help="YAML with the keys of configs/export.yaml")
    p.add_argument("--replace", action="store_true", help="replace a dataset of another corpus or settings")
    p.add_argument("--field", action="append", default=[], metavar="CANONICAL=NAME", help="e.g. text=body")
    p.add_argument("--role", action="append", default=[], metavar="FROM=TO", help="e.g. human=user")
    for key, kind in FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=kind, help=f"configs/export.yaml's {key}")
    return p


def resolve_settings(args) -> dict:
    """The settings, checked; the ratios normalised exactly."""
    s = json.loads(json.dumps(DEFAULTS))  # a deep copy
    if args.config:
        import yaml
        try:
            s.update(yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {})
        except (OSError, yaml.YAMLError, TypeError, ValueError) as e:
            raise fail(f"cannot read config {args.config} as a mapping: {e}", "export-bad-settings") from e
    for key, items in (("fields", args.field), ("roles", args.role)):
        for k, sep, v in (item.partition("=") for item in items):
            if not (sep and k and v and isinstance(s[key], dict)):
                raise fail(f"--{key[:-1]} {k}{sep}{v}: expected KEY=VALUE, e.g. text=body",
                           "export-bad-settings")
            s[key][k] = v
    s.update({k: v for k in FLAGS if (v := getattr(args, k)) is not None})
    if isinstance(s["ratios"], str):  # --ratios 0.9,0.05,0.05
        s["ratios"] = dict(zip(SPLITS, s["ratios"].split(","), strict=False))
    ratios = s["ratios"] if isinstance(s["ratios"], dict) and set(s["ratios"]) == set(SPLITS) else {}
    try:  # exact Fractions (so are the split bounds); PyYAML reads 1e-3 as a string
        r, mrr = {k: Fraction(str(ratios[k])) for k in SPLITS}, Fraction(str(s["max_reject_ratio"]))
    except (KeyError, ValueError, ZeroDivisionError):
        raise fail(f"settings ({args.config or 'command line'}): ratios (train, valid, test) and "
                   "max_reject_ratio must be numbers", "export-bad-settings") from None
    fields, roles, unknown = s["fields"], s["roles"], sorted(set(s) - set(DEFAULTS))
    odd = sorted(set(fields) - set(FIELDS)) if isinstance(fields, dict) else [repr(fields)]
    bad = [what for wrong, what in [
        (unknown, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})"),
        (odd, f"unknown canonical field(s) {', '.join(odd)} (known: {', '.join(FIELDS)})"),
        (not isinstance(roles, dict) or not set(roles.values()) <= {"system", "user", "assistant"},
         "roles must map corpus roles to system|user|assistant, e.g. {human: user, gpt: assistant}"),
        *[(r[k] <= 0, f"ratios.{k} must be > 0 (each split gets records)") for k in SPLITS],
        (not 0 <= mrr <= 1, "max_reject_ratio must be within 0..1"),
        (type(s["max_chars"]) is not int or s["max_chars"] <= 0, "max_chars must be a positive integer"),
        (not all(isinstance(s[k], str) for k in ("text_system_prompt", "text_user_prompt"))
         or not s["text_user_prompt"].strip(), "text prompts must be strings, text_user_prompt not empty"),
        (type(s["split_by"]) is not str or not s["split_by"].strip(),
         f"split_by must be a record field (e.g. source) or {BY_RECORD}"),
        (args.dataset is not None and not paths.is_safe_name(args.dataset),
         f"DATASET {args.dataset!r} is not a safe folder name: use letters, digits, '.', '_', '-'")] if wrong]
    if bad:
        raise fail(f"settings ({args.config or 'command line'}): {'; '.join(bad)}", "export-bad-settings")
    return {**s, "ratios": {k: r[k] / sum(r.values()) for k in SPLITS}, "max_reject_ratio": float(mrr)}


def as_json(s: dict) -> dict:  # the settings as the manifest records them (ratios as floats)
    return {**s, "ratios": {k: float(v) for k, v in s["ratios"].items()}}


def corpus_files(patterns: list[str], out: Path) -> list[dict]:
    """Per file (given or matched, sorted): path (repo-relative inside the repo), sha256, size, gzip'd."""
    found: dict[Path, Path] = {}
    for pat in patterns:
        matches = [Path(m) for m in glob.glob(pat, recursive=True)] if glob.has_magic(pat) else [Path(pat)]
        if not (files := [m for m in matches if m.is_file()]):
            why = ("is a folder: pass its files or a glob" if matches and matches[0].is_dir()
                   else "matches no file" if glob.has_magic(pat) else "not found")
            raise fail(f"corpus {pat!r} {why}: pass CORPUS=<files or glob>", "export-no-input")
        found.update({f.resolve(): f for f in files if f.resolve() not in found})
    if any(r.is_relative_to(out.resolve()) for r in found):
        raise fail(f"a corpus file is inside the output folder {out}: use another DATASET", "export-no-input")
    return [{"path": paths.rel(f), "sha256": sha256_file(f), "bytes": f.stat().st_size, "file": f}
            for f in sorted(found.values(), key=paths.rel)]


def lines(sources: list[dict], limit: int):
    """(path, line number, line) of each file (src["lines"], src["gzip"] noted); cut at limit + 1 bytes."""
    for src in sources:
        n = 0
        try:
            with open(src["file"], "rb") as raw:
                src["gzip"] = raw.peek(2)[:2] == b"\x1f\x8b"
                f = gzip.GzipFile(fileobj=raw) if src["gzip"] else raw
                while line := f.readline(limit + 1):
                    if line[-1:] != b"\n" and len(line) > limit:
                        while (rest := f.readline(1 << 20)) and rest[-1:] != b"\n":
                            pass
                    n += 1
                    yield src["path"], n, line.removesuffix(b"\n")
        except (OSError, EOFError, zlib.error) as e:
            raise fail(f"{src['path']}: cannot read past line {n}: {e}; re-create the file "
                       "(`gzip -t` checks a .gz)", "export-no-input") from e
        src["lines"] = n


def text(v, what: str) -> str:
    if v is None:
        raise Reject("missing_content", f"{what} is absent or null")
    if type(v) is not str:
        raise Reject("non_string_content", f"{what} is {type(v).__name__}, not a string")
    if not v or v.isspace():
        raise Reject("empty_content", f"{what} is empty or whitespace only")
    return v


class Shaper:
    """Corpus lines to output lines, with the settings' field names, roles, prompts and limits."""

    def __init__(self, s: dict):
        self.f = {k: k for k in FIELDS} | s["fields"]  # canonical name -> the corpus's own
        self.roles = {"system": "system", "user": "user", "assistant": "assistant"} | s["roles"]
        self.head = [("system", s["text_system_prompt"])] * bool(s["text_system_prompt"])
        self.head.append(("user", s["text_user_prompt"]))
        self.max_chars, self.limit = s["max_chars"], 8 * s["max_chars"] + (1 << 16)  # JSON: < 6 bytes a char
        by = s["split_by"]  # the canonical names read the corpus's own (--field source=origin)
        self.group_field = None if by == BY_RECORD else self.f.get(by, by)
        r = s["ratios"]  # split bounds on sha256(group)'s first 8 bytes: exact, from Fractions
        self.bounds = [min(int(x * 2**64), 2**64 - 1).to_bytes(8, "big") for x in (r["train"], 1 - r["test"])]

    def turns(self, obj: dict) -> list[tuple[str, str]]:
        """The (role, content) turns of a record, by the first shape it has (in the corpus's field names)."""
        f, get = self.f, obj.get
        if f["messages"] in obj:
            if (m := obj[f["messages"]]) is None:
                raise Reject("missing_content", f"{f['messages']} is null")
            if type(m) is not list or not all(type(x) is dict for x in m):
                raise Reject("bad_messages", f"{f['messages']} is not a list of objects")
            if not m:
                raise Reject("empty_content", f"{f['messages']} is an empty list")
            out = []
            for i, msg in enumerate(m):
                role = msg.get(f["role"])
                if type(role) is not str or role not in self.roles:
                    raise Reject("role_order", f"message {i} has role {role!r}, not system/user/assistant "
                                 "(map it with --role FROM=TO)")
                out.append((self.roles[role], text(msg.get(f["content"]), f"message {i} {f['content']}")))
            turns = [role for role, _ in out[int(out[0][0] == "system"):]]
            if not turns or turns != ["user", "assistant"] * (len(turns) // 2):
                raise Reject("role_order", f"roles {'/'.join(r for r, _ in out)}: want an optional system, "
                             "then user and assistant in turn, ending with assistant")
            return out
        if f["prompt"] in obj:
            reply = f["completion"] if f["completion"] in obj else f["response"]
            return [("user", text(obj[f["prompt"]], f["prompt"])), ("assistant", text(get(reply), reply))]
        if f["instruction"] in obj:
            user, inp = text(obj[f["instruction"]], f["instruction"]), get(f["input"])
            if inp is not None and type(inp) is not str:
                raise Reject("non_string_content", f"{f['input']} is {type(inp).__name__}, not a string")
            user += "\n\n" + inp if inp and not inp.isspace() else ""
            return [("user", user), ("assistant", text(get(f["output"]), f["output"]))]
        if f["text"] in obj:
            return [*self.head, ("assistant", text(obj[f["text"]], f["text"]))]
        raise Reject("missing_content", f"no {f['messages']}, {f['prompt']}, {f['instruction']} or "
                     f"{f['text']} field (remap names with --field)")

    def group_of(self, obj: dict) -> str | None:
        """The record's group, the split_by field's value; None when split by record or the
        field is absent, null or blank: the record is then its own group (its record_id picks its
        split)."""
        if self.group_field is None:
            return None
        value = obj.get(self.group_field)
        if value is None:
            return None
        if type(value) is not str:
            return json.dumps(value, sort_keys=True)  # an integer as str() writes it
        if not value.strip():
            return None
        return value

    def record(self, raw: bytes, lineno: int, fname: str) -> tuple:
        """(output line, split, record_id key, content key, the provenance fields derived, group
        key or None: its own group) or Reject."""
        if len(raw) > self.limit:
            raise Reject("too_long", f"line is over {self.limit} bytes (8 x max_chars + 64 KiB)")
        if not raw or raw.isspace():
            raise Reject("blank_line", "empty or whitespace-only line")
        try:  # a byte-order mark may start a file
            obj = json.loads((raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw).decode())
        except UnicodeDecodeError as e:  # a ValueError too
            raise Reject("non_utf8", f"byte {e.start}: {e.reason}") from None
        except ValueError as e:
            raise Reject("invalid_json", str(e)) from None
        if type(obj) is not dict:
            raise Reject("not_an_object", f"a JSON {type(obj).__name__}, not an object")
        turns, f = self.turns(obj), self.f
        if (n := sum([len(c) for _, c in turns])) > self.max_chars:
            raise Reject("too_long", f"content is {n} chars, over max_chars {self.max_chars}")
        if b"\\ud" in raw or b"\\uD" in raw:
            try:  # JSON may escape half a UTF-16 pair: such a string has no UTF-8 form
                json.dumps(obj, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise Reject("non_utf8",
                             "a lone UTF-16 surrogate escape (e.g. \\ud800): no UTF-8 form") from None
        rid, w, src = [obj.get(f[k], MISSING) for k in ("record_id", "weight", "source")]
        if rid is not MISSING and not (type(rid) is int or type(rid) is str and rid and not rid.isspace()):
            raise Reject("bad_record_id", f"record_id {rid!r} is not a non-empty string or an integer")
        if w is not MISSING and (type(w) not in (int, float) or not 0 <= w <= sys.float_info.max):
            raise Reject("bad_weight", f"weight {w!r} is not a non-negative finite number")
        if src is not MISSING and (type(src) is not str or not src or src.isspace()):
            raise Reject("bad_source", f"source {src!r} is not a non-empty string")
        mj = "[" + ", ".join([f'{{"role": "{r}", "content": {ENC(c)}}}' for r, c in turns]) + "]"
        cd = sha256(mj.encode()).digest()[:16]  # the content's key
        key = "content:" + cd.hex() if rid is MISSING else str(rid)
        rd = sha256(key.encode()).digest()[:16]  # the record_id's key
        weight = 1.0 if w is MISSING else float(w) + 0.0  # + 0.0: -0.0 is written 0.0
        line = (f'{{"messages": {mj}, "record_id": {ENC(key)}, "weight": {weight!r}, '
                f'"source": {ENC(fname if src is MISSING else src)}}}\n')
        derived = tuple(k for k, v in (("record_id", rid), ("weight", w), ("source", src)) if v is MISSING)
        group = self.group_of(obj)
        gd = sha256((key if group is None else group).encode()).digest()[:8]  # it picks the split
        split = 0 if gd < self.bounds[0] else 1 if gd < self.bounds[1] else 2
        group_key = None if group is None else int.from_bytes(gd, "big")
        rid_key, content_key = int.from_bytes(rd, "big"), int.from_bytes(cd, "big")
        return line.encode(), split, rid_key, content_key, derived, group_key


@dataclass
class Groups:
    """The groups each split got: the split_by values seen, and the records alone in theirs."""

    values: list[set] = field(default_factory=lambda: [set() for _ in SPLITS])
    alone: list[int] = field(default_factory=lambda: [0 for _ in SPLITS])

    def add(self, split: int, group: int | None) -> None:
        if group is None:
            self.alone[split] += 1
        else:
            self.values[split].add(group)

    def counts(self) -> dict:
        return {k: len(self.values[i]) + self.alone[i] for i, k in enumerate(SPLITS)}


def split_section(s: dict, bounds: list[bytes], groups: Groups) -> dict:
    """The manifest's `split`: how records were assigned, and the groups each split got."""
    by = s["split_by"]
    without = 0 if by == BY_RECORD else sum(groups.alone)
    return {"split_by": by, "key": "record_id" if by == BY_RECORD else by,
            "ratios": {k: float(v) for k, v in s["ratios"].items()},
            "train_below": bounds[0].hex(), "valid_below": bounds[1].hex(),
            "groups": groups.counts(), "records_without_field": without}


# ---- the export: first duplicate wins, every line accounted for ---------------------------------
def run_export(name: str, sources: list[dict], tmp: Path, s: dict) -> dict:
    """Every line, in input order, into tmp/{train,valid,test,rejects}.jsonl; returns the manifest."""
    outs = {k: open(tmp / f"{k}.jsonl", "wb") for k in (*SPLITS, "rejects")}
    rids, contents, by_reason = {}, set(), dict.fromkeys(REASONS, 0)
    c = dict.fromkeys(("input", "exported", "rejected", "duplicates", *SPLITS), 0)
    derived, shaper = Counter(dict.fromkeys(("record_id", "weight", "source"), 0)), Shaper(s)
    groups = Groups()
    try:
        for fname, n, raw in lines(sources, shaper.limit):
            try:
                line, split, rid, content, absent, group = shaper.record(raw, n, fname)
                if rids.setdefault(rid, content) != content:
                    raise Reject("record_id_conflict", "this record_id was seen earlier with other messages")
            except Reject as e:
                reason, detail = e.args
                by_reason[reason] += 1
                rej = {"file": fname, "line": n, "reason": reason, "detail": detail, "raw_bytes": len(raw),
                       "raw": raw[:500].decode("utf-8", "backslashreplace"),
                       "see": f"RUNBOOK.md#reject-{reason}"}
                outs["rejects"].write(json.dumps(rej, ensure_ascii=False).encode(errors="backslashreplace")
                                      + b"\n")
                continue
            if content in contents:
                c["duplicates"] += 1
                continue
            contents.add(content)
            c[SPLITS[split]] += 1
            groups.add(split, group)
            outs[SPLITS[split]].write(line)
            derived.update(absent)
    finally:
        for f in outs.values():
            f.close()
    c.update(input=sum(x["lines"] for x in sources), rejected=sum(by_reason.values()),
             exported=c["train"] + c["valid"] + c["test"])
    files = {f"{k}.jsonl": {"sha256": sha256_file(f.name), "bytes": os.path.getsize(f.name),
                            "records": c.get(k, c["rejected"])} for k, f in outs.items()}
    return {"dataset": name, "derived": derived, "files": files,
        "settings": as_json(s), "exporter": {
            "script": "bin/export.py", "version": EXPORTER_VERSION, "script_sha256": sha256_file(__file__)},
        "counts": c, "rejects_by_reason": {k: v for k, v in by_reason.items() if v},
        "dataset_sha256": digest_of({f"{k}.jsonl": files[f"{k}.jsonl"]["sha256"] for k in SPLITS}),
        "split": split_section(s, shaper.bounds, groups),
        "sources": [{k: x[k] for k in ("path", "sha256", "bytes", "lines", "gzip")} for x in sources],
        "corpus_sha256": digest_of({x["path"]: x["sha256"] for x in sources})}


def why_export(out: Path, args, sources: list[dict], s: dict) -> str | None:
    """Why this export runs; None (said) when `out` is this export already; another corpus's: refused."""
    if not out.exists() or not any(out.iterdir()) or args.replace:
        return "replace" if out.exists() else "new"
    fix = "the same command with REPLACE=1 (--replace), or another DATASET"
    try:
        m = read_manifest(out)
    except RunbookError as e:
        raise fail(f"{paths.rel(out)} exists and is no export ({e.args[0]}); to replace it on purpose: {fix}",
                   "export-dataset-bound") from None
    want, have = binding({"sources": sources, "settings": as_json(s)}), binding(m)
    if have != want:
        differ = ["corpus files"] * (have["files"] != want["files"]) + [
            k for k in DEFAULTS if have["settings"].get(k) != want["settings"].get(k)]
        raise fail(f"{paths.rel(out)} is bound to another corpus or settings ({', '.join(differ)} differ): "
                   f"it holds {describe(m)}; this export is of {describe({'sources': sources})}. "
                   f"To replace it on purpose: {fix}", "export-dataset-bound")
    if m.get("exporter", {}).get("version") != EXPORTER_VERSION:
        return "another exporter version"
    if bad := [n for n, f in m["files"].items()
               if not (out / n).is_file() or sha256_file(out / n) != f["sha256"]]:
        return f"damaged {', '.join(bad)}"
    event("export_unchanged", dataset=paths.rel(out), corpus_sha256=m["corpus_sha256"][:12],
          dataset_sha256=m["dataset_sha256"], why="the same corpus and settings: nothing written")


def lock_and_clean(out: Path):
    """Lock `out`; remove killed exports' temp folders (or put back a dataset a killed swap moved aside)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = open(out.parent / f".{out.name}.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise fail(f"another export of {paths.rel(out)} is running: wait for it", "export-locked") from None
    ours = re.compile(rf"\.{re.escape(out.name)}\.([0-9a-f]{{8}}\.tmp|old\.\d+)").fullmatch  # atomic_dir's
    for p in sorted(p for p in out.parent.iterdir() if ours(p.name) and p.is_dir()):
        if p.name.endswith(".tmp") or out.exists():
            shutil.rmtree(p, ignore_errors=True)
            event("export_cleanup", removed=paths.rel(p), why="left by an interrupted export")
        else:
            os.replace(p, out)
            event("export_cleanup", restored=paths.rel(out), source=paths.rel(p))
    return lock


def empty_split(empty: list[str], c: dict, sp: dict) -> str:
    """Why a split would be empty: the groups and records each split got, and the fix."""
    by, groups = sp["split_by"], sp["groups"]
    got = ", ".join(f"{k} {groups[k]} / {c[k]}" for k in SPLITS)
    fix = "add records or raise those ratios (--ratios)"
    if by != BY_RECORD:
        fix = (f"add documents (records of more {by} values), change the ratios (--ratios), or "
               f"split by record (--split-by {BY_RECORD}; test then shares documents with train)")
    return (f"split(s) {', '.join(empty)} would be empty: {c['exported']} exported records in "
            f"{sum(groups.values())} group(s) by {by} (groups / records: {got}): {fix}")


def export(out: Path, sources: list[dict], s: dict) -> dict:
    """Export into a temp folder beside `out`, report, and swap it in (or fail, `out` as it was)."""
    failed = out.parent / f"{out.name}.failed-rejects.jsonl"
    with atomic.atomic_dir(out) as tmp:
        m = run_export(out.name, sources, tmp, s)
        c, limit = m["counts"], s["max_reject_ratio"] * m["counts"]["input"]
        sp = m["split"]
        if c["input"] == 0:
            raise fail(f"the corpus has no lines ({', '.join(x['path'] for x in sources)}): pass the right "
                       "CORPUS", "export-no-input")
        event("export_counts", **c)
        ok = ["ok" if c[total] == sum(c[k] for k in parts) else "MISMATCH" for total, parts in (
            ("input", ("exported", "rejected", "duplicates")), ("exported", SPLITS))]
        print(f"accounting input {c['input']} = exported {c['exported']} + rejected {c['rejected']} + "
              f"duplicates {c['duplicates']} {ok[0]}; exported {c['exported']} = train {c['train']} + valid "
              f"{c['valid']} + test {c['test']} {ok[1]}", flush=True)
        groups = {f"groups_{k}": n for k, n in sp["groups"].items()}
        event("export_split", split_by=s["split_by"], **groups,
              records_without_field=sp["records_without_field"])
        event("export_rejects", **m["rejects_by_reason"], total=c["rejected"])
        event("export_derived", **m["derived"])
        if c["rejected"] > limit:
            os.replace(tmp / "rejects.jsonl", failed)
            raise fail(f"{c['rejected']} of {c['input']} lines rejected, over the threshold "
                       f"{s['max_reject_ratio']:g} x input; each (file, line, reason) is in "
                       f"{paths.rel(failed)}: fix the corpus, remap fields (--field), or raise "
                       "max_reject_ratio knowingly", "export-too-many-rejects")
        if empty := [k for k in SPLITS if not c[k]]:
            raise fail(empty_split(empty, c, sp), "export-empty-split")
        (tmp / "manifest.json").write_text(atomic.dumps_json(m), encoding="utf-8")
    failed.unlink(missing_ok=True)
    return m


def main() -> int:
    args, t0 = build_parser().parse_args(), time.monotonic()
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # unwinds: the temp folder goes
    try:
        out, s = paths.DATASETS / args.dataset if args.dataset else Path(args.out), resolve_settings(args)
        sources = corpus_files(args.corpus, out)
        with lock_and_clean(out):
            if (why := why_export(out, args, sources, s)) is None:
                return 0
            m = export(out, sources, s)
    except RunbookError as e:
        return die(e)
    except KeyboardInterrupt:
        return die("interrupted: the previous dataset (if any) is unchanged", 130)
    event("export_done", dataset=out.name, out=paths.rel(out), dataset_sha256=m["dataset_sha256"],
          why=why, wall_s=round(time.monotonic() - t0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
