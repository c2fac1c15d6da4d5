"""check-parity's orchestrator side: the probe call, ssh failures, the lock, topology, macOS tools.

probe() runs lib/parity_probe.py on a host (ssh; local for 127.0.0.1, as mlx.launch does) under its
PYTHON, or its python3 when PYTHON does not run; ssh_failure() names what a failed ssh means and its
fix; lock_pins() is requirements.lock for one host's markers; peers_of() the IPs each host's ranks
talk to; parse_*, thunderbolt_facts and rdma_* read macOS tools' output (tests: tests/fixtures/macos/).
Example: `parity.probe("mac5", PYTHON, REMOTE_ROOT, {"parts": ["runtime"]}, 20)` -> (facts, Result).
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
# What runtime.packages compares: mlx, mlx-lm and the four they load, plus mlx's platform wheel.
PACKAGES = ["mlx", "mlx-lm", "numpy", "transformers", "tokenizers", "safetensors", "mlx-cpu", "mlx-metal"]
MLX_MIN = (0, 32, 1)

# A constant script: $1 = PYTHON, $2 = REMOTE_ROOT, $3 = the probe's JSON parameters, its source on stdin.
# PYTHON missing or dying before it prints: python3 runs it with --fallback; no Python: the shell says so.
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
    """Run the probe on `host` (one ssh round trip): (its facts or None, the raw Result)."""
    argv = ["sh", "-c", PROBE_SH, "parity-probe", python, remote_root, json.dumps(params, sort_keys=True)]
    r = run_on(host, argv, timeout=timeout, input=PROBE_SOURCE.read_text(encoding="utf-8"))
    return parse_probe_output(r.stdout), r


def parse_probe_output(stdout: str) -> dict | None:
    """The last stdout line that is the probe's JSON object (a login banner may precede it)."""
    for line in reversed(stdout.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "probe_version" in obj:
            return obj
    return None


HOST_KEY = "see RUNBOOK.md#parity-ssh-host-key"
SSH_FAILURES = [  # (stderr pattern, detail, fix): {last} = ssh's last line, {ssh} {host} for the fix
    (r"REMOTE HOST IDENTIFICATION HAS CHANGED|Offending", "host key CHANGED since it was recorded in known_hosts "
     "(reinstalled host, or an attack): ssh refused to connect", "confirm the new key fingerprint on the host, "
     "then: ssh-keygen -R {host}; {ssh} -o StrictHostKeyChecking=accept-new {host} true; " + HOST_KEY),
    (r"Host key verification failed|host key is known|No matching host key", "host key unknown: not in "
     "known_hosts, and ssh never prompts here (StrictHostKeyChecking=yes)", "confirm the host's key "
     "fingerprint, then record it once: {ssh} -o StrictHostKeyChecking=accept-new {host} true; " + HOST_KEY),
    (r"Permission denied", "authentication refused: {last}", "install your key on the host: ssh-copy-id {host}"),
    (r"Connection refused", "sshd not listening: {last}",
     "start sshd on the host (macOS: System Settings > General > Sharing > Remote Login)"),
    (r"Could not resolve hostname", "unknown host name: {last}",
     "fix the name in the hostfile or add a Host entry to ~/.ssh/config"),
    (r"timed out|No route to host|Network is unreachable|Host is down", "host unreachable: {last}",
     "check the host is up and the cable/network: {ssh} {host} true"),
]


def ssh_failure(host: str, r: Result) -> tuple[str, str]:
    """(detail, fix) for an ssh call that did not run the remote command."""
    err = (r.stderr or "").strip()
    last = err.splitlines()[-1][:300] if err else f"exit {r.returncode}"
    cfg = os.environ.get("SSH_CONFIG")
    ssh = shlex.join(["ssh", "-F", cfg]) if cfg else "ssh"
    if r.timed_out:
        detail, fix = f"no answer within the time bound ({last})", "check the host is up and the link works: {ssh} {host} true"
    elif r.returncode == 127 and "ssh" in err:
        detail, fix = f"command not found: {last}", "install OpenSSH client (ssh) here"
    else:
        detail, fix = next(((d, f) for pat, d, f in SSH_FAILURES if re.search(pat, err)),
                           (f"ssh failed (exit {r.returncode}): {last}", "run it by hand to see why: {ssh} {host} true"))
    fix = fix.format(ssh=ssh, host=host)
    return detail.format(last=last), fix if "RUNBOOK.md#" in fix else fix + "; see RUNBOOK.md#parity-ssh"


LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*(.*?))?\s*\\?\s*$")


def lock_pins(text: str, env: dict) -> dict[str, str]:
    """{normalized name: version} a uv/pip-compile lock installs on a host with this PEP 508 marker env."""
    from packaging.markers import Marker

    pins = {}
    for m in filter(None, map(LOCK_LINE.match, text.splitlines())):
        if not m.group(3) or Marker(m.group(3)).evaluate(dict(env, extra="")):
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def peers_of(hf: Hostfile) -> dict[str, list[str]]:
    """For each ssh host, the first IP of each rank its ranks talk to: ring neighbours (rank i-1
    and i+1) for ring, every other rank for jaccl's mesh."""
    n, out = hf.size, {}
    for h in hf.hosts:
        others = range(n) if hf.backend == "jaccl" else ((h.rank - 1) % n, (h.rank + 1) % n)
        ips = out.setdefault(h.ssh, [])
        for j in sorted(set(others) - {h.rank}):
            if hf.hosts[j].ips and hf.hosts[j].ips[0] not in ips:
                ips.append(hf.hosts[j].ips[0])
    return out


# ---- macOS tools (parsed here from their real output; tests/fixtures/macos/) ---------------

def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {device: hardware port name}."""
    pairs = re.findall(r"(?m)^Hardware Port: (.*?)\s*\nDevice: (\S+)", text)
    return {dev: port for port, dev in pairs}


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` -> {iface: {"flags": [...], "inet": [...], "members": [...], "status": str}}."""
    out: dict[str, dict] = {}
    cur: dict = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+): flags=\w+<([^>]*)>", line)
        if m:
            cur = out.setdefault(m.group(1), {"flags": m.group(2).split(","), "inet": [], "members": [], "status": ""})
        elif cur and line.strip().split(" ")[0] in ("inet", "member:"):
            cur["inet" if line.strip().startswith("inet") else "members"].append(line.split()[1])
        elif cur and line.strip().startswith("status: "):
            cur["status"] = line.split(":", 1)[1].strip()
    return out


def parse_ibv_devices(text: str) -> list[str]:
    """`ibv_devices` -> device names (the rows under the `------` rule)."""
    body = text.split("------", 1)[1].split("\n", 1)[-1] if "------" in text else ""
    return [ln.split()[0] for ln in body.splitlines() if ln.strip()]


def parse_thunderbolt(text: str) -> list[dict]:
    """`system_profiler SPThunderboltDataType -json` -> per port: {"receptacle", "speed", "peers": [devices]}."""
    ports = []
    for bus in json.loads(text).get("SPThunderboltDataType", []):
        tag = next((v for k, v in bus.items() if k.startswith("receptacle_") and isinstance(v, dict)), {})
        ports.append({"receptacle": tag.get("receptacle_id_key", "?"), "speed": tag.get("current_speed_key", ""),
                      "peers": [i.get("device_name_key") or i.get("_name", "?") for i in bus.get("_items", [])]})
    return ports


def thunderbolt_facts(ips: list[str], outputs: dict) -> tuple[str, str]:
    """(pass|warn|fail, detail): each of this host's hostfile IPs sits on a Thunderbolt
    interface that is up, with a Thunderbolt peer connected."""
    out = {k: v if isinstance(v, str) else "" for k, v in outputs.items()}  # a tool that failed: {"error": ...}
    ports, ifaces = parse_hardware_ports(out.get("networksetup", "")), parse_ifconfig(out.get("ifconfig", ""))
    tb = parse_thunderbolt(out["system_profiler"]) if out.get("system_profiler") else []
    problems, warns, notes = [], [], []
    for ip in ips:
        iface = next((name for name, f in ifaces.items() if ip in f["inet"]), None)
        if iface is None:
            problems.append(f"{ip} is on no interface")
            continue
        port, f = ports.get(iface, ""), ifaces[iface]
        up = [m for m in f["members"] if ifaces.get(m, {}).get("status") == "active"]
        if not (port.startswith("Thunderbolt") or f["members"] and
                all(ports.get(m, "").startswith("Thunderbolt") for m in f["members"])):
            warns.append(f"{ip} is on {iface} ({port or 'unknown port'}), not Thunderbolt: "
                         "ring traffic will not use the Thunderbolt link")
        elif f["status"] and f["status"] != "active":
            problems.append(f"{ip} is on {iface} ({port}) but its status is {f['status']}")
        elif f["members"] and not up:
            problems.append(f"{iface} has no active member ({', '.join(f['members'])})")
        else:
            notes.append(f"{ip} on {iface} ({port}" + (f"; active: {', '.join(up)})" if up else ")"))
    connected = [p for p in tb if p["peers"]]
    if tb and not connected:
        problems.append("no Thunderbolt peer connected on any port (system_profiler): check the cable")
    elif connected:
        notes.append("peer " + ", ".join(f"{p['peers'][0]} on port {p['receptacle']} at {p['speed']}" for p in connected))
    status = "fail" if problems else "warn" if warns else "pass"
    return status, "; ".join(problems + warns + notes if status != "fail" else problems + warns)


def rdma_wanted(row: list) -> list[str]:
    """The device names of one rank's rdma row (null on the diagonal; an entry may be a list)."""
    return [d for d in dict.fromkeys(d for e in row for d in (e if isinstance(e, list) else [e])) if d]


def rdma_missing(wanted: list[str], ibv_output: str) -> tuple[list[str], list[str]]:
    """(missing, listed): the hostfile's rdma devices that `ibv_devices` does not list."""
    listed = parse_ibv_devices(ibv_output if isinstance(ibv_output, str) else "")
    return [d for d in wanted if d not in listed], listed
