"""Host parity facts shared by check-parity, provision and the stages that re-check before a launch.

- `probe(host, ...)`: one call per host (ssh, or local for 127.0.0.1) that runs
  lib/parity_probe.py under the host's PYTHON (or its python3 when PYTHON does not run) and
  returns the probe's JSON facts.
- `ssh_failure(...)`: what an ssh failure means (unknown host key, refused, unreachable, ...)
  and the command that fixes it.
- `lock_pins(...)`: the versions requirements.lock pins for one host's marker environment.
- `parse_*` / `thunderbolt_facts` / `rdma_missing`: macOS network tools' output
  (networksetup, ifconfig, system_profiler -json, ibv_devices), unit-tested from recordings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from lib.hostfile import Hostfile
from lib.remote import Result, run_on

PROBE_SOURCE = Path(__file__).with_name("parity_probe.py")
CODE_PARTS = ["bin", "lib", "configs", "requirements.lock"]
# What the runtime check compares: the six, plus mlx's platform wheel where the lock has one.
PACKAGES = ["mlx", "mlx-lm", "numpy", "transformers", "tokenizers", "safetensors", "mlx-cpu", "mlx-metal"]
MLX_MIN = (0, 32, 1)

# $1 = PYTHON, $2 = REMOTE_ROOT, $3 = the probe's parameters (JSON); the probe's source on stdin.
# A constant script: every value reaches it as a positional argument, never as shell text.
# PYTHON runs the probe (one interpreter start: the probe's time is mostly that). If PYTHON
# is missing, or dies without printing the probe's result (a crash importing mlx), the host's
# python3 runs it again with --fallback and what went wrong, so disk, code and link facts are
# still reported; with no Python at all the shell still reports the free disk.
PROBE_SH = r"""
py=$1; root=$2; params=$3
src=$(cat)
why=missing
if [ -n "$py" ] && [ -x "$py" ] && [ ! -d "$py" ]; then
  out=$("$py" -c "$src" "$params" 2>&1 </dev/null); rc=$?
  case $out in *'"probe_version": '*) printf '%s\n' "$out"; exit 0;; esac
  why="exit $rc: $(printf '%s' "$out" | tail -n 3)"
fi
for c in python3 /usr/bin/python3 /opt/homebrew/bin/python3 /usr/local/bin/python3; do
  if command -v "$c" >/dev/null 2>&1 &&
     "$c" -c 'import sys; sys.exit(sys.version_info < (3, 8))' </dev/null >/dev/null 2>&1; then
    exec "$c" -c "$src" "$params" --fallback "$why" </dev/null
  fi
done
d=$root; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
kb=$(df -Pk "$d" 2>/dev/null | awk 'NR==2 {print $4}')
printf '{"probe_version": 1, "no_python": true, "disk": {"path": "%s", "free_bytes": %s}}\n' "$d" "$(( ${kb:-0} * 1024 ))"
"""


def probe(host: str, python: str, remote_root: str, params: dict, timeout: float) -> tuple[dict | None, Result]:
    """Run the probe on `host` (one ssh round trip); (facts or None, the raw Result)."""
    argv = ["sh", "-c", PROBE_SH, "parity-probe", python, remote_root, json.dumps(params, sort_keys=True)]
    r = run_on(host, argv, timeout=timeout, input=PROBE_SOURCE.read_text(encoding="utf-8"))
    return parse_probe_output(r.stdout), r


def parse_probe_output(stdout: str) -> dict | None:
    """The probe's JSON object: the last stdout line that is one (a login banner or a noisy
    shell profile may print before it)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "probe_version" in obj:
                return obj
    return None


def ssh_cmd_prefix() -> str:
    """`ssh` plus `-F <config>` when SSH_CONFIG is set, for fix commands an operator pastes."""
    cfg = os.environ.get("SSH_CONFIG")
    return shlex.join(["ssh", "-F", cfg]) if cfg else "ssh"


def ssh_failure(host: str, r: Result) -> tuple[str, str]:
    """(detail, fix) for an ssh call that did not run the remote command."""
    err = (r.stderr or "").strip()
    last = err.splitlines()[-1] if err else f"exit {r.returncode}"
    ssh = ssh_cmd_prefix()
    if r.timed_out:
        return (f"no answer within the time bound ({last})",
                f"check the host is up and the link works: {ssh} {host} true; see RUNBOOK.md#parity-ssh")
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err or "Offending" in err:
        return ("host key CHANGED since it was recorded in known_hosts (reinstalled host, or an attack): "
                "ssh refused to connect",
                f"confirm the new key fingerprint on the host, then: ssh-keygen -R {host}; "
                f"{ssh} -o StrictHostKeyChecking=accept-new {host} true; see RUNBOOK.md#parity-ssh-host-key")
    if "Host key verification failed" in err or "host key is known" in err or "No matching host key" in err:
        return ("host key unknown: not in known_hosts, and ssh never prompts here (StrictHostKeyChecking=yes)",
                f"confirm the host's key fingerprint, then record it once: "
                f"{ssh} -o StrictHostKeyChecking=accept-new {host} true; see RUNBOOK.md#parity-ssh-host-key")
    if "Permission denied" in err:
        return (f"authentication refused: {last}",
                f"install your key on the host: ssh-copy-id {host}; see RUNBOOK.md#parity-ssh")
    if "Connection refused" in err:
        return (f"sshd not listening: {last}",
                "start sshd on the host (macOS: System Settings > General > Sharing > Remote Login); "
                "see RUNBOOK.md#parity-ssh")
    if "Could not resolve hostname" in err:
        return (f"unknown host name: {last}",
                "fix the name in the hostfile or add a Host entry to ~/.ssh/config; see RUNBOOK.md#parity-ssh")
    if re.search(r"timed out|No route to host|Network is unreachable|Host is down", err):
        return (f"host unreachable: {last}",
                f"check the host is up and the cable/network: {ssh} {host} true; see RUNBOOK.md#parity-ssh")
    if r.returncode == 127:
        return (f"command not found: {last}", "install OpenSSH client (ssh) here; see RUNBOOK.md#parity-ssh")
    return (f"ssh failed (exit {r.returncode}): {last[:300]}",
            f"run it by hand to see why: {ssh} {host} true; see RUNBOOK.md#parity-ssh")


# ---- requirements.lock ---------------------------------------------------------------------

LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*(.*?))?\s*\\?\s*$")


def norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(text: str) -> list[tuple[str, str, str]]:
    """(name, version, marker) for every pin in a uv/pip-compile lock."""
    out = []
    for line in text.splitlines():
        m = LOCK_LINE.match(line)
        if m:
            out.append((norm_name(m.group(1)), m.group(2), (m.group(3) or "").strip()))
    return out


def lock_pins(text: str, env: dict) -> dict[str, str]:
    """{name: version} the lock installs on a host with this PEP 508 marker environment."""
    from packaging.markers import Marker

    pins = {}
    for name, version, marker in lock_entries(text):
        if not marker or Marker(marker).evaluate(dict(env, extra="")):
            pins[name] = version
    return pins


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


# ---- topology ------------------------------------------------------------------------------

def peers_of(hf: Hostfile) -> dict[str, list[str]]:
    """For each ssh host, the IPs of the ranks its ranks talk to: ring neighbours (rank i-1 and
    i+1) for ring, every other rank for jaccl's mesh. The first IP of each peer."""
    n = hf.size
    out: dict[str, list[str]] = {}
    for h in hf.hosts:
        if n == 1:
            others = []
        elif hf.backend in ("jaccl",):
            others = [j for j in range(n) if j != h.rank]
        else:
            others = sorted({(h.rank - 1) % n, (h.rank + 1) % n} - {h.rank})
        ips = out.setdefault(h.ssh, [])
        for j in others:
            peer = hf.hosts[j]
            if peer.ips and peer.ips[0] not in ips:
                ips.append(peer.ips[0])
    return out


# ---- macOS tools (parsed here, from their real output; tests/fixtures/macos/) ---------------

def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {device: hardware port name}."""
    out, port = {}, None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            out[line.split(":", 1)[1].strip()] = port
            port = None
    return out


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` -> {iface: {"flags": [...], "inet": [...], "members": [...], "status": str}}."""
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+): flags=\w+<([^>]*)>", line)
        if m:
            cur = out.setdefault(m.group(1), {"flags": m.group(2).split(","), "inet": [], "members": [],
                                               "status": ""})
            continue
        if cur is None:
            continue
        s = line.strip()
        if s.startswith("inet "):
            cur["inet"].append(s.split()[1])
        elif s.startswith("member: "):
            cur["members"].append(s.split()[1])
        elif s.startswith("status: "):
            cur["status"] = s.split(":", 1)[1].strip()
    return out


def parse_ibv_devices(text: str) -> list[str]:
    """`ibv_devices` -> device names (the rows under the `------` rule)."""
    devs, body = [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("------"):
            body = True
            continue
        if body and s:
            devs.append(s.split()[0])
    return devs


def parse_thunderbolt(text: str) -> list[dict]:
    """`system_profiler SPThunderboltDataType -json` -> one entry per port (receptacle) of
    this Mac: {"receptacle", "status", "speed", "peers": [device names connected]}."""
    data = json.loads(text)
    ports = []
    for bus in data.get("SPThunderboltDataType", []):
        tag = next((v for k, v in bus.items() if k.startswith("receptacle_") and isinstance(v, dict)), {})
        peers = [item.get("device_name_key") or item.get("_name", "?") for item in bus.get("_items", [])]
        ports.append({
            "bus": bus.get("_name", ""),
            "receptacle": tag.get("receptacle_id_key", "?"),
            "status": tag.get("receptacle_status_key", ""),
            "speed": tag.get("current_speed_key", ""),
            "peers": peers,
        })
    return ports


def thunderbolt_facts(ips: list[str], outputs: dict) -> tuple[str, str]:
    """(status, detail) for "each of this host's hostfile IPs sits on a Thunderbolt interface
    that is up, with a Thunderbolt peer connected". status is pass, warn or fail."""
    ports = parse_hardware_ports(outputs.get("networksetup") or "")
    ifaces = parse_ifconfig(outputs.get("ifconfig") or "")
    tb = [p for p in parse_thunderbolt(outputs["system_profiler"])] if outputs.get("system_profiler") else []
    connected = [p for p in tb if p["peers"]]
    problems, warns, notes = [], [], []
    for ip in ips:
        iface = next((name for name, f in ifaces.items() if ip in f["inet"]), None)
        if iface is None:
            problems.append(f"{ip} is on no interface")
            continue
        port = ports.get(iface, "")
        members = ifaces[iface]["members"]
        member_ports = [ports.get(m, "") for m in members]
        on_tb = port.startswith("Thunderbolt") or (
            bool(members) and all(p.startswith("Thunderbolt") for p in member_ports))
        if not on_tb:
            warns.append(f"{ip} is on {iface} ({port or 'unknown port'}), not Thunderbolt: "
                         "ring traffic will not use the Thunderbolt link")
            continue
        if ifaces[iface]["status"] and ifaces[iface]["status"] != "active":
            problems.append(f"{ip} is on {iface} ({port}) but its status is {ifaces[iface]['status']}")
            continue
        if members:
            up = [m for m in members if ifaces.get(m, {}).get("status") == "active"]
            if not up:
                problems.append(f"{iface} has no active member ({', '.join(members)})")
                continue
            notes.append(f"{ip} on {iface} ({port}; active: {', '.join(up)})")
        else:
            notes.append(f"{ip} on {iface} ({port})")
    if tb and not connected:
        problems.append("no Thunderbolt peer connected on any port (system_profiler): check the cable")
    elif connected:
        notes.append("peer " + ", ".join(f"{p['peers'][0]} on port {p['receptacle']} at {p['speed']}"
                                         for p in connected))
    if problems:
        return "fail", "; ".join(problems + warns)
    if warns:
        return "warn", "; ".join(warns + notes)
    return "pass", "; ".join(notes)


def rdma_missing(wanted: list[str], ibv_output: str) -> tuple[list[str], list[str]]:
    """(missing, listed): the hostfile's rdma devices that `ibv_devices` does not list."""
    listed = parse_ibv_devices(ibv_output or "")
    return [d for d in wanted if d not in listed], listed


def rdma_wanted(row: list) -> list[str]:
    """The device names of one rank's rdma row (null on the diagonal; an entry may be a list)."""
    out: list[str] = []
    for entry in row:
        for d in entry if isinstance(entry, list) else [entry]:
            if d and d not in out:
                out.append(d)
    return out
