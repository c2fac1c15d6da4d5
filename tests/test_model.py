"""`make model` / bin/model.py offline, against a Hugging Face cache built here from tiny models.

The cache has huggingface_hub's own layout (models--org--name/{refs,snapshots,blobs}, files
linked to blobs named by sha256 for LFS files and by git blob sha1 for the rest), so the real
snapshot_download and resolve_revision find it with HF_HUB_OFFLINE=1; a dead proxy makes any
network access fail instead of passing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import PY, make, run

from lib.hashing import sha256_file

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

REPO = "thunder-test/tiny-gemma4-released"
C1, C2 = "1" * 40, "2" * 40  # two commits: main moves from C1 to C2 in one test


def hub_cache(cache: Path, repo: str, model: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """Put a model folder into the cache as repo@commit, with refs pointing at it."""
    d = cache / ("models--" + repo.replace("/", "--"))
    for f in sorted(model.iterdir()):
        if f.name == "provenance.json":  # the generator's record, not part of a Hub repo
            continue
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"
        blob = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (d / "blobs").mkdir(parents=True, exist_ok=True)
        (d / "blobs" / blob).write_bytes(data)
        link = d / "snapshots" / commit / f.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("..", "..", "blobs", blob))
    for ref in refs:
        (d / "refs").mkdir(parents=True, exist_ok=True)
        (d / "refs" / ref).write_text(commit)
    return d / "snapshots" / commit


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(env, {commit: snapshot}): C1 (seed 0) on main and tag v1.0; C2 (seed 1) not on any ref yet."""
    tmp = tmp_path_factory.mktemp("hub")
    snaps = {}
    for commit, seed in ((C1, 0), (C2, 1)):
        out = tmp / f"src-{seed}"
        run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--layout", "released", "--seed", str(seed),
             "--out", str(out)])
        snaps[commit] = hub_cache(tmp / "hf" / "hub", REPO, out, commit, ("main", "v1.0") if seed == 0 else ())
    env = dict(os.environ, HF_HOME=str(tmp / "hf"), HF_HUB_CACHE=str(tmp / "hf" / "hub"), HF_HUB_OFFLINE="1",
               HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    return env, snaps


def fetch(hub, out, *extra, check=True):
    return run([PY, "bin/model.py", "--repo", REPO, "--out", str(out), *extra], env=hub[0], check=check)


def folder_hashes(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(d.iterdir())}


def test_make_model_fetches_offline_with_complete_provenance(hub, tmp_path):
    out = tmp_path / "models" / "gemma"
    p = make("model", f"HF_REPO={REPO}", "REVISION=v1.0", f"MODEL={out}", env=hub[0])
    assert f"model status fetched repo {REPO} revision v1.0 commit {C1}" in p.stdout, p.stdout
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["repo"], prov["revision"], prov["commit"]) == (REPO, "v1.0", C1)
    assert prov["quantization"] is None and prov["repo_quantization"] is None
    # the snapshot's chat template, as it renders: the tiny model's launch variant (an empty thought channel)
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert prov["chat_template"] == {"sha256": hashlib.sha256(template.encode()).hexdigest(),
                                     "has_thinking": True, "variant": "launch"}
    assert re.search(r'chat_template {"sha256": "[0-9a-f]{64}", "has_thinking": true, "variant": "launch"}',
                     p.stdout), p.stdout
    assert prov["tools"] == {"mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
                             "huggingface_hub": version("huggingface_hub")}
    files = {k: v for k, v in folder_hashes(out).items() if k != "provenance.json"}
    assert prov["files"] == files
    # the bytes are the snapshot's (read through the cache's links), every file of it
    assert files == {f.name: sha256_file(f) for f in hub[1][C1].iterdir()}
    assert not [x for x in out.parent.iterdir() if x.name.startswith(".")]  # no temp sibling left

    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok = load(str(out))
    logits = model(mx.array([tok.encode("What is a list?")]))
    assert logits.shape[-1] == 3072 and mx.all(mx.isfinite(logits)).item()


def test_rerun_is_a_no_op_that_says_so(hub, tmp_path):
    out = tmp_path / "m"
    fetch(hub, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    p = fetch(hub, out, "--revision", "v1.0")  # another name of the same commit
    assert p.stdout.startswith(f"model status unchanged repo {REPO} revision v1.0 commit {C1}"), p.stdout
    assert "nothing to do" in p.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_a_differing_folder_is_refused_and_left_intact_until_replace(hub, tmp_path):
    env, snaps = hub
    out = tmp_path / "m"
    fetch(hub, out)
    # 1. the bytes changed under the same provenance
    (out / "tokenizer_config.json").write_text("{}")
    held = folder_hashes(out)
    p = fetch(hub, out, check=False)
    assert p.returncode == 1 and "tokenizer_config.json" in p.stderr and "REPLACE=1" in p.stderr, p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#model") and folder_hashes(out) == held
    # 2. main moved on to another commit: what is there is named, nothing is touched
    (Path(env["HF_HUB_CACHE"]) / ("models--" + REPO.replace("/", "--")) / "refs" / "main").write_text(C2)
    try:
        p = fetch(hub, out, check=False)
        assert p.returncode == 1, p.stdout
        assert f"{out} holds {REPO}@{C1[:12]} (not quantized here), not {REPO}@{C2[:12]}" in p.stderr, p.stderr
        assert folder_hashes(out) == held
        # 3. on purpose: --replace swaps in the new commit whole
        p = fetch(hub, out, "--replace")
        assert f"status fetched repo {REPO} revision main commit {C2}" in p.stdout
        assert json.loads((out / "provenance.json").read_text())["commit"] == C2
        assert {k: v for k, v in folder_hashes(out).items() if k != "provenance.json"} == \
            {f.name: sha256_file(f) for f in snaps[C2].iterdir()}
        assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]
    finally:
        (Path(env["HF_HUB_CACHE"]) / ("models--" + REPO.replace("/", "--")) / "refs" / "main").write_text(C1)


def test_a_folder_it_did_not_fetch_is_refused(hub, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "gemma4"}')
    p = fetch(hub, out, check=False)
    assert p.returncode == 1 and "no provenance.json from bin/model.py" in p.stderr, p.stderr
    assert [x.name for x in out.iterdir()] == ["config.json"]


def test_quantize_4_gives_a_model_mlx_lm_loads_quantized(hub, tmp_path):
    out = tmp_path / "q4"
    p = fetch(hub, out, "--quantize", "4")
    assert "quantize 4" in p.stdout and "[INFO]" not in p.stdout  # convert's chatter goes to stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["quantization"] == {"bits": 4, "group_size": 64, "mode": "affine", "by": "mlx_lm.convert"}
    assert prov["files"] == {k: v for k, v in folder_hashes(out).items() if k != "provenance.json"}

    import mlx.nn as nn
    from mlx_lm.utils import load

    model, _ = load(str(out))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    # mlx-lm's convert quantizes the per-layer embedding table and projections too (widths of 64)
    assert not [k for k, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert prov["chat_template"]["variant"] == "launch" and prov["chat_template"]["has_thinking"]
    # the same repo unquantized is another model: refused, not silently swapped
    p = fetch(hub, out, check=False)
    assert p.returncode == 1 and "(4-bit, group size 64), not" in p.stderr, p.stderr


def test_a_failed_build_leaves_the_old_folder_whole(hub, tmp_path):
    """An MLX 4-bit repository with QUANTIZE=4 fails inside the build: with --replace the folder
    that was there stays as it was, and no temporary sibling is left."""
    env, _ = hub
    src = tmp_path / "src-q4"
    run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--layout", "released", "--quantize", "4",
         "--out", str(src)])
    repo = "thunder-test/tiny-gemma4-released-4bit"
    hub_cache(Path(env["HF_HUB_CACHE"]), repo, src, C1, ("main",))
    out = tmp_path / "models" / "q"
    run([PY, "bin/model.py", "--repo", repo, "--out", str(out)], env=env)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["quantization"] is None and prov["repo_quantization"]["bits"] == 4
    held = folder_hashes(out)
    p = run([PY, "bin/model.py", "--repo", repo, "--out", str(out), "--quantize", "4", "--replace"], env=env,
            check=False)
    assert p.returncode == 1 and "already quantized" in p.stderr, p.stderr
    assert folder_hashes(out) == held and [x.name for x in out.parent.iterdir()] == ["q"]


def test_unknown_revision_offline_names_the_fix(hub, tmp_path):
    p = fetch(hub, tmp_path / "x", "--revision", "no-such-tag", check=False)
    assert p.returncode == 1 and "cannot resolve" in p.stderr and "HF_HUB_OFFLINE=1" in p.stderr, p.stderr
    assert p.stderr.rstrip().endswith("see RUNBOOK.md#model") and not (tmp_path / "x").exists()


def test_make_n_model_is_the_command():
    p = make("-n", "model", "HF_REPO=org/name", "MODEL=models/x", "REVISION=v2", "QUANTIZE=8", "REPLACE=1")
    assert "bin/model.py --repo org/name --out models/x --revision v2 --quantize 8 --replace" in p.stdout
    p = make("-n", "model", "MODEL=models/x", check=False)
    assert p.returncode != 0 and "HF_REPO is not set" in p.stderr


def test_a_sharded_repo_comes_whole_and_an_incomplete_one_is_refused(hub, tmp_path):
    """Gemma 4 E2B's bf16 weights are sharded on the Hub (model-0000N-of-0000M.safetensors with
    model.safetensors.index.json): every shard arrives and loads; a shard the cache never got is named."""
    import shutil

    from support import shard_model

    src = tmp_path / "src"
    shutil.copytree(hub[1][C1], src, symlinks=False)
    shards = shard_model(src, 3)
    env = dict(hub[0], HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    snap = hub_cache(tmp_path / "hf" / "hub", REPO, src, C1, ("main",))
    out = tmp_path / "sharded"
    run([PY, "bin/model.py", "--repo", REPO, "--out", str(out)], env=env)
    assert {*shards, "model.safetensors.index.json"} <= {p.name for p in out.iterdir()}
    import mlx.core as mx
    from mlx_lm.utils import load

    ids = mx.array([[5, 17, 99, 3]])
    sharded, whole = load(str(out))[0](ids), load(str(hub[1][C1]))[0](ids)
    assert mx.array_equal(sharded, whole)  # every weight arrived where the index says
    (snap / shards[2]).unlink()  # a download that stopped before the last shard
    p = run([PY, "bin/model.py", "--repo", REPO, "--out", str(tmp_path / "partial")], env=env, check=False)
    assert p.returncode == 1 and f"in the cache lacks {shards[2]}:" in p.stderr, p.stderr
    assert not (tmp_path / "partial").exists()

