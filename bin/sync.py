#!/usr/bin/env python3
"""sync: code, dataset (and model) to the same absolute path on every host, verified by sha256.

Usage: python bin/sync.py --hostfile HOSTFILE --remote-root DIR --dataset NAME [--model PATH] [--dry-run] ...
Example:
    python bin/sync.py --hostfile hostfile.json --remote-root /Users/op/thunder-runbook \
        --dataset domain_sft_v1_high_signal_thunder --model models/tiny-gemma4 --run stage1

Per host, in parallel, over one ssh connection: a probe hashes the host's copy; rsync sends what
differs (the dataset into datasets/.NAME.incoming, unchanged files hard-linked; host code files this
checkout lacks are deleted); the host hashes what was sent; the dataset goes live only if all of it
matches the manifest (a killed sync or bad copy leaves the old one live). A no-op re-sync is the probe
alone. Writes runs/<RUN>/sync.json. Exit: 0 ok, 1 a host failed, 2 refused.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, hostfile, paths  # noqa: E402
from lib.dataset import read_manifest  # noqa: E402
from lib.hashing import iter_files, sha256_file, tree_hashes  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402
from lib.remote import CONTROL_ENV, close_masters, rsh, run_on  # noqa: E402

CODE = ["bin", "lib", "configs", "Makefile", "requirements.lock"]  # PROBE_SH lists the 3 folders' files
SWAP_TIMEOUT, LONG_TIMEOUT, RSYNC_IO_TIMEOUT = 60, 3600, 300  # s; LONG: a probe (it hashes GBs) or an rsync
MODEL_LOCK = threading.Lock()
HOME_RE = re.compile(r"^/(root|var/root|home/[^/]+|Users/[^/]+)/?$")
PLAIN_PATH_RE = re.compile(r"^[A-Za-z0-9_./+-]+$")
HASH_LINE_RE = re.compile(r"^([0-9a-f]{64}) [ *]\./(.+)$")  # `<hex> *./f` (openssl -r) or `<hex>  ./f`
SENT_RE = re.compile(r"^Total (?:bytes )?sent: ([\d.,']+)(?: B)?$", re.M)
CHANGE_RE = re.compile(r"^(?!\.d)[<>ch.*][fdLDS*]")  # --itemize-changes lines but folders (`*deleting` too)
# Only options rsync 3.x, macOS's 2.6.9 and openrsync share, at either end: not --info, --mkpath, -s,
# --append-verify, --delete-delay, --delete-excluded (3.x hangs on it against openrsync), -R with --delete
# (openrsync to 3.x skips subfolders), --max-delete (2.6.9: 0 = no limit, over it only warns).

# The probe (and the check after a transfer): $1 root; $2 rw (create root/datasets, remove a killed sync's
# staging copy of $3) or ro; $3 the dataset whose files to list (or -); then files to hash (as ./path) and,
# with a leading +, files only to look for. It lists the code folders' files too.
PROBE_SH = r"""
root=$1; mode=$2; name=$3; d=$1/datasets; shift 3
case "$root" in "$HOME"|"${HOME%/}") echo HOMEROOT; exit 0;; esac
if [ "$mode" = rw ]; then mkdir -p -- "$d" && rm -rf -- "$d/.$name.incoming" || exit 3; fi
cd "$root" 2>/dev/null || exit 0  # ro, and no REMOTE_ROOT yet: nothing there
for h in "openssl dgst -sha256 -r" sha256sum "shasum -a 256" ""; do  # the first tool proven on empty input
  case $($h </dev/null 2>/dev/null) in
    e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855*) break;; esac
done
if [ -z "$h" ]; then echo "no working sha256 tool (openssl, sha256sum or shasum) on this host" >&2; exit 3; fi
[ -d "datasets/$name" ] && ls -A -- "datasets/$name" | sed 's/^/LIVE /'
find bin lib configs \( -name '.*' -o -name __pycache__ -o -name '*.pyc' \) -prune -o ! -type d -print \
  2>/dev/null | sed 's/^/CODE /'
for f; do
  shift; g=${f#+}
  if [ "$g" != "$f" ]; then [ -f "$g" ] && echo "EXISTS $g"
  elif [ -f "$f" ]; then set -- "$@" "./$f"; fi
done
if [ $# -gt 0 ]; then $h "$@" || exit 3; fi
"""

# The swap of a verified staging copy: $1 root, $2 dataset. A swap cut between its renames is undone first.
SWAP_SH = r"""set -e; cd "$1/datasets"; n=$2
if [ ! -e "$n" ] && [ -d ".$n.previous" ]; then mv ".$n.previous" "$n"; fi
rm -rf ".$n.previous"; if [ -e "$n" ]; then mv "$n" ".$n.previous"; fi
mv ".$n.incoming" "$n"; rm -rf ".$n.previous"
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
    p.add_argument("--max-delete", type=int, default=20, help="most files deleted on a host (dataset, code)")
    p.add_argument("--bwlimit", type=int, default=0, help="rsync bandwidth limit in KiB/s (0: none)")
    p.add_argument("--rsync", default="rsync", help="the local rsync (e.g. /usr/bin/rsync, openrsync)")
    p.add_argument("--rsync-path", default="", help="the hosts' rsync (default: the one on their PATH)")
    return p


def load_plan(args) -> dict:
    """Every refusal that needs no host, then what goes where: {root, hosts, code, expected, model...}."""
    root = os.path.normpath(hostfile.check_path(args.remote_root, "REMOTE_ROOT"))
    if root == "/" or HOME_RE.match(root) or root == os.path.normpath(os.path.expanduser("~")):
        raise RunbookError(f"REMOTE_ROOT {args.remote_root!r} refused: it is / or a home directory itself; "
                           "use a folder inside it, e.g. REMOTE_ROOT=$HOME/thunder-runbook", "sync-refused")
    if not paths.is_safe_name(args.dataset):
        raise RunbookError(f"DATASET {args.dataset!r} is not a plain folder name", "sync-refused")
    if not shutil.which(args.rsync):
        raise RunbookError(f"--rsync {args.rsync!r}: no such program here; install rsync or pass "
                           "RSYNC=/usr/bin/rsync", "sync-rsync")
    if args.rsync_path and not PLAIN_PATH_RE.match(args.rsync_path):
        raise RunbookError(f"--rsync-path {args.rsync_path!r} refused: the host's shell reads it, so only "
                           "letters, digits and _./+- may be in it: RSYNC_PATH=/usr/bin/rsync", "sync-rsync")
    if args.run:
        paths.check_run_id(args.run)
    hosts, d, model = hostfile.load(args.hostfile).unique_ssh(), f"datasets/{args.dataset}", args.model
    expected = {f"{d}/{f}": m["sha256"] for f, m in sorted(read_manifest(paths.ROOT / d)["files"].items())}
    expected[f"{d}/manifest.json"] = sha256_file(paths.ROOT / d / "manifest.json")
    mrel = None  # the model's path in the repo; None for a hub id (the hosts resolve it)
    if model and (paths.ROOT / model).exists():
        mrel = os.path.relpath(os.path.normpath(paths.ROOT / model), paths.ROOT)  # models/x may be a link
        if mrel.split("/")[0] == "..":
            raise RunbookError(f"MODEL {model} is outside the repo, so it would land outside REMOTE_ROOT; "
                               "move or link it under models/", "sync-model")
        paths.require_complete(paths.ROOT / mrel, model, "sync-model")
    elif model.startswith((".", "/")):
        raise RunbookError(f"MODEL {model} does not exist here: make model", "sync-model")
    return {"root": root, "hosts": hosts, "code": tree_hashes(paths.ROOT, CODE), "expected": expected,
            "model_rel": mrel, "model_files": iter_files(paths.ROOT, [mrel]) if mrel else []}


def probe(host: str, root: str, args: list[str]) -> dict:
    """Run PROBE_SH (args: mode, dataset, files...): {hash: {path: sha256}, live, code, exists}."""
    r = run_on(host, ["sh", "-c", PROBE_SH, "sh", root, *args], timeout=LONG_TIMEOUT)
    if not r.ok:
        raise RunbookError(f"{host}: probe failed (exit {r.returncode}): {r.stderr.strip()[:400]}",
                           "sync-ssh")
    lines = r.stdout.splitlines()
    if "HOMEROOT" in lines:
        raise RunbookError(f"{host}: REMOTE_ROOT {root} is that host's home directory itself; "
                           "use a folder inside it", "sync-refused")
    tags = {t.lower(): {ln[len(t) + 1:] for ln in lines if ln.startswith(f"{t} ")}
            for t in ("LIVE", "CODE", "EXISTS")}
    return dict(tags, hash={m.group(2): m.group(1) for m in map(HASH_LINE_RE.match, lines) if m})


def bytes_sent(stats: str) -> int | None:
    """Bytes sent, from the --stats of rsync 3.x (`1,234`), 2.6.9 (`1234`), openrsync (`1234 B`), or None."""
    m = SENT_RE.search(stats)
    return int(re.sub(r"[,.']", "", m.group(1))) if m else None


def rsync(host: str, args, rsync_args: list[str]) -> tuple[int | None, list[str]]:
    """Run the local rsync with the unattended ssh; returns (bytes sent, itemized changes)."""
    argv = [args.rsync, "-a", "--itemize-changes", "--stats", f"--timeout={RSYNC_IO_TIMEOUT}", "-e", rsh(),
            *([f"--rsync-path={args.rsync_path}"] if args.rsync_path else []),
            *(["--dry-run"] if args.dry_run else []),
            *([f"--bwlimit={args.bwlimit}"] if args.bwlimit else []), *rsync_args]
    r = run_on(host, argv, timeout=LONG_TIMEOUT, local=True)  # here, in the repo (main's chdir)
    if not r.ok:
        raise RunbookError(f"{host}: rsync exited {r.returncode}: {r.stderr.strip()[:500]}", "sync-ssh")
    return bytes_sent(r.stdout), [ln for ln in r.stdout.splitlines() if CHANGE_RE.match(ln)]


def sync_host(host: str, args, plan: dict) -> dict:
    """Probe, transfer what differs, verify, swap. Returns this host's report."""
    root, name, mrel, t0 = plan["root"], args.dataset, plan["model_rel"], time.monotonic()
    rec: dict = {"host": host, "transferred_bytes": 0, "changes": [], "actions": []}
    if hostfile.is_local(host) and Path(root) == paths.ROOT:  # 127.0.0.1 and this repo: only verify
        bad = sorted(f for f, h in plan["expected"].items() if tree_hashes(paths.ROOT, [f]).get(f) != h)
        return dict(rec, actions=["none: destination is the source"], verified=not bad, mismatches=bad,
                    wall_s=round(time.monotonic() - t0, 3))

    # 1. probe (it creates REMOTE_ROOT/datasets, except on a dry run)
    before = probe(host, root, ["ro" if args.dry_run else "rw", name, *plan["code"],
                               *plan["expected"], *(f"+{f}" for f in plan["model_files"])])
    rec["before"] = diff = {"code": [f for f, h in plan["code"].items() if before["hash"].get(f) != h],
                            "dataset": [f for f, h in plan["expected"].items() if before["hash"].get(f) != h],
                            "extra": sorted(before["live"] - {f.rsplit("/", 1)[1] for f in plan["expected"]}),
                            "code_extra": sorted(before["code"] - set(plan["code"]))}
    diff["model"] = bool(mrel) and (args.sync_model or not before["exists"] >= set(plan["model_files"]))
    gone = [*(f"datasets/{name}/{f}" for f in diff["extra"]), *diff["code_extra"]]
    if len(gone) > args.max_delete:
        raise RunbookError(f"{host}: {len(gone)} files that are not in its manifest or this checkout would "
                           f"go ({', '.join(gone[:5])}, ...): more than --max-delete {args.max_delete}; "
                           "check REMOTE_ROOT and DATASET, move them away, or raise it", "sync-refused")

    # 2. transfer what differs: code, dataset and model at once
    dest, jobs = root if hostfile.is_local(host) else f"{host}:{root}", {}
    if diff["code"] or diff["code_extra"]:  # --delete: inside the code folders, not what is excluded
        jobs["code"] = ["--checksum", "--delete", "--exclude=__pycache__", "--exclude=*.pyc", "--exclude=.*",
                        *CODE, f"{dest}/"]
    if diff["dataset"] or diff["extra"]:
        # The manifest's files into a fresh staging folder (dry run: the live one), unchanged ones
        # hard-linked; --checksum when a same-sized damaged file could pass rsync's quick check.
        only = [f"--include=/{f.rsplit('/', 1)[1]}" for f in plan["expected"]] + ["--exclude=*"]
        into = name if args.dry_run else f".{name}.incoming"
        link = [] if args.dry_run else [f"--link-dest={root}/datasets/{name}"]
        check = ["--checksum"] if args.dry_run or set(diff["dataset"]) & set(before["hash"]) else []
        jobs["dataset"] = [*check, *link, *only, f"datasets/{name}/", f"{dest}/datasets/{into}/"]
    if diff["model"]:
        jobs["model"] = ["-R", "--delay-updates", f"{mrel}/", f"{dest}/"]  # -R: creates models/
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        done = dict(zip(jobs, pool.map(lambda a: rsync(host, args, a), jobs.values()), strict=True))
    sizes = [b for b, _ in done.values()]
    rec.update(transferred_bytes=None if None in sizes else sum(sizes), actions=list(jobs),
               changes=[f"{k} {c}" for k, (_, changes) in done.items() for c in changes])
    if args.dry_run:
        rec["changes"] += [f"dataset *deleting {f}" for f in diff["extra"]]
        return dict(rec, verified=None, wall_s=round(time.monotonic() - t0, 3))

    # 3. verify, not trust: the host hashes all that was sent (what was not, the probe hashed: it
    # matched); the dataset is swapped in only if all of it matches.
    if diff["model"]:
        with MODEL_LOCK:  # the model is hashed here once, and only if some host receives it: gigabytes
            plan["model"] = plan.get("model") or tree_hashes(paths.ROOT, plan["model_files"])
    staged = {f"datasets/.{name}.incoming/{f.rsplit('/', 1)[1]}": f for f in plan["expected"]}
    want = {**(plan["code"] if "code" in jobs else {}), **(plan["model"] if diff["model"] else {}),
            **({s: plan["expected"][f] for s, f in staged.items()} if "dataset" in jobs else {})}
    after = probe(host, root, ["ro", "-", *want]) if want else {"hash": {}, "code": set()}
    bad = {staged.get(f, f) for f, h in want.items() if after["hash"].get(f) != h}
    bad |= after["code"] & set(diff["code_extra"])  # what --delete should have removed
    if "dataset" in jobs and not bad & set(plan["expected"]):
        r = run_on(host, ["sh", "-c", SWAP_SH, "sh", root, name], timeout=SWAP_TIMEOUT)
        if not r.ok:
            raise RunbookError(f"{host}: swapping in datasets/.{name}.incoming failed (exit "
                               f"{r.returncode}): {r.stderr.strip()[:400]}", "sync-ssh")
    return dict(rec, verified=not bad, mismatches=sorted(bad), wall_s=round(time.monotonic() - t0, 3))


def main() -> int:
    args, t0 = build_parser().parse_args(), time.time()
    try:  # every refusal comes before any ssh or rsync
        plan = load_plan(args)
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    root, hosts, expected = plan["root"], plan["hosts"], plan["expected"]
    os.chdir(paths.ROOT)  # rsync sends the repo's relative paths
    os.environ[CONTROL_ENV] = ctl = tempfile.mkdtemp(prefix="thsync-", dir="/tmp")  # a socket path: <= 104 B
    try:  # every host at once, each over one shared ssh connection
        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            jobs = [pool.submit(sync_host, h, args, plan) for h in hosts]
        results = [{"host": h, "error": str(j.exception())} if isinstance(j.exception(), RunbookError)
                   else j.result() for h, j in zip(hosts, jobs, strict=True)]
    finally:
        close_masters(hosts)
        shutil.rmtree(ctl, ignore_errors=True)

    # A host's dataset failed verification: is the local copy itself damaged? Name it, not the host.
    suspect = any(set(r.get("mismatches", [])) & set(expected) for r in results)
    local_bad = [f for f, h in expected.items() if suspect and tree_hashes(paths.ROOT, [f]).get(f) != h]
    rc = 0
    for f in local_bad:
        rc = die(RunbookError(f"local {f} does not match its manifest, so no host's dataset was replaced "
                              "with it; re-run make export", "export"))
    for r in results:
        h, b = r["host"], r.get("transferred_bytes")
        if "error" in r:
            event("sync", host=h, status="error")
            rc = die(r["error"])
            continue
        for c in r["changes"]:
            print(f"  {h}: {'would ' if args.dry_run else ''}{c}")
        status = "dry-run" if args.dry_run else ("verified" if r["verified"] else "MISMATCH")
        event("sync", host=h, status=status, actions="+".join(r["actions"]) or "none",
              bytes="unknown" if b is None else b, wall_s=r["wall_s"])
        for f in sorted(set(r.get("mismatches", [])) - set(local_bad)):
            rc = die(RunbookError(f"{h}: {f} does not match the local copy after sync; check the host's disk "
                                  f"(df -h {root}) and re-run make sync", "sync-verify"))

    report = {"remote_root": root, "dataset": args.dataset, "model": args.model, "hosts": results,
              "ok": rc == 0, "local_dataset_errors": local_bad, "wall_s": round(time.time() - t0, 3),
              "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.run and not args.dry_run:
        atomic.write_json(paths.run_dir(args.run) / "sync.json", report)
    event("sync-summary", hosts=len(hosts), ok=rc == 0, wall_s=report["wall_s"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
