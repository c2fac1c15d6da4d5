#!/usr/bin/env python3
"""bench_sync: `bin/sync.py` against a bare `rsync -a` of the same files to the same hosts.

Usage:
    python bench/bench_sync.py [--mb 200] [--hosts 2] [--reps 3] [--min-ratio 0.7] [--max-noop-s 1.0]

Example (root, needs the multi-host test fabric: ip, unshare, Debian's openssh-server):
    .venv/bin/python bench/bench_sync.py

Brings up its own fabric instance (tests/fabric.py), writes a dataset of --mb megabytes
(three JSONL splits and an exporter-shaped manifest) under datasets/, then, to the same
hosts in parallel, in the same run, --reps times, alternating (a pair per repetition, so
a change of machine load hits both sides alike):
  1. baseline: `rsync -a` of the dataset folder over the fabric's ssh (a fresh ssh login per
     host, as an operator's command would) into a fresh scratch folder;
  2. `bin/sync.py` of the same dataset into a fresh REMOTE_ROOT (probe, code + dataset
     transfer, sha256 verification on each host, swap);
then, after the last repetition, `bin/sync.py` again with nothing changed, --reps times: the
no-op re-sync the target is about (a probe per host that hashes the host's whole copy: there
are no hash caches). Prints the medians, then the gated figures with their medians, spreads and
verdicts (bench/gate.py): `sync_throughput_ratio` (each pair's bin/sync.py MB/s over its bare
rsync's, target >= 0.7) and `sync_noop_s` (a sample a re-sync, target <= 1 s); exits 1 when a
target is missed by every sample, 2 when a sync fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fabric_cli  # noqa: E402  (bench/fabric_cli.py: tests/fabric.py through its CLI)
from fabric_cli import write_manifest  # noqa: E402
from gate import Gate, emit, missed  # noqa: E402  (bench/gate.py: samples, spread, verdict)

from lib.remote import rsh  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=200, help="dataset size in MB")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="alternating bare/sync pairs; medians are compared")
    p.add_argument("--min-ratio", type=float, default=0.7)
    p.add_argument("--max-noop-s", type=float, default=1.0)
    return p


def make_dataset(name: str, mb: int) -> Path:
    d = ROOT / "datasets" / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    line = json.dumps({"messages": [{"role": "user", "content": "q " * 100},
                                    {"role": "assistant", "content": "a " * 140}]}) + "\n"
    per = {"train.jsonl": 0.9, "valid.jsonl": 0.05, "test.jsonl": 0.05}
    for fname, share in per.items():
        n = int(mb * 1e6 * share / len(line))
        with open(d / fname, "w") as f:
            for i in range(n):
                f.write(line.replace('"q ', f'"{i} ', 1))
    (d / "rejects.jsonl").write_text("")
    write_manifest(d)
    return d


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


@dataclass
class Timings:
    """Each pair's bare rsync and bin/sync.py seconds, the no-op re-syncs', the bytes sent."""

    bare: list = field(default_factory=list)
    sync: list = field(default_factory=list)
    noop: list = field(default_factory=list)
    mb: float = 0.0
    hosts: int = 0


def measure(args, fab, name: str) -> Timings:
    """--reps pairs (bare rsync, then bin/sync.py, each into a fresh folder), then --reps no-ops."""
    fenv = fab.env()
    hosts = fab.hosts[: args.hosts]
    hf = fab.hostfile(hosts)
    d = make_dataset(name, args.mb)
    t = Timings(mb=dir_bytes(d) * len(hosts) / 1e6, hosts=len(hosts))

    def bare(h, dst):
        subprocess.run(
            ["rsync", "-a", "-e", rsh(), f"{d}/", f"{h}:{dst}/"],
            check=True,
            env=fenv,
            capture_output=True,
        )

    def clean(path):
        with ThreadPoolExecutor(len(hosts)) as pool:
            list(
                pool.map(
                    lambda h: subprocess.run(
                        ["ssh", h, "rm", "-rf", "--", path], env=fenv, capture_output=True
                    ),
                    hosts,
                )
            )

    def sync(root, noop: bool = False) -> float:
        t0 = time.perf_counter()
        p = subprocess.run(
            [PY, "bin/sync.py", "--hostfile", str(hf), "--remote-root", root, "--dataset", name],
            cwd=ROOT,
            env=fenv,
            capture_output=True,
            text=True,
        )
        if p.returncode != 0 or noop and p.stdout.count("actions none bytes 0") != len(hosts):
            raise RuntimeError(
                f"bin/sync.py{' (no-op)' if noop else ''} exited "
                f"{p.returncode}:\n{p.stdout}\n{p.stderr}"
            )
        return time.perf_counter() - t0

    # Warm the page cache of the source for both: the same bytes are read either way.
    for f in d.iterdir():
        f.read_bytes()
    for i in range(args.reps):
        dst = f"{fab.remote_root}/bare-{i}"
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(hosts)) as pool:
            list(pool.map(bare, hosts, [dst] * len(hosts)))
        t.bare.append(time.perf_counter() - t0)
        clean(dst)
        root = f"{fab.remote_root}/sync-{i}"
        t.sync.append(sync(root))
        if i < args.reps - 1:
            clean(root)
    t.noop = [sync(root, noop=True) for _ in range(args.reps)]
    return t


def report(args, t: Timings) -> int:
    """The medians; the throughput ratio (a sample a pair) and the no-op re-sync (one a run)."""
    bare_s, sync_s = statistics.median(t.bare), statistics.median(t.sync)
    runs = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(
        f"bare_rsync_mb_s: {t.mb / bare_s:.1f} ({t.mb:.0f} MB to {t.hosts} hosts in a median "
        f"{bare_s:.2f} s; "
        f"runs {runs(t.bare)} s)"
    )
    print(f"sync_s: {sync_s:.2f} (median; runs {runs(t.sync)} s)")
    print(
        f"sync_throughput_mb_s: {t.mb / sync_s:.1f} (median; includes probe, swap and sha256 "
        "verification on "
        "each host)"
    )
    verdicts = [
        emit(
            Gate(
                "sync_throughput_ratio",
                ">=",
                args.min_ratio,
                tuple(b / s for b, s in zip(t.bare, t.sync, strict=True)),
            ),
            f"bin/sync.py's MB/s over bare rsync's, a pair's; {t.mb:.0f} MB to {t.hosts} hosts",
        ),
        emit(
            Gate("sync_noop_s", "<=", args.max_noop_s, tuple(t.noop)),
            f"no-op re-sync, {t.hosts} hosts, {t.mb / t.hosts:.0f} MB dataset hashed on each",
        ),
    ]
    ok = not missed(verdicts)
    print(f"bench_sync: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    args = build_parser().parse_args()
    fdir = ROOT / "runs" / "fabric-bench-sync"
    name = "bench-sync"
    try:
        fab = fabric_cli.up(fdir, "bsync", args.hosts)
        t = measure(args, fab, name)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(ROOT / "datasets" / name, ignore_errors=True)
        fabric_cli.down(fdir)
    return report(args, t)


if __name__ == "__main__":
    sys.exit(main())
