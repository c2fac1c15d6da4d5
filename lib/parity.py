"""check-parity's orchestrator side (bin/check_parity.py; bench uses CODE_PARTS): lib/parity_probe.py over
ssh (locally for 127.0.0.1, as mlx.launch does), its failures, the lock's pins, topology, macOS tools' output
(tests use recordings). Example: `probe("mac5", PYTHON, {}, time.monotonic() + 20)` -> (facts, Result, s)."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path

from lib.hostfile import Hostfile
from lib.remote import Result, run_on

PROBE_SOURCE = Path(__file__).with_name("parity_probe.py")
CODE_PARTS = ["bin", "lib", "configs", "requirements.lock"]
# What runtime.packages compares: mlx, mlx-lm and the four they load, plus mlx's platform wheel.
PACKAGES = ["mlx", "mlx-lm", "numpy", "transformers", "tokenizers", "safetensors", "mlx-cpu", "mlx-metal"]
LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*(.*?))?\s*\\?\s*$")
# $1 PYTHON, $2 the JSON parameters, the source on stdin; exit 97, "@@ missing|exit N" if PYTHON fails
PROBE_SH = r"""if [ ! -x "$1" ] || [ -d "$1" ]; then echo "@@ missing" >&2; exit 97; fi
"$1" -c "$(cat)" "$2" </dev/null || { echo "@@ exit $?" >&2; exit 97; }"""
SSH_FAILURES = [  # (stderr pattern, detail, fix): {last} = ssh's last line; {ssh} {host} in the fix
    ("IDENTIFICATION HAS CHANGED|Offending|Host key verification failed|host key is known",
     "host key unknown or CHANGED (a reinstalled host, or an attack): ssh never prompts here",
     "confirm the host's key fingerprint, then (if it changed: ssh-keygen -R {host}) "
     "{ssh} -o StrictHostKeyChecking=accept-new {host} true; see RUNBOOK.md#parity-ssh-host-key"),
    ("Permission denied", "authentication refused: {last}", "install your key: ssh-copy-id {host}"),
    ("Connection refused", "sshd not listening: {last}", "enable Remote Login: Settings > General > Sharing"),
    ("timed out|No route|unreachable|Host is down|resolve", "host unreachable: {last}",
     "check the hostfile's name (or ~/.ssh/config), that the host is up, and the cable: {ssh} {host} true"),
]


def probe(host: str, python: str, params: dict, deadline: float) -> tuple[dict | None, Result, float]:
    """(facts or None, Result, s) of the probe on `host` by `deadline`; a login banner may come first."""
    t0 = time.monotonic()
    argv = ["sh", "-c", PROBE_SH, "parity-probe", python, json.dumps(params, sort_keys=True)]
    r = run_on(host, argv, timeout=max(1.0, deadline - t0 - 0.5), input=PROBE_SOURCE.read_text("utf-8"))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{") and '"probe_version": ' in ln]
    return (json.loads(lines[-1]) if lines else None), r, time.monotonic() - t0


def probe_failure(host: str, python: str, r: Result) -> tuple[str, str, str]:
    """(check, detail, fix) with no facts: PYTHON missing or dead (the caller's fix), ssh failed or silent."""
    err = (r.stderr or "").strip()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1][:300] if lines else f"exit {r.returncode}"
    if r.returncode == 97 and last.startswith("@@ "):
        why = "does not exist on this host" if last == "@@ missing" else (
            f"exists but does not run ({last[3:]}: {' | '.join(lines[-3:-1])[-300:]})")
        return "runtime.python", f"PYTHON {python} {why}", ""
    if r.ok:
        tail = (err or r.stdout.strip())[-300:] or "empty output"
        return "ssh", f"ssh works but the probe printed no result: {tail}", (
            "run the probe by hand: see RUNBOOK.md#parity-ssh")
    detail, fix = next(((d, f) for pat, d, f in SSH_FAILURES if re.search(pat, err)), (
        f"ssh failed (exit {r.returncode}): {last}", "run it by hand to see why: {ssh} {host} true"))
    detail = f"no answer within the time bound ({last})" if r.timed_out else detail.format(last=last)
    cfg = os.environ.get("SSH_CONFIG")
    fix = fix.format(ssh=shlex.join(["ssh", "-F", cfg]) if cfg else "ssh", host=host)
    return "ssh", detail, fix if "RUNBOOK.md#" in fix else fix + "; see RUNBOOK.md#parity-ssh"


def lock_pins(text: str, env: dict) -> dict[str, str]:
    """{normalized name: version} a uv/pip-compile lock installs on a host with this PEP 508 marker env."""
    from packaging.markers import Marker
    return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2] for m in map(LOCK_LINE.match, text.splitlines())
            if m and (not m[3] or Marker(m[3]).evaluate(dict(env, extra="")))}


def peers_of(hf: Hostfile) -> dict[str, list[str]]:
    """{ssh host: first IP of each rank its ranks talk to}: ring neighbours, or every rank for jaccl."""
    n, out = hf.size, {}
    for h in hf.hosts:
        others = range(n) if hf.backend == "jaccl" else ((h.rank - 1) % n, (h.rank + 1) % n)
        ips = [hf.hosts[j].ips[0] for j in sorted(set(others) - {h.rank}) if hf.hosts[j].ips]
        out[h.ssh] = list(dict.fromkeys(out.get(h.ssh, []) + ips))
    return out


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {device: hardware port name}."""
    return {dev: port for port, dev in re.findall(r"(?m)^Hardware Port: (.*?)\s*\nDevice: (\S+)", text)}


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` (tab-indented) -> {iface: {"flags", "inet", "members": [...], "status": str}}."""
    return {name: {"flags": flags.split(","), "inet": re.findall(r"\n\s+inet (\S+)", body),
                   "members": re.findall(r"\n\s+member: (\S+)", body),
                   "status": "".join(re.findall(r"(?m)^\s+status: (.*?)\s*$", body)[-1:])}
            for name, flags, body in re.findall(r"(?m)^([\w.-]+): flags=\w+<([^>]*)>(.*(?:\n\t.*)*)", text)}


def parse_thunderbolt(text: str) -> list[dict]:
    """`system_profiler SPThunderboltDataType -json` -> per port: {"receptacle", "speed", "peers"}."""
    ports = []
    for bus in json.loads(text).get("SPThunderboltDataType", []):
        tag = next((v for k, v in bus.items() if k.startswith("receptacle_") and isinstance(v, dict)), {})
        peers = [i.get("device_name_key") or i.get("_name", "?") for i in bus.get("_items", [])]
        ports.append({"receptacle": tag.get("receptacle_id_key", "?"), "peers": peers,
                      "speed": tag.get("current_speed_key", "")})
    return ports


def thunderbolt_facts(ips: list[str], outputs: dict) -> tuple[str, str]:
    """(pass|warn|fail, detail): each hostfile IP is on a Thunderbolt interface that is up, with a peer."""
    out = {k: v if isinstance(v, str) else "" for k, v in outputs.items()}  # a failed tool: {"error": ...}
    ports, ifaces = parse_hardware_ports(out.get("networksetup", "")), parse_ifconfig(out.get("ifconfig", ""))
    tb = parse_thunderbolt(out["system_profiler"]) if out.get("system_profiler") else []
    bad, warns, notes = [], [], []
    for ip in ips:
        iface = next((name for name, f in ifaces.items() if ip in f["inet"]), None)
        port, f = ports.get(iface, ""), ifaces.get(iface, {})
        up = [m for m in f.get("members", []) if ifaces.get(m, {}).get("status") == "active"]
        if iface is None:
            bad.append(f"{ip} is on no interface")
        elif not (port.startswith("Thunderbolt") or f["members"] and
                  all(ports.get(m, "").startswith("Thunderbolt") for m in f["members"])):
            warns.append(f"{ip} is on {iface} ({port or 'unknown port'}), not Thunderbolt")
        elif f["status"] and f["status"] != "active":
            bad.append(f"{ip} is on {iface} ({port}) but its status is {f['status']}")
        elif f["members"] and not up:
            bad.append(f"{iface} has no active member ({', '.join(f['members'])})")
        else:
            notes.append(f"{ip} on {iface} ({port}" + (f"; active: {', '.join(up)})" if up else ")"))
    connected = [f"{p['peers'][0]} on port {p['receptacle']} at {p['speed']}" for p in tb if p["peers"]]
    if tb and not connected:
        bad.append("no Thunderbolt peer connected on any port (system_profiler): check the cable")
    notes += ["peer " + ", ".join(connected)] if connected else []
    return ("fail" if bad else "warn" if warns else "pass"), "; ".join(bad + warns + ([] if bad else notes))


def rdma_missing(row: list, ibv_output: object) -> tuple[list[str], list[str], list[str]]:
    """(wanted, missing, listed): rdma row entries (a name, a list or null) against `ibv_devices`' rows."""
    wanted = [d for d in dict.fromkeys(d for e in row for d in (e if isinstance(e, list) else [e])) if d]
    rows = (ibv_output if isinstance(ibv_output, str) else "").partition("------")[2].partition("\n")[2]
    listed = [ln.split()[0] for ln in rows.splitlines() if ln.strip()]
    return wanted, [d for d in wanted if d not in listed], listed


def sleep_facts(pmset: object, ps: object) -> tuple[str, str, str]:
    """(pass|warn, detail, pmset flag): sleep N > 0 in `pmset -g` sleeps after N idle minutes."""
    m = re.search(r"(?m)^\s*sleep\s+(\d+)(.*)$", pmset if isinstance(pmset, str) else "")
    src = re.search(r"Now drawing from '([^']+)'", ps if isinstance(ps, str) else "")
    source = src.group(1) if src else "the current power source"
    flag = {"Battery Power": "-b", "AC Power": "-c", "UPS Power": "-u"}.get(source, "-a")
    if not m:
        return "warn", f"pmset -g shows no sleep setting ({source})", flag
    n, tail = int(m.group(1)), (" " + m.group(2).strip()).rstrip()
    return ("warn" if n else "pass"), (f"sleep {n}{tail} on {source}: " + (
        f"the system sleeps after {n} idle minute(s)" if n else "never sleeps when idle")), flag


def wired_limit_mb(sysctl: object) -> int | None:
    """`sysctl -n iogpu.wired_limit_mb` (or without -n: `iogpu.wired_limit_mb: 0`): 0 is the default."""
    m = re.search(r"(?:^|:)\s*(\d+)\s*$", sysctl if isinstance(sysctl, str) else "")
    return int(m.group(1)) if m else None
