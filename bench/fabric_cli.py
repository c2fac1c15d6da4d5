"""fabric_cli: the benchmarks' handle on the test fabric, through its command line only
(`python tests/fabric.py up/down`, its state.json and env.sh): bench/ never imports tests/.

Example:
    fab = fabric_cli.up(ROOT / "runs" / "fabric-bench-x", "bx1", 2, pin=True)
    subprocess.run(["ssh", fab.hosts[0], "true"], env=fab.env())
    fabric_cli.down(fab.dir)

Also the two small builders the benchmarks and the tests share (tests/support.py re-exports them).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lib import atomic, parity
from lib.hashing import digest_of, sha256_file

ROOT = Path(__file__).resolve().parent.parent
SPLITS = ("train.jsonl", "valid.jsonl", "test.jsonl")


class Fabric:
    """A fabric that `tests/fabric.py up` brought up in dir: hosts, remote_root, python, env(), hostfile()."""

    def __init__(self, d: Path | str):
        self.dir = Path(d)
        self.state = json.loads((self.dir / "state.json").read_text())
        self.hosts = [h["name"] for h in self.state["hosts"]]
        self.remote_root, self.python = self.state["remote_root"], self.state["python"]

    def env(self) -> dict[str, str]:
        """os.environ plus env.sh's exports, the fabric's ssh shim first on PATH."""
        env = dict(os.environ)
        for line in (self.dir / "env.sh").read_text().splitlines():
            if line.startswith("export ") and "=" in line and not line.startswith("export PATH"):
                k, v = line[len("export "):].split("=", 1)
                env[k] = shlex.split(v)[0] if v else ""
        env["PATH"] = f"{self.dir / 'bin'}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
        return env

    def hostfile(self, names: list[str] | int) -> Path:
        """A hostfile for the first n hosts (or the named ones), written next to the state."""
        names = self.hosts[:names] if isinstance(names, int) else names
        ip = {h["name"]: h["ip"] for h in self.state["hosts"]}
        path = self.dir / f"hostfile.{'-'.join(names)}.json"
        atomic.write_json(path, {"backend": "ring", "envs": [],
                                 "hosts": [{"ssh": n, "ips": [ip[n]], "rdma": []} for n in names]})
        return path


def cli(d: Path | str, *argv: str, prefix: str | None = None) -> subprocess.CompletedProcess:
    pre = ["--prefix", prefix, "--subnet", "auto"] if prefix else []
    return subprocess.run([sys.executable, str(ROOT / "tests" / "fabric.py"), "--dir", str(d), *pre, *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def up(d: Path | str, prefix: str, n: int, pin: bool = False) -> Fabric:
    """`tests/fabric.py up --hosts n [--pin]`; RuntimeError with its output when it fails."""
    p = cli(d, "up", "--hosts", str(n), *(["--pin"] if pin else []), prefix=prefix)
    if p.returncode:
        raise RuntimeError(f"tests/fabric.py up failed (exit {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return Fabric(d)


def down(d: Path | str) -> None:
    p = cli(d, "down")
    if p.returncode:
        print(f"warning: tests/fabric.py down: {p.stdout[-500:]}{p.stderr[-500:]}", file=sys.stderr)


def write_manifest(d: Path) -> None:
    """An exporter-shaped manifest.json for the splits and rejects.jsonl already in folder d."""
    files = {n: {"sha256": sha256_file(d / n), "bytes": (d / n).stat().st_size} for n in (*SPLITS, "rejects.jsonl")}
    atomic.write_json(d / "manifest.json", {"files": files,
                                            "dataset_sha256": digest_of({n: files[n]["sha256"] for n in SPLITS})})


def copy_code(dest: Path, root: Path) -> None:
    """The code parts check-parity compares (lib.parity.CODE_PARTS) from root into dest."""
    for part in parity.CODE_PARTS:
        src = root / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", ".*"))
        else:
            shutil.copy2(src, dest / part)
