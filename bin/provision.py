#!/usr/bin/env python3
"""provision: create or repair PYTHON's venv on every host from requirements.lock.

Usage: python bin/provision.py --hostfile HF --python PY [--python-version X.Y] [--base-python P] [--recreate]
Example (what `make provision` runs, before check-parity's runtime gate):
    python bin/provision.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python
Per host, in parallel: find Python X.Y; ship this machine's wheels to hosts of its platform (others use
their index); keep a venv that runs X.Y, else build it anew (never a non-venv folder or a system
prefix); install the lock with --require-hashes; pip check. Leaves this machine's own venv alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, hostfile, paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import rsh, run_on  # noqa: E402

LOCK = paths.ROOT / "requirements.lock"
XY, TIMEOUT = "{}.{}".format(*sys.version_info), 1800  # this Python's X.Y; seconds per host and step
PRINT, WHEELS = threading.Lock(), threading.Lock()  # one host's lines at a time; the wheels fetched once
SYSTEM_PREFIXES = {"/usr", "/usr/local", "/opt/homebrew", "/opt/local", "/opt/homebrew/opt", "/System",
                   "/Library/Frameworks", "/Applications", "/Users", "/home", "/root", "/var/root"}  # no venv
# What FIND_SH asks each candidate Python; this machine's wheels fit a host whose answer is TAG.
FACTS = "import platform as p, sys; print('%d.%d' % sys.version_info[:2], sys.platform, p.machine())"
TAG = f"{XY} {sys.platform} {platform.machine()}"
# Constant scripts, values only as positional arguments; "@@ " lines are facts, the rest is shown.
# FIND_SH $1 = X.Y, $2 = base python, $3 = venv, $4 = self-marker, $5 = FACTS: "@@ self", or base and tag.
FIND_SH = r"""
want=$1; base=$2; venv=$3; marker=$4; seen=""
if [ -n "$marker" ] && [ -e "$venv/$marker" ]; then echo "@@ self"; exit 0; fi
for c in "$base" "python$want" "/opt/homebrew/bin/python$want" "/usr/local/bin/python$want" \
         "/Library/Frameworks/Python.framework/Versions/$want/bin/python$want" python3; do
  p=$(command -v "$c" 2>/dev/null) || continue  # "" ($base unset) too
  f=$("$p" -c "$5" </dev/null 2>/dev/null) || continue
  [ "${f%% *}" = "$want" ] || { seen="$seen $c=${f%% *}"; continue; }
  mkdir -p "$(dirname "$venv")" || { echo "@@ error cannot-create $(dirname "$venv")"; exit 24; }
  printf '@@ base %s\n@@ tag %s\n' "$p" "$f"; exit 0
done
echo "@@ error no-python found:${seen:- nothing}"; exit 21
"""
# PROVISION_SH $1 = X.Y, $2 = venv, $3 = base python, $4 = 1: recreate, $5 = wheels; stdin: the lock, for pip.
PROVISION_SH = r"""
want=$1; venv=$2; base=$3; recreate=$4; wheels=$5; vpy="$venv/bin/python"; state=create
if [ -e "$venv" ]; then
  [ -f "$venv/pyvenv.cfg" ] || { echo "@@ error not-a-venv $venv"; exit 22; }
  have=$("$vpy" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null)
  if [ "$recreate" != 1 ] && [ "$have" = "$want" ] && "$vpy" -m pip --version </dev/null >/dev/null 2>&1
  then state=repair; else rm -rf "$venv" || { echo "@@ error cannot-remove $venv"; exit 23; }; fi
fi
if [ $state = create ] && ! "$base" -m venv "$venv" </dev/null; then
  echo "@@ error venv-failed $venv"; exit 25; fi
printf '@@ venv %s\n@@ base %s\n' "$state" "$base"
if [ -n "$wheels" ]; then set -- --no-index --find-links "$wheels"; else set --; fi
start=$(date +%s)
"$vpy" -m pip install --quiet --disable-pip-version-check --no-input --require-hashes --no-deps \
  --no-compile "$@" -r /dev/stdin || { echo "@@ error pip-install"; exit 27; }
"$vpy" -m pip check </dev/null || { echo "@@ error pip-check"; exit 28; }
echo "@@ installed $(( $(date +%s) - start ))"
"""
FIXES = {"no-python": "install Python {0} there (macOS: brew install python@{0}; Debian/Ubuntu: apt-get"
                       " install python{0}-venv), or name it: BASE_PYTHON=/path/to/python{0}",
         "not-a-venv": "PYTHON's folder exists but is not a venv: move it away or point PYTHON elsewhere",
         "venv-failed": "the host's Python cannot create a venv (Debian: apt-get install python{0}-venv)",
         "pip-install": "pip could not install the lock: no index access, and not this machine's platform",
         "pip-check": "installed packages conflict: re-run with RECREATE=1",
         "cannot-create": "the venv's parent folder cannot be made: create it writable for the ssh user"
                          " there (sudo mkdir -p DIR && sudo chown $USER DIR), or point PYTHON elsewhere",
         "cannot-remove": "the old venv cannot be removed (permissions): remove it by hand, or point PYTHON"
                          " elsewhere"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="<venv>/bin/python: the same absolute path on every host")
    p.add_argument("--python-version", default=XY, help="default: this one's")
    p.add_argument("--base-python", default="", help="the Python X.Y to use on the hosts (default: search)")
    p.add_argument("--recreate", action="store_true", help="rebuild every venv from scratch")
    return p


def venv_of(python: str) -> str:
    """PYTHON's venv folder; refused unless PYTHON is <venv>/bin/python* outside a system prefix."""
    venv = os.path.normpath(str(Path(hostfile.check_path(python, "PYTHON")).parent.parent))
    if (Path(python).parent.name != "bin" or not re.match(r"^python(3(\.\d+)?)?$", Path(python).name)
            or venv in SYSTEM_PREFIXES or venv.count("/") < 2):
        raise RunbookError(f"PYTHON {python} is not a venv interpreter (<venv>/bin/python, not in a system "
                           "folder), which provision creates: $(REMOTE_ROOT)/.venv/bin/python", "provision")
    return venv


@functools.cache
def wheelhouse() -> Path | None:
    """The lock's wheels for this machine in runs/wheelhouse/, downloaded once; None if pip cannot."""
    d = paths.RUNS / "wheelhouse" / f"{sys.platform}-{platform.machine()}-py{XY}-{sha256_file(LOCK)[:12]}"
    if not d.is_dir():  # atomic_dir: a folder there is complete
        try:
            with atomic.atomic_dir(d) as tmp:
                argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-input", "--no-deps",
                        "--disable-pip-version-check", "--require-hashes", "-r", str(LOCK), "-d", str(tmp)]
                if not (r := run_on("here", argv, timeout=TIMEOUT, local=True)).ok:
                    raise OSError(" | ".join(r.stderr.strip().splitlines()[-3:])[:400])
        except OSError as e:
            print(f"  wheelhouse: cannot download the lock's wheels here ({e}); hosts use their index")
            return None
    print(f"  wheelhouse: {len(list(d.glob('*.whl')))} wheels in {paths.rel(d)}", flush=True)
    return d


def run_sh(host: str, script: str, argv: list[str], stdin_text: str, timeout: float) -> tuple[int, dict]:
    """Run a constant sh script with positional arguments on host: (rc, its @@ facts); shows the rest."""
    r = run_on(host, ["sh", "-c", script, "provision", *argv], timeout=timeout, input=stdin_text)
    lines = (r.stdout + r.stderr).splitlines()
    with PRINT:
        for line in (ln for ln in lines if not ln.startswith("@@ ")):
            print(f"  {host}: {line}", flush=True)
    facts = dict(ln[3:].partition(" ")[::2] for ln in lines if ln.startswith("@@ "))
    return -9 if r.timed_out else r.returncode, facts


def provision_host(host: str, args, venv: str, marker: str) -> bool:
    """One host: find Python X.Y, ship wheels, build or repair the venv, print the outcome; True if ready."""
    t0, wheels = time.monotonic(), ""
    rc, facts = run_sh(host, FIND_SH, [args.python_version, args.base_python, venv, marker, FACTS], "", 120)
    if rc == 0 and facts.get("tag") == TAG:
        with WHEELS:  # downloaded by the first host that needs them
            house = wheelhouse()
        wheels = str(house or "")
        if house and not hostfile.is_local(host):  # this machine's wheels, shipped beside the venv
            wheels = f"{venv}.wheels"
            r = run_on(host, ["rsync", "-a", "--delete", "-e", rsh(), f"{house}/", f"{host}:{wheels}/"],
                       timeout=TIMEOUT, local=True)
            if not r.ok:
                rc, facts["error"] = 30, f"wheels: rsync exited {r.returncode}: {r.stderr[-200:]}"
    if rc == 0 and "base" in facts:
        argv = [args.python_version, venv, facts["base"], "1" if args.recreate else "0", wheels]
        rc, facts = run_sh(host, PROVISION_SH, argv, LOCK.read_text(encoding="utf-8"), TIMEOUT)
    err, wall = facts.get("error") or f"exit {rc}", round(time.monotonic() - t0, 1)
    fix = FIXES.get(err.split(" ", 1)[0]) or (
        "ssh failed (exit 255): make check-parity names the cause" if rc == 255 else "see the lines above")
    why = f"timed out after {TIMEOUT} s" if rc == -9 else f"{err}; fix: {fix.format(args.python_version)}"
    with PRINT:  # one host's outcome at a time
        if "self" in facts:  # nothing done
            event("provision", host=host, status="skipped",
                  why="PYTHON's venv on this host is this machine's own .venv (make setup's)")
        elif rc == 0:
            event("provision", host=host, status="ok", venv=facts.get("venv", "?"), base=facts.get("base"),
                  wheels="shipped" if wheels else "index", pip_s=facts.get("installed", "?"), wall_s=wall)
        else:
            event("provision", host=host, status="FAILED", wall_s=wall)
            print(f"error: {host}: {why}; see RUNBOOK.md#provision", file=sys.stderr, flush=True)
    return rc == 0


def main() -> int:
    args = build_parser().parse_args()
    try:
        t0, hosts, venv = time.monotonic(), hostfile.load(args.hostfile).unique_ssh(), venv_of(args.python)
        if args.base_python:
            hostfile.check_path(args.base_python, "BASE_PYTHON")
    except RunbookError as e:
        return die(e, 2)
    event("provision-start", hosts=len(hosts), venv=venv, python=args.python_version,
          lock=sha256_file(LOCK)[:12])
    # A marker file in this machine's own venv: a host that sees it (127.0.0.1, a shared disk) is skipped.
    own = os.path.realpath(venv) == os.path.realpath(sys.prefix)
    with (tempfile.NamedTemporaryFile(dir=sys.prefix, prefix=".provision-self-") if own
          else contextlib.nullcontext()) as mine:
        marker = Path(mine.name).name if mine else ""
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            ok = all(list(pool.map(lambda h: provision_host(h, args, venv, marker), hosts)))
    event("provision-summary", hosts=len(hosts), ok=ok, wall_s=round(time.monotonic() - t0, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
