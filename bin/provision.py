#!/usr/bin/env python3
"""provision: create or repair PYTHON's venv on every host from requirements.lock.

Usage:
    python bin/provision.py --hostfile HOSTFILE --python PYTHON [--python-version X.Y]
                            [--base-python PATH] [--recreate] [--compile] [--wheels auto|ship|index]

Example (what `make provision` runs, followed by check-parity):
    python bin/provision.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python

PYTHON must be a venv's interpreter (<venv>/bin/python, python3 or python3.X); the venv is
created at that same absolute path on every host. Per host, hosts in parallel:
1. find Python X.Y on the host (default X.Y: this interpreter's, the one the lock was
   resolved and tested with): --base-python, then pythonX.Y on PATH, Homebrew, python.org
   and system locations. A host without it fails, naming what it has and the install command.
2. wheels: with --wheels auto (the default), a host of this machine's platform (OS, CPU,
   Python X.Y) gets the lock's wheels from here: downloaded once into runs/wheelhouse/<tag>/
   (pip download --require-hashes) and rsynced to <venv>.wheels/ beside the venv, so hosts
   need no index access (a Thunderbolt-only network) and install byte-identical files.
   Other hosts use their own package index (--wheels index forces that everywhere).
3. reuse the venv when its interpreter runs at version X.Y; otherwise (missing, broken,
   another version, or --recreate) build it anew. A folder at that path that is not a venv
   is never deleted, nor is a system prefix (/usr, /opt/homebrew, ...).
4. install the lock, sent on stdin, into it: pip install --require-hashes --no-deps
   (pinned versions replace any others; satisfied ones are left alone; --no-compile unless
   --compile, as uv does: a fifth less install time, and the first import compiles only what
   it uses), then pip check, and record the lock's sha256 in <venv>/.provisioned.
This machine's own venv is `make setup`'s, so it is left alone here: on 127.0.0.1, and on any
host that sees the very same folder (a rank that is this machine, a shared filesystem).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.hostfile import check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import rsh, ssh_argv  # noqa: E402

VENV_PY_RE = re.compile(r"^python(3(\.\d+)?)?$")
# Where interpreters live that are not venvs: never a venv to create or replace.
SYSTEM_PREFIXES = {"/usr", "/usr/local", "/opt/homebrew", "/opt/local", "/opt/homebrew/opt", "/System",
                   "/Library/Frameworks", "/Applications", "/Users", "/home", "/root", "/var/root"}
WHEELHOUSE = paths.RUNS / "wheelhouse"

# Constant scripts: values arrive only as positional arguments. Lines starting with "@@ "
# are facts for the orchestrator; everything else is shown as is, prefixed with the host.

# $1 = X.Y, $2 = base python ("" = search), $3 = venv dir, $4 = self-marker name ("" = none).
# Says "@@ self" when the venv holds the marker this machine just put in its own venv (the host
# sees this machine's files: self-ssh to Mac1, or a shared filesystem); else finds Python X.Y
# and makes the venv's parent.
FIND_SH = r"""
want=$1; base=$2; venv=$3; marker=$4
if [ -n "$marker" ] && [ -e "$venv/$marker" ]; then echo "@@ self"; exit 0; fi
seen=""
for c in "$base" "python$want" "/opt/homebrew/bin/python$want" "/usr/local/bin/python$want" \
         "/Library/Frameworks/Python.framework/Versions/$want/bin/python$want" "/usr/bin/python$want" \
         python3 /usr/bin/python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null) || continue
  if [ "$v" = "$want" ]; then
    mkdir -p "$(dirname "$venv")" || { echo "@@ error cannot-create $(dirname "$venv")"; exit 24; }
    echo "@@ base $p"
    echo "@@ facts $("$p" -c 'import os, platform, sys; print(os.path.realpath(sys.executable), platform.python_version(), sys.platform, platform.machine())' </dev/null)"
    exit 0
  fi
  seen="$seen $c=$v"
done
echo "@@ error no-python found:${seen:- nothing}"
exit 21
"""

# $1 = X.Y, $2 = venv dir, $3 = lock sha256, $4 = base python, $5 = "1" to recreate,
# $6 = wheel folder on this host ("" = the package index), $7 = "1" to byte-compile at install.
# The lock arrives on stdin.
PROVISION_SH = r"""
set -u
want=$1; venv=$2; sha=$3; base=$4; recreate=$5; wheels=$6; compile=$7
tmp=$(mktemp "${TMPDIR:-/tmp}/provision-lock.XXXXXX") || exit 20
trap 'rm -f "$tmp"' EXIT
cat > "$tmp"
vpy="$venv/bin/python"
state=create
if [ -e "$venv" ]; then
  if [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "@@ error not-a-venv $venv"
    exit 22
  fi
  have=$("$vpy" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null) || have=broken
  if [ "$recreate" != 1 ] && [ "$have" = "$want" ] && "$vpy" -m pip --version </dev/null >/dev/null 2>&1; then
    state=repair
  else
    echo "@@ recreate was=$have"
    rm -rf "$venv" || { echo "@@ error cannot-remove $venv"; exit 23; }
  fi
fi
if [ "$state" = create ]; then
  "$base" -m venv "$venv" </dev/null || { echo "@@ error venv-failed $venv"; exit 25; }
fi
echo "@@ venv $state"
cp "$tmp" "$venv/requirements.lock.tmp" && mv "$venv/requirements.lock.tmp" "$venv/requirements.lock" || exit 26
if [ -n "$wheels" ]; then set -- --no-index --find-links "$wheels"; else set --; fi
if [ "$compile" != 1 ]; then set -- "$@" --no-compile; fi
start=$(date +%s)
"$vpy" -m pip install --quiet --disable-pip-version-check --no-input --require-hashes --no-deps "$@" \
  -r "$venv/requirements.lock" </dev/null || { echo "@@ error pip-install"; exit 27; }
"$vpy" -m pip check </dev/null || { echo "@@ error pip-check"; exit 28; }
echo "$sha" > "$venv/.provisioned.tmp" && mv "$venv/.provisioned.tmp" "$venv/.provisioned"
echo "@@ installed $(( $(date +%s) - start ))"
echo "@@ ok $("$vpy" -c 'import os, sys; print(os.path.realpath(sys.executable))' </dev/null)"
"""

FIXES = {
    "no-python": "install Python {want} on the host (macOS: brew install python@{want}; Debian/Ubuntu: "
                 "apt-get install python{want} python{want}-venv), or name it with BASE_PYTHON=/path/to/python{want}",
    "not-a-venv": "PYTHON's folder exists but is not a venv: move it away or point PYTHON elsewhere",
    "venv-failed": "the host's Python cannot create a venv (Debian: apt-get install python{want}-venv)",
    "pip-install": "pip could not install the lock (no index access and no shipped wheels? see the lines above; "
                   "--wheels ship needs a host of this machine's platform)",
    "pip-check": "installed packages conflict: re-run with RECREATE=1",
    "cannot-create": "the venv's parent folder cannot be created: check permissions on the host",
    "wheels": "see the lines above",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="<venv>/bin/python: the same absolute path on every host")
    p.add_argument("--python-version", default="{}.{}".format(*sys.version_info[:2]),
                   help="X.Y to build the venv with (default: this interpreter's)")
    p.add_argument("--base-python", default="", help="the Python X.Y to use on the hosts (default: search)")
    p.add_argument("--recreate", action="store_true", help="rebuild every venv from scratch")
    p.add_argument("--compile", action="store_true",
                   help="byte-compile at install (default: no, like uv; the first import compiles what it uses)")
    p.add_argument("--wheels", choices=("auto", "ship", "index"), default="auto",
                   help="auto: ship this machine's wheels to hosts of its platform, else use the index")
    p.add_argument("--lock", default=str(paths.ROOT / "requirements.lock"))
    p.add_argument("--timeout", type=float, default=1800.0, help="per host, seconds")
    return p


def venv_of(python: str) -> str:
    check_path(python, "PYTHON")
    p = Path(python)
    if p.parent.name != "bin" or not VENV_PY_RE.match(p.name):
        raise RunbookError(f"PYTHON {python} is not a venv interpreter (<venv>/bin/python): provision "
                           "creates the venv, so PYTHON must name one, e.g. $(REMOTE_ROOT)/.venv/bin/python",
                           "provision")
    venv = os.path.normpath(str(p.parent.parent))
    if venv in SYSTEM_PREFIXES or venv.count("/") < 2:
        raise RunbookError(f"PYTHON {python} is a system interpreter ({venv}), not a venv's: provision would "
                           "replace that folder; point PYTHON at a venv, e.g. $(REMOTE_ROOT)/.venv/bin/python",
                           "provision")
    return venv


class Wheelhouse:
    """The lock's wheels for this machine's platform, downloaded once (lazily: only when a
    host will receive them) into runs/wheelhouse/<platform>-py<X.Y>-<lock sha>/."""

    def __init__(self, lock: str, lock_sha: str, xy: str):
        self.lock, self.xy = lock, xy
        self.dir = WHEELHOUSE / f"{sys.platform}-{platform.machine()}-py{xy}-{lock_sha[:12]}"
        self._mutex = threading.Lock()
        self._result: tuple[Path | None, str] | None = None

    def get(self, say) -> tuple[Path | None, str]:
        with self._mutex:
            if self._result is None:
                self._result = self._build(say)
            return self._result

    def _build(self, say) -> tuple[Path | None, str]:
        if (self.dir / ".complete").is_file():
            return self.dir, "cached"
        t0 = time.monotonic()
        try:
            with atomic.atomic_dir(self.dir) as tmp:
                p = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                    "--no-input", "--require-hashes", "--no-deps", "-r", self.lock, "-d", str(tmp)],
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
                if p.returncode != 0:
                    tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
                    raise RuntimeError(f"pip download exited {p.returncode}: {tail[:400]}")
                (tmp / ".complete").write_text("ok\n")
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            say(f"wheelhouse: could not download the lock's wheels here ({e}); hosts use their own index")
            return None, str(e)
        n = len(list(self.dir.glob("*.whl")))
        mb = sum(f.stat().st_size for f in self.dir.iterdir()) / 1e6
        say(f"wheelhouse: {n} wheels, {mb:.0f} MB in {paths.rel(self.dir)} ({time.monotonic() - t0:.1f} s)")
        return self.dir, "downloaded"


def run_sh(host: str, script: str, argv: list[str], stdin_text: str, timeout: float, say) -> tuple[int, dict]:
    """Run a constant sh script with positional arguments on host; stream its output; (rc, @@ facts)."""
    full = ["sh", "-c", script, "provision", *argv]
    cmd = full if is_local(host) else ssh_argv(host, full)
    facts: dict = {}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        proc.stdin.write(stdin_text)
        proc.stdin.close()
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("@@ "):
                key, _, value = line[3:].partition(" ")
                facts[key] = value
            else:
                say(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    return rc, facts


def provision_host(host: str, args, venv: str, lock_text: str, lock_sha: str, house: Wheelhouse,
                   self_marker: str, out_lock: threading.Lock) -> dict:
    def say(line: str) -> None:
        with out_lock:
            print(f"  {host}: {line}", flush=True)

    rec: dict = {"host": host, "facts": {}, "error": None, "wheels": "index"}
    t0 = time.monotonic()

    def fail(rc: int, facts: dict) -> dict:
        err = facts.get("error", "")
        kind = err.split(" ", 1)[0]
        if rc == -9:
            rec["error"] = f"timed out after {args.timeout:g} s"
        elif not err and rc == 255:
            rec["error"] = "ssh failed (run make check-parity for the cause and its fix)"
        else:
            rec["error"] = (err or f"exit {rc}") + "; fix: " + FIXES.get(kind, "see the lines above").format(
                want=args.python_version)
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        return rec

    rc, facts = run_sh(host, FIND_SH, [args.python_version, args.base_python, venv, self_marker], "", 120, say)
    rec["facts"].update(facts)
    if rc == 0 and "self" in facts:
        rec.update(skipped="PYTHON's venv on this host is this machine's own .venv (make setup's)",
                   wall_s=round(time.monotonic() - t0, 1))
        return rec
    if rc != 0 or "base" not in facts:
        return fail(rc, facts)
    real, version, plat, machine = (facts.get("facts", "") + " ? ? ? ?").split()[:4]
    rec["facts"]["base"] = f"{real}@{version}"

    wheels = ""
    same = (plat, machine) == (sys.platform, platform.machine()) and args.python_version == "{}.{}".format(
        *sys.version_info[:2])
    if args.wheels == "ship" and not same:
        rec["facts"]["error"] = (f"wheels --wheels ship: the host is {plat}/{machine}, this machine "
                                 f"{sys.platform}/{platform.machine()} with another Python; use --wheels index")
        return fail(29, rec["facts"])
    if args.wheels != "index" and same:
        house_dir, _ = house.get(say)
        if house_dir is not None:
            if is_local(host):
                wheels = str(house_dir)
            else:
                wheels = f"{venv}.wheels"
                p = subprocess.run(["rsync", "-a", "--delete", "-e", rsh(), f"{house_dir}/", f"{host}:{wheels}/"],
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.timeout)
                if p.returncode != 0:
                    rec["facts"]["error"] = f"wheels rsync to {host}:{wheels} exited {p.returncode}: {p.stderr.strip()[:300]}"
                    return fail(30, rec["facts"])
            rec["wheels"] = "shipped"
        elif args.wheels == "ship":
            rec["facts"]["error"] = "wheels no wheelhouse here (see above)"
            return fail(31, rec["facts"])

    rc, facts = run_sh(host, PROVISION_SH, [args.python_version, venv, lock_sha, facts["base"],
                                            "1" if args.recreate else "0", wheels, "1" if args.compile else "0"],
                       lock_text, args.timeout, say)
    rec["facts"].update(facts)
    if rc != 0:
        return fail(rc, facts)
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.monotonic()
    try:
        hf = load_hostfile(args.hostfile)
        venv = venv_of(args.python)
        if not re.match(r"^3\.\d+$", args.python_version):
            raise RunbookError(f"--python-version {args.python_version!r} is not X.Y", "provision")
        if args.base_python:
            check_path(args.base_python, "BASE_PYTHON")
        lock_text = Path(args.lock).read_text(encoding="utf-8")
        lock_sha = sha256_file(args.lock)
    except (RunbookError, OSError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), "provision"), 2)

    hosts = []
    for h in hf.unique_ssh():
        if is_local(h) and os.path.realpath(venv) == os.path.realpath(sys.prefix):
            event("provision", host=h, status="skipped", why="PYTHON is this checkout's own .venv (make setup's)")
            continue
        hosts.append(h)
    event("provision-start", hosts=len(hosts), venv=venv, python=args.python_version, lock=lock_sha[:12])
    out_lock = threading.Lock()
    house = Wheelhouse(args.lock, lock_sha, args.python_version)
    # This machine's own venv must never be rebuilt from "another" host that is really this
    # machine (a rank listed by name, or a shared filesystem): a marker file tells them apart.
    mine = os.path.realpath(venv) == os.path.realpath(sys.prefix)
    self_marker = f".provision-self-{os.getpid()}-{secrets.token_hex(8)}" if mine else ""
    marker_path = Path(sys.prefix) / self_marker if mine else None
    try:
        if marker_path is not None:
            marker_path.write_text("provision: this machine's own venv\n")
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            recs = list(pool.map(lambda h: provision_host(h, args, venv, lock_text, lock_sha, house, self_marker,
                                                          out_lock), hosts))
    finally:
        if marker_path is not None:
            marker_path.unlink(missing_ok=True)

    rc = 0
    for r in recs:
        f = r["facts"]
        if r.get("skipped"):
            event("provision", host=r["host"], status="skipped", why=r["skipped"])
        elif r["error"]:
            event("provision", host=r["host"], status="FAILED", wall_s=r["wall_s"])
            print(f"error: {r['host']}: {r['error']}; see RUNBOOK.md#provision", file=sys.stderr, flush=True)
            rc = 1
        else:
            event("provision", host=r["host"], status="ok", venv=f.get("venv", "?"), base=f.get("base", "?"),
                  wheels=r["wheels"], pip_s=f.get("installed", "?"), wall_s=r["wall_s"])
    event("provision-summary", hosts=len(recs), ok=rc == 0, wall_s=round(time.monotonic() - t0, 1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
