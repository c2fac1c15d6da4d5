"""Launch the trainer on every rank, watch it, bring its artifacts home, name the failure.

Used by bin/smoke.py and bin/run.py; compare, plan, calibrate and status use its provenance helpers.
The launch is mlx.launch with the hostfile (an argument list, never a shell string), or the trainer
itself for one host (mlx 0.32.4 hands a lone rank an empty MLX_HOSTFILE). A new `iter N` step or a
`progress` line is progress; none for the watchdog window stops every rank ("hang / link partition").

    res, ev, argv, category, why = launch.launch_and_collect(args, hf, "runs/r1", targs, "launch-train.log")
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lib import atomic, jsonl, paths, supervisor
from lib.config import calibrated_shares, fallback_ladder, load_config, rank_batches, set_flag
from lib.hashing import digest_of, iter_files, sha256_file, tree_hashes
from lib.hostfile import Hostfile, is_local
from lib.hostfile import load as load_hostfile
from lib.log import CATEGORIES, HANG, OOM_RE, OTHER_FAILURES, PARITY, anchor_of, event
from lib.remote import launch_env, rsh, run_on, ssh_argv

STEP_RE = re.compile(r"(?:^|\s)iter (\d+)\b")
STDIN_FILL = 1 << 18  # bytes: over a local rank's pipe (64 KiB on Linux and macOS); remote ones: launch_env
PROGRESS_RE = re.compile(r"(?:^|\s)(?:progress|rank-joined) rank \d+ ")
DONE_RE = re.compile(r"(?:^|\s)done step \d+")
RANK_STEP_RE = re.compile(r"(?:^|\s)iter \d+ rank \d+ ")  # every step, every rank: logs only
REPORT_RE = re.compile(r"iter (\d+) train_loss (\S+) .*tok/s (\S+) peak_mem_gb (\S+)")  # rank 0's report
STAGE_ORDER = ("export", "sync", "smoke", "train", "control", "compare")
NOW = "%Y-%m-%dT%H:%M:%S%z"


# ---- provenance: manifest.json and reproduce.sh ----------------------------------------
def git_info() -> dict:
    head, status = (subprocess.run(["git", *a], cwd=paths.ROOT, capture_output=True, text=True)
                    for a in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    return {"commit": head.returncode == 0 and head.stdout.strip() or "unknown",
            "dirty": status.returncode == 0 and bool(status.stdout.strip())}


def model_hash(model: str) -> str:
    """sha256 over the files sync ships of a model folder (cached by path, size, mtime), else "hub:<id>"."""
    if not (full := paths.ROOT / model).is_dir():  # an absolute MODEL stays itself
        return f"hub:{model}"
    files = iter_files(full, ["."])
    key = digest_of({f: f"{(st := (full / f).stat()).st_size}:{st.st_mtime_ns}" for f in files})
    known = paths.read_json(cache := paths.ROOT / ".stamps" / "model-hashes.json")
    if known.get(str(full), {}).get("key") != key:
        known[str(full)] = {"key": key, "sha256": digest_of(tree_hashes(full, files))}
        atomic.write_json(cache, known)
    return known[str(full)]["sha256"]


def write_manifest(run_dir: Path, stage: str, variables: dict, hf: Hostfile, extra: dict) -> dict:
    """runs/<RUN>/manifest.json: what this run is made of, written before any rank starts."""
    stages = paths.read_json(run_dir / "manifest.json").get("stages", {})
    stages[stage], v = {"started": time.strftime(NOW)}, variables
    dsha = paths.read_json(paths.DATASETS / v["DATASET"] / "manifest.json").get("dataset_sha256", "missing")
    man = {"run": v["RUN"], "git": git_info(), "lock_sha256": sha256_file(paths.ROOT / "requirements.lock"),
           "hostfile": hf.to_json(), "hostfile_path": v["HOSTFILE"], "variables": v, "dataset": v["DATASET"],
           "dataset_sha256": dsha, "model": v["MODEL"], "model_sha256": model_hash(v["MODEL"]),
           "stages": stages, **extra}
    atomic.write_json(run_dir / "manifest.json", man)
    return man


def finish_manifest(run_dir: Path, stage: str, summary: dict) -> None:
    man = paths.read_json(run_dir / "manifest.json")
    man.setdefault("stages", {}).setdefault(stage, {}).update(
        ended=time.strftime(NOW), ok=summary.get("ok"), category=summary.get("category"))
    atomic.write_json(run_dir / "manifest.json", man)


def export_section(dataset: str) -> list[str]:
    """reproduce.sh's first section: the `make export` of datasets/<dataset> (file names by repr: 1 line)."""
    man = paths.read_json(paths.DATASETS / dataset / "manifest.json")
    files = [f for f in man.get("sources") or [] if isinstance(f, dict) and isinstance(f.get("path"), str)]
    head = ["# --- stage: export ---", f"# The dataset {dataset} this run used (its manifest.json):"]
    if not files:
        return head + [f"# corpus not recorded: re-export it with make export CORPUS=... DATASET={dataset}"]
    head += [f"# corpus file {f['path']!r} sha256 {f.get('sha256', 'not recorded')}" for f in files]
    head.append(f"# corpus_sha256 {man.get('corpus_sha256', 'not recorded')}; "
                f"dataset_sha256 {man.get('dataset_sha256', 'not recorded')}")
    s = man.get("settings") or {}
    flags = [f"--ratios={r['train']},{r['valid']},{r['test']}"] if (r := s.get("ratios")) else []
    flags += [f"--{o}={k}={v}" for o in ("field", "role") for k, v in (s.get(o + "s") or {}).items()]
    flags += [f"--{k.replace('_', '-')}={s[k]}" for k in ("max_reject_ratio", "max_chars",
                                                          "text_system_prompt", "text_user_prompt") if k in s]
    if s:  # a manifest of exporter 2.0 has no split_by: it split by record
        flags.append(f"--split-by={s.get('split_by', 'record')}")
    return head + [shlex.join(["make", "export", "CORPUS=" + " ".join(f["path"] for f in files),
                               f"DATASET={dataset}", "EXPORT_ARGS=" + shlex.join(flags)])]


def write_reproduce(run_dir: Path, stage: str, make_cmd: list[str], launch_cmds: list[list[str]],
                    dataset: str | None = None) -> None:
    """runs/<RUN>/reproduce.sh: the dataset's export, then each stage's make line and what it ran."""
    path = run_dir / "reproduce.sh"
    old = path.read_text().split("\n# --- stage: ")[1:] if path.is_file() else []
    sections = {b.split(" ", 1)[0].strip(): "# --- stage: " + b.rstrip("\n") for b in old}
    sections[stage] = "\n".join([f"# --- stage: {stage} ---", "# The make line (re-runs it, every variable):",
                                 shlex.join(make_cmd), "# What it ran (from the repo root here):",
                                 *("# " + shlex.join(c) for c in launch_cmds)])
    if dataset := dataset or paths.read_json(run_dir / "manifest.json").get("dataset"):
        sections["export"] = "\n".join(export_section(dataset))
    keys = sorted(sections, key=lambda k: ((*STAGE_ORDER, k).index(k), k))
    atomic.write_text(path, "#!/usr/bin/env bash\n# Reproduce this run: copy a stage's make line, or run "
                      'this file from the repo root.\nset -euo pipefail\ncd "$(dirname "$0")/../.."\n\n'
                      + "\n\n".join(sections[k] for k in keys) + "\n")
    path.chmod(0o755)


# ---- the launch ---------------------------------------------------------------------------
@dataclass
class LaunchResult:
    returncode: int
    wall_s: float
    watchdog_fired: bool = False
    steps: list[int] = field(default_factory=list)
    last_progress_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    done: bool = False  # rank 0 printed `done step N`: the trainer finished
    stopped: str | None = None  # the signal that stopped it on purpose (Ctrl-C, make stop)


def launch_argv(hostfile_path: str, hf: Hostfile, python: str, remote_root: str, trainer_args: list[str],
                port: int | None = None, script: str = "bin/train.py") -> list[str]:
    """mlx.launch of `script` on every rank, or the script itself (over ssh if remote) for one host."""
    if hf.size == 1:
        cmd = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", remote_root, python, script, *trainer_args]
        return cmd if is_local(hf.hosts[0].ssh) else ssh_argv(hf.hosts[0].ssh, cmd)
    # mlx.launch's threads poll its pipes (launch_and_collect and launch_env keep that to a wait): niced,
    # what is left yields to ranks that share this Mac over ssh (the test fabric's hosts). A local rank is its
    # child and would inherit the nice value, so a launch with one is left as it is.
    nice = [] if any(is_local(h.ssh) for h in hf.hosts) else ["nice", "-n", "19"]
    argv = [*nice, str(Path(sys.executable).with_name("mlx.launch")), "--hostfile", hostfile_path,
            "--python", python, "--cwd", remote_root]
    argv += ["--backend", hf.backend] if hf.backend else []
    argv += ["--starting-port", str(port)] if port else []
    return argv + ["--", script, *trainer_args]


class Watch:
    """Tees the launch to the log (timestamped) and the terminal: a `step` line per report, not per rank;
    once steps start, the ranks' `progress` lines only in the log."""

    def __init__(self, res: LaunchResult, total: int | None = None):
        self.res, self.lock, self.total = res, threading.Lock(), total
        self.last, self.step_t = time.monotonic(), 0.0

    def read(self, stream, log_path: Path) -> None:
        with open(log_path, "ab") as log:
            for raw in iter(stream.readline, b""):
                log.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()).encode() + raw)
                log.flush()
                if (out := self.saw(raw.decode(errors="replace"), time.monotonic())) is not None:
                    with contextlib.suppress(OSError):  # a terminal that just closed, until SIGHUP's detach
                        print(out, flush=True)

    def saw(self, text: str, now: float) -> str | None:
        m, steps = STEP_RE.search(text), self.res.steps
        with self.lock:
            self.res.done = self.res.done or bool(DONE_RE.search(text))
            if PROGRESS_RE.search(text):
                self.last = now
            if m and (not steps or int(m[1]) > steps[-1]):
                if steps:
                    self.res.step_times.append((now - self.step_t) / (int(m[1]) - steps[-1]))
                steps.append(int(m[1]))
                self.step_t = self.last = now
            if RANK_STEP_RE.search(text) or steps and PROGRESS_RE.search(text):  # the log keeps them
                return None
            if not (r := REPORT_RE.search(text)):
                return text.rstrip("\n")
            left = ((self.total or 0) - int(r[1])) * statistics.median(self.res.step_times or [0])
            eta = time.strftime("%H:%M:%S", time.gmtime(left)) if self.total else "?"
            return (f"step {r[1]}/{self.total or '?'} loss {r[2]} tok/s {float(r[3]):.0f} eta {eta} "
                    f"peak_mem_gb {r[4]}")


def feed(pipe, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):  # a launch that ended (or closed the pipe) first
        pipe.write(data)
        pipe.flush()


def run_launcher(argv: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run for mlx.launch (calibrate, tests, bench) with what launch_and_collect gives it: a stdin
    pipe open until the run ends, fed STDIN_FILL bytes, and launch_env's ssh, so that its select() waits."""
    r, w = os.pipe()
    (t := threading.Thread(target=feed, args=(os.fdopen(w, "wb", closefd=False), b"\n" * STDIN_FILL),
                           daemon=True)).start()
    try:
        return subprocess.run(argv, stdin=r, env=launch_env(env), **kw)
    finally:
        os.close(r)  # a writer still blocked on a full pipe gets EPIPE now
        t.join(timeout=5)
        os.close(w)


def sweep(hosts: list[str], run: str) -> dict[str, str]:
    """Kill any rank of RUN left on any host (SIGCONT first so a frozen one can die)."""
    argv = ["sh", "-c", 'pkill -CONT -f -- "$1"; pkill -KILL -f -- "$1" && echo killed || true', "sh",
            supervisor.pattern(run)]
    with ThreadPoolExecutor(len(hosts)) as pool:
        rs = list(pool.map(lambda h: run_on(h, argv, timeout=15), hosts))
    return {r.host: "killed leftovers" if "killed" in r.stdout else "clean" if r.ok else
            f"unreachable: {r.stderr.strip()[:200]}" for r in rs}


# ---- what happened -------------------------------------------------------------------------
def categorize(res: LaunchResult, ev: dict, world: int) -> tuple[str | None, str]:
    """(category, why), or (None, "") if every rank joined, none failed and rank 0 printed `done`."""
    if res.stopped:  # on purpose: no restart
        return OTHER_FAILURES["stopped"][0], (f"{res.stopped} after step {(res.steps or [0])[-1]}: every rank"
                                              " stopped, the newest verified checkpoint kept; RESUME=1 next")
    if res.watchdog_fired:
        return HANG, f"no progress for the watchdog window (last progress at {res.last_progress_s:.0f} s)"
    for r, f in sorted(ev["failures"].items()):
        if f.get("category") in CATEGORIES:
            return f["category"], f"rank {r}: {f.get('message', '')}"
    if len(ev["joined"]) < world:  # mlx.launch 0.32.4 can exit 0 although a rank never started
        missing = sorted(set(range(world)) - set(ev["joined"]))
        return PARITY, f"ranks {missing} never initialized (launcher exit {res.returncode})"
    if ev["failures"]:
        r, f = min(ev["failures"].items())
        return OTHER_FAILURES.get(f.get("kind"), OTHER_FAILURES["error"])[0], f"rank {r}: {f.get('message')}"
    if ev.get("oom_line"):  # the allocator killed it (segfault on CPU, abort on Metal) before it could say so
        return OTHER_FAILURES["oom"][0], f"a rank died out of memory: {ev['oom_line']}"
    if res.returncode != 0 or not res.done:
        return HANG, (f"a rank died mid-run (launcher exit {res.returncode}, trainer "
                      f"{'finished' if res.done else 'did not finish'}); the link or the host went away")
    return None, ""


def oom_line(log_path: Path, offset: int = 0) -> str | None:
    """The first out-of-memory message after `offset` in the launch log, if any."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        return next((s[:300] for raw in f if OOM_RE.search(s := raw.decode(errors="replace").strip())), None)


def oom_ladder(cfg: dict, argv: list[str], world: int) -> list[str]:
    """lib.config's fallback ladder as launch commands to paste, each in its own run folder."""
    ssh = "bin/train.py" not in argv  # one remote host: ssh's last argument is the command line (ssh_argv)
    cmd = shlex.split(argv[-1]) if ssh else argv
    cut, lines = cmd.index("bin/train.py") + 1, []  # the trainer's flags always include --run-dir
    for n, (what, rung) in enumerate(fallback_ladder(cfg, cmd[cut:], world), 1):
        rung = cmd[:cut] + set_flag(rung, "--run-dir", f"{rung[rung.index('--run-dir') + 1]}-oom{n}")
        lines += [f"# rung {n}: {what}", shlex.join([*argv[:-1], shlex.join(rung)] if ssh else rung)]
    return lines


def print_category(category: str, why: str) -> None:
    print(f"FAILED category: {category}: {why}; see RUNBOOK.md#{anchor_of(category)}", file=sys.stderr)


def metrics(run_dir: Path) -> list[dict]:
    return list(jsonl.read(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else []


# ---- what the launching stages share ----------------------------------------------------------
def add_common_args(p) -> None:
    for flag in ("--run", "--hostfile", "--config", "--model", "--dataset", "--remote-root", "--python"):
        p.add_argument(flag, required=True)
    p.add_argument("--seed", type=int)
    p.add_argument("--watchdog", type=float, help="seconds without progress before every rank is stopped")
    p.add_argument("--port", type=int, help="first ring port (mlx.launch --starting-port)")


def load_inputs(args, stage: str):
    """(hostfile, config) of a launching stage, checked (watchdog_s unless --watchdog; each rank's share of
    the batch, rank_shares: auto from the newest calibration); RUN's lock held."""
    paths.check_run_id(args.run)
    hf, cfg = load_hostfile(args.hostfile), load_config(args.config)
    args.watchdog = cfg.get("watchdog_s") if args.watchdog is None else args.watchdog
    if cfg["rank_shares"] == "auto" and hf.size > 1:
        cfg["rank_shares"] = calibrated_shares([h.ssh for h in hf.hosts], cfg, args.config)
    args.rank_batches = rank_batches(cfg, hf.size)  # refused here, before a launch, when they do not fit
    args.rank_shares = cfg["rank_shares"] if hf.size > 1 else None  # auto as resolved, even ones too
    supervisor.hold(args, stage)
    return hf, cfg


def variables(args, stage: str, **extra) -> dict:
    """The make variables of `make <stage>` that re-runs this invocation (smoke reads SMOKE_CONFIG)."""
    config = "SMOKE_CONFIG" if stage == "smoke" else "CONFIG"
    v = {"RUN": args.run, "HOSTFILE": args.hostfile, config: args.config, "MODEL": args.model,
         "DATASET": args.dataset, "REMOTE_ROOT": args.remote_root, "PYTHON": args.python, "SEED": args.seed,
         "WATCHDOG": args.watchdog and f"{args.watchdog:g}", "PORT": args.port, **extra}
    return {k: str(val) for k, val in v.items() if not (val is None or val == "" or val is False)}  # 0 stays


def make_cmd(target: str, v: dict) -> list[str]:
    return ["make", target] + [f"{k}={val}" for k, val in v.items()]


def trainer_args(args, run_rel: str, config: str, iters: int | None = None, resume: bool = False):
    a = ["--config", config, "--model", args.model, "--data", f"datasets/{args.dataset}"]
    a += ["--run-dir", run_rel] + (["--seed", str(args.seed)] if args.seed is not None else [])
    a += ["--rank-shares", json.dumps(args.rank_shares)] if args.rank_shares else []  # auto: as resolved
    return a + (["--iters", str(iters)] if iters is not None else []) + (["--resume"] if resume else [])


def launch_and_collect(args, hf: Hostfile, run_rel: str, targs: list[str], log_name: str,
                       total: int | None = None) -> tuple[LaunchResult, dict, list[str], str | None, str]:
    """One launch teed to logs/<log_name>, stopped after the watchdog window (--watchdog, else the config's
    watchdog_s, else max(10 x median step, 300 s)) without progress; then the hosts swept, the run folder
    fetched (rank 0's host: all of it; the others: logs), its rank events read, the outcome categorized."""
    launch_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{log_name.split('.')[0]}"
    argv = launch_argv(args.hostfile, hf, args.python, args.remote_root,
                       [*targs, "--expect-world-size", str(hf.size), "--launch-id", launch_id], args.port)
    event("launch", run=run_rel, world_size=hf.size, cmd=shlex.join(argv))
    (log_path := paths.ROOT / run_rel / "logs" / log_name).parent.mkdir(parents=True, exist_ok=True)
    offset = log_path.stat().st_size if log_path.is_file() else 0
    watch, t0 = Watch(res := LaunchResult(returncode=-1, wall_s=0), total), time.monotonic()
    # mlx.launch polls its stdin and each rank's stdin pipe: given /dev/null (always readable) and pipes with
    # room to write, it spins a core of this Mac. A stdin that stays open and enough bytes to fill a local
    # rank's pipe (no rank reads them) let its select() wait: 2 local ranks on 2 cores ran twice as fast.
    # A remote rank's ssh closes its pipe (launch_env), so the first write there ends that poll.
    proc = subprocess.Popen(argv, cwd=paths.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env=launch_env())
    threading.Thread(target=feed, args=(proc.stdin, b"\n" * STDIN_FILL), daemon=True).start()
    guard = subprocess.Popen([sys.executable, "-c", supervisor.GUARD, str(proc.pid)], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    supervisor.write(args, launch_id=launch_id)
    (reader := threading.Thread(target=watch.read, args=(proc.stdout, log_path), daemon=True)).start()
    while proc.poll() is None:
        time.sleep(0.2)
        with watch.lock:
            idle = time.monotonic() - watch.last
            window = args.watchdog or max(10 * statistics.median(res.step_times or [0]), 300.0)
        if idle > window or args.stop:
            res.watchdog_fired, res.stopped = not args.stop, args.stop
            print(f"{args.stop}: stopping every rank" if args.stop else f"watchdog: no progress for "
                  f"{idle:.0f} s (window {window:.0f} s); stopping every rank", flush=True)
            break
    guard.communicate(b"" if res.stopped or res.watchdog_fired else b"done")  # b"": the guard stops it
    proc.wait()
    with contextlib.suppress(OSError):
        proc.stdin.close()
    reader.join(timeout=10)
    res.returncode, res.last_progress_s, res.wall_s = proc.returncode, watch.last - t0, time.monotonic() - t0
    swept, fetched = sweep(hf.unique_ssh(), args.record["run"]), {}
    for i, host in enumerate(hf.unique_ssh()):  # 127.0.0.1 with REMOTE_ROOT here: a no-op copy
        src = ("" if is_local(host) else f"{host}:") + f"{args.remote_root}/{run_rel}/"
        only_logs = ["--include=logs/", "--include=logs/**", "--exclude=*"] if i else []
        p = subprocess.run(["rsync", "-a", "-e", rsh(), *only_logs, src, f"{paths.ROOT / run_rel}/"],
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        fetched[host] = "ok" if p.returncode == 0 else f"rsync exit {p.returncode}: {p.stderr.strip()[:200]}"
    ev = {key: {int(f.name.split(".")[0][5:]): d for f in sorted(log_path.parent.glob(f"rank-*.{kind}.json"))
                if (d := paths.read_json(f)).get("launch_id") == launch_id}  # an earlier launch's are stale
          for key, kind in (("joined", "joined"), ("failures", "failure"))}
    ev |= {"oom_line": oom_line(log_path, offset), "swept": swept, "fetched": fetched}
    return res, ev, argv, *categorize(res, ev, hf.size)


def summarize(res: LaunchResult, category: str | None, why: str, extra: dict) -> dict:
    return {"ok": category is None, "returncode": res.returncode, "category": category, "why": why,
            "anchor": anchor_of(category) if category else None, "wall_s": round(res.wall_s, 3),
            "watchdog_fired": res.watchdog_fired, "last_step_seen": (res.steps or [None])[-1], **extra}


def conclude(run_dir: Path, stage: str, summary: dict, cfg: dict, argv: list[str], world: int) -> int:
    """The stage's end: <stage>.json, the manifest, warnings, the category (+ OOM ladder), PASS/FAIL."""
    mets = metrics(run_dir)
    summary["warnings"] = [m for m in mets if m.get("kind") == "warning"]
    track = [m for m in mets if m.get("kind") == "tracking"]  # rank 0's W&B run, this launch's last
    summary["tracking"] = {k: track[-1][k] for k in ("mode", "id", "url", "dir")} if track else None
    summary["chat_template_args"] = cfg.get("chat_template_args")  # the format the adapter is trained in
    data = [m for m in mets if m.get("kind") == "data"]  # rank 0's: records kept and left out, epochs
    done = [m for m in mets if m.get("kind") == "done"]
    skip = ("step", "kind", "loss", "lr", "tokens", "tok_per_s", "peak_mem_gb", "wall_s")
    summary["data"] = {k: v for k, v in data[-1].items() if k not in skip} if data else None
    summary["padding_fraction"] = done[-1].get("padding_fraction") if done else None
    summary["epochs"] = done[-1].get("epochs") if done else None
    for w in summary["warnings"]:  # e.g. no-improvement: shown once more just above PASS/FAIL
        event("warning", stage=stage, what=w.get("what"), message=json.dumps(w.get("message")))
    atomic.write_json(run_dir / f"{stage}.json", summary)
    finish_manifest(run_dir, stage, summary)
    if summary["category"]:
        print_category(summary["category"], summary["why"])
    if summary["category"] == OTHER_FAILURES["oom"][0]:
        print("fallback ladder (paste one; each keeps the global batch):", *oom_ladder(cfg, argv, world),
              sep="\n", file=sys.stderr)
    shown = {"test_loss": summary["test_loss"]} if "test_loss" in summary else {}  # train/control: even None
    best = {"best_adapter": summary["best_adapter"]} if summary.get("best_adapter") else {}
    event(stage, run=summary.get("run"), status="PASS" if summary["ok"] else "FAIL", **shown,
          wall_s=summary["total_wall_s"], **best)
    return 0 if summary["ok"] else 1
