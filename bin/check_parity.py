#!/usr/bin/env python3
"""check-parity: preflight every host in the hostfile; each failing check names its fix.

Usage:
    python bin/check_parity.py --hostfile HOSTFILE --python PYTHON --remote-root DIR
                               [--model PATH|HF_ID] [--dataset NAME] [--json] [--deep]
                               [--timeout S] [--min-disk-gb N] [--rtt-warn-ms MS]

Example (what `make check-parity` runs):
    python bin/check_parity.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python \
        --remote-root /Users/op/thunder-runbook --model models/tiny-gemma4 \
        --dataset domain_sft_v1_high_signal_thunder

Checks, each `{name, host, status: pass|warn|fail, detail, fix}`:
  inputs, hostfile      the hostfile (mlx.launch format), PYTHON, REMOTE_ROOT, MODEL, DATASET:
                        validated before any subprocess runs
  ssh                   unattended ssh to every host (self-ssh too); never a prompt
  runtime.python        PYTHON exists, resolves to the same real path and Python version everywhere
  runtime.packages      mlx, mlx-lm, numpy, transformers, tokenizers, safetensors equal
                        requirements.lock (for the host's markers) on every host
  runtime.mlx           mlx >= 0.32.1, mlx.core imports and computes one small op
  code                  sha256 of bin/ lib/ configs/ requirements.lock under REMOTE_ROOT = local
  model                 MODEL (a local path) at the same path everywhere: size+mtime, sha256 with --deep
  dataset               datasets/<DATASET>/manifest.json = local, and the split files match it
  resources.disk/memory free disk at REMOTE_ROOT >= --min-disk-gb, free memory
  resources.thunderbolt macOS, ring: the hostfile IPs sit on a Thunderbolt interface with a peer
  resources.rdma        macOS, jaccl: ibv_devices lists the hostfile's rdma devices
  link.ips, link.rtt    each host owns its hostfile IPs; TCP round trip to its ring peers

One ssh round trip per host (lib/parity_probe.py piped to PYTHON), hosts in parallel, the
whole check bounded by --timeout. Never prompts (stdin is /dev/null; ssh BatchMode), never
overlaps itself (flock on runs/parity/.lock: a second run exits 3 at once). The result is
written atomically to runs/parity/last.json. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Only what is needed before the probes start: every import here delays all hosts' answers.
from lib import parity, paths  # noqa: E402
from lib import parity_probe as local_probe  # noqa: E402
from lib.hashing import tree_hashes  # noqa: E402
from lib.hostfile import Hostfile, check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError  # noqa: E402

STATUS = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}
GB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="interpreter path on every host")
    p.add_argument("--remote-root", required=True, help="absolute path of the repo on every host")
    p.add_argument("--model", default="", help="local model folder (checked) or a hub id (skipped)")
    p.add_argument("--dataset", default="", help="dataset name under datasets/ (checked once exported)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--deep", action="store_true", help="hash every model file (default: size + mtime)")
    p.add_argument("--timeout", type=float, default=None,
                   help="hard bound on the whole check, seconds (default 20; 600 with --deep)")
    p.add_argument("--min-disk-gb", type=float, default=10.0, help="free disk needed at REMOTE_ROOT")
    p.add_argument("--min-mem-gb", type=float, default=2.0, help="free memory below this is a warning")
    p.add_argument("--rtt-warn-ms", type=float, default=2.0, help="peer round trip above this is a warning")
    p.add_argument("--link-port", type=int, default=22, help="peer TCP port timed for the round trip")
    p.add_argument("--state-dir", default=str(paths.RUNS / "parity"), help="lock and last.json")
    return p


def check(name: str, host: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "host": host, "status": status, "detail": detail, "fix": fix}


class Busy(Exception):
    pass


def take_lock(state_dir: Path):
    """A non-blocking flock on <state>/.lock; Busy (with the holder's pid) when held."""
    state_dir.mkdir(parents=True, exist_ok=True)
    f = open(state_dir / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise Busy(holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class Deadline(Exception):
    pass


def on_alarm(signum, frame):
    raise Deadline()


# ---- inputs ----------------------------------------------------------------------------------

def resolve_model(model: str, root: str) -> tuple[Path | None, str | None, dict | None]:
    """(local folder, the same folder on the hosts, the model check when there is nothing
    to compare) for MODEL."""
    if not model:
        return None, None, check("model", "-", "pass", "skipped: no MODEL")
    p = Path(model)
    full = p if p.is_absolute() else paths.ROOT / p
    if not full.is_dir():
        if p.is_absolute() or model.startswith(".") or model.startswith("models/"):
            return None, None, check("model", "local", "fail", f"MODEL {model} does not exist here",
                                     "generate it (make tiny-model) or set MODEL=; see RUNBOOK.md#parity-model")
        return None, None, check("model", "-", "pass", f"skipped: MODEL {model} is a hub id "
                                 "(each host resolves it from its own cache)")
    full = Path(os.path.abspath(full))  # not resolved: models/x may be a link to a bigger disk
    try:
        remote = os.path.join(root, full.relative_to(paths.ROOT).as_posix())
    except ValueError:
        remote = str(full)  # outside the repo: the same absolute path on every host
    check_path(remote, "MODEL path on the hosts")
    return full, remote, None


def validate_inputs(args) -> tuple[Hostfile, dict]:
    """Everything that reaches a subprocess, refused before one runs. RunbookError names it."""
    hf = load_hostfile(args.hostfile)
    check_path(args.python, "PYTHON")
    check_path(args.remote_root, "REMOTE_ROOT")
    root = os.path.normpath(args.remote_root)
    if args.dataset and not paths.is_safe_name(args.dataset):
        raise RunbookError(f"DATASET {args.dataset!r} refused: use a plain folder name "
                           "(letters, digits, '.', '_', '-')", "parity-dataset")
    model_local, model_remote, model_check = resolve_model(args.model, root)
    return hf, {"root": root, "model_local": model_local, "model_remote": model_remote,
                "model_check": model_check}


def local_reference(args, inp: dict) -> dict:
    """What every host is compared with: this checkout's code, lock, model and dataset."""
    ref = {"code": tree_hashes(paths.ROOT, parity.CODE_PARTS),
           "lock": (paths.ROOT / "requirements.lock").read_text(encoding="utf-8")}
    if inp["model_local"] is not None:
        ref["model"] = local_probe.probe_model(str(inp["model_local"]), args.deep)
    if args.dataset:
        ddir = paths.DATASETS / args.dataset
        ref["dataset"] = local_probe.probe_dataset(str(ddir)) if (ddir / "manifest.json").is_file() else None
    return ref


def probe_params(args, hf: Hostfile, inp: dict, host: str, peers: dict) -> dict:
    ranks = [h for h in hf.hosts if h.ssh == host]
    own_ips = []
    for h in ranks:
        for ip in h.ips:
            if ip not in own_ips:
                own_ips.append(ip)
    return {
        "python": args.python,
        "remote_root": inp["root"],
        "code_parts": parity.CODE_PARTS,
        "packages": parity.PACKAGES,
        "model_path": inp["model_remote"],
        "deep": args.deep,
        "dataset_path": os.path.join(inp["root"], "datasets", args.dataset) if args.dataset else None,
        "own_ips": own_ips,
        "peers": peers.get(host, []),
        "link_port": args.link_port,
        "link_timeout": 1.0,
        "link_enough_ms": args.rtt_warn_ms / 4,
        "rdma": hf.backend.startswith("jaccl"),
    }


# ---- evaluation --------------------------------------------------------------------------------

def reference(values: dict[str, object], prefer: object = None) -> object:
    """The value most hosts have; a tie goes to `prefer` (this machine's), then rank order."""
    if not values:
        return None
    counts = Counter(values.values())
    top = max(counts.values())
    tied = [v for v in values.values() if counts[v] == top]
    if prefer in tied:
        return prefer
    return tied[0]


def eval_runtime(host: str, f: dict, ref: dict, pins: dict, fixes: dict) -> list[dict]:
    out = []
    py = f.get("python") or {}
    if f.get("no_python"):
        out.append(check("runtime.python", host, "fail",
                         "no Python at all on this host (PYTHON missing, no python3)",
                         "install Python " + ref["pyver"] + " on the host, then " + fixes["provision"]))
        return out
    if py.get("error"):
        out.append(check("runtime.python", host, "fail", f"probe error: {py['error']}", fixes["provision"]))
        return out
    if py.get("fallback"):
        why = "does not exist" if not py.get("exists") else "exists but does not run"
        if py.get("exists") and py.get("why"):
            why += f" ({' | '.join(py['why'].splitlines()[-2:])[:300]})"
        out.append(check("runtime.python", host, "fail", f"PYTHON {py['requested']} {why} on this host",
                         fixes["provision"]))
        return out
    problems, warns = [], []
    real, ver = py.get("realpath"), py.get("version", "")
    if real != ref["real"]:
        problems.append(f"PYTHON resolves to {real}, but to {ref['real']} on {ref['real_hosts']}")
    if ver.split(".")[:2] != ref["pyver"].split(".")[:2]:
        problems.append(f"Python {ver}, but {ref['pyver']} on {ref['ver_hosts']}")
    elif ver != ref["pyver"]:
        warns.append(f"Python {ver}, but {ref['pyver']} on {ref['ver_hosts']} (patch level differs)")
    detail = "; ".join(problems + warns) or f"{py['requested']} -> {real} (Python {ver})"
    out.append(check("runtime.python", host, "fail" if problems else "warn" if warns else "pass", detail,
                     fixes["provision"] if problems or warns else ""))

    pk = f.get("packages") or {}
    wanted = pk.get("wanted") or {}
    if pk.get("error"):
        out.append(check("runtime.packages", host, "fail", f"cannot list packages: {pk['error']}", fixes["provision"]))
    else:
        bad, good = [], []
        for name in parity.PACKAGES:
            pin = pins.get(name)
            have = wanted.get(name)
            if pin is None:
                if name in ("mlx-cpu", "mlx-metal"):
                    continue
                bad.append(f"{name}: requirements.lock has no pin for this host's platform")
            elif have is None:
                bad.append(f"{name} missing (lock {pin})")
            elif have != pin:
                bad.append(f"{name} {have} (lock {pin})")
            else:
                good.append(f"{name} {have}")
        others = pk.get("all") or {}
        drift = sorted(f"{n} {others[n]} (lock {v})" for n, v in pins.items()
                       if n not in parity.PACKAGES and n in others and others[n] != v)
        if bad:
            out.append(check("runtime.packages", host, "fail", "differs from requirements.lock: " + "; ".join(bad),
                             fixes["provision"]))
        elif drift:
            out.append(check("runtime.packages", host, "warn",
                             "core packages match the lock; others differ: " + "; ".join(drift[:6])
                             + (f" (+{len(drift) - 6} more)" if len(drift) > 6 else ""), fixes["provision"]))
        else:
            out.append(check("runtime.packages", host, "pass", ", ".join(good) + " = requirements.lock"))

    mx = f.get("mlx") or {}
    meta = wanted.get("mlx")
    if not mx.get("ok"):
        why = mx.get("error") or f"1+2+3 doubled gave {mx.get('result')}, not 12"
        out.append(check("runtime.mlx", host, "fail", f"mlx.core does not work: {why}", fixes["provision"]))
    elif parity.version_tuple(mx.get("version") or "0") < parity.MLX_MIN:
        out.append(check("runtime.mlx", host, "fail",
                         f"mlx.core {mx.get('version')} from {mx.get('file')} is older than 0.32.1 (earlier versions "
                         "leave the surviving rank hanging when one dies and mishandle the interpreter path)",
                         fixes["provision"]))
    elif meta and mx.get("version") != meta:
        out.append(check("runtime.mlx", host, "fail",
                         f"the imported mlx.core is {mx.get('version')} from {mx.get('file')}, but the installed mlx "
                         f"is {meta}: another mlx shadows it (PYTHONPATH, a .pth file, user site)",
                         "remove the shadowing copy, then " + fixes["provision"]))
    else:
        prefix = os.path.realpath(py.get("prefix") or "/")
        where = mx.get("file") or ""
        inside = os.path.realpath(where).startswith(prefix.rstrip("/") + "/")
        out.append(check("runtime.mlx", host, "pass" if inside else "warn",
                         f"mlx.core {mx.get('version')} imports and computes ({mx.get('device')}, "
                         f"{mx.get('seconds')} s)" + ("" if inside else f"; but it is imported from {where}, "
                                                      f"outside PYTHON's environment {prefix}"),
                         "" if inside else fixes["provision"]))
    return out


def eval_code(host: str, f: dict, ref: dict, root: str, fixes: dict) -> dict:
    code = f.get("code") or {}
    if code.get("error"):
        return check("code", host, "fail", f"probe error: {code['error']}", fixes["sync"])
    if not code.get("root_exists"):
        return check("code", host, "fail", f"REMOTE_ROOT {root} does not exist on this host", fixes["sync"])
    theirs, ours = code.get("hashes") or {}, ref["code"]
    if not theirs:
        return check("code", host, "fail", f"none of the {len(ours)} code files are under {root} "
                     "on this host (not synced yet)", fixes["sync"])
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    differ = sorted(p for p in set(ours) & set(theirs) if ours[p] != theirs[p])
    if not (missing or extra or differ):
        return check("code", host, "pass", f"{len(ours)} files of {', '.join(parity.CODE_PARTS)} identical")
    parts = []
    for label, items in (("differs", differ), ("missing", missing), ("extra on host", extra)):
        if items:
            parts.append(f"{label}: {', '.join(items[:5])}" + (f" (+{len(items) - 5} more)" if len(items) > 5 else ""))
    return check("code", host, "fail", "; ".join(parts), fixes["sync"])


def eval_model(host: str, f: dict, ref: dict, inp: dict, deep: bool, fixes: dict) -> dict:
    m = f.get("model") or {}
    where = inp["model_remote"]
    if m.get("error"):
        return check("model", host, "fail", f"probe error: {m['error']}", fixes["sync_model"])
    if not m.get("exists"):
        return check("model", host, "fail", f"model folder {where} missing on this host", fixes["sync_model"])
    ours, theirs = ref["model"]["files"], m.get("files") or {}
    missing = sorted(set(ours) - set(theirs))
    extra = sorted(set(theirs) - set(ours))
    size = sorted(p for p in set(ours) & set(theirs) if ours[p][0] != theirs[p][0])
    content = sorted(p for p in set(ours) & set(theirs) if deep and ours[p][2] != theirs[p][2] and p not in size)
    mtime = sorted(p for p in set(ours) & set(theirs) if not deep and ours[p][1] != theirs[p][1] and p not in size)
    fails = ([f"missing: {', '.join(missing[:5])}"] if missing else []) + \
            ([f"size differs: {', '.join(size[:5])}"] if size else []) + \
            ([f"sha256 differs: {', '.join(content[:5])}"] if content else [])
    if fails:
        return check("model", host, "fail", f"{where}: " + "; ".join(fails), fixes["sync_model"])
    if mtime or extra:
        warns = ([f"mtime differs (size equal; content unverified): {', '.join(mtime[:5])}"] if mtime else []) + \
                ([f"extra on host: {', '.join(extra[:5])}"] if extra else [])
        return check("model", host, "warn", f"{where}: " + "; ".join(warns),
                     fixes["deep"] if mtime else fixes["sync_model"])
    total = sum(v[0] for v in ours.values())
    how = "sha256" if deep else "size+mtime"
    return check("model", host, "pass", f"{len(ours)} files, {total / 1e6:.1f} MB identical ({how})")


def eval_dataset(host: str, f: dict, ref: dict, dataset: str, fixes: dict) -> dict:
    d = f.get("dataset") or {}
    loc = ref["dataset"]
    if d.get("error") and d.get("manifest_sha256") is None:
        return check("dataset", host, "fail", f"probe error: {d['error']}", fixes["sync"])
    if not d.get("manifest_sha256"):
        return check("dataset", host, "warn", f"datasets/{dataset} not synced to this host yet", fixes["sync"])
    if d.get("error"):
        return check("dataset", host, "fail", f"datasets/{dataset}/{d['error']}", fixes["sync"])
    if d["manifest_sha256"] != loc["manifest_sha256"]:
        return check("dataset", host, "fail",
                     f"datasets/{dataset}/manifest.json differs from the local one "
                     f"({d['manifest_sha256'][:12]} != {loc['manifest_sha256'][:12]})", fixes["sync"])
    bad = d.get("bad") or {}
    if bad:
        return check("dataset", host, "fail",
                     f"datasets/{dataset}: " + "; ".join(f"{k}: {v}" for k, v in sorted(bad.items())[:5]),
                     fixes["sync"])
    return check("dataset", host, "pass", f"manifest {loc['manifest_sha256'][:12]} and its {d.get('checked')} files match")


def eval_resources(host: str, f: dict, args, hf: Hostfile, fixes: dict) -> list[dict]:
    out = []
    disk = f.get("disk") or {}
    if "free_bytes" not in disk:
        out.append(check("resources.disk", host, "fail", f"cannot read free disk: {disk.get('error')}", ""))
    else:
        free = disk["free_bytes"] / GB
        ok = free >= args.min_disk_gb
        out.append(check("resources.disk", host, "pass" if ok else "fail",
                         f"{free:.1f} GB free at {disk.get('path')} (minimum {args.min_disk_gb:g} GB)",
                         "" if ok else f"free space on the host (du -sh {args.remote_root}/runs/*), or lower "
                                       "MIN_DISK_GB; see RUNBOOK.md#parity-resources"))
    mem = f.get("memory") or {}
    if mem.get("available_bytes") is None:
        if not f.get("no_python"):
            out.append(check("resources.memory", host, "warn", f"cannot read free memory: {mem.get('error')}", ""))
    else:
        avail, total = mem["available_bytes"] / GB, (mem.get("total_bytes") or 0) / GB
        ok = avail >= args.min_mem_gb
        out.append(check("resources.memory", host, "pass" if ok else "warn",
                         f"{avail:.1f} GB available of {total:.1f} GB (warn below {args.min_mem_gb:g} GB)",
                         "" if ok else "stop other jobs on the host; see RUNBOOK.md#parity-resources"))
    system = (f.get("host") or {}).get("system") or (f.get("marker_env") or {}).get("platform_system", "")
    ranks = [h for h in hf.hosts if h.ssh == host]
    if system != "Darwin":
        out.append(check("resources.thunderbolt", host, "pass", f"skipped: not macOS ({system or 'unknown'})"))
        if hf.backend.startswith("jaccl"):
            out.append(check("resources.rdma", host, "pass", f"skipped: not macOS ({system or 'unknown'})"))
        return out
    mac = f.get("macos") or {}
    ips = [ip for h in ranks for ip in h.ips]
    if hf.backend.startswith("jaccl"):
        out.append(check("resources.thunderbolt", host, "pass", "skipped: jaccl carries data over rdma devices"))
    elif all(ip.startswith("127.") for ip in ips):
        out.append(check("resources.thunderbolt", host, "pass", "skipped: loopback ranks"))
    else:
        status, detail = parity.thunderbolt_facts(ips, mac)
        out.append(check("resources.thunderbolt", host, status, detail,
                         "" if status == "pass" else "see RUNBOOK.md#parity-thunderbolt"))
    if hf.backend.startswith("jaccl"):
        wanted = [d for h in ranks for d in parity.rdma_wanted(h.rdma)]
        missing, listed = parity.rdma_missing(wanted, mac.get("ibv_devices") or "")
        if missing:
            out.append(check("resources.rdma", host, "fail",
                             f"ibv_devices does not list {', '.join(missing)} (lists: {', '.join(listed) or 'nothing'})",
                             "enable RDMA in recoveryOS (rdma_ctl enable), check the cables; "
                             "see RUNBOOK.md#parity-thunderbolt"))
        else:
            out.append(check("resources.rdma", host, "pass", f"ibv_devices lists {', '.join(wanted)}"))
    return out


def eval_link(host: str, f: dict, args, fixes: dict) -> list[dict]:
    out = []
    ips = f.get("ips") or {}
    if ips and not ips.get("error"):
        missing = [ip for ip, ok in ips.items() if not ok]
        if missing:
            out.append(check("link.ips", host, "fail",
                             f"hostfile IP(s) {', '.join(missing)} are not addresses of this host",
                             "fix the host's ips in the hostfile (or the host's interface setup); "
                             "see RUNBOOK.md#parity-link"))
        else:
            out.append(check("link.ips", host, "pass", f"owns {', '.join(ips)}"))
    link = f.get("link") or {}
    if link.get("error"):
        out.append(check("link.rtt", host, "fail", f"probe error: {link['error']}", ""))
        return out
    if not link:
        out.append(check("link.rtt", host, "pass", "skipped: no peers (one rank)"))
        return out
    dead = {ip: v.get("error") for ip, v in link.items() if v.get("rtt_ms") is None}
    slow = {ip: v["rtt_ms"] for ip, v in link.items() if v.get("rtt_ms") is not None and v["rtt_ms"] > args.rtt_warn_ms}
    shown = ", ".join(f"{ip} {v['rtt_ms']} ms (min of {v.get('tries') or 7})" if v.get("rtt_ms") is not None
                      else f"{ip} unreachable" for ip, v in link.items())
    if dead:
        out.append(check("link.rtt", host, "fail",
                         "peer(s) unreachable: " + "; ".join(f"{ip} ({e})" for ip, e in dead.items()),
                         "check the cable/bridge and the peer's IP; see RUNBOOK.md#parity-link"))
    elif slow:
        out.append(check("link.rtt", host, "warn",
                         f"round trip above {args.rtt_warn_ms:g} ms: {shown} (TCP :{args.link_port})",
                         "the ring may be running over Wi-Fi/Ethernet, not Thunderbolt; see RUNBOOK.md#parity-link"))
    else:
        out.append(check("link.rtt", host, "pass", f"{shown} (TCP :{args.link_port})"))
    return out


def evaluate(args, hf: Hostfile, inp: dict, ref: dict, results: dict, t_probe: dict) -> list[dict]:
    hosts = hf.unique_ssh()
    fixes = {
        "provision": f"make provision HOSTFILE={args.hostfile}; see RUNBOOK.md#parity-runtime",
        "sync": f"make sync HOSTFILE={args.hostfile}; see RUNBOOK.md#parity-code",
        "sync_model": f"make sync HOSTFILE={args.hostfile} SYNC_MODEL=1; see RUNBOOK.md#parity-model",
        "deep": f"make check-parity HOSTFILE={args.hostfile} DEEP=1; see RUNBOOK.md#parity-model",
    }
    checks: list[dict] = []
    facts: dict[str, dict] = {}
    for h in hosts:
        f, r = results[h]
        if f is None:
            if r.ok:
                detail = "ssh works but the probe printed no result: " + (r.stderr.strip()[-300:] or
                                                                          r.stdout.strip()[-300:] or "empty output")
                fix = "run the probe by hand: see RUNBOOK.md#parity-ssh"
            else:
                detail, fix = parity.ssh_failure(h, r)
            checks.append(check("ssh", h, "fail", detail, fix))
            continue
        facts[h] = f
        how = "local (127.0.0.1, like mlx.launch)" if is_local(h) else "ssh ok"
        if inp.get("self_hosts") and h in inp["self_hosts"]:
            how += " (self-ssh: this machine is a rank)"
        checks.append(check("ssh", h, "pass", f"{how}, round trip {t_probe[h]:.2f} s"))

    # Cross-host references for what has no absolute reference (the lock is one for packages).
    runnable = {h: f["python"] for h, f in facts.items()
                if isinstance(f.get("python"), dict) and not f["python"].get("fallback") and "realpath" in f["python"]}
    here = os.path.realpath(args.python) if os.path.exists(args.python) else None
    real = reference({h: p["realpath"] for h, p in runnable.items()}, here)
    pyver = reference({h: p["version"] for h, p in runnable.items()},
                      ".".join(map(str, sys.version_info[:3]))) or ".".join(map(str, sys.version_info[:2]))
    rref = {"real": real, "pyver": pyver,
            "real_hosts": ", ".join(h for h, p in runnable.items() if p["realpath"] == real) or "no host",
            "ver_hosts": ", ".join(h for h, p in runnable.items() if p["version"] == pyver) or "this machine",
            "code": ref["code"], "model": ref.get("model"), "dataset": ref.get("dataset")}

    for h in hosts:
        f = facts.get(h)
        if f is None:
            continue
        if f.get("no_python"):  # only the shell answered: nothing else can be read on this host
            checks += eval_runtime(h, f, rref, {}, fixes) + eval_resources(h, f, args, hf, fixes)[:1]
            continue
        pins = parity.lock_pins(ref["lock"], f.get("marker_env") or {})
        checks += eval_runtime(h, f, rref, pins, fixes)
        checks.append(eval_code(h, f, rref, inp["root"], fixes))
        if inp["model_local"] is not None:
            checks.append(eval_model(h, f, rref, inp, args.deep, fixes))
        if args.dataset and rref["dataset"] is not None:
            checks.append(eval_dataset(h, f, rref, args.dataset, fixes))
        checks += eval_resources(h, f, args, hf, fixes)
        checks += eval_link(h, f, args, fixes)

    if inp["model_check"] is not None:
        checks.append(inp["model_check"])
    if args.dataset and rref["dataset"] is None:
        checks.append(check("dataset", "-", "pass", f"skipped: datasets/{args.dataset} not exported here yet"))
    elif args.dataset and rref["dataset"].get("bad"):
        checks.append(check("dataset", "local", "fail",
                            f"the local datasets/{args.dataset} does not match its own manifest: "
                            + "; ".join(f"{k}: {v}" for k, v in sorted(rref["dataset"]["bad"].items())[:5]),
                            f"make export DATASET={args.dataset}; see RUNBOOK.md#parity-dataset"))
    return checks


def run_checks(args, deadline: float) -> list[dict]:
    try:
        hf, inp = validate_inputs(args)
    except RunbookError as e:
        name = "hostfile" if e.anchor == "hostfile" else "inputs"
        return [check(name, "-", "fail", e.args[0], f"see RUNBOOK.md#{e.anchor}")]
    checks = [check("hostfile", "-", "pass",
                    f"{args.hostfile}: {hf.backend or 'ring'}, {hf.size} rank(s) on {len(hf.unique_ssh())} host(s): "
                    + ", ".join(hf.unique_ssh()))]
    hosts = hf.unique_ssh()
    peers = parity.peers_of(hf)
    mine = local_probe.probe_ips([ip for h in hf.hosts if not is_local(h.ssh) for ip in h.ips])
    inp["self_hosts"] = {h.ssh for h in hf.hosts if not is_local(h.ssh) and any(mine.get(ip) for ip in h.ips)}

    results: dict = {}
    t_probe: dict = {}

    def one(h: str):
        t0 = time.monotonic()
        budget = max(1.0, deadline - time.monotonic() - 0.5)
        results[h] = parity.probe(h, args.python, inp["root"], probe_params(args, hf, inp, h, peers), budget)
        t_probe[h] = time.monotonic() - t0

    errors: list[BaseException] = []

    def guarded(h: str):
        try:
            one(h)
        except BaseException as e:  # re-raised below: the check itself broke (UNKNOWN)
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    ref = local_reference(args, inp)  # hashed here while the hosts answer
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return checks + evaluate(args, hf, inp, ref, results, t_probe)


def summarize(checks: list[dict], t0: float, code: int | None = None) -> dict:
    if code is None:
        st = {c["status"] for c in checks}
        code = 2 if "fail" in st else 1 if "warn" in st else 0
    return {"status": STATUS[code], "code": code, "checks": checks,
            "duration_s": round(time.monotonic() - t0, 3),
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def print_table(result: dict, args) -> None:
    print(f"check-parity hostfile {args.hostfile} python {args.python} remote_root {args.remote_root}")
    rows = result["checks"]
    wn = max([len(c["name"]) for c in rows] + [5])
    wh = max([len(c["host"]) for c in rows] + [4])
    print(f"  {'status':<6}  {'check':<{wn}}  {'host':<{wh}}  detail")
    for c in rows:
        mark = {"pass": "pass", "warn": "WARN", "fail": "FAIL"}[c["status"]]
        print(f"  {mark:<6}  {c['name']:<{wn}}  {c['host']:<{wh}}  {c['detail']}")
        if c["status"] != "pass" and c["fix"]:
            print(f"  {'':<6}  {'':<{wn}}  {'':<{wh}}  fix: {c['fix']}")
    n = Counter(c["status"] for c in rows)
    print(f"check-parity status {result['status']} code {result['code']} checks {len(rows)} "
          f"fail {n['fail']} warn {n['warn']} duration_s {result['duration_s']}", flush=True)


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.monotonic()
    if args.timeout is None:
        args.timeout = 600.0 if args.deep else 20.0
    state = Path(args.state_dir)
    try:
        lock = take_lock(state)
    except Busy as e:
        msg = (f"another check-parity is running (pid {e.args[0]} holds {state / '.lock'}); "
               "this run exits without checking")
        result = summarize([check("lock", "-", "fail", msg, "wait for it to finish; see RUNBOOK.md#parity-lock")],
                           t0, code=3)
        print(json.dumps(result, sort_keys=True) if args.json else f"check-parity: {msg}; see RUNBOOK.md#parity-lock",
              file=sys.stdout if args.json else sys.stderr, flush=True)
        return 3

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(math.ceil(args.timeout)) + 2)
    deadline = time.monotonic() + args.timeout
    code = None
    try:
        checks = run_checks(args, deadline)
    except Deadline:
        checks = [check("deadline", "-", "fail", f"the check did not finish within {args.timeout:g} s",
                        "see RUNBOOK.md#parity-ssh")]
        code = 3
    except Exception as e:  # the check itself broke: UNKNOWN, with where
        import traceback

        tb = traceback.extract_tb(e.__traceback__)[-1]
        checks = [check("internal", "-", "fail",
                        f"{type(e).__name__}: {e} (at {Path(tb.filename).name}:{tb.lineno})",
                        "report it with runs/parity/last.json; see RUNBOOK.md#parity-unknown")]
        code = 3
    finally:
        signal.alarm(0)
    result = summarize(checks, t0, code)
    from lib import atomic

    atomic.write_json(state / "last.json", result)
    lock.close()
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        print_table(result, args)
    return result["code"]


if __name__ == "__main__":
    sys.exit(main())
