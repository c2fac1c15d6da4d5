"""Launch the trainer on every rank, watch it, bring its artifacts home, name the failure.

Shared by bin/smoke.py and bin/run.py (train and control). The launch is mlx.launch with the
hostfile (argument list, never a shell string), or, for a single host, the trainer started
directly (mlx 0.32.4's launcher hands a lone rank an empty MLX_HOSTFILE that
mx.distributed.init() cannot parse). While it runs, a watchdog reads the step lines the
ranks print; no progress for the window stops every rank and reports "hang / link partition".
After the launch, whatever happened, every host is swept for leftover rank processes of this
run and the run folder is fetched back from the hosts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lib import atomic, jsonl, paths
from lib.hashing import digest_of, sha256_file, tree_hashes
from lib.hostfile import Hostfile, is_local
from lib.log import CATEGORIES, OTHER_FAILURES, anchor_of, event
from lib.remote import rsh, run_on

STEP_RE = re.compile(r"(?:^|\s)iter (\d+)\b")
DONE_RE = re.compile(r"(?:^|\s)done step \d+")
DEFAULT_WATCHDOG_S = 300.0


def trainer_pattern(run_rel: str) -> str:
    """The pkill -f pattern that matches the rank processes writing to run_rel (e.g.
    runs/stage1 or runs/stage1/smoke) and nothing else."""
    # POSIX ERE (pkill on Linux and macOS): run ids hold only [A-Za-z0-9._-], so '.' is the
    # one character to escape.
    return r"bin/train\.py .*--run-dir " + run_rel.replace(".", r"\.") + r"( |$)"


def git_info() -> dict:
    def git(*a):
        p = subprocess.run(["git", *a], cwd=paths.ROOT, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or "unknown", "dirty": dirty}


def model_hash(model: str) -> str:
    """sha256 over the model folder's file hashes (cached by path, size and mtime: a real
    model is gigabytes), or "hub:<id>" for a model that is not a local folder."""
    p = Path(model)
    full = p if p.is_absolute() else paths.ROOT / p
    if not full.is_dir():
        return f"hub:{model}"
    files = sorted(f for f in full.rglob("*") if f.is_file() and not f.name.startswith("."))
    key = digest_of({str(f.relative_to(full)): f"{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files})
    cache = paths.ROOT / ".stamps" / "model-hashes.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if known.get(str(full)) and known[str(full)]["key"] == key:
        return known[str(full)]["sha256"]
    digest = digest_of(tree_hashes(full, [f.relative_to(full).as_posix() for f in files]))
    known[str(full)] = {"key": key, "sha256": digest}
    atomic.write_json(cache, known)
    return digest


def dataset_sha256(dataset: str) -> str:
    m = paths.DATASETS / dataset / "manifest.json"
    if not m.is_file():
        return "missing"
    return json.loads(m.read_text()).get("dataset_sha256", "unknown")


def write_manifest(run_dir: Path, stage: str, variables: dict, hf: Hostfile, extra: dict) -> dict:
    """runs/<RUN>/manifest.json: what this run is made of, written before any rank starts."""
    path = run_dir / "manifest.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    stages = old.get("stages", {})
    stages[stage] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    man = {
        "run": variables["RUN"],
        "git": git_info(),
        "lock_sha256": sha256_file(paths.ROOT / "requirements.lock"),
        "hostfile": hf.to_json(),
        "hostfile_path": variables["HOSTFILE"],
        "dataset": variables["DATASET"],
        "dataset_sha256": dataset_sha256(variables["DATASET"]),
        "model": variables["MODEL"],
        "model_sha256": model_hash(variables["MODEL"]),
        "variables": variables,
        "stages": stages,
        **extra,
    }
    atomic.write_json(path, man)
    return man


def finish_manifest(run_dir: Path, stage: str, summary: dict) -> None:
    path = run_dir / "manifest.json"
    man = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
    man.setdefault("stages", {}).setdefault(stage, {}).update(
        ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), ok=summary.get("ok"), category=summary.get("category"))
    atomic.write_json(path, man)


def write_reproduce(run_dir: Path, stage: str, make_cmd: list[str], launch_cmds: list[list[str]]) -> None:
    """runs/<RUN>/reproduce.sh: the make invocation with every variable, and what it ran."""
    path = run_dir / "reproduce.sh"
    sections = {}
    if path.is_file():
        for block in path.read_text().split("\n# --- stage: ")[1:]:
            name = block.split(" ", 1)[0].strip()
            sections[name] = "# --- stage: " + block.rstrip("\n")
    body = [f"# --- stage: {stage} ---", "# The make invocation (re-runs the stage with every variable):",
            shlex.join(make_cmd), "# What it ran underneath (from the repo root on this orchestrator):"]
    body += ["# " + shlex.join(c) for c in launch_cmds]
    sections[stage] = "\n".join(body)
    head = ["#!/usr/bin/env bash", "# Reproduce this run: copy a stage's make line, or run this file from the repo root.",
            "set -euo pipefail", 'cd "$(dirname "$0")/../.."']
    order = ["export", "sync", "smoke", "train", "control", "compare"]
    keys = sorted(sections, key=lambda k: (order.index(k) if k in order else len(order), k))
    text = "\n".join(head) + "\n\n" + "\n\n".join(sections[k] for k in keys) + "\n"
    atomic.write_text(path, text)
    path.chmod(0o755)


@dataclass
class LaunchResult:
    returncode: int
    wall_s: float
    watchdog_fired: bool = False
    steps: list[int] = field(default_factory=list)
    last_progress_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    done: bool = False  # rank 0 printed `done step N`: the trainer finished


def launch_argv(hostfile_path: str, hf: Hostfile, python: str, remote_root: str, trainer_args: list[str],
                port: int | None = None, script: str = "bin/train.py") -> list[str]:
    """mlx.launch of `script` (the trainer; calibrate's rank probe) on every rank, or the script
    directly for a lone host."""
    train = [script, *trainer_args]
    if hf.size == 1:
        host = hf.hosts[0].ssh
        cmd = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", remote_root, python, *train]
        if is_local(host):
            return cmd
        from lib.remote import ssh_argv

        return ssh_argv(host, cmd)
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    argv = [launcher, "--hostfile", hostfile_path, "--python", python, "--cwd", remote_root]
    if hf.backend:
        argv += ["--backend", hf.backend]
    if port:
        argv += ["--starting-port", str(port)]
    return argv + ["--", *train]


def run_watched(argv: list[str], log_path: Path, window_s: float | None, cwd: Path = paths.ROOT) -> LaunchResult:
    """Run the launch, tee its output to the console and log_path, and stop it when no step
    progress is seen for the watchdog window (None: max(10 x median step, 300 s))."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res = LaunchResult(returncode=-1, wall_s=0)
    state = {"last": t0, "last_step": None, "step_t": None}
    lock = threading.Lock()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def reader():
        with open(log_path, "ab") as log:
            for raw in iter(proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                sys.stdout.buffer.write(raw)
                sys.stdout.buffer.flush()
                text = raw.decode(errors="replace")
                if DONE_RE.search(text):
                    res.done = True
                m = STEP_RE.search(text)
                if m:
                    step = int(m.group(1))
                    now = time.monotonic()
                    with lock:
                        if state["last_step"] is None or step > state["last_step"]:
                            if state["step_t"] is not None and state["last_step"] is not None:
                                res.step_times.append((now - state["step_t"]) / (step - state["last_step"]))
                            state["last_step"], state["step_t"], state["last"] = step, now, now
                            res.steps.append(step)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    while proc.poll() is None:
        time.sleep(0.2)
        with lock:
            idle = time.monotonic() - state["last"]
            median = statistics.median(res.step_times) if res.step_times else 0.0
        window = window_s if window_s else max(10 * median, DEFAULT_WATCHDOG_S)
        if idle > window:
            res.watchdog_fired = True
            print(f"watchdog: no step progress for {idle:.0f} s (window {window:.0f} s); stopping every rank",
                  flush=True)
            stop_group(proc)
            break
    proc.wait()
    th.join(timeout=10)
    res.returncode = proc.returncode
    res.wall_s = time.monotonic() - t0
    res.last_progress_s = state["last"] - t0
    return res


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the launcher's process group, then SIGKILL what is left after `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def sweep(hf: Hostfile, run_rel: str) -> dict[str, str]:
    """Kill any rank process of this run left on any host (SIGCONT first so a frozen one
    can die); returns what was found per host."""
    pattern = trainer_pattern(run_rel)
    found = {}

    def one(host: str):
        r = run_on(host, ["sh", "-c", 'pkill -CONT -f -- "$1"; pkill -KILL -f -- "$1" && echo killed || true',
                          "sh", pattern], timeout=15)
        found[host] = "killed leftovers" if "killed" in r.stdout else ("clean" if r.ok else f"unreachable: {r.stderr.strip()[:200]}")

    threads = [threading.Thread(target=one, args=(h,)) for h in hf.unique_ssh()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


def fetch(hf: Hostfile, run_rel: str, remote_root: str) -> dict[str, str]:
    """Bring run_rel (runs/<RUN>[/smoke]) home: everything from rank 0's host, logs from the others."""
    out = {}
    local_dir = paths.ROOT / run_rel
    local_dir.mkdir(parents=True, exist_ok=True)
    if Path(remote_root) == paths.ROOT and all(is_local(h.ssh) for h in hf.hosts):
        return {h: "local" for h in hf.unique_ssh()}
    for i, host in enumerate(hf.unique_ssh()):
        src_root = f"{remote_root}/{run_rel}/"
        src = src_root if is_local(host) else f"{host}:{src_root}"
        argv = ["rsync", "-a", "-e", rsh()]
        if i > 0:
            argv += ["--include=logs/", "--include=logs/**", "--exclude=*"]
        argv += [src, f"{local_dir}/"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        out[host] = "ok" if p.returncode == 0 else f"rsync exit {p.returncode}: {p.stderr.strip()[:200]}"
    return out


def rank_events(run_dir: Path, launch_id: str) -> dict:
    """What the ranks of this launch said about themselves: logs/rank-R.joined.json and
    logs/rank-R.failure.json carrying this launch_id (older files are stale)."""
    joined, failures = {}, {}
    logs = run_dir / "logs"
    for kind, out in (("joined", joined), ("failure", failures)):
        for f in sorted(logs.glob(f"rank-*.{kind}.json")):
            try:
                d = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if d.get("launch_id") == launch_id:
                out[int(f.name.split("-")[1].split(".")[0])] = d
    return {"joined": joined, "failures": failures}


def categorize(res: LaunchResult, ev: dict, world: int) -> tuple[str | None, str]:
    """(category, why) for a failed launch; (None, "") when it succeeded. mlx.launch's exit
    code alone is not trusted (0.32.4 can exit 0 when a rank never started): success needs
    every rank joined, no failure file, and the trainer's own `done` line."""
    if res.watchdog_fired:
        return "hang / link partition", f"no step progress for the watchdog window (last progress at {res.last_progress_s:.0f} s)"
    for r, f in sorted(ev["failures"].items()):
        if f.get("category") in CATEGORIES:
            return f["category"], f"rank {r}: {f.get('message', '')}"
    if len(ev["joined"]) < world:
        missing = sorted(set(range(world)) - set(ev["joined"]))
        return "runtime parity", f"ranks {missing} never initialized (launcher exit {res.returncode})"
    if ev["failures"]:
        r, f = sorted(ev["failures"].items())[0]
        name, _ = OTHER_FAILURES.get(f.get("kind", "error"), OTHER_FAILURES["error"])
        return name, f"rank {r}: {f.get('message', '')}"
    if ev.get("oom_line"):
        # Killed by the allocator (a segfault on CPU, an abort on Metal) before it could say so.
        return "out of memory", f"a rank died out of memory: {ev['oom_line']}"
    if res.returncode != 0 or not res.done:
        return "hang / link partition", (f"a rank died mid-run (launcher exit {res.returncode}, trainer "
                                         f"{'finished' if res.done else 'did not finish'}); the link or the host went away")
    return None, ""


def oom_line(log_path: Path, offset: int = 0) -> str | None:
    """The first out-of-memory message in this launch's part of the launch log, if any."""
    from lib.config import OOM_RE

    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            for raw in f:
                line = raw.decode(errors="replace").strip()
                if OOM_RE.search(line):
                    return line[:300]
    except OSError:
        return None
    return None


def oom_ladder(cfg: dict, argv: list[str], world: int) -> list[str]:
    """The fallback ladder (per-rank batch 1 with gradient accumulation keeping the global
    batch; then half max_seq_length) as launch commands ready to paste."""
    from lib.config import fallback_ladder, set_flag

    cut = argv.index("bin/train.py") + 1 if "bin/train.py" in argv else len(argv)
    head, train_args = argv[:cut], argv[cut:]
    lines = []
    for n, (what, rung) in enumerate(fallback_ladder(cfg, train_args, world), 1):
        if "--run-dir" in rung:  # each rung in its own run folder
            rung = set_flag(rung, "--run-dir", f"{rung[rung.index('--run-dir') + 1]}-oom{n}")
        lines.append(f"# rung {n}: {what}")
        lines.append(shlex.join(head + rung))
    return lines


def print_category(category: str, why: str) -> None:
    anchor = anchor_of(category)
    print(f"FAILED category: {category}: {why}; see RUNBOOK.md#{anchor}", file=sys.stderr, flush=True)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return list(jsonl.read(path)) if path.is_file() else []


def summarize(res: LaunchResult, category: str | None, why: str, extra: dict) -> dict:
    return {
        "ok": category is None,
        "returncode": res.returncode,
        "category": category,
        "anchor": anchor_of(category) if category else None,
        "why": why,
        "wall_s": round(res.wall_s, 3),
        "watchdog_fired": res.watchdog_fired,
        "last_step_seen": res.steps[-1] if res.steps else None,
        **extra,
    }


def announce(stage: str, **fields) -> None:
    event(stage, **fields)


def add_common_args(p) -> None:
    """The make variables every launching stage takes, as flags."""
    p.add_argument("--run", required=True, help="run id: runs/<RUN>/")
    p.add_argument("--hostfile", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--remote-root", required=True)
    p.add_argument("--python", required=True, help="interpreter path on the hosts")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--watchdog", type=float, default=None,
                   help="seconds without step progress before every rank is stopped "
                        "(default: max(10 x median step time, 300))")
    p.add_argument("--port", type=int, default=None, help="first ring port (mlx.launch --starting-port)")


def load_inputs(args):
    """Validate the run id, hostfile and config a launching stage was given; the config's
    watchdog_s applies when --watchdog was not. Returns (hostfile, config)."""
    from lib.config import load_config
    from lib.hostfile import load as load_hostfile

    paths.check_run_id(args.run)
    hf = load_hostfile(args.hostfile)
    cfg = load_config(args.config)
    if args.watchdog is None and cfg.get("watchdog_s"):
        args.watchdog = float(cfg["watchdog_s"])
    return hf, cfg


def variables(args, **extra) -> dict:
    """The make variables of this invocation, for the manifest and reproduce.sh."""
    v = {"RUN": args.run, "HOSTFILE": args.hostfile, "CONFIG": args.config, "MODEL": args.model,
         "DATASET": args.dataset, "REMOTE_ROOT": args.remote_root, "PYTHON": args.python}
    if args.seed is not None:
        v["SEED"] = str(args.seed)
    if args.watchdog is not None:
        v["WATCHDOG"] = f"{args.watchdog:g}"
    if args.port is not None:
        v["PORT"] = str(args.port)
    v.update({k: str(val) for k, val in extra.items() if val not in (None, "", False)})
    return v


def make_cmd(target: str, v: dict) -> list[str]:
    return ["make", target] + [f"{k}={val}" for k, val in v.items()]


def trainer_args(args, run_rel: str, config: str, iters: int | None = None, resume: bool = False) -> list[str]:
    a = ["--config", config, "--model", args.model, "--data", f"datasets/{args.dataset}", "--run-dir", run_rel]
    if args.seed is not None:
        a += ["--seed", str(args.seed)]
    if iters is not None:
        a += ["--iters", str(iters)]
    if resume:
        a += ["--resume"]
    return a


def smoke_key(hostfile_path: str, dataset: str, model: str) -> str:
    """What a passing smoke vouches for: code, lock, dataset, model and hostfile."""
    parts = tree_hashes(paths.ROOT, ["bin", "lib", "configs", "requirements.lock"])
    return digest_of({
        "code": digest_of(parts),
        "dataset": dataset_sha256(dataset),
        "model": model_hash(model),
        "hostfile": sha256_file(hostfile_path),
    })


def launch_and_collect(args, hf: Hostfile, run_rel: str, targs: list[str], log_name: str) -> tuple[LaunchResult, dict, list[str]]:
    """One launch: run it watched, sweep the hosts, fetch the artifacts, read the ranks' events."""
    launch_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{log_name.split('.')[0]}"
    targs = [*targs, "--expect-world-size", str(hf.size), "--launch-id", launch_id]
    argv = launch_argv(args.hostfile, hf, args.python, args.remote_root, targs, args.port)
    event("launch", run=run_rel, world_size=hf.size, cmd=shlex.join(argv))
    log_path = paths.ROOT / run_rel / "logs" / log_name
    offset = log_path.stat().st_size if log_path.is_file() else 0
    res = run_watched(argv, log_path, args.watchdog)
    swept = sweep(hf, run_rel)
    fetched = fetch(hf, run_rel, args.remote_root)
    ev = rank_events(paths.ROOT / run_rel, launch_id)
    ev["oom_line"] = oom_line(log_path, offset)
    ev["swept"], ev["fetched"] = swept, fetched
    return res, ev, argv
