#!/usr/bin/env python3
"""provision: create or repair PYTHON's venv on every host from requirements.lock.

Usage: python bin/provision.py --hostfile HF --python PY [--python-version X.Y] [--base-python PATH] [--recreate]
Example (what `make provision` runs, before check-parity's runtime gate):
    python bin/provision.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python
Per host, in parallel: find Python X.Y; ship this machine's wheels to hosts of its platform (others use their
index); keep a venv that runs X.Y, else build it anew (never a non-venv folder or a system prefix); install
the lock with --require-hashes, pip check, record its sha256 in <venv>/.provisioned. Leaves this machine's venv.
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
from lib.remote import rsh, run_on  # noqa: E402

LOCK = paths.ROOT / "requirements.lock"
# Where interpreters live that are not venvs: never a venv to create or replace.
SYSTEM_PREFIXES = {"/usr", "/usr/local", "/opt/homebrew", "/opt/local", "/opt/homebrew/opt", "/System",
                   "/Library/Frameworks", "/Applications", "/Users", "/home", "/root", "/var/root"}
# Constant scripts, values only as positional arguments; "@@ " lines are facts, the rest is shown.
# FIND_SH $1 = X.Y, $2 = base python, $3 = venv, $4 = self-marker: "@@ self", or Python X.Y's facts.
FIND_SH = r"""
want=$1; base=$2; venv=$3; marker=$4; seen=""
if [ -n "$marker" ] && [ -e "$venv/$marker" ]; then echo "@@ self"; exit 0; fi
for c in "$base" "python$want" "/opt/homebrew/bin/python$want" "/usr/local/bin/python$want" \
         "/Library/Frameworks/Python.framework/Versions/$want/bin/python$want" "/usr/bin/python$want" \
         python3 /usr/bin/python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null) || continue
  [ "$v" = "$want" ] || { seen="$seen $c=$v"; continue; }
  mkdir -p "$(dirname "$venv")" || { echo "@@ error cannot-create $(dirname "$venv")"; exit 24; }
  echo "@@ base $p"
  echo "@@ facts $("$p" -c 'import os, platform, sys; print(os.path.realpath(sys.executable), platform.python_version(), sys.platform, platform.machine())' </dev/null)"
  exit 0
done
echo "@@ error no-python found:${seen:- nothing}"; exit 21
"""
# PROVISION_SH $1 = X.Y, $2 = venv, $3 = lock sha256, $4 = base python, $5 = 1: recreate, $6 = wheels; lock on stdin.
PROVISION_SH = r"""
want=$1; venv=$2; sha=$3; base=$4; recreate=$5; wheels=$6
lock=$(mktemp "${TMPDIR:-/tmp}/provision-lock.XXXXXX") || exit 20
trap 'rm -f "$lock"' EXIT; cat > "$lock"
vpy="$venv/bin/python"; state=create
if [ -e "$venv" ]; then
  [ -f "$venv/pyvenv.cfg" ] || { echo "@@ error not-a-venv $venv"; exit 22; }
  have=$("$vpy" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null) || have=broken
  if [ "$recreate" != 1 ] && [ "$have" = "$want" ] && "$vpy" -m pip --version </dev/null >/dev/null 2>&1; then state=repair
  else rm -rf "$venv" || { echo "@@ error cannot-remove $venv"; exit 23; }; fi
fi
if [ "$state" = create ]; then "$base" -m venv "$venv" </dev/null || { echo "@@ error venv-failed $venv"; exit 25; }; fi
echo "@@ venv $state"
if [ -n "$wheels" ]; then set -- --no-index --find-links "$wheels"; else set --; fi
start=$(date +%s)
"$vpy" -m pip install --quiet --disable-pip-version-check --no-input --require-hashes --no-deps --no-compile "$@" \
  -r "$lock" </dev/null || { echo "@@ error pip-install"; exit 27; }
"$vpy" -m pip check </dev/null || { echo "@@ error pip-check"; exit 28; }
echo "$sha" > "$venv/.provisioned.tmp" && mv "$venv/.provisioned.tmp" "$venv/.provisioned"
echo "@@ installed $(( $(date +%s) - start ))"
"""
FIXES = {"no-python": "install Python {want} on the host (macOS: brew install python@{want}; Debian/Ubuntu: apt-get "
                       "install python{want} python{want}-venv), or name it with BASE_PYTHON=/path/to/python{want}",
         "not-a-venv": "PYTHON's folder exists but is not a venv: move it away or point PYTHON elsewhere",
         "venv-failed": "the host's Python cannot create a venv (Debian: apt-get install python{want}-venv)",
         "pip-install": "pip could not install the lock: no index access, and not this machine's platform",
         "pip-check": "installed packages conflict: re-run with RECREATE=1",
         "cannot-create": "the venv's parent folder cannot be created: check permissions on the host"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="<venv>/bin/python: the same absolute path on every host")
    p.add_argument("--python-version", default="{}.{}".format(*sys.version_info[:2]), help="default: this one's")
    p.add_argument("--base-python", default="", help="the Python X.Y to use on the hosts (default: search)")
    p.add_argument("--recreate", action="store_true", help="rebuild every venv from scratch")
    p.add_argument("--timeout", type=float, default=1800.0, help="per host, seconds")
    return p


def venv_of(python: str) -> str:
    """PYTHON's venv folder; refused when PYTHON is not <venv>/bin/python* or the folder is a system prefix."""
    venv = os.path.normpath(str(Path(check_path(python, "PYTHON")).parent.parent))
    if Path(python).parent.name != "bin" or not re.match(r"^python(3(\.\d+)?)?$", Path(python).name):
        raise RunbookError(f"PYTHON {python} is not a venv interpreter (<venv>/bin/python): provision creates the "
                           "venv, so PYTHON must name one, e.g. $(REMOTE_ROOT)/.venv/bin/python", "provision")
    if venv in SYSTEM_PREFIXES or venv.count("/") < 2:
        raise RunbookError(f"PYTHON {python} is a system interpreter ({venv}), not a venv's: provision would replace "
                           "that folder; point PYTHON at a venv, e.g. $(REMOTE_ROOT)/.venv/bin/python", "provision")
    return venv


def wheelhouse(lock_sha: str, xy: str, say) -> Path | None:
    """The lock's wheels for this machine's platform in runs/wheelhouse/, downloaded the first time;
    None when pip cannot download them (the hosts then use their index)."""
    d, t0 = paths.RUNS / "wheelhouse" / f"{sys.platform}-{platform.machine()}-py{xy}-{lock_sha[:12]}", time.monotonic()
    if (d / ".complete").is_file():
        return d
    try:
        with atomic.atomic_dir(d) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-input", "--require-hashes", "--no-deps", "-r", str(LOCK), "-d", str(tmp)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800, check=True)
            (tmp / ".complete").write_text("ok\n")
    except (OSError, subprocess.SubprocessError) as e:
        tail = " | ".join((getattr(e, "stderr", None) or str(e)).strip().splitlines()[-3:])[:400]
        say(f"wheelhouse: could not download the lock's wheels here ({tail}); hosts use their own index")
        return None
    say(f"wheelhouse: {len(list(d.glob('*.whl')))} wheels in {paths.rel(d)} ({time.monotonic() - t0:.1f} s)")
    return d


def run_sh(host: str, script: str, argv: list[str], stdin_text: str, timeout: float, say) -> tuple[int, dict]:
    """Run a constant sh script with positional arguments on host: (rc, its @@ facts); other lines are shown."""
    r = run_on(host, ["sh", "-c", script, "provision", *argv], timeout=timeout, input=stdin_text)
    lines = (r.stdout + r.stderr).splitlines()
    for line in (ln for ln in lines if not ln.startswith("@@ ")):
        say(line)
    return -9 if r.timed_out else r.returncode, dict(ln[3:].partition(" ")[::2] for ln in lines if ln.startswith("@@ "))


def ship_wheels(host: str, venv: str, args, shared: dict, say) -> tuple[str, str]:
    """(the wheel folder on the host, or "" for its index; an error): this machine's wheels, beside the venv."""
    with shared["wheels"]:  # downloaded once, by the first host that needs them
        house = shared["house"] = shared["house"] if "house" in shared else wheelhouse(shared["lock_sha"], args.python_version, say)
    if house is None or is_local(host):
        return str(house or ""), ""
    p = subprocess.run(["rsync", "-a", "--delete", "-e", rsh(), f"{house}/", f"{host}:{venv}.wheels/"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.timeout)
    return f"{venv}.wheels", p.returncode and f"wheels: rsync to {host} exited {p.returncode}: {p.stderr[-300:]}"


def provision_host(host: str, args, venv: str, lock: str, marker: str, shared: dict) -> bool:
    """One host: find Python X.Y, ship wheels, build or repair the venv, print the outcome; True when ready."""
    t0, wheels, base = time.monotonic(), "", "?"

    def say(line: str) -> None:
        with shared["print"]:
            print(f"  {host}: {line}", flush=True)
    rc, facts = run_sh(host, FIND_SH, [args.python_version, args.base_python, venv, marker], "", 120, say)
    if rc == 0 and "self" in facts:
        with shared["print"]:
            event("provision", host=host, status="skipped", why="PYTHON's venv on this host is this machine's "
                  "own .venv (make setup's)")
        return True
    if rc == 0 and "base" in facts:
        real, version, plat, machine = (facts.get("facts", "") + " ? ? ? ?").split()[:4]
        base = f"{real}@{version}"
        if (plat, machine, args.python_version) == (sys.platform, platform.machine(), "{}.{}".format(*sys.version_info)):
            wheels, facts["error"] = ship_wheels(host, venv, args, shared, say)
            rc = 30 if facts["error"] else 0
        if rc == 0:
            rc, facts = run_sh(host, PROVISION_SH, [args.python_version, venv, shared["lock_sha"], facts["base"],
                                                    "1" if args.recreate else "0", wheels], lock, args.timeout, say)
    err, wall = facts.get("error") or "", round(time.monotonic() - t0, 1)
    with shared["print"]:  # one host's outcome at a time
        if rc == 0:
            event("provision", host=host, status="ok", venv=facts.get("venv", "?"), base=base,
                  wheels="shipped" if wheels else "index", pip_s=facts.get("installed", "?"), wall_s=wall)
            return True
        fix = FIXES.get(err.split(" ", 1)[0], "see the lines above").format(want=args.python_version)
        why = (f"timed out after {args.timeout:g} s" if rc == -9 else "ssh failed (make check-parity names the cause "
               "and its fix)" if rc == 255 and not err else f"{err or f'exit {rc}'}; fix: {fix}")
        event("provision", host=host, status="FAILED", wall_s=wall)
        print(f"error: {host}: {why}; see RUNBOOK.md#provision", file=sys.stderr, flush=True)
    return False


def main() -> int:
    args = build_parser().parse_args()
    try:
        t0, hf, venv = time.monotonic(), load_hostfile(args.hostfile), venv_of(args.python)
        if not re.match(r"^3\.\d+$", args.python_version):
            raise RunbookError(f"--python-version {args.python_version!r} is not X.Y", "provision")
        if args.base_python:
            check_path(args.base_python, "BASE_PYTHON")
        lock = LOCK.read_text(encoding="utf-8")
    except (RunbookError, OSError) as e:
        return die(e if isinstance(e, RunbookError) else RunbookError(str(e), "provision"), 2)
    mine = os.path.realpath(venv) == os.path.realpath(sys.prefix)
    hosts = [h for h in hf.unique_ssh() if not (is_local(h) and mine)]
    for h in set(hf.unique_ssh()) - set(hosts):
        event("provision", host=h, status="skipped", why="PYTHON is this checkout's own .venv (make setup's)")
    shared = {"print": threading.Lock(), "wheels": threading.Lock(), "lock_sha": sha256_file(LOCK)}
    event("provision-start", hosts=len(hosts), venv=venv, python=args.python_version, lock=shared["lock_sha"][:12])
    # A marker file in this machine's venv tells a host that is really this machine (a shared disk) apart.
    marker = f".provision-self-{os.getpid()}-{secrets.token_hex(8)}" if mine else ""
    try:
        if mine:
            (Path(sys.prefix) / marker).write_text("provision: this machine's own venv\n")
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            ok = all(list(pool.map(lambda h: provision_host(h, args, venv, lock, marker, shared), hosts)))
    finally:
        if mine:
            (Path(sys.prefix) / marker).unlink(missing_ok=True)
    event("provision-summary", hosts=len(hosts), ok=ok, wall_s=round(time.monotonic() - t0, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
