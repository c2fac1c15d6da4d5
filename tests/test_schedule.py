"""Scheduled check-parity the way macOS runs it: `make cron-line` under cron's environment on the
fabric, and `make launchd-plist` (the same argv, no shell string)."""

from __future__ import annotations

import fcntl
import json
import os
import plistlib
import re
import shlex
import subprocess
import time

import pytest
from conftest import ROOT, make

STATE = ROOT / "runs" / "parity"


def cron_env(fabric) -> dict[str, str]:
    """What cron gives a job: a minimal PATH, HOME, SHELL, LOGNAME; no ssh-agent, no terminal.
    SSH_CONFIG is the fabric's ssh config (a crontab line `SSH_CONFIG=...` sets it there; on the
    Macs ssh reads ~/.ssh/config instead)."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "SHELL": "/bin/sh",
            "LOGNAME": "root", "SSH_CONFIG": str(fabric.ssh_config)}


def cron_command(fabric, **kw) -> str:
    hf = fabric.hostfile(2)
    line = make("cron-line", f"HOSTFILE={hf}", f"REMOTE_ROOT={fabric.remote_root}", f"PYTHON={fabric.python}",
                "MODEL=", "DATASET=", env=fabric.env(), **kw).stdout.strip()
    m = re.fullmatch(r"\*/15 \* \* \* \* (.+)", line)
    assert m and "\n" not in line, line
    return m.group(1)


def run_like_cron(cmd: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", cmd], cwd=env["HOME"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.fabric
def test_cron_line_runs_under_crons_environment(fabric):
    cmd = cron_command(fabric)
    last = STATE / "last.json"
    last.unlink(missing_ok=True)
    p = run_like_cron(cmd, cron_env(fabric))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and err == "", err  # the line itself always ends cleanly
    doc = json.loads(last.read_text())
    assert {c["host"] for c in doc["checks"]} >= {"fab1", "fab2"}, doc
    code = doc["code"]
    if code == 0:
        assert out == "", out  # cron mails any output: silence on success
    else:  # the alert: one line on stdout, which cron mails
        assert f"check-parity exit {code}" in out and str(last) in out, out


@pytest.mark.fabric
def test_a_second_cron_copy_exits_at_once(fabric):
    cmd = cron_command(fabric)
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / ".lock", "a+") as held:  # a first copy holds the lock
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        t0 = time.monotonic()
        p = run_like_cron(cmd, cron_env(fabric))
        out, _ = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 5
        assert "check-parity exit 3" in out, out


def test_launchd_plist_runs_the_cron_lines_command(tmp_path):
    variables = ["HOSTFILE=hostfile.local.json", f"REMOTE_ROOT={ROOT}", f"PYTHON={ROOT}/.venv/bin/python",
                 "MODEL=models/tiny-gemma4", "DATASET=domain_sft_v1_high_signal_thunder"]
    line = make("cron-line", *variables).stdout.strip()
    make("launchd-plist", *variables)
    doc = plistlib.loads((STATE / "com.thunder-runbook.check-parity.plist").read_bytes())
    argv = doc["ProgramArguments"]
    assert argv[0] == str(ROOT / ".venv" / "bin" / "python") and argv[1] == str(ROOT / "bin" / "check_parity.py")
    assert argv[-1] == "--json" and f"--hostfile {ROOT}/hostfile.local.json" in shlex.join(argv)
    assert shlex.join(argv) in line  # the very same command
    assert doc["StartInterval"] == 900 and doc["WorkingDirectory"] == str(ROOT)


def test_a_percent_sign_never_reaches_a_crontab(tmp_path):
    p = make("cron-line", "HOSTFILE=hostfile.local.json", "REMOTE_ROOT=/srv/a%b", "PYTHON=/srv/a%b/.venv/bin/python",
             check=False)
    assert p.returncode != 0 and "'%'" in p.stderr and "RUNBOOK.md#scheduled-parity" in p.stderr
