"""Load and validate an mlx.launch hostfile before any subprocess sees it.

The format is exactly mlx.launch's: a dict `{"backend", "envs", "hosts": [{"ssh", "ips",
"rdma"}]}` or the bare list of hosts. Everything that will reach ssh, rsync or a remote
command (hostnames, IPs, env entries) is checked here first, so a hostfile cannot smuggle
an ssh option (`-oProxyCommand=...`) or a shell metacharacter into a command line.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from lib.log import RunbookError

ANCHOR = "hostfile"
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
    rdma: list = field(default_factory=list)


@dataclass
class Hostfile:
    path: str
    hosts: list[Host]
    backend: str = ""
    envs: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.hosts)

    def unique_ssh(self) -> list[str]:
        """Each distinct ssh target once, in rank order."""
        seen: list[str] = []
        for h in self.hosts:
            if h.ssh not in seen:
                seen.append(h.ssh)
        return seen

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "envs": self.envs,
            "hosts": [{"ssh": h.ssh, "ips": h.ips, "rdma": h.rdma} for h in self.hosts],
        }


def check_hostname(name: object, where: str) -> str:
    if not isinstance(name, str) or not HOST_RE.match(name) or ".." in name:
        raise RunbookError(
            f"{where}: hostname {name!r} refused: it must be a plain host name, ssh alias or IP "
            "(letters, digits, '.', '-', '_', no leading '-', no spaces, quotes or shell characters)",
            ANCHOR,
        )
    return name


def check_ip(ip: object, where: str) -> str:
    try:
        ipaddress.ip_address(ip)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise RunbookError(f"{where}: {ip!r} is not an IP address", ANCHOR) from None
    return str(ip)


def check_env(entry: object, where: str) -> str:
    if not isinstance(entry, str) or not ENV_RE.match(entry):
        raise RunbookError(
            f"{where}: env entry {entry!r} refused: use NAME=value with a value of letters, "
            "digits and ./:,@%+=-_ only",
            ANCHOR,
        )
    return entry


def check_path(path: str, what: str) -> str:
    """An absolute path without '..', whitespace or shell characters (REMOTE_ROOT, PYTHON)."""
    if (
        not path.startswith("/")
        or ".." in Path(path).parts
        or not re.match(r"^/[A-Za-z0-9_./@+-]*$", path)
    ):
        raise RunbookError(
            f"{what} {path!r} refused: it must be an absolute path of letters, digits and "
            "'_./@+-', without '..'",
            "paths",
        )
    return path


def parse(data: object, path: str = "<hostfile>") -> Hostfile:
    """Validate parsed JSON (dict or list form) into a Hostfile; raise RunbookError naming the entry."""
    backend, envs = "", []
    if isinstance(data, dict):
        unknown = set(data) - {"backend", "envs", "hosts"}
        if unknown:
            raise RunbookError(f"{path}: unknown keys {sorted(unknown)} (mlx.launch knows backend, envs, hosts)", ANCHOR)
        backend = data.get("backend", "")
        envs = data.get("envs", [])
        hosts_raw = data.get("hosts")
    elif isinstance(data, list):
        hosts_raw = data
    else:
        raise RunbookError(f"{path}: expected an object with 'hosts' or a list of hosts", ANCHOR)
    if backend not in BACKENDS:
        raise RunbookError(f"{path}: backend {backend!r} unknown; use one of {', '.join(b for b in BACKENDS if b)}", ANCHOR)
    if not isinstance(envs, list):
        raise RunbookError(f"{path}: 'envs' must be a list of NAME=value strings", ANCHOR)
    envs = [check_env(e, f"{path}: envs[{i}]") for i, e in enumerate(envs)]
    if not isinstance(hosts_raw, list) or not hosts_raw:
        raise RunbookError(f"{path}: 'hosts' must be a non-empty list", ANCHOR)

    hosts: list[Host] = []
    for i, h in enumerate(hosts_raw):
        where = f"{path}: hosts[{i}]"
        if not isinstance(h, dict) or "ssh" not in h:
            raise RunbookError(f"{where}: each host needs an 'ssh' name", ANCHOR)
        unknown = set(h) - {"ssh", "ips", "rdma"}
        if unknown:
            raise RunbookError(f"{where}: unknown keys {sorted(unknown)} (mlx.launch knows ssh, ips, rdma)", ANCHOR)
        ssh = check_hostname(h["ssh"], where)
        ips = h.get("ips", [])
        if not isinstance(ips, list):
            raise RunbookError(f"{where}: 'ips' must be a list", ANCHOR)
        ips = [check_ip(ip, f"{where}.ips[{j}]") for j, ip in enumerate(ips)]
        rdma = h.get("rdma", [])
        if not isinstance(rdma, list):
            raise RunbookError(f"{where}: 'rdma' must be a list", ANCHOR)
        for j, dev in enumerate(rdma):
            devs = dev if isinstance(dev, list) else [dev]
            for d in devs:
                if d is not None and (not isinstance(d, str) or not RDMA_RE.match(d)):
                    raise RunbookError(f"{where}.rdma[{j}]: device {d!r} refused", ANCHOR)
        hosts.append(Host(i, ssh, ips, rdma))

    if backend in ("ring", "") and any(not h.ips for h in hosts) and len(hosts) > 1:
        missing = [h.ssh for h in hosts if not h.ips]
        raise RunbookError(f"{path}: the ring backend needs 'ips' for every host; missing for {missing}", ANCHOR)
    if backend.startswith("jaccl"):
        n = len(hosts)
        for h in hosts:
            if len(h.rdma) != n or h.rdma[h.rank] is not None or any(
                d is None for j, d in enumerate(h.rdma) if j != h.rank
            ):
                raise RunbookError(
                    f"{path}: hosts[{h.rank}] ({h.ssh}): jaccl needs an {n} x {n} 'rdma' matrix "
                    "with null on the diagonal and a device everywhere else",
                    ANCHOR,
                )
    pairs = [(h.ssh, tuple(h.ips)) for h in hosts]
    dup = {p for p in pairs if pairs.count(p) > 1}
    # Two ranks on one machine are fine over loopback (the embedded default); anything else
    # listed twice with the same ssh name and the same IPs is a copy-paste error.
    dup = {p for p in dup if not all(ipaddress.ip_address(ip).is_loopback for ip in p[1])}
    if dup:
        raise RunbookError(f"{path}: duplicate host/IP pairs {sorted(dup)}", ANCHOR)
    return Hostfile(path, hosts, backend, envs)


def load(path: str | Path) -> Hostfile:
    """Read and validate a hostfile; errors name the file and the entry."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunbookError(f"hostfile {p} does not exist (set HOSTFILE=...)", ANCHOR) from None
    except json.JSONDecodeError as e:
        raise RunbookError(f"{p}:{e.lineno}: invalid JSON: {e.msg}", ANCHOR) from None
    return parse(data, str(p))


def is_local(host: str) -> bool:
    """mlx.launch runs a rank without ssh exactly when its ssh name is 127.0.0.1."""
    return host == "127.0.0.1"
