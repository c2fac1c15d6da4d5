"""W&B tracking for `report_to: wandb` (mlx-lm's key): rank 0 logs each metrics.jsonl event as it writes it.

Online when it can; when that fails (no API key, no network within INIT_TIMEOUT_S) the run is kept offline
under the run folder's wandb/ for `wandb sync` later. It never stops a run: a failing call is a warning and
tracking ends there, while metrics.jsonl stays the record. WANDB_MODE=offline or disabled is obeyed. It never
asks: mlx.launch starts remote ranks under `ssh -tt`, and without a key wandb would prompt on that terminal
(and read mlx.launch's stdin) forever, so WANDB_SILENT is forced on and a start that hangs is given up.

    t = Tracker(warn=print)                      # tracks nothing yet
    t.start(cfg, Path("runs/stage1"), resumed_at=0)
    t.log({"step": 3, "kind": "step", "loss": 2.1, ...})   # logged as step/loss at step 3
    t.info  # {"report_to": "wandb", "mode": "offline", "id": ..., "url": None,
            #  "dir": "runs/stage1/wandb/offline-run-..."}
    t.finish(0)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

INIT_TIMEOUT_S = 30  # an online start that cannot reach W&B within this goes offline
GIVE_UP_S = 90  # a start still not back after this (any cause) is abandoned: the run goes on untracked
FINISH_TIMEOUT_S = 60  # an online run still uploading after this is left to `wandb sync`


def started(box: dict, init, mode: str, kw: dict) -> None:
    try:
        box["run"] = init(mode=mode, **kw)
    except Exception as e:  # wandb's UsageError (no API key), CommError (no network), anything
        box["error"] = e


def describe(info: dict | None) -> str:
    """Where a run's W&B record is: its url, or the offline folder to `wandb sync` ("-": not tracked)."""
    if not info or info.get("mode") in (None, "disabled"):
        return "-"
    where = info["url"] or f"`.venv/bin/wandb sync {info['dir']}` uploads it"
    return f"W&B {info['mode']} run {info['id']}: {where}"


def without_wandb() -> None:
    """For a process that does not track: mlx-lm's tuner imports wandb wherever it is installed (1.2 to 1.8 s
    of CPU per process, on every rank); hidden, that import fails at once and mlx-lm leaves wandb alone."""
    sys.modules.setdefault("wandb", None)


class Tracker:
    def __init__(self, warn=print):
        self.run, self.warn, self.seconds = None, warn, 0.0
        self.info = {"report_to": "wandb", "mode": "disabled", "id": None, "url": None, "dir": None}

    def start(self, cfg: dict, run_dir: Path, resumed_at: int) -> None:
        """The W&B run, online or offline; its warnings are logged to it once it is up."""
        warn, forced = self.warn, os.environ.get("WANDB_MODE", "").lower()
        if forced == "disabled":
            return
        os.environ["WANDB_SILENT"] = "true"  # before wandb's setup reads it: no login prompt on a rank's tty
        try:
            import wandb
        except ImportError as e:
            warn(f"report_to: wandb, but wandb does not import ({e}): run `make provision`; "
                 "metrics.jsonl only")
            return
        settings = wandb.Settings(console="off", silent=True, init_timeout=INIT_TIMEOUT_S)
        group = run_dir.name.removesuffix("-control")  # a run and its control side by side
        kw = {"project": cfg["project_name"] or "thunder-runbook", "group": group,
              "name": run_dir.name + (f"-resumed-at-{resumed_at}" if resumed_at else ""), "dir": str(run_dir),
              "config": cfg, "settings": settings}
        why = []
        for mode in [forced] if forced in ("online", "offline") else ["online", "offline"]:
            box: dict = {}
            (t := threading.Thread(target=started, args=(box, wandb.init, mode, kw), daemon=True)).start()
            t.join(GIVE_UP_S)
            if "run" in box:
                self.run = box["run"]
                break
            e = box.get("error") or TimeoutError(f"no answer within {GIVE_UP_S} s (given up)")
            why.append(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if t.is_alive():  # a hung start would hang an offline one too
                break
        if self.run is None:
            warn(f"W&B did not start ({'; '.join(why)}); metrics.jsonl only")
            return
        folder = run_dir / "wandb" / Path(self.run.sync_dir).name  # as on disk under the run folder
        offline = self.run.settings.mode == "offline"
        self.info.update(mode="offline" if offline else "online", id=self.run.id,
                         url=None if offline else self.run.url, dir=str(folder))
        if why:
            warn(f"W&B online did not start ({why[0]}); tracking offline: `.venv/bin/wandb sync "
                 f"{self.info['dir']}` on Mac1 uploads it once the run is home")

    def log(self, ev: dict) -> None:
        """One metrics event: its numbers as KIND/KEY at its step (wall_s too; text and nulls are not)."""
        if self.run is None:
            return
        tic = time.perf_counter()
        try:
            self.run.log({f"{ev['kind']}/{k}": v for k, v in ev.items() if k not in ("step", "kind")
                          and isinstance(v, int | float) and not isinstance(v, bool)}, step=ev["step"])
        except Exception as e:
            self.stop(f"W&B log failed at step {ev['step']} ({type(e).__name__}: {e}); tracking stops, "
                      "metrics.jsonl goes on")
        self.seconds += time.perf_counter() - tic

    def cost(self) -> dict:
        """The seconds its calls took in the training loop (the done event's; bench: its overhead)."""
        return {"tracking_s": round(self.seconds, 4)} if self.info["mode"] != "disabled" else {}

    def finish(self, exit_code: int) -> None:
        """Close the W&B run (an online one waits up to FINISH_TIMEOUT_S for its uploads)."""
        if self.run is None:
            return
        run, self.run = self.run, None
        done = threading.Thread(target=run.finish, kwargs={"exit_code": exit_code}, daemon=True)
        done.start()
        done.join(FINISH_TIMEOUT_S)
        if done.is_alive():
            self.warn(f"W&B still uploading after {FINISH_TIMEOUT_S} s: `.venv/bin/wandb sync "
                      f"{self.info['dir']}` on Mac1 uploads the rest")

    def stop(self, message: str) -> None:
        run, self.run = self.run, None  # first: the warning is an event, which would be logged here
        self.warn(message)
        try:
            run.finish(exit_code=1)
        except Exception:  # tracking already failed once; the run goes on
            pass
