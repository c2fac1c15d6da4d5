#!/usr/bin/env python3
"""sync: code, dataset (and model) to the same absolute path on every host, verified by sha256.

Usage:
    python bin/sync.py --hostfile HOSTFILE --remote-root DIR --dataset NAME [--model PATH]
                       [--sync-model] [--dry-run] [--run RUN] [--max-delete N] [--bwlimit KBPS]
                       [--rsync PATH] [--rsync-path PATH]

Example:
    python bin/sync.py --hostfile hostfile.json --remote-root /Users/op/thunder-runbook \
        --dataset domain_sft_v1_high_signal_thunder --model models/tiny-gemma4 --run stage1

Per host (hosts in parallel, each over one shared ssh connection):
1. probe: one call refuses a REMOTE_ROOT that is the host's $HOME, creates REMOTE_ROOT, hashes
   the host's code and dataset (openssl, sha256sum or shasum: no Python needed there), lists its
   dataset folder and says which model files exist.
2. rsync what differs, at once: the code into REMOTE_ROOT (never deletes); the manifest's files
   into datasets/.NAME.incoming (--link-dest: unchanged files are hard links, not bytes); the
   model with --sync-model or when a file of it is missing on the host.
3. verify, then swap: everything sent is hashed on the host; the staging dataset is renamed into
   place only if every file of it matches the local manifest. A killed sync or a bad copy leaves
   the previous dataset live; a mismatch names host and file.
A no-op re-sync is the probe alone. rsync 3.x, macOS's rsync 2.6.9 and Apple's openrsync all
work, at either end (--rsync: the local binary; --rsync-path: the hosts'). On the embedded
default (127.0.0.1, REMOTE_ROOT = this repo) the destination is the source: sync only verifies.
Writes runs/<RUN>/sync.json. Exit codes: 0 verified, 1 a host failed, 2 refused before any copy.
"""

from __future__ import annotations

import argparse
import functools
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
from lib.hashing import iter_files, sha256_file  # noqa: E402
from lib.hostfile import check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import CONTROL_ENV, close_masters, rsh, run_on  # noqa: E402

CODE = ["bin", "lib", "configs", "Makefile", "requirements.lock"]
PROBE_TIMEOUT = 60
RSYNC_TIMEOUT = 3600
RSYNC_IO_TIMEOUT = 300  # rsync gives up after this long without any I/O
HOME_RE = re.compile(r"^/(root|var/root|home/[^/]+|Users/[^/]+)/?$")
PLAIN_PATH_RE = re.compile(r"^[A-Za-z0-9_./+-]+$")
HASH_LINE_RE = re.compile(r"^([0-9a-f]{64}) [ *]\./(.+)$")  # openssl -r: `<hex> *./f`; the others `<hex>  ./f`
# `Total bytes sent: 1,234` (rsync 3.x; 2.6.9 prints no commas); openrsync: `Total sent: 278 B`
# (its humanize_number: plain bytes without -h, which we never pass; `1.2 MB` with -h, `1.2 MiB` with -hh).
SENT_RE = re.compile(r"^Total (?:bytes )?sent: ([\d.,']+) ?(?:([KMGTPE]?)(i?)B?)$", re.M)
CHANGE_RE = re.compile(r"^[<>ch.*][fdLDS*]")  # --itemize-changes lines (`*deleting` included)
# Only options all three rsyncs have: -a -c -R --include/--exclude
# --link-dest --delay-updates --itemize-changes --stats --timeout --bwlimit --dry-run -e --rsync-path.
# Not used: --info, --mkpath, -s/--protect-args, --append-verify (neither 2.6.9 nor openrsync has
# them), --delete-delay (not in 2.6.9), --delete-excluded (rsync 3.x hangs on it against openrsync).
# Deletions: only the swap removes files (what the probe listed beyond the manifest, at most
# --max-delete), never rsync, whose --max-delete differs between them (2.6.9: 0 is no limit and
# going over only warns; 3.x: 0 deletes nothing and going over exits 25).

# Choose the fastest sha256 a host has, proven on empty input before it is trusted: `openssl dgst`
# uses the CPU's SHA instructions (3x coreutils' sha256sum here), then sha256sum, then macOS's
# `shasum -a 256`. Files are passed as ./path, so no name can be read as an option.
PICK_HASH_SH = r"""
h=
for c in "openssl dgst -sha256 -r" sha256sum "shasum -a 256"; do
  s=$($c </dev/null 2>/dev/null) || continue
  case "$s" in e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855*) h=$c; break;; esac
done
if [ -z "$h" ]; then echo "no working sha256 tool (openssl, sha256sum or shasum) on this host" >&2; exit 3; fi
"""

# The probe, also the verification after a transfer. $1 = root; $2 = rw (create root/datasets and
# root/$3 unless $3 is -; remove the staging folder a killed sync left beside $4) or ro (change
# nothing); $4 = the dataset folder to list (or -); then the files to
# hash, then `--exists` and the files only to look for. Prints HOMEROOT, NOROOT, `LIVE <name>`,
# `MISSING <path>`, `EXISTS <path>` and the hash tool's `<sha256> ./<path>` lines. Every value
# reaches the constant script as a positional argument.
PROBE_SH = r"""
root=$1; mode=$2; mk=$3; list=$4; shift 4
case "$root" in "$HOME"|"${HOME%/}") echo HOMEROOT; exit 0;; esac
if [ "$mode" = rw ]; then
  mkdir -p -- "$root/datasets" || exit 3
  if [ "$mk" != - ]; then mkdir -p -- "$root/$mk" || exit 3; fi
fi
if [ ! -d "$root" ]; then echo NOROOT; exit 0; fi
cd "$root" || exit 3
""" + PICK_HASH_SH + r"""
if [ "$list" != - ] && [ -d "$list" ]; then ls -A -- "$list" | sed 's/^/LIVE /'; fi
if [ "$mode" = rw ] && [ "$list" != - ]; then rm -rf -- "${list%/*}/.${list##*/}.incoming"; fi
exists=
for f; do
  shift
  if [ "$f" = --exists ]; then exists=1
  elif [ ! -f "$f" ]; then printf 'MISSING %s\n' "$f"
  elif [ -n "$exists" ]; then printf 'EXISTS %s\n' "$f"
  else set -- "$@" "./$f"; fi
done
if [ $# -gt 0 ]; then $h "$@" || exit 3; fi
"""

# The swap, once the staging copy verified: $1 = root, $2 = dataset name. If an earlier swap was
# cut between its two renames, the aside copy is put back first.
SWAP_SH = r"""set -e
cd "$1/datasets"; n=$2
if [ ! -e "$n" ] && [ -d ".$n.previous" ]; then mv ".$n.previous" "$n"; fi
rm -rf ".$n.previous"
if [ -e "$n" ]; then mv "$n" ".$n.previous"; fi
mv ".$n.incoming" "$n"
rm -rf ".$n.previous"
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--remote-root", required=True, help="absolute path on every host")
    p.add_argument("--dataset", required=True, help="name under datasets/")
    p.add_argument("--model", default="", help="model path (synced when under the repo)")
    p.add_argument("--sync-model", action="store_true", help="sync the model even if present")
    p.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    p.add_argument("--run", default="", help="run id: writes runs/<RUN>/sync.json")
    p.add_argument("--max-delete", type=int, default=20, help="most files removed from a host's dataset folder")
    p.add_argument("--bwlimit", type=int, default=0, help="rsync bandwidth limit in KiB/s (0: none)")
    p.add_argument("--rsync", default="rsync", help="the local rsync (e.g. /usr/bin/rsync, openrsync)")
    p.add_argument("--rsync-path", default="", help="the hosts' rsync (default: the one on their PATH)")
    return p


def refuse_dangerous(remote_root: str) -> str:
    """REMOTE_ROOT must be an absolute, clean path that is neither / nor a home directory."""
    check_path(remote_root, "REMOTE_ROOT")
    norm = os.path.normpath(remote_root)
    if norm == "/" or HOME_RE.match(norm) or norm == os.path.normpath(os.path.expanduser("~")):
        raise RunbookError(f"REMOTE_ROOT {remote_root!r} refused: it is / or a home directory itself; "
                           "use a folder inside it, e.g. REMOTE_ROOT=$HOME/thunder-runbook", "sync-refused")
    return norm


def check_rsyncs(local: str, remote: str) -> None:
    if not shutil.which(local):
        raise RunbookError(f"--rsync {local!r}: no such program here; install rsync or pass RSYNC=/usr/bin/rsync",
                           "sync-rsync")
    if remote and not PLAIN_PATH_RE.match(remote):
        raise RunbookError(f"--rsync-path {remote!r} refused: it reaches the host's shell, so it must be a plain "
                           "path (letters, digits, _ . / + -), e.g. RSYNC_PATH=/usr/bin/rsync", "sync-rsync")


def inside(root: str, rel: str) -> str:
    """root/rel, refusing anything that would land outside root or that a host cannot verify."""
    dest = os.path.normpath(os.path.join(root, rel))
    if os.path.isabs(rel) or ".." in Path(rel).parts or not dest.startswith(root.rstrip("/") + "/"):
        raise RunbookError(f"destination {rel!r} is outside REMOTE_ROOT {root}", "sync-refused")
    if any(c in rel for c in "\n\r\\"):
        raise RunbookError(f"{rel!r}: a file name with a newline or backslash cannot be verified on the hosts; "
                           "rename it", "sync-refused")
    return dest


def model_rel(model: str) -> str | None:
    """The model's path relative to the repo, or None for a Hugging Face id (each host resolves it
    from its own cache). A local model outside the repo would land outside REMOTE_ROOT: refused."""
    if not model:
        return None
    full = Path(model) if Path(model).is_absolute() else paths.ROOT / model
    if not full.exists():
        if Path(model).is_absolute() or model.startswith("."):
            raise RunbookError(f"MODEL {model} does not exist here", "sync-model")
        return None  # a hub id such as mlx-community/gemma-4-e2b-it-4bit
    try:  # not resolved: models/x may link to another disk; it lands as models/x on the hosts
        return Path(os.path.normpath(full)).relative_to(paths.ROOT).as_posix()
    except ValueError:
        raise RunbookError(f"MODEL {model} is outside the repo, so it would land outside REMOTE_ROOT; "
                           "move or link it under models/", "sync-model") from None


def load_manifest(dataset: str) -> dict[str, str]:
    """{datasets/NAME/file: sha256} from the local manifest, plus the manifest itself. Each host's
    staging copy must hash to these before it is swapped in."""
    mpath = paths.DATASETS / dataset / "manifest.json"
    if not mpath.is_file():
        raise RunbookError(f"{paths.rel(mpath)} missing: export the dataset first (make export DATASET={dataset})",
                           "export")
    files = json.loads(mpath.read_text(encoding="utf-8")).get("files")
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


_model_lock = threading.Lock()


@functools.cache
def _model_hashes(files: tuple[str, ...]) -> dict[str, str]:
    return {f: sha256_file(paths.ROOT / f) for f in files}


def model_hashes(files: list[str]) -> dict[str, str]:
    """Hashed once, and only if some host receives the model (gigabytes: never on a no-op sync)."""
    with _model_lock:
        return _model_hashes(tuple(files))


def probe(host: str, local: bool, root: str, args: list[str]) -> dict:
    """Run PROBE_SH (args: mode, mkdir, folder to list, files...) and parse what it prints."""
    r = run_on(host, ["sh", "-c", PROBE_SH, "sh", root, *args], timeout=PROBE_TIMEOUT, local=local)
    if not r.ok:
        raise RunbookError(f"{host}: probe failed (exit {r.returncode}): {r.stderr.strip()[:400]}", "sync-ssh")
    out: dict = {"noroot": False, "hash": {}, "live": set(), "exists": set()}
    for line in r.stdout.splitlines():
        m = HASH_LINE_RE.match(line)
        if line == "HOMEROOT":
            raise RunbookError(f"{host}: REMOTE_ROOT {root} is that host's home directory itself; "
                               "use a folder inside it", "sync-refused")
        out["noroot"] |= line == "NOROOT"
        if line.startswith(("LIVE ", "EXISTS ")):
            out["live" if line[0] == "L" else "exists"].add(line.split(" ", 1)[1])
        elif m:
            out["hash"][m.group(2)] = m.group(1)
    return out


def bytes_sent(stats: str) -> int | None:
    """Bytes sent, from the --stats of rsync 3.x, rsync 2.6.9 or openrsync (None: no such line)."""
    m = SENT_RE.search(stats)
    if not m:
        return None
    number, unit, iec = m.groups()
    if not unit:
        return int(re.sub(r"[,.']", "", number))
    return round(float(number.replace(",", "")) * (1024 if iec else 1000) ** ("KMGTPE".index(unit) + 1))


def rsync(host: str, args, rsync_args: list[str]) -> tuple[int | None, list[str]]:
    """Run the local rsync with the unattended ssh; returns (bytes sent, itemized changes)."""
    argv = [args.rsync, "-a", "--itemize-changes", "--stats", f"--timeout={RSYNC_IO_TIMEOUT}", "-e", rsh(),
            *([f"--rsync-path={args.rsync_path}"] if args.rsync_path else []),
            *(["--dry-run"] if args.dry_run else []), *([f"--bwlimit={args.bwlimit}"] if args.bwlimit else []),
            *rsync_args]
    p = subprocess.run(argv, cwd=paths.ROOT, capture_output=True, text=True, timeout=RSYNC_TIMEOUT,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RunbookError(f"{host}: {args.rsync} exited {p.returncode}: {p.stderr.strip()[:600]}", "sync-ssh")
    changes = [ln for ln in p.stdout.splitlines() if CHANGE_RE.match(ln) and not ln.startswith(".d")]
    return bytes_sent(p.stdout), changes


def transfers(host: str, args, plan: dict, before: dict, diff: dict) -> list[tuple[str, list[str]]]:
    """(kind, rsync arguments) for what this host lacks: code, dataset, model."""
    root, name, mrel = plan["root"], args.dataset, plan["model_rel"]
    dest = root if is_local(host) else f"{host}:{root}"
    jobs = []
    if diff["code"]:
        jobs.append(("code", ["--checksum", "-R", "--exclude=__pycache__", "--exclude=*.pyc", "--exclude=.*",
                              *CODE, f"{dest}/"]))
    if diff["dataset"] or diff["extra"]:
        # Only the manifest's files travel (everything that goes live is verified), into a fresh
        # staging folder, unchanged files hard-linked from the live copy; a dry run compares with
        # the live copy itself. rsync's quick check (size, mtime) could keep a same-sized damaged
        # file, so --checksum whenever a differing file exists on the host. (No --delete-excluded:
        # rsync 3.x hangs on it against openrsync; the probe lists what the swap deletes.)
        only = [f"--include=/{f.rsplit('/', 1)[1]}" for f in plan["expected"]] + ["--exclude=*"]
        into = f"datasets/{name}" if args.dry_run else f"datasets/.{name}.incoming"
        link = [] if args.dry_run else [f"--link-dest={inside(root, f'datasets/{name}')}"]
        check = ["--checksum"] if args.dry_run or set(diff["dataset"]) & set(before["hash"]) else []
        jobs.append(("dataset", [*check, *link, *only, f"datasets/{name}/", f"{dest}/{into}/"]))
    if diff["model"]:
        jobs.append(("model", ["--delay-updates", f"{mrel}/", f"{dest}/{mrel}/"]))
    return jobs


def sync_host(host: str, args, plan: dict) -> dict:
    """Probe, transfer what differs, verify, swap. Returns this host's report."""
    root, name, mrel = plan["root"], args.dataset, plan["model_rel"]
    local, t0 = is_local(host), time.monotonic()
    rec: dict = {"host": host, "transferred_bytes": 0, "changes": [], "actions": [], "verified": False}
    if local and Path(root) == paths.ROOT:  # the embedded default: nothing to copy; verify it
        bad = sorted(f for f, h in plan["expected"].items() if sha256_file(paths.ROOT / f) != h)
        return dict(rec, actions=["none: destination is the source"], verified=not bad, mismatches=bad,
                    wall_s=round(time.monotonic() - t0, 3))

    # 1. probe (it creates REMOTE_ROOT and the folders the transfers land in, except on a dry run)
    mkdir = os.path.dirname(mrel) if mrel and os.path.dirname(mrel) else "-"
    before = probe(host, local, root, ["ro" if args.dry_run else "rw", mkdir, f"datasets/{name}",
                                       *plan["code"], *plan["expected"], "--exists", *plan["model_files"]])
    names = {f.rsplit("/", 1)[1] for f in plan["expected"]}
    diff = {"code": [f for f, h in plan["code"].items() if before["hash"].get(f) != h],
            "dataset": [f for f, h in plan["expected"].items() if before["hash"].get(f) != h],
            "extra": sorted(before["live"] - names),
            "model_missing": [f for f in plan["model_files"] if f not in before["exists"]]}
    diff["model"] = bool(mrel) and (args.sync_model or bool(diff["model_missing"]))
    rec["before"] = diff
    if len(diff["extra"]) > args.max_delete:
        raise RunbookError(f"{host}: datasets/{name} holds {len(diff['extra'])} files that are not in its manifest "
                           f"({', '.join(diff['extra'][:5])}, ...): more than --max-delete {args.max_delete} to "
                           "delete; check DATASET, move them away, or raise --max-delete", "sync-refused")

    # 2. transfer what differs: code, dataset and model at once
    jobs = transfers(host, args, plan, before, diff)
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        for (kind, _), (sent, changes) in zip(jobs, pool.map(lambda j: rsync(host, args, j[1]), jobs)):
            total = rec["transferred_bytes"]
            rec["transferred_bytes"] = None if sent is None or total is None else total + sent
            rec["changes"] += [f"{kind} {c}" for c in changes]
            rec["actions"].append(kind)
    if args.dry_run:
        rec["changes"] += [f"dataset *deleting {f}" for f in diff["extra"]]
        return dict(rec, verified=None, wall_s=round(time.monotonic() - t0, 3))

    # 3. verify, not trust: hash on the host everything sent; swap the dataset in only if all of
    # it matches. Files not sent stand on the probe's hashes.
    want = dict(plan["code"], **plan["expected"], **(model_hashes(plan["model_files"]) if diff["model"] else {}))
    staged = {f"datasets/.{name}.incoming/{f.rsplit('/', 1)[1]}": f
              for f in plan["expected"]} if "dataset" in rec["actions"] else {}
    sent = [*(plan["code"] if diff["code"] else []), *(plan["model_files"] if diff["model"] else []), *staged]
    got = dict(before["hash"])
    if sent:
        after = probe(host, local, root, ["ro", "-", "-", *sent])["hash"]
        good = all(after.get(s) == want[f] for s, f in staged.items())
        if staged and good:
            r = run_on(host, ["sh", "-c", SWAP_SH, "sh", root, name], local=local, timeout=PROBE_TIMEOUT)
            if not r.ok:
                raise RunbookError(f"{host}: swapping datasets/.{name}.incoming in failed (exit {r.returncode}): "
                                   f"{r.stderr.strip()[:400]}", "sync-ssh")
        got.update({f: after.get(f, "missing") for f in sent if f not in staged})
        got.update({f: after.get(s, "missing") for s, f in staged.items() if good or after.get(s) != want[f]})
    mismatches = sorted(f for f, h in want.items() if got.get(f) != h)
    return dict(rec, verified=not mismatches, mismatches=mismatches, wall_s=round(time.monotonic() - t0, 3))


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.time()
    try:  # every refusal comes before any ssh or rsync
        root = refuse_dangerous(args.remote_root)
        check_rsyncs(args.rsync, args.rsync_path)
        if not paths.is_safe_name(args.dataset):
            raise RunbookError(f"DATASET {args.dataset!r} is not a plain folder name", "sync-refused")
        hf = load_hostfile(args.hostfile)
        expected = load_manifest(args.dataset)
        code = {f: sha256_file(paths.ROOT / f) for f in iter_files(paths.ROOT, CODE)}
        mrel = model_rel(args.model)
        model_files = iter_files(paths.ROOT, [mrel]) if mrel else []
        for f in [*code, *expected, *model_files]:
            inside(root, f)
        if args.run:
            paths.check_run_id(args.run)
    except RunbookError as e:
        return die(e, 2)

    plan = {"root": root, "code": code, "expected": expected, "model_rel": mrel, "model_files": model_files}
    hosts = hf.unique_ssh()

    def one(h: str) -> dict:
        try:
            return sync_host(h, args, plan)
        except RunbookError as e:
            return {"host": h, "error": str(e)}
        except subprocess.TimeoutExpired as e:
            return {"host": h, "error": f"{h}: timed out: {e}; see RUNBOOK.md#sync-ssh"}

    ctl = tempfile.mkdtemp(prefix="thsync-", dir="/tmp")  # short: a socket path is <= 104 bytes
    os.environ[CONTROL_ENV] = ctl  # one ssh connection per host for all of its calls
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            results = list(pool.map(one, hosts))
    finally:
        close_masters(hosts)
        os.environ.pop(CONTROL_ENV, None)
        shutil.rmtree(ctl, ignore_errors=True)

    # A host's dataset failed verification: is the local copy itself damaged? Name it, not the host.
    local_bad = []
    if any(set(r.get("mismatches", [])) & set(expected) for r in results):
        local_bad = [f for f, h in expected.items() if not (paths.ROOT / f).is_file()
                     or sha256_file(paths.ROOT / f) != h]
    rc = 0
    for f in local_bad:
        rc = die(RunbookError(f"local {f} does not match its manifest, so no host's dataset was replaced "
                              "with it; re-run make export", "export"))
    for r in results:
        h = r["host"]
        if "error" in r:
            event("sync", host=h, status="error")
            rc = die(r["error"])
            continue
        for c in r["changes"]:
            print(f"  {h}: {'would ' if args.dry_run else ''}{c}")
        b = r["transferred_bytes"]
        event("sync", host=h, status="dry-run" if args.dry_run else ("verified" if r["verified"] else "MISMATCH"),
              actions="+".join(r["actions"]) or "none", bytes="unknown" if b is None else b, wall_s=r["wall_s"])
        for f in r.get("mismatches", []):
            if f not in local_bad:
                rc = die(RunbookError(f"{h}: {f} does not match the local copy after sync; check the host's disk "
                                      f"(df -h {root}) and re-run make sync", "sync-verify"))
        rc = rc or int(r["verified"] is False)

    report = {"hostfile": args.hostfile, "remote_root": root, "dataset": args.dataset, "model": args.model,
              "dry_run": args.dry_run, "rsync": args.rsync, "rsync_path": args.rsync_path, "hosts": results,
              "local_dataset_errors": local_bad, "ok": rc == 0, "wall_s": round(time.time() - t0, 3),
              "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.run and not args.dry_run:
        atomic.write_json(paths.run_dir(args.run) / "sync.json", report)
    event("sync-summary", hosts=len(hosts), ok=rc == 0, wall_s=report["wall_s"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
