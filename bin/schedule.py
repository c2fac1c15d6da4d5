#!/usr/bin/env python3
"""schedule: the periodic check-parity for this checkout, as a crontab line or a launchd job.

Usage:
    python bin/schedule.py cron-line|launchd-plist [--every-min N] -- <bin/check_parity.py arguments>

Example (what `make cron-line` runs):
    python bin/schedule.py cron-line --every-min 15 -- --hostfile hostfile.json \
        --python /Users/op/thunder-runbook/.venv/bin/python --remote-root /Users/op/thunder-runbook \
        --model=models/gemma-4-e2b --dataset=domain_sft_v1_high_signal_thunder

Both run this venv's python, bin/check_parity.py, the arguments (--hostfile made absolute) and --json
from the repo root, output in runs/parity/ (last.json, scheduled.log); the crontab line alerts on a
non-zero exit (stdout, which cron mails, and `logger`). See RUNBOOK.md#scheduled-parity.
"""

from __future__ import annotations

import argparse
import plistlib
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.log import RunbookError, die  # noqa: E402

LABEL = "com.thunder-runbook.check-parity"
OUT = paths.RUNS / "parity"
PATH_FLAGS = ("--hostfile", "--state-dir")  # flags whose value is a local path (made absolute)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["cron-line", "launchd-plist"])
    p.add_argument("--every-min", type=int, default=15, help="minutes between checks (1-59 for cron)")
    return p  # after `--`: bin/check_parity.py's own arguments


def main() -> int:
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    args, given = build_parser().parse_args(sys.argv[1:cut]), sys.argv[cut + 1:]
    argv = [str(paths.ROOT / ".venv" / "bin" / "python"), str(paths.ROOT / "bin" / "check_parity.py"),
            *(str((paths.ROOT / a).resolve()) if i and given[i - 1] in PATH_FLAGS else a
              for i, a in enumerate(given)), "--json"]
    if bad := [a for a in argv if "%" in a or "\n" in a or "\r" in a]:  # cron turns % into a newline
        return die(RunbookError(f"argument {bad[0]!r} holds '%' or a line break, which a crontab line cannot "
                                "carry: rename the path", "scheduled-parity"), 2)
    log = str(OUT / "scheduled.log")
    if args.what == "launchd-plist":
        atomic.write_bytes(plist := OUT / f"{LABEL}.plist", plistlib.dumps({
            "Label": LABEL, "ProgramArguments": argv, "WorkingDirectory": str(paths.ROOT), "RunAtLoad": False,
            "StartInterval": args.every_min * 60, "StandardOutPath": log, "StandardErrorPath": log}))
        print(f"launchd-plist {plist}\ninstall: cp {shlex.quote(str(plist))} ~/Library/LaunchAgents/ && "
              f"launchctl bootstrap gui/$(id -u) ~/Library/LaunchAgents/{LABEL}.plist")
        return 0
    if not 1 <= args.every_min <= 59:
        return die(RunbookError(f"--every-min {args.every_min}: cron takes 1-59", "scheduled-parity"), 2)
    alert = ('rc=$?; echo "thunder-runbook check-parity exit $rc (1 WARNING, 2 CRITICAL, 3 UNKNOWN): '
             f'see {OUT}/last.json"; /usr/bin/logger -t thunder-runbook "check-parity exit $rc"')
    print(f"*/{args.every_min} * * * * mkdir -p {shlex.quote(str(OUT))} && cd {shlex.quote(str(paths.ROOT))} "
          f"&& {shlex.join(argv)} >> {shlex.quote(log)} 2>&1 || {{ {alert}; }}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
