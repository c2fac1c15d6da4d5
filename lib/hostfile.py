"""Load and validate an mlx.launch hostfile (`{"backend", "envs", "hosts": [{"ssh", "ips", "rdma"}]}`
or the bare list) before any subprocess sees it: hostnames, IPs, env entries and rdma devices that
could smuggle an ssh option (`-oProxyCommand=...`) or shell text are refused. Every stage uses it.
Example: `load("hostfile.json").unique_ssh()` -> `["mac4", "mac5"]`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path

from lib.log import RunbookError

ANCHOR = "hostfile"  # the RUNBOOK section every hostfile error points at
BACKENDS = ("", "ring", "jaccl", "jaccl-ring", "mpi", "nccl")
# A DNS name or ssh alias, optionally user@: letters, digits, '.', '-', '_'; never a leading '-'.
HOST_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,63}@)?[A-Za-z0-9_][A-Za-z0-9._-]{0,252}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_./:,@%+=-]*$")
RDMA_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class Host:
    rank: int
    ssh: str
    ips: list[str]
    rdma: list


@dataclass
class Hostfile:
    path: str
    hosts: list[Host]
    backend: str = ""
    envs: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.hosts)

    def unique_ssh(self) -> list[str]:  # each distinct ssh target once, in rank order
        return list(dict.fromkeys(h.ssh for h in self.hosts))

    def to_json(self) -> dict:
        return {"backend": self.backend, "envs": self.envs,
                "hosts": [{"ssh": h.ssh, "ips": h.ips, "rdma": h.rdma} for h in self.hosts]}


def need(ok: object, message: str, anchor: str = ANCHOR) -> None:
    if not ok:
        raise RunbookError(message, anchor)


def check_hostname(name: object, where: str) -> str:
    need(isinstance(name, str) and HOST_RE.match(name) and ".." not in name, f"{where}: hostname {name!r} "
         "refused: use a plain host name, ssh alias or IP (letters, digits, '.', '-', '_'; no leading '-')")
    return name


def check_path(path: str, what: str) -> str:
    """An absolute path without '..', whitespace or shell characters (REMOTE_ROOT, PYTHON)."""
    need(re.match(r"^/[A-Za-z0-9_./@+-]*$", path) and ".." not in Path(path).parts, f"{what} {path!r} "
         "refused: it must be an absolute path of letters, digits and '_./@+-', without '..'", "paths")
    return path


def parse_host(i: int, h: object, path: str) -> Host:
    where = f"{path}: hosts[{i}]"
    need(isinstance(h, dict) and "ssh" in h and set(h) <= {"ssh", "ips", "rdma"},
         f"{where}: a host has an 'ssh' name and optional 'ips' and 'rdma' (mlx.launch's keys)")
    ips, rdma = h.get("ips", []), h.get("rdma", [])
    need(isinstance(ips, list) and isinstance(rdma, list), f"{where}: 'ips' and 'rdma' must be lists")
    for j, ip in enumerate(ips):
        try:
            ip_address(ip)
        except (ValueError, TypeError):
            need(False, f"{where}.ips[{j}]: {ip!r} is not an IP address")
    for j, dev in enumerate(rdma):
        for d in dev if isinstance(dev, list) else [dev]:
            need(d is None or isinstance(d, str) and RDMA_RE.match(d), f"{where}.rdma[{j}]: {d!r} refused")
    return Host(i, check_hostname(h["ssh"], where), [str(ip) for ip in ips], rdma)


def parse(data: object, path: str = "<hostfile>") -> Hostfile:
    """Validate parsed JSON (dict or list form) into a Hostfile; RunbookError names the entry."""
    data = {"hosts": data} if isinstance(data, list) else data
    need(isinstance(data, dict) and set(data) <= {"backend", "envs", "hosts"}, f"{path}: expected a list of "
         f"hosts or an object of mlx.launch's backend, envs and hosts; got {str(data)[:80]}")
    backend, envs, raw = data.get("backend", ""), data.get("envs", []), data.get("hosts")
    need(backend in BACKENDS, f"{path}: backend {backend!r} unknown; use one of {', '.join(BACKENDS[1:])}")
    bad = ([e for e in envs if not (isinstance(e, str) and ENV_RE.match(e))]
           if isinstance(envs, list) else [envs])
    need(not bad, f"{path}: env entry {bad} refused: 'envs' is a list of NAME=value with a value of letters, "
         "digits and ./:,@%+=-_ only")
    need(isinstance(raw, list) and raw, f"{path}: 'hosts' must be a non-empty list")
    hosts, n = [parse_host(i, h, path) for i, h in enumerate(raw)], len(raw)
    need(backend not in ("ring", "") or n == 1 or all(h.ips for h in hosts), f"{path}: the ring backend "
         f"needs 'ips' for every host; missing for {[h.ssh for h in hosts if not h.ips]}")
    for h in hosts if backend.startswith("jaccl") else []:
        need(len(h.rdma) == n and all((d is None) == (j == h.rank) for j, d in enumerate(h.rdma)),
             f"{path}: hosts[{h.rank}] ({h.ssh}): jaccl needs an {n} x {n} 'rdma' matrix with null on the "
             "diagonal and a device everywhere else")
    # Two ranks on one machine are fine over loopback; anything else listed twice is a copy-paste error.
    pairs = [(h.ssh, tuple(h.ips)) for h in hosts]
    dup = {p for p in pairs if pairs.count(p) > 1 and not all(ip_address(a).is_loopback for a in p[1])}
    need(not dup, f"{path}: duplicate host/IP pairs {sorted(dup)}")
    return Hostfile(path, hosts, backend, envs)


def load(path: str | Path) -> Hostfile:
    """parse() of a hostfile's JSON; errors name the file and the entry (the line, for bad JSON)."""
    try:
        return parse(json.loads(Path(path).read_text(encoding="utf-8")), str(path))
    except FileNotFoundError:
        raise RunbookError(f"hostfile {path} does not exist (set HOSTFILE=...)", ANCHOR) from None
    except json.JSONDecodeError as e:
        raise RunbookError(f"{path}:{e.lineno}: invalid JSON: {e.msg}", ANCHOR) from None


def is_local(host: str) -> bool:  # mlx.launch runs a rank without ssh exactly when its ssh name is 127.0.0.1
    return host == "127.0.0.1"
