"""One supervisor per run (RUN's smoke, train and control), and what a closed terminal or a stop does to it.
runs/<RUN>/supervisor.lock is flock-ed for the supervisor's life (a JSON line: pid, host, stage, launch id).
SIGINT/SIGTERM (Ctrl-C, make stop) set args.stop, which the launch loop acts on; SIGHUP (the terminal closed)
detaches it, its output to runs/<RUN>/logs/supervisor.log, and the run goes on. RUNBOOK.md#supervisor.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time

from lib import paths
from lib.log import RunbookError

ANCHOR = "one-launch-per-run"
# The launch's guard (lib/launch.py), in its own session: EOF on stdin with nothing read means the supervisor
# died or stops the launch, so it SIGKILLs the launch's process group (mlx.launch and its ssh -tt clients: the
# remote ranks get SIGHUP; checkpoints are atomic).
GUARD = "import os, sys\nif not sys.stdin.read():\n    os.killpg(int(sys.argv[1]), 9)"


def pattern(run: str) -> str:
    """The ERE (pkill -f) of any rank of RUN: its --run-dir runs/RUN, runs/RUN/smoke or runs/RUN-control."""
    return r"bin/train\.py .*--run-dir runs/" + run.replace(".", r"\.") + r"(/smoke|-control)?( |$)"


def busy(run: str, rec: dict) -> str:
    return (f"RUN {run} is held by supervisor pid {rec.get('pid')} on {rec.get('host')} ({rec.get('stage')}, "
            f"launch {rec.get('launch_id', '-')}, since {rec.get('started')}): watch it with make status "
            f"RUN={run}, or stop it with make stop RUN={run}")


def holder(run: str) -> dict | None:
    """The record of the live supervisor that holds RUN ({} while it writes it), else None."""
    with contextlib.suppress(FileNotFoundError), open(lock := paths.RUNS / run / "supervisor.lock") as f:
        with contextlib.suppress(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        return paths.read_json(lock)
    return None


def write(args, **fields) -> None:
    args.record.update(fields)
    args.lock.truncate(0)
    args.lock.write(json.dumps(args.record) + "\n")
    args.lock.flush()


def hold(args, stage: str) -> None:
    """Hold RUN for this process's life, or refuse naming its holder (a dead one's lock is taken over, and
    said); then SIGINT and SIGTERM stop the run, SIGHUP detaches it."""
    args.lock = open(paths.run_dir(args.run) / "supervisor.lock", "a+")
    try:
        fcntl.flock(args.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunbookError(busy(args.run, holder(args.run) or {}), ANCHOR) from None
    args.lock.seek(0)
    if old := args.lock.read().strip():
        print(f"supervisor: took over runs/{args.run}/supervisor.lock from {old}: it is gone", flush=True)
    args.stop, args.record = None, {}
    atexit.register(args.lock.truncate, 0)  # any clean exit: an empty record, no takeover to say
    write(args, pid=os.getpid(), host=socket.gethostname(), stage=stage, run=args.run,
          started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda n, _: setattr(args, "stop", signal.Signals(n).name))
    signal.signal(signal.SIGHUP, lambda n, _: detach(args))


def detach(args) -> None:
    """The terminal closed: fds 1 and 2 to logs/supervisor.log; on macOS, Mac1 kept awake as before."""
    log = paths.RUNS / args.run / "logs" / "supervisor.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    write(args, detached=paths.rel(log))
    if os.path.isfile("/usr/bin/caffeinate"):
        subprocess.Popen(["/usr/bin/caffeinate", "-i", "-w", str(os.getpid())], start_new_session=True)


def release(args, code: int) -> int:
    """The stage's end: detached and passed, the stamp that make, gone with the terminal, cannot touch."""
    if code == 0 and args.record.get("detached") and (stamps := paths.ROOT / ".stamps").is_dir():
        (stamps / f"{args.record['stage']}.{args.record['run']}").touch()
    return code
