"""Run commands on hosts over ssh: always unattended, always argument lists (check-parity, provision,
sync, calibrate, lib/launch.py; launch_env for mlx.launch's own ssh). ssh never prompts (BatchMode,
strict host keys) and times out; `SSH_CONFIG` adds `-F <file>`; every remote argument is shlex-quoted,
so no value becomes shell text.
Example: `run_on("mac5", ["uname", "-m"], timeout=10).stdout` -> `"arm64\\n"`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lib import paths
from lib.hostfile import check_hostname, is_local

CONTROL_ENV = "THUNDER_SSH_CONTROL_DIR"  # set: one shared connection per host (sync's many calls)
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3", "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR"]
LAUNCH_SSH = paths.ROOT / "bin" / "launch-ssh"  # the ssh mlx.launch runs: the real one with -n (launch_env)


def launch_env(env: dict | None = None) -> dict:
    """mlx.launch's environment: bin/launch-ssh first on PATH, the real ssh in THUNDER_SSH. Its ssh -tt reads
    the stdin pipe mlx.launch polls; without -n, that poll spins until 2 MiB per rank (the session's window)
    have crossed the link, and the rank's terminal echoes them into the launch log as blank lines."""
    env = dict(os.environ if env is None else env)
    real = shutil.which("ssh", path=env.get("PATH"))
    if real and Path(real).parent != LAUNCH_SSH:
        env["THUNDER_SSH"], env["PATH"] = real, f"{LAUNCH_SSH}{os.pathsep}{env.get('PATH', '')}"
    return env


def ssh_options() -> list[str]:
    """`-F $SSH_CONFIG`, SSH_OPTIONS, and a shared master when CONTROL_ENV names its folder (30 s idle)."""
    cfg, ctl = os.environ.get("SSH_CONFIG"), os.environ.get(CONTROL_ENV)
    shared = ["-o", "ControlMaster=auto", "-o", f"ControlPath={ctl}/%C", "-o", "ControlPersist=30"]
    return (["-F", cfg] if cfg else []) + SSH_OPTIONS + (shared if ctl else [])


def close_masters(hosts: list[str]) -> None:
    """Close the shared connections opened under CONTROL_ENV (no-op without it)."""
    for h in [h for h in hosts if not is_local(h)] if os.environ.get(CONTROL_ENV) else []:
        subprocess.run(["ssh", *ssh_options(), "-O", "exit", "--", h], capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=10)


def ssh_argv(host: str, argv: list[str]) -> list[str]:
    """The ssh argument list that runs `argv` on `host` (validated), quoted for the remote shell."""
    return ["ssh", *ssh_options(), "--", check_hostname(host, "ssh target"), shlex.join(argv)]


def rsh() -> str:  # rsync's -e: ssh with the same unattended options (no host values inside)
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
    """Run argv on host (here for 127.0.0.1, as mlx.launch does); never raises
    (124: timed out, 127: no command)."""
    cmd = argv if (is_local(host) if local is None else local) else ssh_argv(host, argv)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                           stdin=subprocess.DEVNULL if input is None else None)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Result(host, 124, out, f"timed out after {timeout:g} s", timed_out=True)
    except FileNotFoundError as e:
        return Result(host, 127, "", str(e))
    return Result(host, p.returncode, p.stdout, p.stderr)
