#!/usr/bin/env python3
"""schedule: the periodic check-parity for this checkout, as a crontab line or a launchd job.

Usage:
    python bin/schedule.py cron-line [--every-min N] -- <bin/check_parity.py arguments>
    python bin/schedule.py launchd-plist [--every-min N] [--out PLIST] -- <check_parity arguments>

Example (what `make cron-line` runs):
    python bin/schedule.py cron-line --every-min 15 -- --hostfile hostfile.json \
        --python /Users/op/thunder-runbook/.venv/bin/python --remote-root /Users/op/thunder-runbook \
        --model=models/gemma-4-e2b --dataset=domain_sft_v1_high_signal_thunder

Both run the same argument list: this checkout's venv python, bin/check_parity.py, `--json`
and the given arguments, with every path made absolute (cron and launchd start in $HOME with a
minimal PATH and no ssh-agent or terminal; check-parity relies on none of them). check-parity
writes its result atomically to runs/parity/last.json; its stdout and stderr are appended to
runs/parity/scheduled.log. Its own lock makes a second copy exit 3 at once (and leave
last.json alone). The crontab line adds an alert on a non-zero exit: one
line on stdout, which cron mails to the crontab's owner, and a syslog entry (`logger`).
The launchd job (macOS's own scheduler) is a plist with ProgramArguments, no shell string;
launchd has no mail, so read runs/parity/scheduled.json or the syslog there.
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
PATH_FLAGS = ("--hostfile", "--state-dir")  # flags whose value is a local path (made absolute)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["cron-line", "launchd-plist"])
    p.add_argument("--every-min", type=int, default=15, help="minutes between checks (1-59 for cron)")
    p.add_argument("--out", default=str(paths.RUNS / "parity" / f"{LABEL}.plist"), help="plist path")
    return p  # after `--`: bin/check_parity.py's own arguments


def command(parity_args: list[str]) -> list[str]:
    """The argv both schedulers run: absolute interpreter, script and local paths, plus --json."""
    args = list(parity_args)
    for i, a in enumerate(args):
        for flag in PATH_FLAGS:
            if a == flag and i + 1 < len(args):
                args[i + 1] = str((paths.ROOT / args[i + 1]).resolve())
            elif a.startswith(flag + "="):
                args[i] = f"{flag}={(paths.ROOT / a.split('=', 1)[1]).resolve()}"
    argv = [str(paths.ROOT / ".venv" / "bin" / "python"), str(paths.ROOT / "bin" / "check_parity.py"),
            *args, "--json"]
    for a in argv:  # cron turns % into a newline, and a newline would end the crontab entry
        if "%" in a or "\n" in a or "\r" in a:
            raise RunbookError(f"argument {a!r} holds '%' or a line break, which a crontab line cannot carry: "
                               "rename the path", "scheduled-parity")
    return argv


def cron_line(argv: list[str], every: int) -> str:
    if not 1 <= every <= 59:
        raise RunbookError(f"--every-min {every}: cron's minute field takes 1-59", "scheduled-parity")
    out = paths.RUNS / "parity"
    q = shlex.quote
    alert = ('rc=$?; echo "thunder-runbook check-parity exit $rc (1 WARNING, 2 CRITICAL, 3 UNKNOWN): '
             f'see {out}/last.json"; /usr/bin/logger -t thunder-runbook "check-parity exit $rc"')
    return (f"*/{every} * * * * mkdir -p {q(str(out))} && cd {q(str(paths.ROOT))} && "
            f"{shlex.join(argv)} >> {q(str(out / 'scheduled.log'))} 2>&1 || {{ {alert}; }}")


def plist(argv: list[str], every: int) -> bytes:
    out = paths.RUNS / "parity"
    return plistlib.dumps({
        "Label": LABEL, "ProgramArguments": argv, "WorkingDirectory": str(paths.ROOT),
        "StartInterval": every * 60, "RunAtLoad": False,
        "StandardOutPath": str(out / "scheduled.log"), "StandardErrorPath": str(out / "scheduled.log"),
    })


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    try:
        argv = command(argv[cut + 1:])
        if args.what == "cron-line":
            print(cron_line(argv, args.every_min))
            return 0
        (paths.RUNS / "parity").mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(args.out, plist(argv, args.every_min))
    except RunbookError as e:
        return die(e, 2)
    print(f"launchd-plist {args.out}\n"
          f"install: cp {shlex.quote(args.out)} ~/Library/LaunchAgents/ && "
          f"launchctl bootstrap gui/$(id -u) ~/Library/LaunchAgents/{LABEL}.plist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
