"""Run commands on hosts over ssh, always unattended and always as argument lists.

ssh runs with BatchMode (never a password or host-key prompt), a connect timeout and
server-alive probes; `SSH_CONFIG` (set by the test fabric's env.sh) adds `-F <file>`. The
remote command is a list; each element is quoted with shlex for the remote shell, so a value
can never become shell syntax. Hostnames are validated by lib.hostfile before they get here.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass

from lib.hostfile import check_hostname, is_local

CONNECT_TIMEOUT = 5


def ssh_options() -> list[str]:
    opts = [
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "LogLevel=ERROR",
    ]
    cfg = os.environ.get("SSH_CONFIG")
    if cfg:
        opts = ["-F", cfg] + opts
    ctl = os.environ.get(CONTROL_ENV)
    if ctl:
        # One connection per host for a script's many calls (sync: probe, rsync, swap, verify).
        # The master exits when the script closes it, or 30 s after its last use.
        opts += ["-o", "ControlMaster=auto", "-o", f"ControlPath={ctl}/%C", "-o", "ControlPersist=30"]
    return opts


CONTROL_ENV = "THUNDER_SSH_CONTROL_DIR"


def close_masters(hosts: list[str]) -> None:
    """Close the shared connections opened under CONTROL_ENV (no-op without it)."""
    if not os.environ.get(CONTROL_ENV):
        return
    for h in hosts:
        if not is_local(h):
            subprocess.run(["ssh", *ssh_options(), "-O", "exit", "--", h], capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=10)


def ssh_argv(host: str, argv: list[str]) -> list[str]:
    """The ssh argument list that runs `argv` on `host` (validated), quoted for the remote shell."""
    check_hostname(host, "ssh target")
    return ["ssh", *ssh_options(), "--", host, shlex.join(argv)]


def rsh() -> str:
    """The `-e` value for rsync: ssh with the same unattended options (no host values inside)."""
    return shlex.join(["ssh", *ssh_options()])


@dataclass
class Result:
    host: str
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_on(host: str, argv: list[str], timeout: float = 30, local: bool | None = None,
           input: str | None = None) -> Result:
    """Run argv on host (locally when the host is 127.0.0.1, like mlx.launch); never raises
    on failure: the Result says what happened."""
    if local is None:
        local = is_local(host)
    cmd = argv if local else ssh_argv(host, argv)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL if input is None else None, input=input)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Result(host, 124, out, f"timed out after {timeout:g} s", timed_out=True)
    except FileNotFoundError as e:
        return Result(host, 127, "", str(e))
    return Result(host, p.returncode, p.stdout, p.stderr)
