"""The sample corpus: real pydoc prose in the corpus input format, deterministic, atomic."""

from __future__ import annotations

import json
import math
import platform
import re
from collections import Counter

import pytest
from conftest import PY, make, run

from lib.hashing import sha256_file

RID = re.compile(r"^pydoc-([a-z0-9-]+)-(\d{4})$")


def write(out, *extra, check=True):
    return run([PY, "demo/make_sample_corpus.py", "--out", str(out), *extra], check=check)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    p = write(out)
    assert p.stdout.startswith("sample-corpus records "), p.stdout
    return out


@pytest.fixture(scope="module")
def records(corpus):
    raw = corpus.read_bytes()
    assert raw.endswith(b"\n") and b"\r" not in raw
    return [json.loads(line) for line in raw.decode("utf-8").split("\n")[:-1]]


def test_size_and_shapes(records):
    assert 2000 <= len(records) <= 5000
    shapes = Counter("text" if "text" in r else "prompt/response" for r in records)
    assert shapes["text"] >= 0.2 * len(records) and shapes["prompt/response"] >= 0.2 * len(records)
    for r in records:
        keys = set(r)
        assert keys in ({"record_id", "weight", "source", "text"},
                        {"record_id", "weight", "source", "prompt", "response"}), r
        for k in keys - {"weight"}:
            assert isinstance(r[k], str) and r[k].strip(), r
        assert len(r.get("text") or r["response"]) <= 1500, r["record_id"]


def test_record_ids_sources_weights(records):
    version = platform.python_version()
    ids = [r["record_id"] for r in records]
    assert len(set(ids)) == len(ids)
    for r in records:
        m = RID.match(r["record_id"])
        assert m, r["record_id"]
        assert r["source"] == f"cpython-{version}/pydoc_data.topics/{m.group(1)}"
        w = r["weight"]
        assert type(w) is float and math.isfinite(w) and w >= 0
    assert {r["weight"] for r in records} == {0.5, 1.0}


def test_content_is_real_reference_prose(records):
    by_id = {r["record_id"]: r for r in records}
    first = by_id["pydoc-assert-0001"]
    assert (first.get("text") or first["response"]).startswith("Assert statements are a convenient way")
    bodies = [r.get("text") or r["response"] for r in records]
    assert len(set(bodies)) == len(bodies)  # sections pydoc repeats under several topics: once
    assert sum("\n" in b for b in bodies) > 50  # code kept verbatim under the prose that introduces it
    assert not any(re.match(r"^[*=~^-]{3,}$", line) for b in bodies for line in b.split("\n"))
    assert all(r["prompt"].endswith((".", "?")) for r in records if "prompt" in r)


def test_deterministic(corpus, tmp_path):
    write(tmp_path / "again.jsonl")
    assert sha256_file(tmp_path / "again.jsonl") == sha256_file(corpus)


def test_bad_argument_leaves_old_file(tmp_path):
    out = tmp_path / "corpus.jsonl"
    out.write_text("old\n")
    p = write(out, "--max-chars", "10", check=False)
    assert p.returncode != 0 and "see RUNBOOK.md#generated-inputs" in p.stderr
    assert out.read_text() == "old\n"
    assert [x.name for x in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_too_few_records_fails_without_writing(tmp_path):
    out = tmp_path / "corpus.jsonl"
    p = write(out, "--min-records", "100000", check=False)
    assert p.returncode != 0 and "records came out" in p.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_make_target_runs_the_script():
    p = make("-n", "-B", "sample-corpus")
    assert "demo/make_sample_corpus.py --out datasets/sample/corpus.jsonl" in p.stdout
