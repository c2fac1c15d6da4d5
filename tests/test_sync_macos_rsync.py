"""sync with the rsyncs macOS ships (issue #14 item 3), on the multi-host test fabric.

Apple's openrsync (/usr/bin/rsync on macOS 15.4+) and rsync 2.6.9 (older macOS), built from
Apple's sources by .ci/macos-tools.sh, at both ends and mixed (rsync 3.x here, openrsync on the
hosts): first sync, no-op re-sync, flipped-byte repair, DRY_RUN, --max-delete, a code file gone
from git deleted and a sync killed mid-transfer, with the bytes sent reported right by every one.
MACOS_TOOLS names the tools' bin dir (CI); without it they are built when clang exists.
REQUIRE_MACOS_TOOLS=1 turns a skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, kill_sync_mid_transfer, run
from support import write_manifest

pytestmark = [pytest.mark.fabric]

@pytest.fixture(scope="module")
def macos_tools() -> Path:
    d, why = os.environ.get("MACOS_TOOLS", ""), ""
    if not d and shutil.which("clang"):
        p = run(["bash", ".ci/macos-tools.sh"], check=False, timeout=900)
        d = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else ""
        why = "" if d else f".ci/macos-tools.sh failed: {p.stderr.strip()[-400:]}"
    elif not d:
        why = "MACOS_TOOLS is unset and there is no clang to build the tools (.ci/macos-tools.sh)"
    if d and not all(os.access(Path(d) / t, os.X_OK) for t in ("openrsync", "rsync269")):
        why = f"{d} lacks openrsync or rsync269"
    if why:
        if os.environ.get("REQUIRE_MACOS_TOOLS") == "1":
            pytest.fail(f"REQUIRE_MACOS_TOOLS=1 but macOS's rsyncs are unavailable: {why}")
        pytest.skip(f"macOS's rsyncs unavailable: {why}")
    return Path(d)


def make_dataset(name: str, records: int, pad: int = 0) -> Path:
    d = ROOT / "datasets" / name
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", records), ("valid", max(1, records // 10)), ("test", max(1, records // 10))):
        with open(d / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i} " + "x" * pad},
                                                 {"role": "assistant", "content": f"a{i}"}]}) + "\n")
    (d / "rejects.jsonl").write_text("")
    write_manifest(d)
    return d


def size_of_dataset(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir())


def moved(stdout: str, host: str, dataset: Path) -> int:
    """The bytes of the files rsync itemized as sent to host (code paths are the repo's, dataset
    paths the dataset folder's): what `bytes` may exceed only by rsync's own overhead."""
    total = 0
    for line in stdout.splitlines():
        m = re.match(rf"^  {re.escape(host)}: (code|dataset) [<>]f\S* (.+)$", line)
        f = m and (ROOT if m.group(1) == "code" else dataset) / m.group(2)
        total += f.stat().st_size if f and f.is_file() else 0
    return total


@pytest.mark.parametrize("ends", ["openrsync-openrsync", "rsync269-rsync269", "rsync-openrsync"])
def test_sync_with_macos_rsyncs(fabric, macos_tools, ends, request):
    local_rsync, host_rsync = (t if t == "rsync" else str(macos_tools / t) for t in ends.split("-"))
    hosts = fabric.hosts[:2]
    name, run_id, sub = f"synctest-mac-{ends}", f"synctest-mac-{ends}", f"mac-{ends}"
    root = f"{fabric.remote_root}/{sub}"
    ddir = make_dataset(name, records=300)
    request.addfinalizer(lambda: [shutil.rmtree(ROOT / "datasets" / name, ignore_errors=True),
                                  shutil.rmtree(ROOT / "runs" / run_id, ignore_errors=True),
                                  [shutil.rmtree(fabric.backing_dir(h) / sub, ignore_errors=True) for h in hosts]])
    argv = [PY, "bin/sync.py", "--hostfile", str(fabric.hostfile(2)), "--remote-root", root, "--dataset", name,
            "--run", run_id, "--rsync", local_rsync, "--rsync-path", host_rsync]
    env = fabric.env()

    def sync(*extra, check=True):
        p = run([*argv, *extra], check=check, env=env, timeout=300)
        assert "bytes unknown" not in p.stdout, p.stdout
        return p

    def sent() -> dict[str, int]:
        return {h["host"]: h["transferred_bytes"] for h in json.loads((ROOT / "runs" / run_id / "sync.json").read_text())["hosts"]}

    def live(h: str) -> Path:
        return fabric.backing_dir(h) / sub / "datasets" / name

    # First sync: everything travels; the bytes sent are what the files hold, plus rsync's overhead.
    # (Other work may edit the repo's code meanwhile: code may travel again in any later step.)
    p = sync()
    assert p.stdout.count("status verified actions code+dataset") == 2, p.stdout
    for h, b in sent().items():
        m = moved(p.stdout, h, ddir)
        assert m > size_of_dataset(ddir) and 0.95 * m <= b <= 1.1 * m + 65536, (h, b, m)
    for h in hosts:
        assert {f.name: f.read_bytes() for f in live(h).iterdir()} == {f.name: f.read_bytes() for f in ddir.iterdir()}

    # No-op re-sync: nothing travels.
    p = sync()
    assert p.stdout.count("actions none bytes 0") == 2, p.stdout

    # One flipped byte on fab2, same size and mtime (rsync's quick check cannot see it).
    target = live(hosts[1]) / "train.jsonl"
    st, data = target.stat(), bytearray(target.read_bytes())
    data[7] ^= 0x01
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    # DRY_RUN: names the file, changes nothing anywhere.
    listing = {f: f.stat().st_mtime_ns for h in hosts for f in (fabric.backing_dir(h) / sub).rglob("*")}
    p = run(["make", "--no-print-directory", "sync", f"HOSTFILE={fabric.hostfile(2)}", f"REMOTE_ROOT={root}",
             f"DATASET={name}", f"RUN={run_id}", "MODEL=example/hub-model", "DRY_RUN=1", f"RSYNC={local_rsync}",
             f"RSYNC_PATH={host_rsync}"], env=env, timeout=300)
    assert f"{hosts[1]}: would dataset" in p.stdout and "train.jsonl" in p.stdout, p.stdout
    assert f"--rsync {local_rsync} --rsync-path {host_rsync}" in p.stdout, "make did not pass RSYNC / RSYNC_PATH"
    assert {f: f.stat().st_mtime_ns for h in hosts for f in (fabric.backing_dir(h) / sub).rglob("*")} == listing
    assert target.read_bytes() == bytes(data)
    # The repair: only fab2's dataset travels, by rsync's delta (less than the file itself).
    p = sync()
    assert re.search(rf"{hosts[1]} status verified actions (code\+)?dataset ", p.stdout), p.stdout
    assert re.search(rf"{hosts[0]} status verified actions (none|code) ", p.stdout), p.stdout
    assert 0 < sent()[hosts[1]] <= moved(p.stdout, hosts[1], ddir) + 65536, sent()
    assert target.read_bytes() == (ddir / "train.jsonl").read_bytes()

    # --max-delete: three stray files on fab1; a bound of 2 refuses that host, the default removes them.
    for i in range(3):
        (live(hosts[0]) / f"stray{i}.jsonl").write_text("old\n")
    p = sync("--max-delete", "2", check=False)
    assert p.returncode == 1 and "3 files that are not in its manifest" in p.stderr, p.stderr
    assert len(list(live(hosts[0]).iterdir())) == 8
    p = sync()
    assert re.search(rf"{hosts[0]} status verified actions (code\+)?dataset ", p.stdout), p.stdout
    assert not list(live(hosts[0]).glob("stray*"))
    assert 0 < sent()[hosts[0]] <= moved(p.stdout, hosts[0], ddir) + 65536, sent()

    # A code file this checkout no longer has (deleted or moved in git) goes from every host.
    for h in hosts:
        (fabric.backing_dir(h) / sub / "lib" / "gone_from_git.py").write_text("x\n")
    p = sync()
    assert len(re.findall(r"code \*deleting +lib/gone_from_git\.py", p.stdout)) == 2, p.stdout
    assert not any((fabric.backing_dir(h) / sub / "lib" / "gone_from_git.py").exists() for h in hosts)

    # A sync killed mid-transfer (a bigger dataset at 100 KiB/s) keeps the previous copy live.
    before = {h: {f.name: f.read_bytes() for f in live(h).iterdir()} for h in hosts}
    make_dataset(name, records=3000, pad=300)
    kill_sync_mid_transfer([*argv, "--bwlimit", "100"], live(hosts[0]).parent / f".{name}.incoming", env=env,
                           wait_s=30)
    deadline = time.time() + 10  # the hosts' receivers see their connection end and exit
    while time.time() < deadline and any(fabric.procs(h, "rsync") for h in hosts):
        time.sleep(0.2)
    for h in hosts:
        for proc in fabric.procs(h, "rsync"):
            subprocess.run(["kill", "-KILL", str(proc["pid"])], check=False)
        assert {f.name: f.read_bytes() for f in live(h).iterdir()} == before[h], f"{h}'s dataset changed mid-sync"
    p = sync()
    assert len(re.findall(r"status verified actions (code\+)?dataset ", p.stdout)) == 2, p.stdout
    for h in hosts:
        assert {f.name: f.read_bytes() for f in live(h).iterdir()} == {f.name: f.read_bytes() for f in ddir.iterdir()}
        assert 0 < sent()[h] <= moved(p.stdout, h, ddir) + 65536, sent()
        assert sorted(x.name for x in live(h).parent.iterdir()) == [name], "a staging copy was left behind"


@pytest.mark.parametrize("line,want", [
    ("Total bytes sent: 1,234,567", 1234567),      # rsync 3.x (digits grouped)
    ("Total bytes sent: 5678", 5678),              # rsync 2.6.9
    ("Total sent: 278 B", 278),                    # openrsync (sync never passes -h)
    ("Total sent: 5001396 B", 5001396),            # openrsync, a larger transfer: still bytes
    ("sent 278 bytes  received 35 bytes", None),   # no --stats block
])
def test_bytes_sent_from_every_rsyncs_stats(line, want):
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_script", ROOT / "bin" / "sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.bytes_sent(f"Number of files: 3\n{line}\nTotal received: 35 B\n") == want
