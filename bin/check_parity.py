#!/usr/bin/env python3
"""check-parity: preflight every host of the hostfile, in the plan's order; each failure names its fix.

Usage:
    python bin/check_parity.py --hostfile HOSTFILE --python PYTHON --remote-root DIR [--gate runtime|content|all]
        [--model PATH|HF_ID] [--dataset NAME] [--json] [--deep] [--timeout S] [--min-disk-gb N] [--state-dir DIR]

Example (what `make check-parity` runs; `make provision` adds --gate runtime):
    python bin/check_parity.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python \
        --remote-root /Users/op/thunder-runbook --model models/tiny-gemma4 --dataset domain_sft_v1_high_signal_thunder

Gate runtime (passes on freshly provisioned hosts): the hostfile and inputs, refused before any subprocess;
ssh (unattended, self-ssh too); runtime.python (one real path and version), .packages (the lock's versions),
.mlx (imports and computes), .env (MLX_METAL_FAST_SYNCH unset); resources.disk, .memory, .remote_root (macOS
privacy protection), .thunderbolt and .rdma (macOS); link.ips, link.rtt. Gate content (after sync, before every
launch): code, model (size+mtime; sha256 with --deep) and dataset bytes under REMOTE_ROOT equal this checkout's.
--gate all (the default) runs both. One ssh round trip per host (lib/parity_probe.py), hosts in parallel,
bounded by --timeout; never prompts; never overlaps itself (flock on <state-dir>/.lock: a second run exits 3).
The result goes atomically to <state-dir>/last.json (last-<gate>.json for one gate). Text output starts with a
monitoring plugin's line, then the table: `PARITY OK - runtime OK; content OK | duration=0.31s;;;0 failed=0;;;0
warned=0;;;0 rtt_fab1=0.08ms;;;0`. --json: one JSON object. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Only what the probes need: every import here delays all hosts' answers.
from lib import parity, paths  # noqa: E402
from lib import parity_probe as local_probe  # noqa: E402
from lib.hostfile import check_path, is_local  # noqa: E402
from lib.hostfile import load as load_hostfile  # noqa: E402
from lib.log import RunbookError  # noqa: E402

STATUS = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}
GATES = {"runtime": ["runtime"], "content": ["content"], "all": ["runtime", "content"]}
CONTENT = ("code", "model", "dataset")
FAST_SYNCH = "MLX_METAL_FAST_SYNCH"
TCC_FIX = ("on the host: System Settings > General > Sharing > Remote Login (i) > Allow full disk access for "
           "remote users, or move REMOTE_ROOT out of ~/Desktop, ~/Documents, ~/Downloads; see RUNBOOK.md#parity-tcc")
MIN_MEM_GB, RTT_WARN_MS, GB = 2.0, 2.0, 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="interpreter path on every host")
    p.add_argument("--remote-root", required=True, help="absolute path of the repo on every host")
    p.add_argument("--gate", choices=GATES, default="all", help="runtime, content or all (default)")
    p.add_argument("--model", default="", help="local model folder (checked) or a hub id (skipped)")
    p.add_argument("--dataset", default="", help="dataset name under datasets/ (checked once exported)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--deep", action="store_true", help="hash every model file (default: size + mtime)")
    p.add_argument("--timeout", type=float, help="bound on the whole check, s (default 20; 600 with --deep)")
    p.add_argument("--min-disk-gb", type=float, default=10.0, help="free disk needed at REMOTE_ROOT")
    p.add_argument("--state-dir", default=str(paths.RUNS / "parity"), help="lock and last.json")
    return p


def check(name: str, host: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "host": host, "status": status, "detail": detail, "fix": "" if status == "pass" else fix}


def listed(label: str, items: list) -> list[str]:
    more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
    return [f"{label}: {', '.join(sorted(items)[:5])}{more}"] if items else []


# ---- inputs, refused before any subprocess runs ---------------------------------------------------

def validate_inputs(args):
    """The hostfile and every value that reaches a subprocess (RunbookError names it)."""
    hf = load_hostfile(args.hostfile)
    check_path(args.python, "PYTHON")
    args.root = os.path.normpath(check_path(args.remote_root, "REMOTE_ROOT"))
    if args.dataset and not paths.is_safe_name(args.dataset):
        raise RunbookError(f"DATASET {args.dataset!r} refused: use a plain folder name (letters, digits, "
                           "'.', '_', '-')", "parity-dataset")
    local = Path(os.path.abspath(paths.ROOT / args.model))  # not resolved: models/x may link to a bigger disk
    args.model_local = local if args.model and local.is_dir() else None
    args.model_remote = None  # the same folder under REMOTE_ROOT, or the same absolute path outside the repo
    if args.model_local:
        inside = local.is_relative_to(paths.ROOT)
        remote = os.path.join(args.root, local.relative_to(paths.ROOT).as_posix()) if inside else str(local)
        args.model_remote = check_path(remote, "MODEL path on the hosts")
    manifest = paths.DATASETS / args.dataset / "manifest.json"
    args.dataset_parts = None  # the manifest and the files it lists, once exported here
    if args.dataset and manifest.is_file():
        args.dataset_parts = ["manifest.json", *json.loads(manifest.read_text(encoding="utf-8")).get("files", {})]
    h = f"HOSTFILE={args.hostfile}"
    args.fix = {"provision": f"make provision {h}; see RUNBOOK.md#parity-runtime",
                "sync": f"make sync {h}; see RUNBOOK.md#parity-code",
                "sync_model": f"make sync {h} SYNC_MODEL=1; see RUNBOOK.md#parity-model",
                "deep": f"make check-parity {h} DEEP=1; see RUNBOOK.md#parity-model"}
    return hf


def local_reference(args) -> dict:
    """What every host is compared with: this checkout's lock, and its code, model and dataset files."""
    ref = {"lock": (paths.ROOT / "requirements.lock").read_text(encoding="utf-8"), "model": None, "dataset": None}
    if "content" in GATES[args.gate]:
        ref["code"] = local_probe.probe_files(str(paths.ROOT), parity.CODE_PARTS, True)
        if args.model_local:
            ref["model"] = local_probe.probe_files(str(args.model_local), ["."], args.deep)
        if args.dataset_parts:
            ref["dataset"] = local_probe.probe_files(str(paths.DATASETS / args.dataset), args.dataset_parts, True)
    return ref


# ---- runtime ------------------------------------------------------------------------------------

def eval_python(h: str, py: dict, runnable: dict, args) -> dict:
    """PYTHON runs and resolves to the interpreter (real path and version) most hosts have; a tie
    goes to this machine's, then to rank order."""
    if py["fallback"]:
        why = "exists but does not run" if py["exists"] else "does not exist"
        if py["exists"] and py["why"]:
            why += f" ({' | '.join(py['why'].splitlines()[-2:])[:300]})"
        return check("runtime.python", h, "fail", f"PYTHON {py['requested']} {why} on this host", args.fix["provision"])
    keys = {k: f"{p['realpath']} (Python {p['version']})" for k, p in runnable.items()}
    counts = Counter(keys.values())
    tied = [v for v in keys.values() if counts[v] == max(counts.values())]
    here = f"{os.path.realpath(args.python)} (Python {platform.python_version()})"
    best = here if here in tied else tied[0]
    if keys[h] == best:
        return check("runtime.python", h, "pass", f"{py['requested']} -> {keys[h]}")
    return check("runtime.python", h, "fail", f"PYTHON resolves to {keys[h]}, but to {best} on "
                 + ", ".join(k for k, v in keys.items() if v == best), args.fix["provision"])


def eval_packages(h: str, f: dict, lock: str, fix: str) -> list[dict]:
    """runtime.packages: PACKAGES at the lock's versions for this host; runtime.mlx: mlx.core imports,
    computes, is new enough and is the installed one (not shadowed by PYTHONPATH or a .pth file)."""
    have, mx, pins = f.get("packages") or {}, f.get("mlx") or {}, parity.lock_pins(lock, f["marker_env"])
    bad = [f"{n}: requirements.lock has no pin for this host's platform" for n in parity.PACKAGES[:6] if n not in pins]
    bad += [f"{n} {have.get(n) or 'missing'} (lock {pins[n]})" for n in parity.PACKAGES
            if n in pins and have.get(n) != pins[n]]
    bad = [f"cannot list packages: {have['error']}"] if "error" in have else bad
    ok = ", ".join(f"{n} {have[n]}" for n in parity.PACKAGES if n in pins) + " = requirements.lock"
    out = [check("runtime.packages", h, "fail" if bad else "pass",
                 "differs from requirements.lock: " + "; ".join(bad) if bad else ok, fix)]
    where = f"mlx.core {mx.get('version')} from {mx.get('file')}"
    if not mx.get("ok"):
        why = "mlx.core does not work: " + (mx.get("error") or f"1+2+3 doubled gave {mx.get('result')}, not 12")
    elif parity.version_tuple(mx["version"] or "0") < parity.MLX_MIN:
        why = (f"{where} is older than 0.32.1 (earlier versions leave the surviving rank hanging when one dies "
               "and mishandle the interpreter path)")
    elif have.get("mlx") and mx["version"] != have["mlx"]:
        why = f"the imported {where}, but the installed mlx is {have['mlx']}: another copy shadows it"
    else:
        return out + [check("runtime.mlx", h, "pass", f"{where} computes ({mx['device']}, {mx['seconds']} s)")]
    return out + [check("runtime.mlx", h, "fail", why, fix)]


def eval_env(h: str, f: dict, envs: list[str]) -> dict:
    where = [w for w, on in (("the hostfile's envs", any(e.split("=")[0] == FAST_SYNCH for e in envs)),
                             ("this host's ssh environment", FAST_SYNCH in f["env"])) if on]
    detail = (f"{FAST_SYNCH} is set in {' and '.join(where)}: it can wedge the GPU until a reboot "
              "(ml-explore/mlx#3142, #3830)" if where else f"{FAST_SYNCH} unset")
    return check("runtime.env", h, "fail" if where else "pass", detail, "remove it (hostfile envs, the host's "
                 "~/.zshenv): the MLX docs say to leave it unset, though the coordinator seed still recommends it; "
                 "see RUNBOOK.md#parity-fast-synch")


def eval_disk(args, h: str, disk: dict) -> dict:
    if "free_bytes" not in disk:
        return check("resources.disk", h, "fail", f"cannot read free disk: {disk.get('error')}", "see RUNBOOK.md#parity-resources")
    free = disk["free_bytes"] / GB
    return check("resources.disk", h, "pass" if free >= args.min_disk_gb else "fail", f"{free:.1f} GB free at "
                 f"{disk['path']} (minimum {args.min_disk_gb:g} GB)", f"free space on the host (du -sh "
                 f"{args.root}/runs/*), or lower MIN_DISK_GB; see RUNBOOK.md#parity-resources")


def eval_memory(h: str, mem: dict) -> dict:
    avail = (mem.get("available_bytes") or 0) / GB
    detail = (f"{avail:.1f} GB available of {mem['total_bytes'] / GB:.1f} GB (warn below {MIN_MEM_GB:g} GB)"
              if "available_bytes" in mem else f"cannot read free memory: {mem.get('error')}")
    return check("resources.memory", h, "pass" if avail >= MIN_MEM_GB else "warn", detail,
                 "stop other jobs on the host; see RUNBOOK.md#parity-resources")


def eval_remote_root(args, h: str, disk: dict, system: str) -> dict:
    """The ssh session may read REMOTE_ROOT: macOS privacy protection (TCC) refuses ~/Desktop, ~/Documents
    and ~/Downloads with EPERM ("Operation not permitted"); a folder's owner or mode refuses with EACCES."""
    err, root, home = disk.get("errno"), args.root, (disk.get("home") or "/-").rstrip("/") + "/"
    under = root[len(home):].split("/")[0] if root.startswith(home) else ""
    status, fix = "fail", TCC_FIX
    if err == "EPERM":
        why = f"{root}: Operation not permitted (EPERM): macOS privacy protection (TCC) refuses this ssh session"
    elif err == "EACCES":
        why = f"{root}: Permission denied (EACCES): its owner or mode refuses the ssh user"
        fix = f"ls -ld {root} on the host, then chown or chmod it for the ssh user; see RUNBOOK.md#parity-tcc"
    elif err not in (None, "ENOENT"):
        why = f"{root}: {disk.get('error')}"
    elif system == "Darwin" and under in ("Desktop", "Documents", "Downloads"):
        status, why = "warn", (f"{root} lies under ~/{under}: ssh may read it only while full disk access for "
                               "remote users stays on, and a macOS update can turn that off")
    else:
        status, why = "pass", f"{root} " + ("does not exist yet (sync creates it)" if err else "is readable over ssh")
    return check("resources.remote_root", h, status, why, fix)


def eval_macos(h: str, f: dict, hf) -> list[dict]:
    jaccl, ranks, mac = hf.backend.startswith("jaccl"), [r for r in hf.hosts if r.ssh == h], f.get("macos") or {}
    ips = [ip for r in ranks for ip in r.ips]
    if f["system"] != "Darwin":
        skip = f"skipped: not macOS ({f['system']})"
        return [check("resources.thunderbolt", h, "pass", skip)] + [check("resources.rdma", h, "pass", skip)] * jaccl
    if jaccl or all(ip.startswith("127.") for ip in ips):
        why = "jaccl carries data over rdma devices" if jaccl else "loopback ranks"
        out = [check("resources.thunderbolt", h, "pass", f"skipped: {why}")]
    else:
        out = [check("resources.thunderbolt", h, *parity.thunderbolt_facts(ips, mac), "see RUNBOOK.md#parity-thunderbolt")]
    if jaccl:
        wanted = [d for r in ranks for d in parity.rdma_wanted(r.rdma)]
        missing, shown = parity.rdma_missing(wanted, mac.get("ibv_devices"))
        detail = (f"ibv_devices does not list {', '.join(missing)} (lists: {', '.join(shown) or 'nothing'})"
                  if missing else f"ibv_devices lists {', '.join(wanted)}")
        out.append(check("resources.rdma", h, "fail" if missing else "pass", detail, "enable RDMA in recoveryOS "
                         "(rdma_ctl enable), check the cables; see RUNBOOK.md#parity-thunderbolt"))
    return out


def eval_link(h: str, f: dict) -> list[dict]:
    ips, link, out = f["ips"], f["link"], []
    missing = [ip for ip, ok in ips.items() if ok is not True]
    if ips and "error" not in ips:
        detail = f"hostfile IP(s) {', '.join(missing)} are not this host's" if missing else f"owns {', '.join(ips)}"
        out.append(check("link.ips", h, "fail" if missing else "pass", detail, "fix the host's ips in the "
                         "hostfile (or the host's interface setup); see RUNBOOK.md#parity-link"))
    if "error" in link or not link:
        detail = f"probe error: {link['error']}" if link else "skipped: no peers (one rank)"
        return out + [check("link.rtt", h, "fail" if link else "pass", detail)]
    dead = [f"{ip} ({v['error']})" for ip, v in link.items() if v["rtt_ms"] is None]
    slow = [ip for ip, v in link.items() if v["rtt_ms"] is not None and v["rtt_ms"] > RTT_WARN_MS]
    shown = ", ".join(f"{ip} {v['rtt_ms']} ms (min of {v['tries']})" for ip, v in link.items() if v["rtt_ms"] is not None)
    if dead:
        return out + [check("link.rtt", h, "fail", "peer(s) unreachable: " + "; ".join(dead),
                            "check the cable/bridge and the peer's IP; see RUNBOOK.md#parity-link")]
    detail = (f"round trip above {RTT_WARN_MS:g} ms: " if slow else "") + f"{shown} (TCP :22)"
    return out + [check("link.rtt", h, "warn" if slow else "pass", detail, "the ring may be running over "
                        "Wi-Fi/Ethernet, not Thunderbolt; see RUNBOOK.md#parity-link")]


# ---- content ------------------------------------------------------------------------------------

def compare(ours: dict, theirs: dict) -> tuple[list[str], list[str]]:
    """(failures, warnings) between two trees {rel: [size, mtime, sha256 or None]}: without sha256
    on both sides, equal sizes with other mtimes are only a warning."""
    both = set(ours) & set(theirs)
    differ = [p for p in both if ours[p][0] != theirs[p][0] or ours[p][2] != theirs[p][2]]
    unsure = [p for p in both if p not in differ and ours[p][2] is None and ours[p][1] != theirs[p][1]]
    return (listed("differs", differ) + listed("missing", set(ours) - set(theirs))
            + listed("extra on host", set(theirs) - set(ours)), listed("mtime differs (size equal; unverified)", unsure))


def eval_content(args, h: str, f: dict, ref: dict) -> list[dict]:
    """code, model and dataset files on the host equal this checkout's."""
    out = []
    for name, where, fix in (("code", args.root, "sync"), ("model", args.model_remote, "sync_model"),
                             ("dataset", f"{args.root}/datasets/{args.dataset}", "sync")):
        ours, theirs = ref[name], f[name]
        if ours is None:
            continue
        if "error" in theirs:
            fails, warns = [f"probe error: {theirs['error']}"], []
        elif not theirs:  # not synced yet: for a dataset a warning until a launch needs it
            fails = warns = [f"none of its {len(ours)} files exist on this host (not synced yet)"]
        else:
            fails, warns = compare(ours, theirs)
        fails = [] if name == "dataset" and not theirs else fails
        status = "fail" if fails else "warn" if warns else "pass"
        mb = sum(v[0] for v in ours.values()) / 1e6
        detail = "; ".join(fails or warns) or f"{len(ours)} files, {mb:.1f} MB identical"
        fix = "deep" if status == "warn" and name == "model" else fix
        out.append(check(name, h, status, f"{where}: {detail}", args.fix[fix]))
    return out


def model_note(args) -> list[dict]:
    """MODEL when there is no local folder to compare: missing here, or a hub id each host resolves."""
    if args.model_local:
        return []
    if args.model.startswith((".", "/", "models/")):
        return [check("model", "local", "fail", f"MODEL {args.model} does not exist here",
                      "generate it (make tiny-model) or set MODEL=; see RUNBOOK.md#parity-model")]
    return [check("model", "-", "pass", f"skipped: MODEL {args.model} is a hub id (each host resolves it from its "
                  "own cache)" if args.model else "skipped: no MODEL")]


# ---- every host, in parallel ----------------------------------------------------------------------

def evaluate(args, hf, ref: dict, results: dict) -> list[dict]:
    """The gate's checks for every host from its probe: results[host] = (facts or None, Result, seconds)."""
    checks, facts, runtime = [], {}, "runtime" in GATES[args.gate]
    for h in hf.unique_ssh():
        f, r, secs = results[h]
        if f is None:
            tail = (r.stderr.strip() or r.stdout.strip())[-300:] or "empty output"
            detail, fix = parity.ssh_failure(h, r) if not r.ok else (
                f"ssh works but the probe printed no result: {tail}", "run the probe by hand: see RUNBOOK.md#parity-ssh")
            checks.append(check("ssh", h, "fail", detail, fix))
            continue
        facts[h] = f
        how = "local (127.0.0.1, like mlx.launch)" if is_local(h) else "ssh ok" + (
            " (self-ssh: this machine is a rank)" if h in args.self_hosts else "")
        checks.append(check("ssh", h, "pass", f"{how}, round trip {secs:.2f} s"))
    runnable = {h: f["python"] for h, f in facts.items() if "python" in f and not f["python"]["fallback"]}
    for h, f in facts.items():
        if f.get("no_python"):  # only the probe's shell part answered: nothing but the disk is known
            checks += [check("runtime.python", h, "fail", "no Python at all on this host (PYTHON missing, no python3)",
                             f"install Python {sys.version_info[0]}.{sys.version_info[1]} on the host, then " + args.fix["provision"]),
                       eval_disk(args, h, f["disk"])] if runtime else []
            continue
        if runtime:
            checks.append(eval_python(h, f["python"], runnable, args))
            checks += [] if f["python"]["fallback"] else eval_packages(h, f, ref["lock"], args.fix["provision"])
            checks += [eval_env(h, f, hf.envs), eval_disk(args, h, f["disk"]), eval_memory(h, f.get("memory") or {}),
                       eval_remote_root(args, h, f["disk"], f["system"])]
            checks += eval_macos(h, f, hf) + eval_link(h, f)
        if "content" in GATES[args.gate]:
            checks += eval_content(args, h, f, ref)
    return checks + (model_note(args) if "content" in GATES[args.gate] else [])


def probe_host(args, h: str, hf, peers: dict, deadline: float) -> tuple:
    """(facts or None, Result, seconds) of one host's probe."""
    params = {"python": args.python, "remote_root": args.root, "parts": GATES[args.gate], "peers": peers.get(h, []),
              "own_ips": list(dict.fromkeys(ip for r in hf.hosts if r.ssh == h for ip in r.ips)),
              "link_enough_ms": RTT_WARN_MS / 4, "rdma": hf.backend.startswith("jaccl"),
              "code_parts": parity.CODE_PARTS, "model_path": args.model_remote, "deep": args.deep,
              "dataset_parts": args.dataset_parts,
              "dataset_path": os.path.join(args.root, "datasets", args.dataset) if args.dataset else None}
    t0 = time.monotonic()
    facts, r = parity.probe(h, args.python, args.root, params, max(1.0, deadline - t0 - 0.5))
    return facts, r, time.monotonic() - t0


def run_checks(args, deadline: float) -> list[dict]:
    try:
        hf = validate_inputs(args)
    except RunbookError as e:
        name = "hostfile" if e.anchor == "hostfile" else "inputs"
        return [check(name, "-", "fail", e.args[0], f"see RUNBOOK.md#{e.anchor}")]
    hosts, peers = hf.unique_ssh(), parity.peers_of(hf)
    mine = local_probe.probe_ips([ip for r in hf.hosts if not is_local(r.ssh) for ip in r.ips])
    args.self_hosts = {r.ssh for r in hf.hosts if not is_local(r.ssh) and any(mine.get(ip) for ip in r.ips)}
    with ThreadPoolExecutor(len(hosts)) as pool:  # every probe bounded by the deadline (subprocess timeout)
        running = {h: pool.submit(probe_host, args, h, hf, peers, deadline) for h in hosts}
        ref = local_reference(args)  # hashed here while the hosts answer
        results = {h: f.result() for h, f in running.items()}  # a probe that raised: UNKNOWN
    links = {h: f.get("link") for h, (f, _, _) in results.items() if f and "error" not in (f.get("link") or {"error"})}
    args.rtts = {h: max(v["rtt_ms"] for v in link.values()) for h, link in links.items()
                 if all(v["rtt_ms"] is not None for v in link.values())}
    summary = f"{args.hostfile}: {hf.backend or 'ring'}, {hf.size} rank(s) on {len(hosts)} host(s): {', '.join(hosts)}"
    return [check("hostfile", "-", "pass", summary)] + evaluate(args, hf, ref, results)


# ---- report -------------------------------------------------------------------------------------

def code_of(checks: list[dict]) -> int:
    st = {c["status"] for c in checks}
    return 2 if "fail" in st else 1 if "warn" in st else 0


def perf_label(label: str) -> str:
    """A perfdata label: single-quoted (a quote doubled) unless plain, per the plugin guidelines."""
    return label if re.fullmatch(r"[A-Za-z0-9_]+", label) else "'" + label.replace("'", "''") + "'"


def plugin_line(result: dict, args) -> str:
    """`PARITY <STATUS> - <summary> | <perfdata>` (Nagios plugin guidelines): which gate failed, and where."""
    rows, summary = result["checks"], []
    for part in ("runtime", "content"):
        mine = [c for c in rows if ("content" if c["name"] in CONTENT else "runtime") == part]
        bad = [f"{c['name']} on {c['host']}" for c in mine if c["status"] != "pass"]
        more = f", +{len(bad) - 4} more" if len(bad) > 4 else ""
        if bad or (mine and part in GATES[args.gate]):
            summary.append(f"{part} {STATUS[code_of(mine)]}" + (f" ({', '.join(bad[:4])}{more})" if bad else ""))
        else:  # a gate not asked for, or one that the hostfile or inputs stopped before it began
            summary.append(f"{part} not checked (--gate {args.gate})" if part not in GATES[args.gate] else
                           f"{part} not reached")
    if result["code"] == 3:
        summary = [rows[0]["detail"][:200]]
    n = Counter(c["status"] for c in rows)
    perf = [f"duration={result['duration_s']}s;;;0", f"failed={n['fail']};;;0", f"warned={n['warn']};;;0"]
    perf += [f"{perf_label('rtt_' + h)}={ms}ms;;;0" for h, ms in getattr(args, "rtts", {}).items()]
    return f"PARITY {result['status']} - " + "; ".join(summary).replace("|", "/") + " | " + " ".join(perf)


def print_table(result: dict, args) -> None:
    rows, n = result["checks"], Counter(c["status"] for c in result["checks"])
    wn, wh = max([len(c["name"]) for c in rows] + [5]), max([len(c["host"]) for c in rows] + [4])
    print(plugin_line(result, args))
    print(f"check-parity gate {args.gate} hostfile {args.hostfile} python {args.python} remote_root {args.remote_root}")
    print(f"  {'status':<6}  {'check':<{wn}}  {'host':<{wh}}  detail")
    for c in rows:
        mark = {"pass": "pass", "warn": "WARN", "fail": "FAIL"}[c["status"]]
        print(f"  {mark:<6}  {c['name']:<{wn}}  {c['host']:<{wh}}  {c['detail']}")
        if c["fix"]:
            print(f"  {'':<6}  {'':<{wn}}  {'':<{wh}}  fix: {c['fix']}")
    print(f"check-parity status {result['status']} code {result['code']} checks {len(rows)} fail {n['fail']} "
          f"warn {n['warn']} duration_s {result['duration_s']}", flush=True)


def on_alarm(signum, frame):
    raise TimeoutError()


def checked(args) -> tuple[list[dict], int]:
    """(checks, exit code), bounded by --timeout (SIGALRM); a check that breaks is UNKNOWN, never OK."""
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout) + 3)
    try:
        checks = run_checks(args, time.monotonic() + args.timeout)
        return checks, code_of(checks)
    except TimeoutError:
        return [check("deadline", "-", "fail", f"the check did not finish within {args.timeout:g} s",
                      "see RUNBOOK.md#parity-ssh")], 3
    except Exception as e:
        return [check("internal", "-", "fail", f"{type(e).__name__}: {e}",
                      "report it with runs/parity/last.json; see RUNBOOK.md#parity-unknown")], 3
    finally:
        signal.alarm(0)


def main() -> int:
    args = build_parser().parse_args()
    t0, state = time.monotonic(), Path(args.state_dir)
    args.timeout = args.timeout or (600.0 if args.deep else 20.0)
    state.mkdir(parents=True, exist_ok=True)
    with open(state / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run holds it: say so, touch nothing
            lock.seek(0)
            holder, last = lock.read().strip() or "?", None
            checks, code = [check("lock", "-", "fail", f"another check-parity is running (pid {holder} holds "
                                  f"{state / '.lock'}); this run exits without checking",
                                  "wait for it to finish; see RUNBOOK.md#parity-lock")], 3
        else:
            lock.truncate(0)
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            checks, code = checked(args)
            last = state / ("last.json" if args.gate == "all" else f"last-{args.gate}.json")
        result = {"status": STATUS[code], "code": code, "checks": checks,
                  "duration_s": round(time.monotonic() - t0, 3), "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if last is not None:
            from lib import atomic

            atomic.write_json(last, result)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        print_table(result, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
