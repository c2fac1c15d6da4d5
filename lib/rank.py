"""A rank's output: its lines on stdout and in logs/rank-R.log, rank 0's metrics.jsonl (and W&B with
report_to: wandb, lib/tracking.py), its failure marker, and its Mac kept awake. bin/train.py's, on every rank.

    rep = Reporter(Path("runs/stage1"), rank=0)
    rep.line("checkpoint", step=5, seconds=0.1)    # `checkpoint step 5 seconds 0.1` on stdout and in the log
    rep.event("step", 5, loss=2.1)                 # rank 0, once rep.metrics is open: a metrics.jsonl line
    return fail(as_error(e), rep, launch_id)       # logs/rank-R.failure.json; the exit code
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from lib import atomic, jsonl
from lib.log import HANG, OOM_RE, PEER_LOST_RE, RunbookError, event, failure
from lib.tracking import Tracker

CAFFEINATE = "/usr/bin/caffeinate"  # macOS; absent on Linux (tests point it at a fake)


class Reporter:
    """The rank's lines on stdout and in logs/rank-R.log; rank 0's metrics.jsonl (and W&B); the step a failure
    names."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank, self.step, self.metrics, self.tracker = run_dir, rank, None, None, Tracker()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "logs" / f"rank-{rank}.log", "a", encoding="utf-8")
        self.t0 = self.last_beat = time.monotonic()

    def marker(self, name: str) -> Path:
        return self.run_dir / "logs" / f"rank-{self.rank}.{name}.json"

    def line(self, name: str, /, **fields) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {event(name, **fields)}\n")
        self.log.flush()

    def warn(self, message: str, what: str | None = None, **fields) -> None:
        """A warning line; with `what`, a metrics event too (shown again above the stage's PASS/FAIL)."""
        self.line("warning", rank=self.rank, message=json.dumps(message))
        if what:
            self.event("warning", self.step or 0, what=what, message=message, **fields)

    def beat(self, phase: str, every_s: float = 1.0) -> None:
        """A progress line for the orchestrator's watchdog (at most one per every_s)."""
        if time.monotonic() - self.last_beat >= every_s:
            self.last_beat = time.monotonic()
            self.line("progress", rank=self.rank, phase=phase)

    @contextmanager
    def beating(self, phase: str):
        """Progress lines every 3 s around one long local call without collectives; they stop first."""
        self.beat(phase, 0.0)
        done, t0 = threading.Event(), time.monotonic()

        def beats() -> None:
            while not done.wait(3.0):
                self.line("progress", rank=self.rank, phase=phase, elapsed_s=round(time.monotonic() - t0))

        (thread := threading.Thread(target=beats, daemon=True)).start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def event(self, kind: str, step: int, **fields) -> None:
        """Rank 0: one metrics event (JSON has no NaN/inf: those are null and named in `nonfinite`)."""
        if self.metrics is None:
            return
        ev = {"step": step, "kind": kind, "loss": None, "lr": None, "tokens": None, "tok_per_s": None,
              "peak_mem_gb": None, "wall_s": round(time.monotonic() - self.t0, 3), **fields}
        if bad := {k: str(v) for k, v in ev.items() if isinstance(v, float) and not math.isfinite(v)}:
            ev.update({k: None for k in bad}, nonfinite=bad)
        self.metrics.write(jsonl.dumps(ev) + "\n")
        self.metrics.flush()
        self.tracker.log(ev)


def as_error(e: BaseException) -> RunbookError:
    """An exception as the RunbookError it stands for (out of memory by MLX's error text)."""
    if isinstance(e, RunbookError):
        return e
    if isinstance(e, (RuntimeError, MemoryError)) and OOM_RE.search(str(e)):
        return RunbookError(f"out of memory or GPU timeout: {e}; retry with the orchestrator's fallback "
                            "ladder (per-rank batch 1 with gradient accumulation)", "out-of-memory")
    if isinstance(e, RuntimeError) and PEER_LOST_RE.search(str(e)):
        return failure(HANG, f"{e}: another rank, its host or the cable went away mid-step; "
                             "RESTARTS=N resumes from the newest verified checkpoint")
    traceback.print_exc()
    return RunbookError(f"{type(e).__name__}: {e}", "trainer")


def fail(err: RunbookError, rep: Reporter, launch_id: str) -> int:
    """Write logs/rank-R.failure.json and say why; returns the exit code."""
    atomic.write_json(rep.marker("failure"), {
        "rank": rep.rank, "category": err.category, "anchor": err.anchor, "kind": err.kind,
        "message": err.args[0], "step": rep.step, "exit_code": err.exit_code, "launch_id": launch_id,
        "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    rep.line("failed", rank=rep.rank, exit_code=err.exit_code, category=json.dumps(err.category),
             step=rep.step, message=json.dumps(str(err)))
    print(f"error: {err}", file=sys.stderr, flush=True)
    rep.tracker.finish(err.exit_code)
    return err.exit_code


def keep_awake(rep: Reporter):
    """macOS: `caffeinate -i -w PID` keeps this Mac from idle sleep while this rank lives."""
    if not os.path.isfile(CAFFEINATE):
        return None
    p = subprocess.Popen([CAFFEINATE, "-i", "-w", str(os.getpid())], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rep.line("caffeinate", rank=rep.rank, pid=p.pid)
    return p
