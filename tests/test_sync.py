"""sync: safety refusals, verified no-op on the embedded default, incremental transfer,
repair of a flipped byte, dry run, and an interrupted transfer that leaves the old copy."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import PY, ROOT, kill_sync_mid_transfer, run
from support import write_manifest

from lib.hashing import sha256_file


def make_dataset(name: str, records: int = 200, pad: int = 0) -> Path:
    """A small dataset folder with an exporter-shaped manifest (files: name -> sha256, bytes)."""
    d = ROOT / "datasets" / name
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", records), ("valid", max(1, records // 20)), ("test", max(1, records // 20))):
        with open(d / f"{split}.jsonl", "w") as f:
            for i in range(n):
                msg = {"messages": [{"role": "user", "content": f"q{i} " + "x" * pad},
                                    {"role": "assistant", "content": f"a{i}"}], "record_id": f"{split}-{i}"}
                f.write(json.dumps(msg) + "\n")
    (d / "rejects.jsonl").write_text("")
    write_manifest(d)
    return d


@pytest.fixture
def dataset(request):
    name = f"synctest-{request.node.name[:40]}".replace("[", "-").replace("]", "")
    d = make_dataset(name)
    yield name
    subprocess.run(["rm", "-rf", str(d)])


def sync(*extra, check=False, env=None, remote_root=None, dataset="x", hostfile="hostfile.local.json"):
    cmd = [PY, "bin/sync.py", "--hostfile", hostfile, "--remote-root", str(remote_root or ROOT),
           "--dataset", dataset, *extra]
    return run(cmd, check=check, env=env)


@pytest.fixture
def rsync_spy(tmp_path):
    """An rsync first on PATH that only records that it ran: proves a refusal came first."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "rsync-ran"
    (bindir / "rsync").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bindir / "rsync").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    return env, marker


@pytest.mark.parametrize("root", ["/", "/root", "/home/op", "/Users/op", "/Users/op/", "relative/dir",
                                  "/srv/../etc", "/srv/a b", "/srv/$(id)"])
def test_dangerous_destinations_refused_before_rsync(root, dataset, rsync_spy):
    env, marker = rsync_spy
    p = sync(remote_root=root, dataset=dataset, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "refused" in p.stderr and "RUNBOOK.md#" in p.stderr
    assert not marker.exists(), "rsync ran although the destination was refused"


def test_dataset_name_outside_datasets_refused(rsync_spy, tmp_path):
    env, marker = rsync_spy
    p = sync(remote_root=tmp_path / "dst", dataset="../lib", env=env)
    assert p.returncode == 2 and "not a plain folder name" in p.stderr
    assert not marker.exists()
    p = sync("--run", "a;b", remote_root=tmp_path / "dst", dataset="x", env=env)  # an error, not a traceback
    assert p.returncode == 2 and "see RUNBOOK.md#run-folders" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def test_embedded_default_is_a_verified_noop(dataset):
    p = sync("--run", "synctest-noop", dataset=dataset, check=True)
    assert "status verified actions none: destination is the source bytes 0" in p.stdout
    report = json.loads((ROOT / "runs/synctest-noop/sync.json").read_text())
    assert report["ok"] and report["hosts"][0]["verified"] is True
    subprocess.run(["rm", "-rf", str(ROOT / "runs/synctest-noop")])


def test_incremental_repair_and_dry_run(dataset, tmp_path):
    dst = tmp_path / "remote"
    p = sync(remote_root=dst, dataset=dataset, check=True)
    assert "status verified actions code+dataset" in p.stdout
    target = dst / "datasets" / dataset / "train.jsonl"
    assert sha256_file(target) == sha256_file(ROOT / "datasets" / dataset / "train.jsonl")
    # Nothing changed: nothing transferred.
    p = sync(remote_root=dst, dataset=dataset, check=True)
    assert "actions none bytes 0" in p.stdout
    # Flip one byte, keep size and mtime (rsync's quick check would miss it): sync repairs it.
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[10] ^= 0x01
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Dry run: says what it would do, changes nothing.
    listing = {f: f.stat().st_mtime_ns for f in dst.rglob("*")}
    p = sync("--dry-run", remote_root=dst, dataset=dataset, check=True)
    assert "would dataset" in p.stdout and "train.jsonl" in p.stdout
    assert target.read_bytes() == bytes(data)
    assert {f: f.stat().st_mtime_ns for f in dst.rglob("*")} == listing, "the dry run changed the destination"
    p = sync(remote_root=dst, dataset=dataset, check=True)
    assert re.search(r"status verified actions (code\+)?dataset", p.stdout)
    assert sha256_file(target) == sha256_file(ROOT / "datasets" / dataset / "train.jsonl")
    # No staging or aside folder is left behind.
    assert sorted(x.name for x in (dst / "datasets").iterdir()) == [dataset]


def test_stale_file_in_dataset_folder_is_deleted_only_there(dataset, tmp_path):
    """Files the host has and this checkout lacks go from the dataset folder and from bin/, lib/,
    configs/ (a dry run names them first); caches, dotfiles and everything else stay."""
    dst = tmp_path / "remote"
    sync(remote_root=dst, dataset=dataset, check=True)
    (dst / "datasets" / dataset / "stale.jsonl").write_text("old\n")
    (dst / "lib" / "extra_local_file.txt").write_text("gone from git\n")
    (dst / "lib" / "old").mkdir()
    (dst / "lib" / "old" / "moved.py").write_text("gone from git\n")
    kept = [dst / "lib" / "__pycache__" / "x.cpython-312.pyc", dst / "lib" / ".DS_Store", dst / "notes.txt",
            dst / "datasets" / "other" / "train.jsonl", dst / "models" / "m" / "config.json"]
    for f in kept:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("keep me\n")
    # Force a dataset transfer by changing a split on the remote side.
    (dst / "datasets" / dataset / "valid.jsonl").write_text("changed\n")
    p = sync("--dry-run", remote_root=dst, dataset=dataset, check=True)
    assert "would code *deleting" in p.stdout and "lib/extra_local_file.txt" in p.stdout, p.stdout
    assert "lib/old/moved.py" in p.stdout and "would dataset *deleting stale.jsonl" in p.stdout
    assert (dst / "lib" / "extra_local_file.txt").exists()
    p = sync(remote_root=dst, dataset=dataset, check=True)
    assert re.search(r"status verified actions code\+dataset ", p.stdout), p.stdout
    assert not (dst / "datasets" / dataset / "stale.jsonl").exists()
    assert not (dst / "lib" / "extra_local_file.txt").exists() and not (dst / "lib" / "old" / "moved.py").exists()
    assert all(f.read_text() == "keep me\n" for f in kept)
    assert "actions none bytes 0" in sync(remote_root=dst, dataset=dataset, check=True).stdout


def test_interrupted_sync_keeps_previous_good_copy(tmp_path, request):
    name = "synctest-interrupt"
    make_dataset(name, records=200)
    request.addfinalizer(lambda: subprocess.run(["rm", "-rf", str(ROOT / "datasets" / name)]))
    dst = tmp_path / "remote"
    sync(remote_root=dst, dataset=name, check=True)
    before = {f.name: sha256_file(f) for f in (dst / "datasets" / name).iterdir()}
    # A new, bigger dataset; transfer it at 200 KiB/s so the kill lands mid-transfer.
    make_dataset(name, records=4000, pad=200)
    kill_sync_mid_transfer([PY, "bin/sync.py", "--hostfile", "hostfile.local.json", "--remote-root", str(dst),
                            "--dataset", name, "--bwlimit", "200"], dst / "datasets" / f".{name}.incoming")
    after = {f.name: sha256_file(f) for f in (dst / "datasets" / name).iterdir()}
    assert after == before, "the host's dataset changed although the sync was killed mid-transfer"
    # The next sync completes and verifies.
    out = sync(remote_root=dst, dataset=name, check=True)
    assert "status verified" in out.stdout
    assert sha256_file(dst / "datasets" / name / "train.jsonl") == sha256_file(ROOT / "datasets" / name / "train.jsonl")


def test_damaged_local_copy_never_goes_live(dataset, tmp_path):
    """The hosts verify against the manifest, so a local file changed after export is caught
    there: it never goes live, and the error names the local file and the fix. A host that
    already holds the manifest's bytes is left as it is."""
    good = tmp_path / "good"
    sync(remote_root=good, dataset=dataset, check=True)
    before = {f.name: sha256_file(f) for f in (good / "datasets" / dataset).iterdir()}
    local = ROOT / "datasets" / dataset / "valid.jsonl"
    local.write_text(local.read_text() + '{"messages": []}\n')  # no longer what the manifest says
    fresh = tmp_path / "fresh"
    p = sync(remote_root=fresh, dataset=dataset)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"local datasets/{dataset}/valid.jsonl does not match its manifest" in p.stderr
    assert "re-run make export" in p.stderr and "RUNBOOK.md#export" in p.stderr
    assert "status MISMATCH" in p.stdout
    assert not (fresh / "datasets" / dataset).exists(), "a copy that fails its manifest went live"
    p = sync(remote_root=good, dataset=dataset, check=True)
    assert "status verified actions none bytes 0" in p.stdout
    assert {f.name: sha256_file(f) for f in (good / "datasets" / dataset).iterdir()} == before


def _tool_dir(tmp_path: Path, tools: dict[str, str]) -> dict:
    """A PATH whose first folder holds the given scripts (name -> body)."""
    bindir = tmp_path / "tools"
    bindir.mkdir()
    for name, body in tools.items():
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")


def test_a_lying_hash_tool_is_not_trusted(dataset, tmp_path):
    """Each host's hash tool is proven on empty input first: an openssl that prints a wrong
    digest is passed over for the next tool, and the sync still verifies correctly."""
    env = _tool_dir(tmp_path, {"openssl": "echo 0000000000000000000000000000000000000000000000000000000000000000 '*stdin'\n"})
    dst = tmp_path / "remote"
    p = sync(remote_root=dst, dataset=dataset, env=env, check=True)
    assert "status verified" in p.stdout
    assert sha256_file(dst / "datasets" / dataset / "train.jsonl") == sha256_file(ROOT / "datasets" / dataset / "train.jsonl")


def test_no_working_hash_tool_is_a_clear_error(dataset, tmp_path):
    broken = "exit 1\n"
    env = _tool_dir(tmp_path, {"openssl": broken, "sha256sum": broken, "shasum": broken})
    dst = tmp_path / "remote"
    p = sync(remote_root=dst, dataset=dataset, env=env)
    assert p.returncode == 1
    assert "no working sha256 tool (openssl, sha256sum or shasum) on this host" in p.stderr
    assert not (dst / "datasets" / dataset).exists()


def test_remote_root_that_is_the_hosts_home_is_refused_before_any_write(dataset, tmp_path):
    """The host's own $HOME (which the local refusal cannot know) is refused by the probe
    before it creates anything there."""
    home = tmp_path / "home-of-host"
    home.mkdir()
    # The "host" is this machine, but its shell sees another $HOME than sync.py does.
    env = _tool_dir(tmp_path, {"sh": f'HOME={home} exec /bin/sh "$@"\n'})
    p = sync(remote_root=home, dataset=dataset, env=env)
    assert p.returncode == 1 and "home directory itself" in p.stderr, p.stderr
    assert list(home.iterdir()) == [], "something was written into the home directory"


def _sync_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_script", ROOT / "bin" / "sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shell", ["sh", "bash --posix"])
def test_probe_and_swap_scripts_as_a_host_runs_them(tmp_path, shell):
    """PROBE_SH on its own: a name with a space is hashed, a missing file skipped, the dataset folder
    listed, `+` files only looked for. SWAP_SH puts the staging copy live, also after a swap
    that was cut between its two renames (the aside copy is put back first, then replaced)."""
    import hashlib

    mod = _sync_module()
    root = tmp_path / "root"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "my run.yaml").write_text("a\n")
    (root / "datasets" / "d").mkdir(parents=True)
    (root / "datasets" / "d" / "train.jsonl").write_text("old\n")
    p = subprocess.run([*shell.split(), "-c", mod.PROBE_SH, "sh", str(root), "ro", "d",
                        "configs/my run.yaml", "configs/gone.yaml", "+datasets/d/train.jsonl", "+models/x"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    hashes = {m.group(2): m.group(1) for m in map(mod.HASH_LINE_RE.match, p.stdout.splitlines()) if m}
    assert hashes == {"configs/my run.yaml": hashlib.sha256(b"a\n").hexdigest()}
    assert {"LIVE train.jsonl", "EXISTS datasets/d/train.jsonl"} <= set(p.stdout.splitlines()), p.stdout
    assert not [ln for ln in p.stdout.splitlines() if "gone.yaml" in ln or "models/x" in ln], p.stdout
    # A swap cut after its first rename: no live copy, an aside one, and a new staging copy.
    (root / "datasets" / "d").rename(root / "datasets" / ".d.previous")
    (root / "datasets" / ".d.incoming").mkdir()
    (root / "datasets" / ".d.incoming" / "train.jsonl").write_text("new\n")
    p = subprocess.run([*shell.split(), "-c", mod.SWAP_SH, "sh", str(root), "d"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in (root / "datasets").iterdir()) == ["d"]
    assert (root / "datasets" / "d" / "train.jsonl").read_text() == "new\n"


def test_only_the_manifest_files_go_live(dataset, tmp_path):
    """A stray local file in the dataset folder (not in the manifest, so never verified) is not
    sent; the host's folder holds exactly the manifest's files."""
    (ROOT / "datasets" / dataset / "notes.txt").write_text("scratch\n")
    dst = tmp_path / "remote"
    sync(remote_root=dst, dataset=dataset, check=True)
    live = sorted(f.name for f in (dst / "datasets" / dataset).iterdir())
    assert live == ["manifest.json", "rejects.jsonl", "test.jsonl", "train.jsonl", "valid.jsonl"]


def test_a_manifest_entry_that_is_not_a_plain_file_is_refused(dataset, rsync_spy):
    env, marker = rsync_spy
    mpath = ROOT / "datasets" / dataset / "manifest.json"
    m = json.loads(mpath.read_text())
    m["files"]["../../lib/x.py"] = {"sha256": "0" * 64, "bytes": 1}
    mpath.write_text(json.dumps(m))
    p = sync(remote_root="/srv/thunder", dataset=dataset, env=env)
    assert p.returncode == 2 and "no valid 'files' table (plain names with a sha256)" in p.stderr, p.stderr
    assert "make export" in p.stderr
    assert not marker.exists()


def test_max_delete_bounds_what_leaves_a_hosts_dataset_folder(dataset, tmp_path):
    """Files in a host's dataset folder that are not in the manifest are removed by the next sync,
    at most --max-delete of them: above that, the host is refused before any transfer."""
    dst = tmp_path / "remote"
    sync(remote_root=dst, dataset=dataset, check=True)
    ddir = dst / "datasets" / dataset
    for i in range(3):
        (ddir / f"stale{i}.jsonl").write_text("old\n")
    p = sync("--max-delete", "2", remote_root=dst, dataset=dataset)
    assert p.returncode == 1 and "3 files that are not in its manifest" in p.stderr and "--max-delete 2" in p.stderr
    assert "RUNBOOK.md#sync-refused" in p.stderr and len(list(ddir.iterdir())) == 8
    p = sync("--max-delete", "3", remote_root=dst, dataset=dataset, check=True)
    assert re.search(r"status verified actions (code\+)?dataset ", p.stdout), p.stdout  # code: others edit it
    assert sorted(f.name for f in ddir.iterdir()) == ["manifest.json", "rejects.jsonl", "test.jsonl", "train.jsonl",
                                                      "valid.jsonl"]


def parity_rows(dst: Path, model: str, dataset: str, *extra: str) -> tuple[int, dict, str]:
    p = subprocess.run([PY, "bin/check_parity.py", "--hostfile", "hostfile.local.json", "--python", PY,
                        "--remote-root", str(dst), "--model", model, "--dataset", dataset, "--json", *extra,
                        "--state-dir", str(dst.parent / "parity")], cwd=ROOT, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    rows = {c["name"]: c for c in json.loads(p.stdout)["checks"]} if p.stdout.strip() else {}
    return p.returncode, rows, p.stderr


def test_a_sharded_model_goes_whole_and_a_damaged_or_missing_shard_is_named(dataset, tmp_path):
    """A model over 5 GB comes from the Hub as shards and model.safetensors.index.json: sync carries
    every shard, check-parity names the damaged one, and an incomplete model goes nowhere."""
    import shutil

    from support import shard_model

    name = f"models/synctest-sharded-{os.getpid()}"
    shutil.copytree(ROOT / "models/tiny-gemma4", ROOT / name)
    try:
        shards = shard_model(ROOT / name)
        dst = tmp_path / "remote"
        p = sync("--model", name, "--sync-model", remote_root=dst, dataset=dataset)
        assert p.returncode == 0 and "model" in p.stdout, p.stdout + p.stderr
        assert {f.name for f in (dst / name).iterdir()} >= {*shards, "model.safetensors.index.json"}
        code, rows, err = parity_rows(dst, name, dataset)
        assert rows["model"]["status"] == "pass", (rows.get("model"), err)
        target = dst / name / shards[1]  # one flipped byte in the second shard, size and mtime kept
        st, data = target.stat(), bytearray(target.read_bytes())
        data[-10] ^= 0x01
        target.write_bytes(bytes(data))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        code, rows, err = parity_rows(dst, name, dataset, "--deep")  # same size and mtime: DEEP=1 hashes
        assert code == 2 and rows["model"]["status"] == "fail" and shards[1] in rows["model"]["detail"], rows
        (ROOT / name / shards[1]).unlink()  # an interrupted download on Mac1
        for p in (sync("--model", name, "--sync-model", remote_root=dst, dataset=dataset),
                  subprocess.run([PY, "bin/check_parity.py", "--hostfile", "hostfile.local.json", "--python", PY, "--remote-root",
                                  str(dst), "--model", name, "--dataset", dataset], cwd=ROOT, capture_output=True,
                                 text=True, stdin=subprocess.DEVNULL, timeout=60)):
            assert p.returncode == 2 and f"incomplete here: model.safetensors.index.json names {shards[1]}" in p.stdout + p.stderr, \
                p.stdout + p.stderr
        assert target.read_bytes() == bytes(data)  # nothing was synced: the host's (damaged) copy is as it was
    finally:
        shutil.rmtree(ROOT / name, ignore_errors=True)
