"""export (issues #4, #13, #15): bin/export.py and `make export`, through the operator's entry points.

Covers every reject reason, the accounting identity, the input shapes and the text-to-chat
rule, remaps, gzip and globs, derived record ids, stable splits under additions, documents kept
whole across splits (split_by, issue #39), first-wins dedup, determinism (also across argument
order and globs), atomicity (threshold failure, empty split, SIGTERM and SIGKILL mid-export), a
dataset bound to its corpus and settings (refused, replaced on purpose, a no-op when the same),
and mlx-lm reading and training on the output unchanged.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, make, run

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

MODEL = ROOT / "models" / "tiny-gemma4"
REASONS = ["blank_line", "non_utf8", "invalid_json", "not_an_object", "missing_content",
           "empty_content", "non_string_content", "bad_messages", "role_order", "bad_weight",
           "bad_record_id", "bad_source", "record_id_conflict", "too_long"]
SPLIT_FILES = ("train.jsonl", "valid.jsonl", "test.jsonl")


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


exp = load_module("bin_export", ROOT / "bin" / "export.py")
bench = load_module("bench_export", ROOT / "bench" / "bench_export.py")


# ---- helpers ----------------------------------------------------------------------------------
def good(i: int, **kw) -> dict:
    """A record of its own document (split_by source groups it alone)."""
    r = {"record_id": f"r{i:05d}", "weight": 1.0, "source": f"doc{i:05d}",
         "prompt": f"question {i}?", "response": f"answer number {i}."}
    r.update(kw)
    return r


def write(path: Path, items, compress: bool = False) -> Path:
    """One line per item: dicts as JSON, str/bytes as given (raw lines)."""
    lines = []
    for it in items:
        if isinstance(it, dict):
            it = json.dumps(it)
        lines.append(it if isinstance(it, bytes) else it.encode())
    data = b"\n".join(lines) + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return path


def export(*corpus, out: Path, args=(), check=True, replace=False):
    return run([PY, "bin/export.py", *map(str, corpus), "--out", str(out), *(["--replace"] if replace else []),
                *map(str, args)], check=check)


def records(out: Path, split: str | None = None) -> list[dict]:
    names = [f"{split}.jsonl"] if split else SPLIT_FILES
    return [json.loads(line) for n in names for line in (out / n).read_text().splitlines()]


def rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def split_of(out: Path) -> dict[str, str]:
    """record_id -> the split it landed in."""
    return {r["record_id"]: s for s in ("train", "valid", "test") for r in records(out, s)}


def split_by_rule(key: str, split: dict) -> str:
    """The documented rule, recomputed: sha256(key)'s first 16 hex digits against the bounds."""
    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    return "train" if h < split["train_below"] else "valid" if h < split["valid_below"] else "test"


def tree_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def verify_intact(out: Path) -> dict:
    """The dataset's files match its manifest byte for byte."""
    m = manifest(out)
    for name, meta in m["files"].items():
        data = (out / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], name
        assert len(data) == meta["bytes"], name
    return m


GOOD = [good(i) for i in range(200)]


# ---- shapes and the text-to-chat rule ----------------------------------------------------------
def test_every_input_shape_becomes_chat_with_provenance(tmp_path):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]
    items = GOOD + [
        {"record_id": "m", "weight": 2, "source": "s1", "messages": msgs},
        {"record_id": "pc", "prompt": "P1", "completion": "C1"},
        {"record_id": "pr", "prompt": "P2", "response": "R2", "weight": 0},
        {"record_id": "ii", "instruction": "Sum", "input": "1 2", "output": "3"},
        {"record_id": "io", "instruction": "Say hi", "output": "hi", "input": ""},
        {"record_id": "t", "text": "Plain café text.", "source": "s2"},
    ]
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "ds"
    p = export(corpus, out=out)
    by_id = {r["record_id"]: r for r in records(out)}
    assert by_id["m"] == {"messages": msgs, "record_id": "m", "weight": 2.0, "source": "s1"}
    u, a = "user", "assistant"
    assert by_id["pc"]["messages"] == [{"role": u, "content": "P1"}, {"role": a, "content": "C1"}]
    assert by_id["pr"]["messages"] == [{"role": u, "content": "P2"}, {"role": a, "content": "R2"}]
    assert by_id["pr"]["weight"] == 0.0
    assert by_id["ii"]["messages"] == [{"role": u, "content": "Sum\n\n1 2"}, {"role": a, "content": "3"}]
    assert by_id["io"]["messages"] == [{"role": u, "content": "Say hi"}, {"role": a, "content": "hi"}]
    # the text-to-chat rule with the defaults: no system turn, the fixed user prompt
    assert by_id["t"]["messages"] == [
        {"role": u, "content": exp.DEFAULTS["text_user_prompt"]},
        {"role": a, "content": "Plain café text."}]
    # absent weight -> 1.0, absent source -> the corpus file; both counted
    assert by_id["pc"]["weight"] == 1.0 and by_id["pc"]["source"] == str(corpus)
    assert manifest(out)["derived"] == {"record_id": 0, "weight": 4, "source": 4}
    assert "export_derived record_id 0 weight 4 source 4" in p.stdout
    # every line is the canonical, pure-ASCII JSON of its record, keys in the contract's order
    for name in SPLIT_FILES:
        for line in (out / name).read_bytes().decode("ascii").splitlines():
            r = json.loads(line)
            assert list(r) == ["messages", "record_id", "weight", "source"]
            assert line == json.dumps(r, separators=(", ", ": "))


def test_text_to_chat_prompts_come_from_config_and_command_line(tmp_path):
    corpus = write(tmp_path / "c.jsonl", GOOD + [{"record_id": "t", "text": "Body."}])
    cfg = tmp_path / "export.yaml"
    cfg.write_text('text_system_prompt: "You are a Python expert."\ntext_user_prompt: "Recite."\n')
    out = tmp_path / "a"
    export(corpus, out=out, args=["--config", cfg])
    t = next(r for r in records(out) if r["record_id"] == "t")
    assert t["messages"] == [{"role": "system", "content": "You are a Python expert."},
                             {"role": "user", "content": "Recite."},
                             {"role": "assistant", "content": "Body."}]
    out = tmp_path / "b"  # the command line wins over the config
    export(corpus, out=out, args=["--config", cfg, "--text-user-prompt", "Go on.",
                                  "--text-system-prompt", ""])
    t = next(r for r in records(out) if r["record_id"] == "t")
    assert [m["content"] for m in t["messages"]] == ["Go on.", "Body."]
    assert manifest(out)["settings"]["text_user_prompt"] == "Go on."


def test_field_and_role_remaps(tmp_path):
    items = [{"id": f"x{i}", "body": f"text {i}", "origin": f"o{i // 2}", "w": 0.5}
             for i in range(150)]
    items += [{"id": "sg", "conversations": [{"from": "human", "value": "q"},
                                             {"from": "gpt", "value": "a"}]}]
    corpus = write(tmp_path / "c.jsonl", items)
    cfg = tmp_path / "export.yaml"
    cfg.write_text("fields: {text: body, record_id: id, messages: conversations}\n"
                   "roles: {human: user}\n")
    out = tmp_path / "ds"
    export(corpus, out=out, args=["--config", cfg, "--field", "source=origin", "--field", "weight=w",
                                  "--field", "role=from", "--field", "content=value",
                                  "--role", "gpt=assistant"])
    by_id = {r["record_id"]: r for r in records(out)}
    assert len(by_id) == 151 and by_id["x7"]["source"] == "o3" and by_id["x7"]["weight"] == 0.5
    assert by_id["x7"]["messages"][-1] == {"role": "assistant", "content": "text 7"}
    assert by_id["sg"]["messages"] == [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a"}]
    assert manifest(out)["settings"]["fields"]["text"] == "body"
    # split_by source reads the remapped field: each origin's two records in one split
    where = {}
    for rid, split in split_of(out).items():
        where.setdefault(by_id[rid]["source"], set()).add(split)
    assert all(len(splits) == 1 for splits in where.values()), where
    assert manifest(out)["split"]["groups"]["train"] < manifest(out)["counts"]["train"]


# ---- rejects -----------------------------------------------------------------------------------
BAD = {
    "blank_line": ["", "   \t"],
    "non_utf8": [b'{"record_id": "u1", "text": "caf\xe9"}',
                 '{"record_id": "u2", "text": "half a pair \\ud800 here"}'],
    "invalid_json": ['{"record_id": "j1", "text": ', '{"text": "a"} trailing', "{'text': 'x'}"],
    "not_an_object": ["[1, 2]", '"just a string"', "42"],
    "missing_content": [{"record_id": "m1", "weight": 1}, {"prompt": "q only"},
                        {"messages": None}, {"text": None}, {"instruction": "i"}],
    "empty_content": [{"text": ""}, {"text": "  \n "}, {"messages": []},
                      {"prompt": "", "response": "a"}],
    "non_string_content": [{"text": 5}, {"instruction": "i", "input": 3, "output": "o"},
                           {"messages": [{"role": "user", "content": ["parts"]},
                                         {"role": "assistant", "content": "b"}]}],
    "bad_messages": [{"messages": "hi"}, {"messages": ["hi"]}],
    "role_order": [{"messages": [{"role": "user", "content": "no answer"}]},
                   {"messages": [{"role": "assistant", "content": "a"},
                                 {"role": "user", "content": "u"}]},
                   {"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "u"},
                                 {"role": "assistant", "content": "a"}]},
                   {"messages": [{"role": "bot", "content": "u"}, {"role": "assistant", "content": "a"}]},
                   {"messages": [{"content": "u"}, {"role": "assistant", "content": "a"}]},
                   {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                                 {"role": "system", "content": "late"}]}],
    "bad_weight": ['{"record_id": "w1", "text": "t1", "weight": -1}',
                   '{"record_id": "w2", "text": "t2", "weight": NaN}',
                   '{"record_id": "w3", "text": "t3", "weight": 1e400}',
                   '{"record_id": "w4", "text": "t4", "weight": "1.0"}',
                   '{"record_id": "w5", "text": "t5", "weight": true}',
                   '{"record_id": "w6", "text": "t6", "weight": null}'],
    "bad_record_id": [{"record_id": "", "text": "a"}, {"record_id": 1.5, "text": "b"},
                      {"record_id": None, "text": "c"}, {"record_id": True, "text": "d"},
                      {"record_id": ["x"], "text": "e"}],
    "bad_source": [{"text": "s1", "source": ""}, {"text": "s2", "source": 5}],
    # r00003 and r00004 exist among the good lines with other content
    "record_id_conflict": [good(3, response="different"), good(4, prompt="other")],
    "too_long": [{"record_id": "L1", "text": "x" * 1200},
                 '{"record_id": "L2", "text": "' + "y" * 80000 + '"}'],
}


def test_reject_reasons_cover_the_issue_list():
    assert sorted(BAD) == sorted(REASONS) == sorted(exp.REASONS)


@pytest.mark.parametrize("reason", REASONS)
def test_each_reject_reason(tmp_path, reason):
    bad = BAD[reason]
    items, where = list(GOOD), []
    for k, line in enumerate(bad):  # spread the bad lines among the good ones
        at = 20 + 30 * k
        items.insert(at, line)
        where.append(at + 1)
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "ds"
    p = export(corpus, out=out, args=["--max-reject-ratio", "1", "--max-chars", "1000"])
    rj = rejects(out)
    assert [r["reason"] for r in rj] == [reason] * len(bad), rj
    assert [r["line"] for r in rj] == where
    for r, line in zip(rj, bad, strict=True):
        assert r["file"] == str(corpus)
        assert r["see"] == f"RUNBOOK.md#reject-{reason}" and r["detail"]
        raw = line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode()
        assert r["raw_bytes"] == min(len(raw), 8 * 1000 + 65536 + 1)  # a line over the line limit is read cut
        # rejects.jsonl keeps the first 500 bytes of a rejected line
        assert r["raw"] == raw[:500].decode("utf-8", "backslashreplace")
    m = manifest(out)
    assert m["counts"]["rejected"] == len(bad) and m["rejects_by_reason"] == {reason: len(bad)}
    assert m["counts"]["exported"] == len(GOOD) and m["counts"]["input"] == len(items)
    assert f"export_rejects {reason} {len(bad)}" in p.stdout


def test_accounting_identity_with_every_kind_of_bad_line(tmp_path):
    items = list(GOOD)
    for k, line in enumerate(x for lines in BAD.values() for x in lines):
        items.insert(5 + 4 * k, line)
    items += [good(7), good(8, record_id="dup-of-8"), good(9)]  # 3 exact duplicates
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "ds"
    p = export(corpus, out=out, args=["--max-reject-ratio", "1", "--max-chars", "1000"])
    c = manifest(out)["counts"]
    assert sorted(c) == sorted(["input", "exported", "rejected", "duplicates", "train", "valid", "test"])
    n_bad = sum(len(v) for v in BAD.values())
    assert c["input"] == len(items) and c["rejected"] == n_bad and c["duplicates"] == 3
    assert c["input"] == c["exported"] + c["rejected"] + c["duplicates"]
    assert c["exported"] == c["train"] + c["valid"] + c["test"] == len(GOOD)
    assert manifest(out)["rejects_by_reason"] == {k: len(v) for k, v in BAD.items()}
    assert (f"accounting input {c['input']} = exported {c['exported']} + rejected {c['rejected']} "
            f"+ duplicates 3 ok; exported {c['exported']} = train {c['train']} + valid "
            f"{c['valid']} + test {c['test']} ok") in p.stdout
    assert len(rejects(out)) == n_bad
    assert [r["line"] for r in rejects(out)] == sorted(r["line"] for r in rejects(out))


def test_over_long_line_is_skipped_with_bounded_memory_and_lines_stay_counted(tmp_path):
    big = '{"record_id": "huge", "text": "' + "z" * 3_000_000 + '"}'
    items = GOOD[:100] + [big] + GOOD[100:]
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "ds"
    export(corpus, out=out, args=["--max-reject-ratio", "1", "--max-chars", "100"])
    (r,) = rejects(out)
    assert r["reason"] == "too_long" and r["line"] == 101 and r["raw_bytes"] == 8 * 100 + 65536 + 1
    assert manifest(out)["counts"]["exported"] == 200


# ---- failures leave the previous dataset in place ----------------------------------------------
def test_too_many_rejects_fails_and_keeps_the_previous_dataset(tmp_path):
    out = tmp_path / "ds"
    export(write(tmp_path / "good.jsonl", GOOD), out=out)
    before = tree_bytes(out)
    items = GOOD + ["not json"]  # 1 of 201 lines = 0.5% > 0.1%
    p = export(write(tmp_path / "bad.jsonl", items), out=out, check=False, replace=True)
    assert p.returncode == 1
    assert "1 of 201 lines rejected, over the threshold 0.001" in p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#export-too-many-rejects")
    assert "[export format or path consistency]" in p.stderr
    assert "export_rejects invalid_json 1" in p.stdout  # the report still prints
    assert tree_bytes(out) == before
    failed = tmp_path / "ds.failed-rejects.jsonl"
    assert json.loads(failed.read_text())["line"] == 201
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".ds.") and x.is_dir()]
    # a generous threshold lets it through, and the stale failed-rejects file goes
    export(tmp_path / "bad.jsonl", out=out, args=["--max-reject-ratio", "0.01"], replace=True)
    assert manifest(out)["counts"]["rejected"] == 1 and not failed.exists()


def test_empty_split_fails_and_keeps_the_previous_dataset(tmp_path):
    out = tmp_path / "ds"
    export(write(tmp_path / "good.jsonl", GOOD), out=out)
    before = tree_bytes(out)
    p = export(write(tmp_path / "tiny.jsonl", GOOD[:3]), out=out, check=False, replace=True)
    assert p.returncode == 1 and "would be empty" in p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#export-empty-split")
    assert tree_bytes(out) == before


def test_bad_settings_and_inputs_name_the_fix(tmp_path):
    corpus = write(tmp_path / "c.jsonl", GOOD)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("ratio: {train: 1}\n")
    cases = [
        (["--config", cfg], "unknown key(s) ratio", "export-bad-settings"),
        (["--ratios", "0.9,0.1,0"], "ratios.test must be > 0", "export-bad-settings"),
        (["--field", "txt=body"], "unknown canonical field(s) txt", "export-bad-settings"),
        (["--role", "gpt=bot"], "roles must map corpus roles", "export-bad-settings"),
        (["--split-by", " "], "split_by must be a record field (e.g. source) or record",
         "export-bad-settings"),
    ]
    for args, text, anchor in cases:
        p = export(corpus, out=tmp_path / "ds", args=args, check=False)
        assert p.returncode == 1 and text in p.stderr, p.stderr
        assert p.stderr.rstrip().endswith(f"see RUNBOOK.md#{anchor}")
    for missing, text in [(tmp_path / "nope.jsonl", "not found"),
                          (str(tmp_path / "*.nothing"), "matches no file"),
                          (tmp_path, "is a folder")]:
        p = export(missing, out=tmp_path / "ds", check=False)
        assert p.returncode == 1 and text in p.stderr
        assert p.stderr.rstrip().endswith("see RUNBOOK.md#export-no-input")
    p = export(write(tmp_path / "empty.jsonl", []), out=tmp_path / "ds", check=False)
    assert p.returncode == 1
    assert not (tmp_path / "ds").exists()
    (tmp_path / "zero.jsonl").write_bytes(b"")  # no line at all: the fix is the corpus, not the ratios
    p = export(tmp_path / "zero.jsonl", out=tmp_path / "ds", check=False)
    assert p.returncode == 1 and "the corpus has no lines" in p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#export-no-input") and not (tmp_path / "ds").exists()


def test_sigterm_mid_export_removes_the_temp_folder(tmp_path, big_corpus):
    out = tmp_path / "ds"
    export(write(tmp_path / "good.jsonl", GOOD), out=out)
    before = tree_bytes(out)
    proc = start_export(big_corpus, out)
    wait_for_partial_output(out, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    assert tree_bytes(out) == before
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".ds.") and x.is_dir()]


def test_sigkill_mid_export_leaves_the_old_dataset_loadable(tmp_path, big_corpus, tokenizer):
    from types import SimpleNamespace

    from mlx_lm.tuner.datasets import load_local_dataset

    out = tmp_path / "ds"
    export(write(tmp_path / "good.jsonl", GOOD), out=out)
    before = tree_bytes(out)
    proc = start_export(big_corpus, out)
    wait_for_partial_output(out, proc)
    proc.kill()
    proc.wait(timeout=30)
    assert tree_bytes(out) == before
    verify_intact(out)
    train, valid, test = load_local_dataset(out, tokenizer, SimpleNamespace())
    assert len(train) + len(valid) + len(test) == len(GOOD)
    tokens, _ = train.process(train[0])
    assert len(tokens) > 5
    # the next export clears what the killed one left behind
    stale = [x for x in tmp_path.iterdir() if x.name.startswith(".ds.") and x.name.endswith(".tmp")]
    assert stale
    other = tmp_path / ".ds.old.v2.0123abcd.tmp"  # an export of dataset "ds.old.v2" in flight: not ours
    other.mkdir()
    p = export(tmp_path / "good.jsonl", out=out)  # the same corpus: nothing to export, but the cleanup runs
    assert "export_cleanup removed" in p.stdout and not any(x.exists() for x in stale) and other.is_dir()
    assert "export_unchanged" in p.stdout and tree_bytes(out) == before


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """~60 MB: the export takes a few seconds, long enough to be interrupted mid-way."""
    path = tmp_path_factory.mktemp("big") / "corpus.jsonl"
    bench.generate(path, 120_000)
    return path


def start_export(corpus: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, "bin/export.py", str(corpus), "--out", str(out), "--replace"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_partial_output(out: Path, proc: subprocess.Popen) -> None:
    """Until the export has written part of its new train.jsonl in its temp folder."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the export finished before it could be interrupted"
        for tmp in out.parent.glob(f".{out.name}.*.tmp"):
            t = tmp / "train.jsonl"
            if t.exists() and t.stat().st_size > 1 << 20:
                return
        time.sleep(0.05)
    raise AssertionError("the export wrote nothing within 60 s")


# ---- splits, dedup, determinism ----------------------------------------------------------------
def documents(n_docs: int, first: int = 0, seed: int = 0) -> list[dict]:
    """Records of n_docs documents (source doc-NNNN), 1 to 30 records each, interleaved."""
    rng = random.Random(seed)
    out = []
    for d in range(first, first + n_docs):
        out += [good(d * 100 + k, source=f"doc-{d:04d}") for k in range(rng.randint(1, 30))]
    rng.shuffle(out)
    return out


def test_split_by_source_keeps_each_document_in_one_split(tmp_path):
    """#39: the default splits documents, not records: no source is in two splits. A record
    without a source is its own group (split by its record_id) and counted, in the manifest."""
    loose = [{"record_id": f"loose-{i}", "text": f"no source {i}"} for i in range(40)]
    items = documents(80) + loose
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "ds"
    p = export(corpus, out=out)
    where = split_of(out)
    by_source = {}
    for it in items:
        by_source.setdefault(it.get("source"), set()).add(where[it["record_id"]])
    loose_splits = by_source.pop(None)
    assert len(by_source) == 80 and all(len(s) == 1 for s in by_source.values()), by_source
    assert len(loose_splits) == 3  # 40 records alone, by record_id: they spread
    # The rule, recomputed: a document's split is sha256(source)'s, a loose record's its id's
    m = manifest(out)
    sp = m["split"]
    for src, splits in by_source.items():
        assert splits == {split_by_rule(src, sp)}, src
    for it in loose:
        assert where[it["record_id"]] == split_by_rule(it["record_id"], sp)
    # The manifest: split_by, and each split's groups (documents + loose records), counted here
    groups = {k: 0 for k in ("train", "valid", "test")}
    for splits in by_source.values():
        groups[next(iter(splits))] += 1
    for it in loose:
        groups[where[it["record_id"]]] += 1
    assert sp["split_by"] == "source" and sp["key"] == "source"
    assert m["settings"]["split_by"] == "source"
    assert sp["groups"] == groups and sp["records_without_field"] == 40
    assert all(n > 0 for n in groups.values()) and sum(groups.values()) == 120
    line = (f"export_split split_by source groups_train {groups['train']} groups_valid "
            f"{groups['valid']} groups_test {groups['test']} records_without_field 40")
    assert line in p.stdout, p.stdout


def test_split_by_record_keeps_the_record_id_rule(tmp_path):
    """split_by: record is exporter 2.0's split: sha256(record_id) alone, so a document's records
    spread over the splits; stable when records are added."""
    rng = random.Random(1)
    old = [good(i, source="one-document") for i in range(3000)]
    out1, out2 = tmp_path / "v1", tmp_path / "v2"
    export(write(tmp_path / "v1.jsonl", old), out=out1, args=["--split-by", "record"])
    grown = list(old)
    for i in range(300):  # 10% new records, anywhere in the file
        grown.insert(rng.randrange(len(grown) + 1), good(10_000 + i, source="one-document"))
    export(write(tmp_path / "v2.jsonl", grown), out=out2, args=["--split-by", "record"])
    where1, where2 = split_of(out1), split_of(out2)
    moved = [k for k in where1 if where1[k] != where2[k]]
    assert len(where1) == 3000 and len(where2) == 3300 and moved == []
    c = manifest(out1)["counts"]
    assert 0.87 < c["train"] / 3000 < 0.93 and c["valid"] > 100 and c["test"] > 100
    # the documented rule, recomputed here: sha256(record_id)'s first 16 hex digits
    split = manifest(out2)["split"]
    assert all(s == split_by_rule(rid, split) for rid, s in where2.items())
    assert split["split_by"] == "record" and split["key"] == "record_id"
    assert split["groups"] == {k: manifest(out2)["counts"][k] for k in ("train", "valid", "test")}
    assert split["records_without_field"] == 0


def test_a_split_with_no_document_is_refused_with_the_numbers_and_the_fix(tmp_path):
    """One document cannot fill three splits: refused, naming groups and records per split and the
    fixes; nothing written. split_by record exports the same corpus."""
    corpus = write(tmp_path / "c.jsonl", [good(i, source="the-manual") for i in range(300)])
    out = tmp_path / "ds"
    p = export(corpus, out=out, check=False)
    assert p.returncode == 1 and not out.exists()
    err = p.stderr
    bounds = {"train_below": "e666666666666666", "valid_below": "f333333333333333"}  # 90/5/5
    home = split_by_rule("the-manual", bounds)
    per_split = [f"{k} 1 / 300" if k == home else f"{k} 0 / 0" for k in ("train", "valid", "test")]
    got = ", ".join(per_split)
    assert "would be empty: 300 exported records in 1 group(s) by source" in err, err
    assert f"(groups / records: {got})" in err, err
    assert "add documents" in err and "--ratios" in err and "--split-by record" in err
    assert err.rstrip().endswith("see RUNBOOK.md#export-empty-split")
    export(corpus, out=out, args=["--split-by", "record"])
    assert manifest(out)["counts"]["exported"] == 300


def test_split_by_another_field_groups_its_values(tmp_path):
    """split_by names any record field: a value is a group (5 and "5" alike, as for record_id); a
    record whose field is absent, null or blank is its own group."""
    items = [good(i, doc=i % 40) for i in range(200)]
    items += [good(200 + i, doc=str(i)) for i in range(40)]
    items += [good(300, doc=None), good(301, doc="  "), good(302)]
    out = tmp_path / "ds"
    export(write(tmp_path / "c.jsonl", items), out=out, args=["--split-by", "doc"])
    where = split_of(out)
    by_doc = {}
    for it in items[:240]:
        by_doc.setdefault(str(it["doc"]), set()).add(where[it["record_id"]])
    assert len(by_doc) == 40 and all(len(s) == 1 for s in by_doc.values()), by_doc
    sp = manifest(out)["split"]
    assert (sp["split_by"], sp["key"], sp["records_without_field"]) == ("doc", "doc", 3)
    assert sum(sp["groups"].values()) == 43
    for it in items[240:]:
        assert where[it["record_id"]] == split_by_rule(it["record_id"], sp)


def test_split_by_source_is_stable_when_documents_and_records_are_added(tmp_path):
    """#39: adding records (of new documents, and of old ones) anywhere in the corpus moves no old
    record; an old document's new records join it."""
    rng = random.Random(2)
    old = documents(120)
    out1, out2 = tmp_path / "v1", tmp_path / "v2"
    export(write(tmp_path / "v1.jsonl", old), out=out1)
    grown = list(old)
    added = documents(30, first=120, seed=3)
    added += [good(900_000 + k, source=f"doc-{k:04d}") for k in range(40)]  # of old documents
    for it in added:
        grown.insert(rng.randrange(len(grown) + 1), it)
    export(write(tmp_path / "v2.jsonl", grown), out=out2)
    where1, where2 = split_of(out1), split_of(out2)
    assert len(where2) == len(where1) + len(added)
    assert [k for k in where1 if where1[k] != where2[k]] == []
    doc_split = {it["source"]: where1[it["record_id"]] for it in old}
    for it in added[-40:]:
        assert where2[it["record_id"]] == doc_split[it["source"]]


def test_duplicates_are_kept_once_first_in_sorted_file_order(tmp_path):
    a = write(tmp_path / "a.jsonl", GOOD[:100] + [good(900, prompt="shared", response="same")])
    b = write(tmp_path / "b.jsonl.gz", GOOD[100:] + [good(901, prompt="shared", response="same"),
                                                     good(5, source="elsewhere")], compress=True)
    out = tmp_path / "ds"
    export(b, a, out=out)  # argument order does not matter: files are read sorted
    recs = records(out)
    shared = [r for r in recs if r["messages"][0]["content"] == "shared"]
    assert [r["record_id"] for r in shared] == ["r00900"]  # a.jsonl's copy wins
    c = manifest(out)["counts"]
    assert c["duplicates"] == 2 and c["exported"] == 201  # r00901 and the re-sourced r00005
    ids = [r["record_id"] for r in recs]
    assert len(ids) == len(set(ids))
    contents = [json.dumps(r["messages"]) for r in recs]
    assert len(contents) == len(set(contents))  # never in two splits


def test_two_exports_are_byte_identical_across_argument_order_and_globs(tmp_path):
    items = [x for x in GOOD] + [{"text": f"derived {i}"} for i in range(50)] + ["bad"]
    items += [good(3)]  # a duplicate
    a = write(tmp_path / "in" / "a.jsonl", items[:120])
    b = write(tmp_path / "in" / "b.jsonl", items[120:])
    args = ["--max-reject-ratio", "0.01"]
    outs = [tmp_path / "x" / "ds", tmp_path / "y" / "ds", tmp_path / "z" / "ds"]
    export(a, b, out=outs[0], args=args)
    export(b, a, out=outs[1], args=args)
    export(str(tmp_path / "in" / "*.jsonl"), out=outs[2], args=args)
    first = tree_bytes(outs[0])
    assert set(first) == {"train.jsonl", "valid.jsonl", "test.jsonl", "manifest.json", "rejects.jsonl"}
    for o in outs[1:]:
        assert tree_bytes(o) == first
    m = verify_intact(outs[0])
    assert m["derived"]["record_id"] == 50
    derived = [r for r in records(outs[0]) if r["record_id"].startswith("content:")]
    assert len(derived) == 50
    assert "export_derived record_id 50" in export(a, b, out=tmp_path / "w" / "ds", args=args).stdout
    # dataset_sha256: sha256 over the sorted "<sha256>  <name>" lines of the three split files
    lines = "".join(f"{m['files'][n]['sha256']}  {n}\n" for n in sorted(SPLIT_FILES))
    assert m["dataset_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert [s["path"] for s in m["sources"]] == [str(a), str(b)]
    assert m["sources"][0]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    assert m["exporter"]["version"] == exp.EXPORTER_VERSION
    assert "timestamp" not in json.dumps(m) and "time" not in m


def test_gzip_and_glob_inputs_give_the_same_records(tmp_path):
    plain = write(tmp_path / "p" / "c.jsonl", GOOD)
    write(tmp_path / "g" / "part1.jsonl.gz", GOOD[:90], compress=True)
    write(tmp_path / "g" / "part2.jsonl", GOOD[90:])
    export(plain, out=tmp_path / "o1")
    export(str(tmp_path / "g" / "part*"), out=tmp_path / "o2")
    assert records(tmp_path / "o1") == records(tmp_path / "o2")
    m = manifest(tmp_path / "o2")
    assert [s["gzip"] for s in m["sources"]] == [True, False]
    gz = tmp_path / "g" / "part1.jsonl.gz"
    assert m["sources"][0]["sha256"] == hashlib.sha256(gz.read_bytes()).hexdigest()
    assert m["sources"][0]["lines"] == 90


def test_corrupt_gzip_names_the_file(tmp_path):
    gz = write(tmp_path / "c.jsonl.gz", GOOD, compress=True)
    gz.write_bytes(gz.read_bytes()[:-40])
    p = export(gz, out=tmp_path / "ds", check=False)
    assert p.returncode == 1 and str(gz) in p.stderr and "gzip -t" in p.stderr
    assert not (tmp_path / "ds").exists()


# ---- dedup and conflicts equal a plain sequential reading ----------------------------------------
def test_dedup_equals_sequential_semantics(tmp_path):
    """Heavy record_id and content reuse: the first of each wins."""
    rng = random.Random(7)
    items = [good(rng.randrange(60), prompt=f"q{rng.randrange(40)}", response="a") for _ in range(900)]
    corpus = write(tmp_path / "c.jsonl", items)
    out = tmp_path / "out"
    out.mkdir()
    s = exp.resolve_settings(exp.build_parser().parse_args([str(corpus), "--out", str(out)]))
    r = exp.run_export("out", exp.corpus_files([str(corpus)], out), out, s)
    seen_r, seen_c, kept, dups, conflicts = {}, set(), [], 0, []
    for n, it in enumerate(items, 1):
        content = it["prompt"]
        if seen_r.get(it["record_id"], content) != content:
            conflicts.append(n)
            continue
        seen_r.setdefault(it["record_id"], content)
        if content in seen_c:
            dups += 1
        else:
            seen_c.add(content)
            kept.append(it["record_id"])
    got = [json.loads(x)["record_id"] for n in SPLIT_FILES for x in (out / n).read_text().splitlines()]
    assert sorted(got) == sorted(kept) and r["counts"]["duplicates"] == dups
    assert [x["line"] for x in rejects(out)] == conflicts
    assert {x["reason"] for x in rejects(out)} == {"record_id_conflict"}
    assert r["counts"]["input"] == len(items)


# ---- mlx-lm reads and trains on the output unchanged -------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    if not (MODEL / "config.json").is_file():
        make("tiny-model", "ARCH=gemma4")
    return load_tokenizer(MODEL)


@pytest.mark.slow
def test_mlx_lm_loads_and_trains_on_the_export(tmp_path, tokenizer):
    from types import SimpleNamespace

    from mlx_lm.tuner.datasets import ChatDataset, load_local_dataset

    corpus = tmp_path / "corpus.jsonl"
    run([PY, "demo/make_sample_corpus.py", "--out", str(corpus)])
    out = tmp_path / "ds"
    export(corpus, out=out)
    train, valid, test = load_local_dataset(out, tokenizer, SimpleNamespace())
    c = manifest(out)["counts"]
    assert (len(train), len(valid), len(test)) == (c["train"], c["valid"], c["test"])
    assert all(isinstance(d, ChatDataset) for d in (train, valid, test))
    for d in (train, valid, test):
        tokens, offset = d.process(d[0])
        assert len(tokens) > 10 and offset == 0
    masked = load_local_dataset(out, tokenizer, SimpleNamespace(mask_prompt=True))[0]
    tokens, offset = masked.process(masked[0])
    assert 0 < offset < len(tokens)
    p = run([PY, "-m", "mlx_lm", "lora", "--model", str(MODEL), "--train", "--data", str(out),
             "--iters", "3", "--num-layers", "2", "--batch-size", "2", "--val-batches", "2",
             "--steps-per-eval", "3", "--max-seq-length", "256",
             "--adapter-path", str(tmp_path / "adapters")], timeout=300)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout)  # mlx-lm's table: iter, loss, tokens
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"(?m)^\s*(\d+)\s+([0-9.]+) [▼▲]", plain)}
    vals = {int(m[1]): float(m[2]) for m in re.finditer(r"(?m)^\s*(\d+)\s+val\s+([0-9.]+)", plain)}
    assert 3 in losses and 3 in vals and all(map(math.isfinite, [*losses.values(), *vals.values()])), plain
    assert (tmp_path / "adapters" / "adapters.safetensors").is_file()


# ---- a dataset is bound to its corpus and settings (issue #13) ----------------------------------
def test_manifest_records_the_corpus_files_their_sha256_and_the_settings(tmp_path):
    a = write(tmp_path / "in" / "a.jsonl", GOOD[:120])
    b = write(tmp_path / "in" / "b.jsonl.gz", GOOD[120:], compress=True)
    out = tmp_path / "ds"
    export(str(tmp_path / "in" / "*.jsonl*"), out=out, args=["--max-chars", "900", "--field", "text=body"])
    m = manifest(out)
    assert [(x["path"], x["sha256"]) for x in m["sources"]] == [
        (str(f), hashlib.sha256(f.read_bytes()).hexdigest()) for f in (a, b)]
    assert m["corpus_sha256"] == hashlib.sha256("".join(
        f"{x['sha256']}  {x['path']}\n" for x in sorted(m["sources"], key=lambda x: x["path"])).encode()).hexdigest()
    assert m["settings"]["max_chars"] == 900 and m["settings"]["fields"] == {"text": "body"}
    assert m["settings"]["ratios"] == {"train": 0.9, "valid": 0.05, "test": 0.05}
    assert sorted(m["settings"]) == sorted(exp.DEFAULTS)


def test_another_corpus_or_settings_is_refused_and_the_dataset_left_as_it_is(tmp_path):
    out = tmp_path / "ds"
    first = write(tmp_path / "first.jsonl", GOOD)
    export(first, out=out)
    before, c = tree_bytes(out), manifest(out)["counts"]
    other = write(tmp_path / "other.jsonl", GOOD[:150] + [good(900)])
    for corpus, args, differ in [(other, [], "corpus files"), (first, ["--ratios", "0.8,0.1,0.1"], "ratios"),
                                 (first, ["--text-user-prompt", "Go."], "text_user_prompt"),
                                 (first, ["--split-by", "record"], "split_by")]:
        p = export(corpus, out=out, args=args, check=False)
        assert p.returncode == 1, p.stdout
        err = p.stderr
        assert f"is bound to another corpus or settings ({differ} differ)" in err, err
        assert f"it holds {first} (corpus_sha256 {manifest(out)['corpus_sha256'][:12]})" in err
        assert f"train {c['train']} / valid {c['valid']} / test {c['test']} records" in err
        assert "--replace" in err and err.rstrip().endswith("see RUNBOOK.md#export-dataset-bound")
        assert tree_bytes(out) == before
    first.write_bytes(first.read_bytes() + json.dumps(good(901)).encode() + b"\n")  # same path, other bytes
    p = export(first, out=out, check=False)
    assert p.returncode == 1 and "(corpus files differ)" in p.stderr and tree_bytes(out) == before
    p = export(other, out=out, replace=True)  # on purpose
    assert "export_done" in p.stdout and manifest(out)["sources"][0]["path"] == str(other)
    assert manifest(out)["counts"]["exported"] == 151


def test_a_dataset_of_exporter_2_0_was_split_by_record(tmp_path):
    """A manifest without split_by (exporter 2.0) is bound to split_by record: the new default is
    another setting (refused unless --replace); --split-by record re-exports the same bytes."""
    out = tmp_path / "ds"
    corpus = write(tmp_path / "c.jsonl", GOOD)
    export(corpus, out=out, args=["--split-by", "record"])
    m = manifest(out)
    del m["settings"]["split_by"]
    m["split"] = {k: m["split"][k] for k in ("key", "ratios", "train_below", "valid_below")}
    m["exporter"]["version"] = "2.0.0"
    (out / "manifest.json").write_text(json.dumps(m))
    p = export(corpus, out=out, check=False)
    assert p.returncode == 1 and "(split_by differ)" in p.stderr, p.stderr
    before = {n: (out / n).read_bytes() for n in SPLIT_FILES}
    p = export(corpus, out=out, args=["--split-by", "record"])
    assert "why another exporter version" in p.stdout
    assert {n: (out / n).read_bytes() for n in SPLIT_FILES} == before


def test_the_same_corpus_and_settings_again_change_nothing(tmp_path):
    out = tmp_path / "ds"
    corpus = write(tmp_path / "c.jsonl", GOOD)
    export(corpus, out=out, args=["--max-chars", "900"])
    before = tree_bytes(out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    p = export(corpus, out=out, args=["--max-chars", "900", "--max-reject-ratio", "0.5"])  # no output change
    assert "export_unchanged" in p.stdout and "nothing written" in p.stdout and "export_done" not in p.stdout
    assert tree_bytes(out) == before and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    (out / "valid.jsonl").write_text("damaged\n")  # a damaged copy of the same export is exported again
    p = export(corpus, out=out, args=["--max-chars", "900"])
    assert "export_done" in p.stdout and "damaged valid.jsonl" in p.stdout and tree_bytes(out) == before


def test_a_folder_that_is_no_export_is_refused(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    p = export(write(tmp_path / "c.jsonl", GOOD), out=out, check=False)
    assert p.returncode == 1 and "exists and is no export" in p.stderr and "manifest.json" in p.stderr
    assert (out / "notes.txt").read_text() == "mine"


def test_make_export_refuses_another_corpus_unless_replace(tmp_path):
    name = f"pytest-export-{os.getpid()}"
    ds = ROOT / "datasets" / name
    c1 = write(tmp_path / "one.jsonl", GOOD)
    write(tmp_path / "more" / "a.jsonl", GOOD[:100])
    write(tmp_path / "more" / "b.jsonl.gz", GOOD[100:] + [good(500)], compress=True)
    glob_corpus = str(tmp_path / "more" / "*")
    try:
        n = make("-n", "export", f"CORPUS={c1}", f"DATASET={name}").stdout
        assert f"bin/export.py {c1} --dataset {name} --config configs/export.yaml" in n and "--replace" not in n
        assert "--replace" in make("-n", "export", f"CORPUS={c1}", f"DATASET={name}", "REPLACE=1").stdout
        p = make("export", f"CORPUS={c1}", f"DATASET={name}")
        assert "export_done" in p.stdout and verify_intact(ds)["counts"]["exported"] == 200
        before = tree_bytes(ds)
        p = make("export", f"CORPUS={c1}", f"DATASET={name}")  # the same again: nothing written
        assert "export_done" not in p.stdout and tree_bytes(ds) == before
        p = make("export", f"CORPUS={glob_corpus}", f"DATASET={name}", check=False)  # another corpus
        assert p.returncode != 0 and "is bound to another corpus" in p.stderr and "REPLACE=1" in p.stderr
        assert tree_bytes(ds) == before
        p = make("export", f"CORPUS={glob_corpus}", f"DATASET={name}", "REPLACE=1")
        assert "export_done" in p.stdout and manifest(ds)["counts"]["exported"] == 201
        p = make("export", f"CORPUS={glob_corpus}", f"DATASET={name}", "EXPORT_ARGS=--ratios 1,1,1", "REPLACE=1")
        assert manifest(ds)["split"]["train_below"] == "5555555555555555"
    finally:
        import shutil

        shutil.rmtree(ds, ignore_errors=True)
        for leftover in (ROOT / "datasets").glob(f".{name}*"):
            leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover, ignore_errors=True)


def test_every_anchor_the_exporter_names_is_a_runbook_heading():
    slugs = set()
    for line in (ROOT / "RUNBOOK.md").read_text().splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:  # GitHub's rule: lower case, punctuation but - and _ dropped, spaces to -
            slugs.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    src = (ROOT / "bin" / "export.py").read_text()
    named = set(re.findall(r'"(export-[a-z-]+)"\)', src)) | {f"reject-{r}" for r in exp.REASONS}
    assert len(named) > len(exp.REASONS) + 3
    assert named - slugs == set()
    assert "export" in slugs


def test_nothing_in_export_branches_on_the_platform():
    """macOS has no memfd and no /proc: the one code path is the standard library's."""
    src = (ROOT / "bin" / "export.py").read_text()
    assert not re.search(r"sys\.platform|platform\.|memfd|hasattr\(os|/proc|F_SETPIPE_SZ|darwin", src)
