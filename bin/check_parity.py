#!/usr/bin/env python3
"""check-parity: preflight every host of the hostfile, in the plan's order; each failure names its fix.

Gate runtime: ssh, runtime.*, resources.*, link.*; gate content: the code, model and dataset bytes.
One probe per host, all within --timeout; a second run exits 3 (flock); the result also goes to
<state-dir>/last.json. Text output starts with a monitoring plugin's line (`PARITY OK - runtime OK;
content OK | duration=0.31s;;;0 ...`). Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
Example (`make check-parity`; `make provision` adds --gate runtime):
    python bin/check_parity.py --hostfile hostfile.json --python /Users/op/thunder-runbook/.venv/bin/python \
        --remote-root /Users/op/thunder-runbook --model models/gemma-4-e2b-4bit --dataset domain_sft_v1
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, dataset, hostfile, parity, parity_probe, paths, supervisor  # noqa: E402
from lib.log import RunbookError  # noqa: E402

STATUS, CODE = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}, {"pass": 0, "warn": 1, "fail": 2}
GATES = {"runtime": ["runtime"], "content": ["content"], "all": ["runtime", "content"]}
FAST_SYNCH, LINK_FIX = "MLX_METAL_FAST_SYNCH", "see RUNBOOK.md#parity-link"
MIN_MEM_GB, RTT_WARN_MS, GB, MiB = 2.0, 2.0, 1 << 30, 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--python", required=True, help="interpreter path on every host")
    p.add_argument("--remote-root", required=True, help="absolute path of the repo on every host")
    p.add_argument("--gate", choices=GATES, default="all", help="runtime, content or all (default)")
    p.add_argument("--model", default="", help="local model folder (checked) or a hub id (skipped)")
    p.add_argument("--dataset", default="", help="dataset name under datasets/ (checked once exported)")
    p.add_argument("--config", default="", help="run config: only a calibration with its loss is used")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--deep", action="store_true", help="hash every model file (default: compare sizes)")
    p.add_argument("--timeout", type=float, help="bound on the whole check, s (default 20; 600 with --deep)")
    p.add_argument("--min-disk-gb", type=float, default=10.0, help="free disk needed at REMOTE_ROOT")
    p.add_argument("--state-dir", default=str(paths.RUNS / "parity"), help="lock and last.json")
    p.add_argument("--run", default="", help="the launch gate: fail while RUN's supervisor or a rank lives")
    return p


def check(name: str, host: str, status: str | bool, detail: str, fix: str = "") -> dict:
    """One row of the result (status True: pass, False: fail); a passing row carries no fix."""
    status = {True: "pass", False: "fail"}.get(status, status)
    return dict(name=name, host=host, status=status, detail=detail, fix="" if status == "pass" else fix)


def validate_inputs(args):
    """The hostfile and every value that reaches a subprocess, refused before any runs (RunbookError).
    Sets args.content: {name: (this checkout's folder, the hosts' folder, its parts, sha256 or sizes)}."""
    hf = hostfile.load(args.hostfile)
    hostfile.check_path(args.python, "PYTHON")
    args.root = os.path.normpath(hostfile.check_path(args.remote_root, "REMOTE_ROOT"))
    if args.dataset and not paths.is_safe_name(args.dataset):
        raise RunbookError(f"DATASET {args.dataset!r} refused: use a plain folder name", "parity-dataset")
    args.content = {"code": (str(paths.ROOT), args.root, parity.CODE_PARTS, True)}
    local = Path(os.path.abspath(paths.ROOT / args.model))  # not resolved: models/x may link to a bigger disk
    args.model_local = local if args.model and local.is_dir() else None
    if args.model_local:  # on the hosts under REMOTE_ROOT; a folder outside the repo at the same path
        paths.require_complete(local, args.model, "parity-model")
        rel = local.relative_to(paths.ROOT).as_posix() if local.is_relative_to(paths.ROOT) else str(local)
        remote = hostfile.check_path(os.path.join(args.root, rel), "MODEL path on the hosts")
        args.content["model"] = (str(local), remote, ["."], args.deep)
    manifest = paths.DATASETS / args.dataset / "manifest.json"
    if args.dataset and manifest.is_file():  # exported here: the manifest and the files it names
        files = ["manifest.json", *dataset.read_manifest(manifest.parent)["files"]]
        args.content["dataset"] = (str(manifest.parent), f"{args.root}/datasets/{args.dataset}", files, True)
    args.model_bytes = sum(p.stat().st_size for p in local.glob("*.safetensors")) if args.model_local else 0
    args.peaks, args.calibration = calibrated_peaks(args.model, args.config)
    sync = f"make sync HOSTFILE={args.hostfile}"
    args.fix = {"provision": f"make provision HOSTFILE={args.hostfile}; see RUNBOOK.md#parity-runtime",
                "model": f"{sync} SYNC_MODEL=1; see RUNBOOK.md#parity-model"}
    args.fix["code"] = args.fix["dataset"] = f"{sync}; see RUNBOOK.md#parity-code"
    return hf


def calibrated_peaks(model: str, config: str = "") -> tuple[dict, str]:
    """({host: peak bytes at the recommended batch}, file) of MODEL's newest calibration of CONFIG's loss."""
    docs = [(path, doc) for path, doc in paths.calibrations() if model and doc.get("model") == model]
    if config and docs:  # lib.config (yaml) only when it matters: every import delays the probes
        from lib.config import load_config
        loss = load_config(config)["loss"]
        docs = [(path, doc) for path, doc in docs if (doc.get("config") or {}).get("loss") == loss]
    for path, doc in docs[:1]:
        b = (doc.get("recommendation") or {}).get("per_rank_batch")
        fit = {h["ssh"]: [r for r in h.get("sweep", []) if not r.get("over_memory")]
               for h in doc.get("hosts", [])}
        return {h: next((r for r in rows if r["batch"] == b), rows[-1])["peak_mem_bytes"]
                for h, rows in fit.items() if rows}, path.name
    return {}, ""


def eval_runtime(args, h: str, f: dict, facts: dict, lock: str, envs: list[str]) -> list[dict]:
    """runtime.python: the first host's interpreter (real path, version); runtime.packages: the lock's
    versions; runtime.mlx: mlx.core computes and is not shadowed; runtime.env: FAST_SYNCH unset."""
    key = {k: f"{v['python']['realpath']} (Python {v['python']['version']})" for k, v in facts.items()}
    first, fix = next(iter(key)), args.fix["provision"]
    py = f"PYTHON resolves to {key[h]}, but to {key[first]} on {first}" if key[h] != key[first] else ""
    have, mx, pins = f.get("packages") or {}, f.get("mlx") or {}, parity.lock_pins(lock, f["marker_env"])
    bad = [f"{n}: requirements.lock has no pin for this host's platform" for n in parity.PACKAGES[:6]
           if n not in pins]  # the six every host needs; mlx-cpu / mlx-metal only where they apply
    bad += [f"{n} {have.get(n) or 'missing'} (lock {pins[n]})" for n in parity.PACKAGES
            if n in pins and have.get(n) != pins[n]]
    bad = [f"cannot list packages: {have['error']}"] if "error" in have else bad
    same = ", ".join(f"{n} {have.get(n)}" for n in parity.PACKAGES if n in pins) + " = requirements.lock"
    where, why = f"mlx.core {mx.get('version')} from {mx.get('file')}", ""
    if not mx.get("ok"):
        why = "mlx.core does not work: " + (mx.get("error") or f"1+2+3 doubled gave {mx.get('result')}")
    elif have.get("mlx") and mx["version"] != have["mlx"]:
        why = f"the imported {where}, but the installed mlx is {have['mlx']}: another copy shadows it"
    ok = f"{where} computes ({mx.get('device')}, {mx.get('seconds')} s)"
    bad = "differs from requirements.lock: " + "; ".join(bad) if bad else ""
    set_in = [w for w, on in (("the hostfile's envs", any(e.split("=")[0] == FAST_SYNCH for e in envs)),
                              ("this host's ssh environment", FAST_SYNCH in f["env"])) if on]
    env = f"{FAST_SYNCH} is set in {' and '.join(set_in)}: it can wedge the GPU until a reboot (mlx#3142)"
    return [check("runtime.python", h, not py, py or f"{f['python']['requested']} -> {key[h]}", fix),
            check("runtime.packages", h, not bad, bad or same, fix),
            check("runtime.mlx", h, not why, why or ok, fix),
            check("runtime.env", h, not set_in, env if set_in else f"{FAST_SYNCH} unset", "remove it from "
                  "the hostfile's envs and the host's ~/.zshenv (the MLX docs say to leave it unset, though "
                  "the coordinator seed recommends it); see RUNBOOK.md#parity-fast-synch")]


def eval_resources(args, h: str, f: dict) -> list[dict]:
    """Free disk and memory; may ssh read REMOTE_ROOT (TCC refuses ~/Documents with EPERM, modes EACCES)."""
    disk, mem, root, fix = f["disk"], f.get("memory") or {}, args.root, "see RUNBOOK.md#parity-resources"
    free, avail = disk.get("free_bytes", -GB) / GB, (mem.get("available_bytes") or 0) / GB
    out = [check("resources.disk", h, free >= args.min_disk_gb, f"cannot read free disk: {disk.get('error')}"
                 if free < 0 else f"{free:.1f} GB free at {disk['path']} (minimum {args.min_disk_gb:g} GB)",
                 f"free space on the host (du -sh {root}/runs/*), or lower MIN_DISK_GB; {fix}"),
           check("resources.memory", h, "pass" if avail >= MIN_MEM_GB else "warn",
                 f"{avail:.1f} GB available of {(mem.get('total_bytes') or 0) / GB:.1f} GB (warn below "
                 f"{MIN_MEM_GB:g} GB)" if "available_bytes" in mem else f"cannot read free memory: "
                 f"{mem.get('error')}", f"stop other jobs on the host; {fix}")]
    err, status = disk.get("errno"), "fail"
    under = os.path.relpath(root, disk.get("home") or "/").split("/")[0]  # ".." when not under home
    fix = ("on the host: Remote Login (i) > Allow full disk access for remote users, or move REMOTE_ROOT "
           "out of ~/Desktop, ~/Documents, ~/Downloads; see RUNBOOK.md#parity-tcc")
    if err == "EPERM":
        why = f"{root}: Operation not permitted (EPERM): macOS privacy protection (TCC) refuses ssh"
    elif err == "EACCES":
        why = f"{root}: Permission denied (EACCES): its owner or mode refuses the ssh user"
        fix = f"on the host: ls -ld {root}, then chown or chmod it; see RUNBOOK.md#parity-tcc"
    elif err not in (None, "ENOENT"):
        why = f"{root}: {disk.get('error')}"
    elif f["system"] == "Darwin" and under in ("Desktop", "Documents", "Downloads"):
        status, why = "warn", f"{root} lies under ~/{under}: a macOS update can take ssh's access away"
    else:
        status, why = "pass", f"{root} " + ("does not exist yet (sync creates it)" if err else "is readable")
    return out + [check("resources.remote_root", h, status, why, fix)]


def eval_macos(args, h: str, f: dict, hf) -> list[dict]:
    """Thunderbolt, RDMA, sleep and wired memory from the macOS tools' output (skipped elsewhere)."""
    ranks, mac = [r for r in hf.hosts if r.ssh == h], f.get("macos") or {}
    ips, jaccl = [ip for r in ranks for ip in r.ips], hf.backend.startswith("jaccl")
    if f["system"] != "Darwin":
        names = ["resources.thunderbolt", "resources.sleep", "resources.wired"] + ["resources.rdma"] * jaccl
        return [check(n, h, "pass", f"skipped: not macOS ({f['system']})") for n in names]
    skip = "jaccl carries data over rdma devices" if jaccl else "loopback ranks" if all(
        ip.startswith("127.") for ip in ips) else ""
    out = [check("resources.thunderbolt", h, "pass", f"skipped: {skip}") if skip else check(
        "resources.thunderbolt", h, *parity.thunderbolt_facts(ips, mac), "see RUNBOOK.md#parity-thunderbolt")]
    status, detail, flag = parity.sleep_facts(mac.get("pmset"), mac.get("pmset_ps"))
    out += [check("resources.sleep", h, status, detail, f"on the host: sudo pmset {flag} sleep 0 (caffeinate"
                  " -i holds only while the run does); see RUNBOOK.md#parity-sleep"), eval_wired(args, h, f)]
    if jaccl:
        rdma = [d for r in ranks for d in r.rdma]
        wanted, missing, shown = parity.rdma_missing(rdma, mac.get("ibv_devices"))
        detail = f"lists {', '.join(shown) or 'nothing'}, not {', '.join(missing)}" if missing else (
            f"lists {', '.join(wanted)}")
        out.append(check("resources.rdma", h, not missing, "ibv_devices " + detail, "rdma_ctl enable in "
                         "recoveryOS, check the cables; see RUNBOOK.md#parity-thunderbolt"))
    return out


def eval_wired(args, h: str, f: dict) -> dict:
    """A rank's need (calibrated peak, else the weights) against Metal's recommended working set."""
    limit = parity.wired_limit_mb((f.get("macos") or {}).get("wired_limit"))
    ws, total = (f.get("mlx") or {}).get("working_set"), (f.get("memory") or {}).get("total_bytes") or 0
    peak, fix, froze = args.peaks.get(h), "see RUNBOOK.md#parity-wired-limit", "over-wiring froze 16 GB Macs"
    need, safe_mb = max(args.model_bytes, peak or 0), max(total // MiB - 4096, 0)
    what = (f"calibrated peak {peak / GB:.1f} GB ({args.calibration}, weights included)" if peak else
            f"the model's {args.model_bytes / GB:.1f} GB of weights (no calibration of this model)")
    detail = (f"iogpu.wired_limit_mb {limit if limit else '0 (the default)'}; recommended working set "
              f"{(ws or 0) / GB:.1f} GB of {total / GB:.0f} GB; needs {what}")
    status = "pass" if ws else "warn"
    if limit and limit > safe_mb:
        status, detail = "warn", f"{detail}: the limit leaves under 4 GB to macOS ({froze}, exo#1672)"
        fix = f"on the host: sudo sysctl iogpu.wired_limit_mb={safe_mb} (or 0, the default); " + fix
    elif ws and need > ws:
        status, detail = "warn", f"{detail}: over the working set by {(need - ws) / GB:.1f} GB (it pages)"
        fix = (f"a smaller per-rank batch (make calibrate), or on the host: sudo sysctl iogpu.wired_limit_mb="
               f"{min(-(-need // MiB) + 1024, safe_mb)} (until reboot; keep 4 GB for macOS: exo#1672); {fix}")
    elif not ws:
        detail = "mlx reports no recommended working set: " + detail
    return check("resources.wired", h, status, detail, fix)


def eval_link(args, h: str, f: dict) -> dict:
    """link.rtt: the fastest TCP handshake to each peer IP (ring neighbours, or every rank for jaccl)."""
    if not (link := f["link"]):
        return check("link.rtt", h, "pass", "skipped: no peers (one rank)")
    if "error" in link:
        return check("link.rtt", h, "fail", f"probe error: {link['error']}", LINK_FIX)
    if dead := [f"{ip} ({v['error']})" for ip, v in link.items() if v["rtt_ms"] is None]:
        return check("link.rtt", h, "fail", "peer(s) unreachable: " + "; ".join(dead),
                     f"check the cable/bridge and the peer's IP; {LINK_FIX}")
    args.rtts[h] = max(v["rtt_ms"] for v in link.values())  # for the perfdata
    shown = ", ".join(f"{ip} {v['rtt_ms']} ms (min of {v['tries']})" for ip, v in link.items()) + " (TCP :22)"
    slow = f"round trip above {RTT_WARN_MS:g} ms: " if args.rtts[h] > RTT_WARN_MS else ""
    return check("link.rtt", h, "warn" if slow else "pass", slow + shown,
                 f"the ring may run over Wi-Fi/Ethernet, not Thunderbolt; {LINK_FIX}")


def evaluate(args, hf, ref: dict, results: dict) -> list[dict]:
    """The gate's checks for every host from its probe: results[host] = (facts or None, Result, seconds)."""
    checks, facts = [], {h: f for h, (f, _, _) in results.items() if f}  # no facts: nothing more to ask
    for h, (f, r, secs) in results.items():
        name, why, fix = ("", "", "") if f else parity.probe_failure(h, args.python, r)
        how = "local (127.0.0.1, like mlx.launch)" if hostfile.is_local(h) else "ssh ok"  # by name: ssh
        checks += [check("ssh", h, "pass", f"{how}, round trip {secs:.2f} s")] if name != "ssh" else []
        checks += [check(name, h, "fail", why, fix or args.fix["provision"])] if name else []
    for h, f in facts.items():
        if args.run:  # one launch per run folder: no rank of RUN alive on any host
            ranks, fix = f.get("ranks") or [], f"make stop RUN={args.run}; see RUNBOOK.md#{supervisor.ANCHOR}"
            alive = ("; ".join(f"pid {pid} (launch {lid})" for pid, lid in ranks) if isinstance(ranks, list)
                     else f"probe error: {ranks.get('error')}")
            checks.append(check("run", h, not alive, f"RUN {args.run}'s ranks alive here: {alive}" if alive
                                else f"no rank of RUN {args.run}", fix))
        if "runtime" in GATES[args.gate]:
            checks += eval_runtime(args, h, f, facts, ref["lock"], hf.envs)
            checks += [*eval_resources(args, h, f), *eval_macos(args, h, f, hf), eval_link(args, h, f)]
        for name, (_, where, _, _) in args.content.items() if "content" in GATES[args.gate] else ():
            ours, theirs = ref[name], f[name]  # {rel: [size, sha256 or None]} here and on the host
            if "error" in theirs:
                status, detail = "fail", f"probe error: {theirs['error']}"
            elif not theirs:
                status = "warn" if name == "dataset" else "fail"
                detail = f"none of its {len(ours)} files exist on this host (not synced yet)"
            else:
                diff = {"differs": [p for p in set(ours) & set(theirs) if ours[p] != theirs[p]],
                        "missing": set(ours) - set(theirs), "extra on host": set(theirs) - set(ours)}
                bad = [f"{k}: {', '.join(sorted(v)[:5])}" + (f" (+{len(v) - 5} more)" if len(v) > 5 else "")
                       for k, v in diff.items() if v]
                mb = sum(v[0] for v in ours.values()) / 1e6
                status, detail = not bad, "; ".join(bad) or f"{len(ours)} files, {mb:.1f} MB identical"
            checks.append(check(name, h, status, f"{where}: {detail}", args.fix[name]))
    if "content" in GATES[args.gate] and not args.model_local:  # missing here, or a hub id each host resolves
        missing = args.model.startswith((".", "/", "models/"))
        why = (f"MODEL {args.model} does not exist here" if missing else f"skipped: MODEL {args.model} is a "
               "hub id (each host resolves it from its own cache)" if args.model else "skipped: no MODEL")
        checks.append(check("model", "local" if missing else "-", not missing, why,
                            "fetch it (make model HF_REPO=...) or set MODEL=; see RUNBOOK.md#parity-model"))
    return checks


def run_checks(args) -> list[dict]:
    """The hostfile's row, then every host's checks; refused inputs are one row, before any ssh. Bounded by
    --timeout (SIGALRM); a check that breaks is UNKNOWN (its row comes first), never OK."""
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout) + 3)
    try:
        hf = validate_inputs(args)
        hosts, peers = hf.unique_ssh(), parity.peers_of(hf)
        params = {"python": args.python, "remote_root": args.root, "parts": GATES[args.gate],
                  "content": args.content, "link_enough_ms": RTT_WARN_MS / 4,
                  "rdma": hf.backend.startswith("jaccl"), "ranks": args.run and supervisor.pattern(args.run)}
        deadline = time.monotonic() + args.timeout  # every probe bounded by it (subprocess timeout)
        with ThreadPoolExecutor(len(hosts)) as pool:
            running = {h: pool.submit(parity.probe, h, args.python, dict(params, peers=peers[h]), deadline)
                       for h in hosts}
            ref = {name: parity_probe.probe_files(here, parts, hashed) for name, (here, _, parts, hashed)
                   in args.content.items() if "content" in GATES[args.gate]}  # while the hosts answer
            ref["lock"] = (paths.ROOT / "requirements.lock").read_text("utf-8")
            results = {h: f.result() for h, f in running.items()}  # a probe that raised: UNKNOWN
        row = check("hostfile", "-", "pass", f"{args.hostfile}: {hf.backend or 'ring'}, {hf.size} rank(s) on "
                    f"{len(hosts)} host(s): {', '.join(hosts)}")
        rec = supervisor.holder(args.run) if args.run else None  # another supervisor of RUN on this Mac
        held = [check("supervisor", "-", "fail", supervisor.busy(args.run, rec),
                      f"see RUNBOOK.md#{supervisor.ANCHOR}")] if rec is not None else []
        return [row, *held, *evaluate(args, hf, ref, results)]
    except RunbookError as e:
        return [check("hostfile" if e.anchor == "hostfile" else "inputs", "-", "fail", e.args[0],
                      f"see RUNBOOK.md#{e.anchor}")]
    except TimeoutError:
        return [check("deadline", "-", "fail", f"the check did not finish within {args.timeout:g} s",
                      "see RUNBOOK.md#parity-ssh")]
    except Exception as e:
        return [check("internal", "-", "fail", f"{type(e).__name__}: {e}",
                      "report it with runs/parity/last.json; see RUNBOOK.md#parity-unknown")]
    finally:
        signal.alarm(0)


def perf_label(label: str) -> str:
    """A perfdata label: single-quoted (a quote doubled) unless plain, per the plugin guidelines."""
    return label if label.isascii() and label.isidentifier() else "'" + label.replace("'", "''") + "'"


def table(result: dict, args) -> list[str]:
    """`PARITY <STATUS> - <summary> | <perfdata>` (Nagios plugin guidelines: which gate failed, and where),
    a row per check with its fix, then the status line."""
    rows, summary, gates = result["checks"], [], GATES[args.gate]
    n = {s: [c["status"] for c in rows].count(s) for s in ("fail", "warn")}
    for part in ("runtime", "content") if result["code"] != 3 else ():
        mine = [c for c in rows if (c["name"] in ("code", "model", "dataset")) == (part == "content")]
        bad = [f"{c['name']} on {c['host']}" for c in mine if c["status"] != "pass"]
        where = f" ({', '.join(bad[:4])}{f', +{len(bad) - 4} more' if len(bad) > 4 else ''})" if bad else ""
        worst = STATUS[max([CODE[c["status"]] for c in mine], default=0)] + where
        summary.append(f"{part} " + (worst if bad or mine and part in gates else
                                     "not reached" if part in gates else f"not checked (--gate {args.gate})"))
    perf = [f"duration={result['duration_s']}s;;;0", f"failed={n['fail']};;;0", f"warned={n['warn']};;;0"]
    perf += [f"{perf_label('rtt_' + h)}={ms}ms;;;0" for h, ms in args.rtts.items()]
    summary = "; ".join(summary or [rows[0]["detail"][:200]]).replace("|", "/")
    L = [f"PARITY {result['status']} - {summary} | " + " ".join(perf)]
    wn, wh = max([len(c["name"]) for c in rows] + [5]), max([len(c["host"]) for c in rows] + [4])
    for c in rows:
        status = c["status"] if c["status"] == "pass" else c["status"].upper()
        L.append(f"  {status:<6}  {c['name']:<{wn}}  {c['host']:<{wh}}  {c['detail']}")
        L += [" " * (wn + wh + 14) + f"fix: {c['fix']}"] if c["fix"] else []
    return L + [f"check-parity status {result['status']} code {result['code']} checks {len(rows)} fail "
                f"{n['fail']} warn {n['warn']} duration_s {result['duration_s']}"]


def on_alarm(signum, frame):
    raise TimeoutError()


def main() -> int:
    args = build_parser().parse_args()
    t0, state, args.rtts = time.monotonic(), Path(args.state_dir), {}
    args.timeout = args.timeout or (600.0 if args.deep else 20.0)
    state.mkdir(parents=True, exist_ok=True)
    last = state / ("last.json" if args.gate == "all" else f"last-{args.gate}.json")
    with open(state / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run holds it: say so, touch nothing
            lock.seek(0)
            why = f"another check-parity is running (pid {lock.read().strip() or '?'} holds {lock.name})"
            checks, last = [check("lock", "-", "fail", why + "; this run exits without checking",
                                  "wait for it to finish; see RUNBOOK.md#parity-lock")], None
        else:
            lock.truncate(0)
            print(os.getpid(), file=lock, flush=True)
            checks = run_checks(args)
        unknown = checks[0]["name"] in ("lock", "deadline", "internal")  # the check itself did not finish
        code = 3 if unknown else max(CODE[c["status"]] for c in checks)
        result = {"status": STATUS[code], "code": code, "checks": checks,
                  "duration_s": round(time.monotonic() - t0, 3), "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if last:
            atomic.write_json(last, result)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
        return code
    lines = table(result, args)
    if args.run and code == 0 and last:  # the launch gate, all passed: one line; the table in the state dir
        atomic.write_text(state / "last.txt", "\n".join(lines) + "\n")
        lines = [f"{lines[-1]} table {paths.rel(state / 'last.txt')}"]
    print("\n".join(lines), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
