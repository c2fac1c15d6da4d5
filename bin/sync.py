#!/usr/bin/env python3
"""sync: code, dataset (and model) to the same absolute path on every host, verified by hash.

Usage:
    python bin/sync.py --hostfile HOSTFILE --remote-root DIR --dataset NAME [--model PATH]
                       [--sync-model] [--dry-run] [--run RUN] [--max-delete N] [--bwlimit KBPS]

Example:
    python bin/sync.py --hostfile hostfile.json --remote-root /Users/op/thunder-runbook \
        --dataset domain_sft_v1_high_signal_thunder --model models/tiny-gemma4 --run stage1

What it does, per host (hosts in parallel, each distinct ssh name once):
1. probe: one ssh call hashes the host's copy of the code and the dataset (openssl, sha256sum
   or `shasum -a 256`, whichever is fastest there; no Python needed), says which model files
   exist, and creates REMOTE_ROOT and datasets/ after refusing a REMOTE_ROOT that is $HOME.
2. transfer what differs, with rsync over ssh (argument lists only), all at once:
   - code (bin/ lib/ configs/ Makefile requirements.lock) into REMOTE_ROOT; never deletes;
   - the dataset into REMOTE_ROOT/datasets/.<NAME>.incoming (rsync --link-dest against the
     current copy, so unchanged files are hard links, not bytes);
   - the model when --sync-model is given or a file of it is missing on the host.
3. verify and swap: one ssh call hashes everything that was sent; the staging dataset is
   renamed into place only if every file of it matches the local manifest, so a host never
   sees a half-synced or bad dataset under its final name. A mismatch names the host and the
   file, and the exit code is 1.
A re-sync with nothing changed is one probe per host and transfers nothing. When a host is
127.0.0.1 and REMOTE_ROOT is this repo (the embedded default), the destination is the source:
sync only verifies the local copy. Writes runs/<RUN>/sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import HashCache, iter_files  # noqa: E402
from lib.hostfile import Hostfile, check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import CONTROL_ENV, close_masters, rsh, run_on  # noqa: E402

CODE = ["bin", "lib", "configs", "Makefile", "requirements.lock"]
PROBE_TIMEOUT = 60
RSYNC_TIMEOUT = 3600

# Choose the fastest sha256 a host has, proven on empty input before it is trusted: `openssl dgst`
# uses the CPU's SHA instructions (3x coreutils' sha256sum here), then sha256sum, then macOS's
# `shasum -a 256`. Every tool prints the hex digest first. Files are passed as ./path, so no
# name can be read as an option by any of them.
PICK_HASH_SH = r"""
h=
for c in "openssl dgst -sha256 -r" sha256sum "shasum -a 256"; do
  s=$($c </dev/null 2>/dev/null) || continue
  case "$s" in e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855*) h=$c; break;; esac
done
if [ -z "$h" ]; then echo "no working sha256 tool (openssl, sha256sum or shasum) on this host" >&2; exit 3; fi
"""

# The probe. $1 = root; $2 = ro (change nothing) or rw (create root and the folders of the
# --mkdir group, after refusing a root that is this host's $HOME); then groups
# "--mkdir d...", "--hash f..." and "--exists f...". Prints `HOME <dir>`, then
# `<sha256>  <size:mtime:ctime:inode>  <path>`, `MISSING  <path>` or `EXISTS  <path>` per
# file. Beyond those folders it changes only its hash cache (REMOTE_ROOT/.thunder-sync-hashes:
# sha256 by size, mtime, ctime and inode, like git's index; a write always changes ctime, and
# entries younger than 2 s are not kept, so a cached hash is never stale). The script is a
# constant; every value reaches it as a positional argument.
PROBE_SH = r"""
root=$1; rw=$2; shift 2
printf 'HOME %s\n' "$HOME"
if [ "$rw" = rw ]; then
  case "$root" in "$HOME"|"${HOME%/}") echo HOMEROOT; exit 0;; esac
  mkdir -p -- "$root" || exit 3
fi
if [ ! -d "$root" ]; then echo NOROOT; exit 0; fi
cd "$root" || exit 3
""" + PICK_HASH_SH + r"""
if stat -c %s . >/dev/null 2>&1; then fmt="-c %s:%Y:%Z:%i"; else fmt="-f %z:%m:%c:%i"; fi
cache=.thunder-sync-hashes
now=$(date +%s)
new=/dev/null
[ "$rw" != rw ] || new=$(mktemp "$root/.thunder-sync-hashes.XXXXXX" 2>/dev/null) || new=/dev/null
mode=hash
for f in "$@"; do
  case "$f" in
    --mkdir) mode=mkdir; continue;;
    --hash) mode=hash; continue;;
    --exists) mode=exists; continue;;
  esac
  if [ "$mode" = mkdir ]; then
    [ "$rw" != rw ] || mkdir -p -- "./$f" || exit 3
    continue
  fi
  if [ ! -f "$f" ]; then printf 'MISSING  %s\n' "$f"; continue; fi
  if [ "$mode" = exists ]; then printf 'EXISTS  %s\n' "$f"; continue; fi
  key=$(stat $fmt -- "$f") || exit 3
  sum=$(awk -v k="$key" -v p="$f" '$2 == k && $3 == p { print $1; exit }' "$cache" 2>/dev/null)
  if [ -z "$sum" ]; then
    sum=$($h "./$f") || exit 3
    sum=${sum%% *}
  fi
  printf '%s  %s  %s\n' "$sum" "$key" "$f"
  ctime=${key#*:*:}; ctime=${ctime%%:*}
  if [ $((now - ctime)) -gt 2 ]; then printf '%s %s %s\n' "$sum" "$key" "$f" >> "$new"; fi
done
if [ "$new" != /dev/null ]; then mv -f "$new" "$cache" 2>/dev/null || rm -f "$new"; fi
"""

# After the transfers, one call per host: hash what was sent, then swap the dataset's staging
# folder into place. $1 = root; $2 = the dataset's folder relative to root (datasets/NAME), or
# - when no dataset was sent; then pairs `<sha256> <path>` (relative to root; the dataset's
# files as datasets/.NAME.incoming/<file>). A mismatch prints `MISMATCH <path> <got>` and the
# exit code is 4; the staging folder is swapped in only when every one of its files matched,
# so a bad copy never goes live (code and model mismatches are reported the same way). If an
# earlier swap was cut between its two renames, the aside copy is put back first.
VERIFY_SWAP_SH = r"""
set -e
root=$1; swap=$2; shift 2
cd "$root"
""" + PICK_HASH_SH + r"""
staging=//none; if [ "$swap" != - ]; then parent=${swap%/*}; name=${swap##*/}; staging="$parent/.$name.incoming"; fi
bad=; badstage=
mismatch() {
  echo "MISMATCH $1 $2"; bad=1
  case "$1" in "$staging"/*) badstage=1;; esac
}
# Missing files first; the pairs of the files that exist stay in "$@".
want=
for a; do
  shift
  if [ -z "$want" ]; then want=$a; continue; fi
  if [ -f "$a" ]; then set -- "$@" "$want" "$a"; else mismatch "$a" missing; fi
  want=
done
# One hash call for all of them (a process per file costs more than hashing small files).
hash_all() {
  odd=
  for a; do shift; if [ -n "$odd" ]; then set -- "$@" "./$a"; odd=; else odd=1; fi; done
  [ $# -eq 0 ] || $h "$@"
}
out=$(hash_all "$@")
while IFS= read -r line; do
  [ -n "$line" ] || continue
  want=$1; f=$2; shift 2
  got=${line%% *}
  if [ "$got" != "$want" ]; then mismatch "$f" "$got"; fi
done <<EOF
$out
EOF
if [ $# -ne 0 ]; then echo "the hash tool printed fewer lines than files" >&2; exit 3; fi
if [ "$swap" != - ] && [ -z "$badstage" ]; then
  cd "$parent"
  if [ ! -e "$name" ] && [ -d ".$name.previous" ]; then mv ".$name.previous" "$name"; fi
  rm -rf ".$name.previous"
  if [ -e "$name" ]; then mv "$name" ".$name.previous"; fi
  mv ".$name.incoming" "$name"
  rm -rf ".$name.previous"
  echo SWAPPED
fi
if [ -n "$bad" ]; then exit 4; fi
"""

HOME_RE = re.compile(r"^/(root|var/root|home/[^/]+|Users/[^/]+)/?$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--remote-root", required=True, help="absolute path on every host")
    p.add_argument("--dataset", required=True, help="name under datasets/")
    p.add_argument("--model", default="", help="model path (synced when under the repo)")
    p.add_argument("--sync-model", action="store_true", help="sync the model even if present")
    p.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    p.add_argument("--run", default="", help="run id: writes runs/<RUN>/sync.json")
    p.add_argument("--max-delete", type=int, default=20, help="bound on deletions in the dataset folder")
    p.add_argument("--bwlimit", type=int, default=0, help="rsync bandwidth limit in KiB/s (0: none)")
    return p


def refuse_dangerous(remote_root: str) -> str:
    """REMOTE_ROOT must be an absolute, clean path that is neither / nor a home directory."""
    check_path(remote_root, "REMOTE_ROOT")
    norm = os.path.normpath(remote_root)
    home = os.path.normpath(os.path.expanduser("~"))
    if norm == "/" or HOME_RE.match(norm) or norm == home:
        raise RunbookError(
            f"REMOTE_ROOT {remote_root!r} refused: it is / or a home directory itself; "
            "use a folder inside it, e.g. REMOTE_ROOT=$HOME/thunder-runbook",
            "sync-refused",
        )
    return norm


def inside(root: str, rel: str) -> str:
    """root/rel, refusing anything that would land outside root."""
    if os.path.isabs(rel) or ".." in Path(rel).parts:
        raise RunbookError(f"destination {rel!r} is outside REMOTE_ROOT {root}", "sync-refused")
    dest = os.path.normpath(os.path.join(root, rel))
    if not dest.startswith(root.rstrip("/") + "/"):
        raise RunbookError(f"destination {dest!r} is outside REMOTE_ROOT {root}", "sync-refused")
    return dest


def model_rel(model: str) -> str | None:
    """The model's path relative to the repo, or None when it is not a local folder here
    (a Hugging Face id: each host resolves it from its own cache). A local model outside the
    repo is refused: it would land outside REMOTE_ROOT."""
    if not model:
        return None
    p = Path(model)
    full = p if p.is_absolute() else paths.ROOT / p
    if not full.exists():
        if p.is_absolute() or model.startswith("."):
            raise RunbookError(f"MODEL {model} does not exist here", "sync-model")
        return None  # a hub id such as mlx-community/gemma-4-e2b-it-4bit
    try:
        # Not resolved: models/x may be a link to another disk; it lands as models/x on the hosts.
        return Path(os.path.normpath(full)).relative_to(paths.ROOT).as_posix()
    except ValueError:
        raise RunbookError(
            f"MODEL {model} is outside the repo, so it would land outside REMOTE_ROOT; "
            "move or link it under models/",
            "sync-model",
        ) from None


CACHE = HashCache(paths.ROOT / ".stamps" / "sync-hashes.json")
sha256_file = CACHE.sha256


def load_manifest(dataset: str) -> dict[str, str]:
    """Expected sha256 of every dataset file from the local manifest, plus the manifest itself.
    Each host's staging copy must hash to these before it is swapped in, so a local copy that
    no longer matches its manifest never goes live anywhere (verify_local then names it)."""
    ddir = paths.DATASETS / dataset
    mpath = ddir / "manifest.json"
    if not mpath.is_file():
        raise RunbookError(f"{paths.rel(mpath)} missing: export the dataset first (make export DATASET={dataset})",
                           "export")
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise RunbookError(f"{paths.rel(mpath)} has no 'files' table; re-run make export", "export")
    for name, meta in files.items():
        if not paths.is_safe_name(name) or name == "manifest.json" or not isinstance(meta, dict) \
                or not re.fullmatch(r"[0-9a-f]{64}", str(meta.get("sha256", ""))):
            raise RunbookError(f"{paths.rel(mpath)}: entry {name!r} is not a plain file name with a sha256; "
                               "re-run make export", "export")
    expected = {f"datasets/{dataset}/{name}": meta["sha256"] for name, meta in sorted(files.items())}
    expected[f"datasets/{dataset}/manifest.json"] = sha256_file(mpath)
    return expected


def verify_local(expected: dict[str, str]) -> dict[str, str]:
    """{file: error} for every local dataset file that does not hash to its manifest value. Run
    only when a host's copy failed verification, to tell a damaged local copy from a bad transfer."""
    bad = {}
    for rel, want in expected.items():
        got = sha256_file(paths.ROOT / rel) if (paths.ROOT / rel).is_file() else "MISSING"
        if got != want:
            bad[rel] = str(RunbookError(f"local {rel} does not match its manifest ({got[:12]} != {want[:12]}), so "
                                        "no host's dataset was replaced with it; re-run make export", "export"))
    return bad


class ModelHashes:
    """The model's file hashes, computed once and only if some host receives the model
    (a real model is gigabytes; hashing it on every no-op sync would dominate)."""

    def __init__(self, files: list[str]):
        self.files = files
        self._lock = threading.Lock()
        self._hashes: dict[str, str] | None = None

    def get(self) -> dict[str, str]:
        with self._lock:
            if self._hashes is None:
                self._hashes = {f: sha256_file(paths.ROOT / f) for f in self.files}
            return self._hashes


def probe(host: str, local: bool, root: str, hash_files: list[str], exist_files: list[str],
          mkdirs: list[str] = (), read_only: bool = False) -> dict:
    argv = ["sh", "-c", PROBE_SH, "sh", root, "ro" if read_only else "rw",
            "--mkdir", *mkdirs, "--hash", *hash_files, "--exists", *exist_files]
    r = run_on(host, argv, timeout=PROBE_TIMEOUT, local=local)
    if not r.ok:
        raise RunbookError(f"{host}: probe failed (exit {r.returncode}): {r.stderr.strip()[:400]}", "sync-ssh")
    out = {"home": "", "noroot": False, "hash": {}, "stat": {}, "missing": set(), "exists": set()}
    for line in r.stdout.splitlines():
        if line.startswith("HOME "):
            out["home"] = line[5:].strip()
        elif line == "HOMEROOT":
            raise RunbookError(f"{host}: REMOTE_ROOT {root} is that host's home directory itself; "
                               "use a folder inside it", "sync-refused")
        elif line == "NOROOT":
            out["noroot"] = True
        elif line.startswith("MISSING  "):
            out["missing"].add(line[9:])
        elif line.startswith("EXISTS  "):
            out["exists"].add(line[8:])
        elif re.match(r"^[0-9a-f]{64}  [0-9]+:[0-9]+:", line):
            key, path = line[66:].split("  ", 1)
            out["hash"][path] = line[:64]
            out["stat"][path] = key
    return out


def rsync(args: list[str], dry_run: bool, bwlimit: int) -> tuple[int, list[str], str]:
    """Run rsync with the unattended ssh; returns (bytes sent, itemized changes, stderr)."""
    argv = ["rsync", "-a", "--itemize-changes", "--stats", "-e", rsh()]
    if dry_run:
        argv.append("--dry-run")
    if bwlimit:
        argv.append(f"--bwlimit={bwlimit}")
    argv += args
    p = subprocess.run(argv, cwd=paths.ROOT, capture_output=True, text=True, timeout=RSYNC_TIMEOUT,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RunbookError(f"rsync exited {p.returncode}: {p.stderr.strip()[:600]}", "sync-ssh")
    sent = 0
    m = re.search(r"Total bytes sent: ([\d,.]+)", p.stdout)
    if m:
        sent = int(re.sub(r"[,.]", "", m.group(1)))
    changes = [ln for ln in p.stdout.splitlines() if re.match(r"^[<>ch.*][fdLDS*]", ln) and not ln.startswith(".d")]
    return sent, changes, p.stderr


def mismatched_paths(stdout: str) -> list[str]:
    """The paths of VERIFY_SWAP_SH's `MISMATCH <path> <got>` lines (a path may hold spaces; the
    digest, or `missing`, does not)."""
    return [ln[9:].rsplit(" ", 1)[0] for ln in stdout.splitlines() if ln.startswith("MISMATCH ")]


def quick_key(path: Path) -> list[str]:
    """[size, mtime seconds]: what rsync's quick check compares."""
    st = path.stat()
    return [str(st.st_size), str(int(st.st_mtime))]


def sync_host(host: str, args, plan: dict) -> dict:
    """Probe, transfer what differs, swap, verify. Returns this host's report."""
    root = plan["root"]
    local = is_local(host)
    rec: dict = {"host": host, "transferred_bytes": 0, "changes": [], "actions": [], "verified": False}
    t0 = time.monotonic()
    if local and Path(root) == paths.ROOT:
        # The embedded default: the destination is this repo. Nothing to copy; verify it.
        bad = {f: h for f, h in plan["expected"].items() if sha256_file(paths.ROOT / f) != h}
        rec.update(actions=["none: destination is the source"], verified=not bad,
                   mismatches=sorted(bad), wall_s=round(time.monotonic() - t0, 3))
        return rec

    dest = root if local else f"{host}:{root}"
    name = args.dataset
    final_rel, staging_rel = f"datasets/{name}", f"datasets/.{name}.incoming"
    mrel = plan["model_rel"]
    hash_files = sorted(plan["code"]) + sorted(plan["expected"])
    # The probe also creates REMOTE_ROOT and the folders the transfers land in (not on a dry
    # run), after refusing a REMOTE_ROOT that is the host's $HOME: no separate mkdir round trip.
    mkdirs = ["datasets", *([os.path.dirname(mrel)] if mrel and os.path.dirname(mrel) else [])]
    before = probe(host, local, root, hash_files, plan["model_files"], mkdirs, read_only=args.dry_run)
    if before["home"] and os.path.normpath(before["home"]) == root:
        raise RunbookError(f"{host}: REMOTE_ROOT {root} is that host's home directory itself", "sync-refused")

    code_diff = [f for f, h in plan["code"].items() if before["hash"].get(f) != h]
    data_diff = [f for f, h in plan["expected"].items() if before["hash"].get(f) != h]
    model_missing = [f for f in plan["model_files"] if f in before["missing"]] if mrel else []
    do_model = bool(mrel) and (args.sync_model or bool(model_missing) or before["noroot"])
    rec["before"] = {"code_differs": code_diff, "dataset_differs": data_diff, "model_missing": model_missing}

    def send_code():
        return "code", *rsync(["--checksum", "-R", "--exclude=__pycache__", "--exclude=*.pyc",
                               "--exclude=.*", *CODE, f"{dest}/"], args.dry_run, args.bwlimit)[:2]

    # Only the manifest's files (and the manifest) travel: everything that goes live is verified.
    only = [f"--include=/{f.rsplit('/', 1)[1]}" for f in plan["expected"]] + ["--exclude=*"]

    def send_dataset():
        src = f"datasets/{name}/"
        if args.dry_run:
            return "dataset", *rsync(["--checksum", "--delete", "--delete-excluded", f"--max-delete={args.max_delete}",
                                      *only, src, f"{dest}/{final_rel}/"], True, args.bwlimit)[:2]
        # Into the staging folder; unchanged files are hard links to the live copy. rsync's
        # quick check (size and mtime) decides what --link-dest links. It can only be fooled by
        # a file that differs in content but not in size and mtime (to the second); only then
        # pay a --checksum pass over every file.
        fooled = [f for f in data_diff if f in before["stat"]
                  and quick_key(paths.ROOT / f) == before["stat"][f].split(":")[:2]]
        rec["checksum_pass"] = bool(fooled)
        sent, changes, _ = rsync([*(["--checksum"] if fooled else []), "--delete",
                                  f"--max-delete={args.max_delete}", f"--link-dest={inside(root, final_rel)}",
                                  *only, src, f"{dest}/{staging_rel}/"], False, args.bwlimit)
        return "dataset", sent, changes

    def send_model():
        return "model", *rsync(["--delay-updates", f"{mrel}/", f"{dest}/{mrel}/"], args.dry_run, args.bwlimit)[:2]

    # Code, dataset and model travel at once (each its own rsync over the host's one connection).
    jobs = [fn for fn, needed in ((send_code, code_diff), (send_dataset, data_diff), (send_model, do_model)) if needed]
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        for kind, sent, changes in pool.map(lambda fn: fn(), jobs):
            rec["transferred_bytes"] += sent
            rec["changes"] += [f"{kind} {c}" for c in changes]
            rec["actions"].append(kind)

    if args.dry_run:
        rec["verified"] = None
        rec["wall_s"] = round(time.monotonic() - t0, 3)
        return rec

    # Verify, not trust: one call hashes on the host everything that was sent (the dataset in
    # its staging folder) and swaps the dataset in only if all of its files match. Files that
    # were not sent stand on the probe's hashes.
    want = dict(plan["code"], **plan["expected"], **(plan["model_hashes"].get() if do_model else {}))
    sent_files = ([*plan["code"]] if code_diff else []) + (plan["model_files"] if do_model else [])
    pairs = [x for f in sent_files for x in (want[f], f)]
    to_final = {}
    if data_diff:
        for f in plan["expected"]:
            staged = f"{staging_rel}/{f.rsplit('/', 1)[1]}"
            to_final[staged] = f
            pairs += [want[f], staged]
    got = dict(before["hash"])
    if pairs:
        sw = run_on(host, ["sh", "-c", VERIFY_SWAP_SH, "sh", root, final_rel if data_diff else "-", *pairs],
                    local=local, timeout=RSYNC_TIMEOUT)
        bad = {to_final.get(p, p) for p in mismatched_paths(sw.stdout)}
        if sw.returncode not in (0, 4) or (sw.returncode == 4 and not bad):
            raise RunbookError(f"{host}: verify/swap failed (exit {sw.returncode}): {sw.stderr.strip()[:400]}",
                               "sync-ssh")
        swapped = "SWAPPED" in sw.stdout.split()
        if data_diff and not bad & set(plan["expected"]) and not swapped:
            raise RunbookError(f"{host}: {staging_rel} verified but was not swapped into {final_rel}", "sync-ssh")
        # The live dataset is the new one only if it was swapped in; else the probe's hashes stand.
        got.update({f: want[f] for f in [*sent_files, *(to_final.values() if swapped else ())] if f not in bad})
        got.update({f: "mismatch" for f in bad})
    mismatches = sorted(f for f, h in want.items() if got.get(f) != h)
    rec.update(verified=not mismatches, mismatches=mismatches,
               wall_s=round(time.monotonic() - t0, 3))
    return rec


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.time()
    try:
        root = refuse_dangerous(args.remote_root)
        if not paths.is_safe_name(args.dataset):
            raise RunbookError(f"DATASET {args.dataset!r} is not a plain folder name", "sync-refused")
        hf: Hostfile = load_hostfile(args.hostfile)
        expected = load_manifest(args.dataset)
        code = {f: sha256_file(paths.ROOT / f) for f in iter_files(paths.ROOT, CODE)}
        mrel = model_rel(args.model)
        model_files = [f for f in iter_files(paths.ROOT, [mrel])] if mrel else []
        for f in list(code) + list(expected) + model_files:
            inside(root, f)
            if any(c in f for c in "\n\r\\"):
                raise RunbookError(f"{f!r}: a file name with a newline or backslash cannot be verified on the "
                                   "hosts; rename it", "sync-refused")
        if args.run:
            paths.check_run_id(args.run)
    except RunbookError as e:
        return die(e, 2)

    plan = {"root": root, "code": code, "expected": expected, "model_rel": mrel,
            "model_files": model_files, "model_hashes": ModelHashes(model_files)}
    hosts = hf.unique_ssh()

    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def one(h: str) -> None:
        try:
            results[h] = sync_host(h, args, plan)
        except RunbookError as e:
            errors[h] = str(e)
        except subprocess.TimeoutExpired as e:
            errors[h] = f"{h}: timed out: {e}"

    ctl = tempfile.mkdtemp(prefix="thsync-", dir="/tmp")  # short: a socket path is <= 104 bytes
    os.environ[CONTROL_ENV] = ctl
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            list(pool.map(one, hosts))
    finally:
        close_masters(hosts)
        os.environ.pop(CONTROL_ENV, None)
        shutil.rmtree(ctl, ignore_errors=True)
    CACHE.save()

    # A host whose copy of the dataset failed verification: is the local copy itself damaged?
    local_bad: dict[str, str] = {}
    if any(set(r.get("mismatches", [])) & set(expected) for r in results.values()):
        local_bad = verify_local(expected)

    code_rc = 0
    for msg in local_bad.values():
        print(f"error: {msg}", file=sys.stderr)
        code_rc = 1
    for h in hosts:
        if h in errors:
            event("sync", host=h, status="error")
            print(f"error: {errors[h]}", file=sys.stderr)
            code_rc = 1
            continue
        r = results[h]
        for c in r["changes"]:
            print(f"  {h}: {'would ' if args.dry_run else ''}{c}")
        status = "dry-run" if args.dry_run else ("verified" if r["verified"] else "MISMATCH")
        event("sync", host=h, status=status, actions="+".join(r["actions"]) or "none",
              bytes=r["transferred_bytes"], wall_s=r["wall_s"])
        if r["verified"] is False:
            for f in r["mismatches"]:
                if f in local_bad:
                    continue  # named above: the local copy is the culprit
                print(f"error: {h}: {f} does not match the local copy after sync; "
                      f"check the host's disk (df -h {root}) and re-run make sync; "
                      "see RUNBOOK.md#sync-verify", file=sys.stderr)
            code_rc = 1

    report = {
        "hostfile": args.hostfile,
        "remote_root": root,
        "dataset": args.dataset,
        "model": args.model,
        "dry_run": args.dry_run,
        "hosts": [results.get(h, {"host": h, "error": errors.get(h)}) for h in hosts],
        "local_dataset_errors": local_bad,
        "ok": code_rc == 0,
        "wall_s": round(time.time() - t0, 3),
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.run and not args.dry_run:
        atomic.write_json(paths.run_dir(args.run) / "sync.json", report)
    event("sync-summary", hosts=len(hosts), ok=code_rc == 0, wall_s=report["wall_s"])
    return code_rc


if __name__ == "__main__":
    sys.exit(main())
