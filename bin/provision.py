#!/usr/bin/env python3
"""provision: create or repair PYTHON's venv on every host from requirements.lock.

Usage:
    python bin/provision.py --hostfile HOSTFILE --python PYTHON [--python-version X.Y]
                            [--base-python PATH] [--recreate] [--timeout S]

Example (what `make provision` runs, followed by check-parity):
    python bin/provision.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python

PYTHON must be a venv's interpreter (<venv>/bin/python, python3 or python3.X); the venv is
created at that same absolute path on every host. Per host (hosts in parallel, one ssh call
each, the lock sent on stdin):
1. find Python X.Y on the host (default: this interpreter's version, the one the lock was
   resolved and tested with): --base-python, then pythonX.Y on PATH, Homebrew, python.org
   and system locations. A host without it fails, naming what it has and the install command.
2. reuse the venv when its interpreter runs at version X.Y; otherwise (missing, broken,
   another version, or --recreate) build it anew. A folder at that path that is not a venv
   is never deleted.
3. install the lock into it: pip install --require-hashes --no-deps -r <venv>/requirements.lock
   (pinned versions replace any others; already-satisfied packages are not downloaded again),
   then pip check, and record the lock's sha256 in <venv>/.provisioned.
The orchestrator's own .venv on 127.0.0.1 is `make setup`'s, so it is left alone here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.hostfile import check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import ssh_argv  # noqa: E402

VENV_PY_RE = re.compile(r"^python(3(\.\d+)?)?$")
# Where interpreters live that are not venvs: never a venv to create or replace.
SYSTEM_PREFIXES = {"/usr", "/usr/local", "/opt/homebrew", "/opt/local", "/opt/homebrew/opt", "/System",
                   "/Library/Frameworks", "/Applications", "/Users", "/home", "/root", "/var/root"}

# $1 = X.Y, $2 = venv dir, $3 = lock sha256, $4 = base python ("" = search), $5 = "1" to recreate.
# The lock arrives on stdin. A constant script; values arrive only as positional arguments.
# Lines starting with "@@ " are facts for the orchestrator; everything else is shown as is.
PROVISION_SH = r"""
set -u
want=$1; venv=$2; sha=$3; base=$4; recreate=$5
tmp=$(mktemp "${TMPDIR:-/tmp}/provision-lock.XXXXXX") || exit 20
trap 'rm -f "$tmp"' EXIT
cat > "$tmp"
seen=""
found=""
for c in "$base" "python$want" "/opt/homebrew/bin/python$want" "/usr/local/bin/python$want" \
         "/Library/Frameworks/Python.framework/Versions/$want/bin/python$want" "/usr/bin/python$want" \
         python3 /usr/bin/python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null) || continue
  if [ "$v" = "$want" ]; then found=$p; break; fi
  seen="$seen $c=$v"
done
if [ -z "$found" ]; then
  echo "@@ error no-python found:${seen:- nothing}"
  exit 21
fi
echo "@@ base $("$found" -c 'import os, platform, sys; print(os.path.realpath(sys.executable), platform.python_version())' </dev/null)"
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
  mkdir -p "$(dirname "$venv")" || { echo "@@ error cannot-create $venv"; exit 24; }
  "$found" -m venv "$venv" </dev/null || { echo "@@ error venv-failed $venv"; exit 25; }
fi
echo "@@ venv $state"
cp "$tmp" "$venv/requirements.lock.tmp" && mv "$venv/requirements.lock.tmp" "$venv/requirements.lock" || exit 26
start=$(date +%s)
"$vpy" -m pip install --quiet --disable-pip-version-check --no-input --require-hashes --no-deps \
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
    "pip-install": "pip could not install the lock (network or index, see the lines above)",
    "pip-check": "installed packages conflict: re-run with RECREATE=1",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="<venv>/bin/python: the same absolute path on every host")
    p.add_argument("--python-version", default="{}.{}".format(*sys.version_info[:2]),
                   help="X.Y to build the venv with (default: this interpreter's)")
    p.add_argument("--base-python", default="", help="the Python X.Y to use on the hosts (default: search)")
    p.add_argument("--recreate", action="store_true", help="rebuild every venv from scratch")
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


def provision_host(host: str, args, venv: str, lock_text: str, lock_sha: str, out_lock: threading.Lock) -> dict:
    argv = ["sh", "-c", PROVISION_SH, "provision", args.python_version, venv, lock_sha, args.base_python,
            "1" if args.recreate else "0"]
    cmd = argv if is_local(host) else ssh_argv(host, argv)
    rec: dict = {"host": host, "facts": {}, "error": None}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    timer = threading.Timer(args.timeout, proc.kill)
    timer.start()
    try:
        proc.stdin.write(lock_text)
        proc.stdin.close()
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("@@ "):
                key, _, value = line[3:].partition(" ")
                rec["facts"][key] = value
                continue
            with out_lock:
                print(f"  {host}: {line}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    rec["rc"] = rc
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    if rc != 0:
        err = rec["facts"].get("error", "")
        kind = err.split(" ", 1)[0]
        if rc == -9:
            rec["error"] = f"timed out after {args.timeout:g} s"
        elif not err and rc == 255:
            rec["error"] = "ssh failed (run make check-parity for the cause and its fix)"
        else:
            rec["error"] = (err or f"exit {rc}") + "; fix: " + FIXES.get(kind, "see the lines above").format(
                want=args.python_version)
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
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        recs = list(pool.map(lambda h: provision_host(h, args, venv, lock_text, lock_sha, out_lock), hosts))

    rc = 0
    for r in recs:
        f = r["facts"]
        if r["error"]:
            event("provision", host=r["host"], status="FAILED", wall_s=r["wall_s"])
            print(f"error: {r['host']}: {r['error']}; see RUNBOOK.md#provision", file=sys.stderr, flush=True)
            rc = 1
        else:
            event("provision", host=r["host"], status="ok", venv=f.get("venv", "?"),
                  base=f.get("base", "?").replace(" ", "@"), pip_s=f.get("installed", "?"),
                  wall_s=r["wall_s"])
    event("provision-summary", hosts=len(recs), ok=rc == 0, wall_s=round(time.monotonic() - t0, 1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
