#!/usr/bin/env python3
"""The multi-host test fabric: N Linux "hosts" on one machine, each with its own
IPv4 address, its own sshd and its own filesystem at REMOTE_ROOT, reached
through the same ssh, rsync and mlx.launch code paths an operator uses against
real Macs. Only the hostfile and the ssh config differ.

Usage:
    python tests/fabric.py up [--hosts N] [--fresh]     # N from 1 to 4, default 2
    python tests/fabric.py down
    python tests/fabric.py status [--json]
    python tests/fabric.py procs HOST [PATTERN]
    python tests/fabric.py fault ACTION [HOST] [--pattern P] [--size S] [--package P --version V]
    python tests/fabric.py sweep                        # down test fabrics whose pytest died

Example:
    make fabric-up HOSTS=3 && . runs/fabric/env.sh && ssh fab1 hostname && make fabric-down

How a host is built (root only; nothing is mounted in the root namespace):
  - an "anchor" process (`sleep infinity`, detached) is started by
    `unshare --net --mount --uts --propagation private`; it holds the host's
    network, mount and UTS namespaces. Inside them: REMOTE_ROOT is a bind mount
    of runs/fabric/hosts/fabN/root, /run is a private tmpfs (sshd's privilege
    separation dir lives there), the hostname is fabN. The rest of the machine's
    filesystem (/usr, the venv, the checkout) stays visible and unmodified.
  - the login user's shell profile is the host's own: runs/fabric/hosts/fabN/bashrc
    (empty) is bind-mounted over ~/.bashrc, which Debian's bash runs for every ssh
    command. A compute Mac's zsh runs no profile of this machine's; without this,
    every ssh command on the fabric paid for this machine's profile (pyenv init:
    about 0.1 s of CPU each). The rest of the home stays shared (the venv's
    interpreter may live there).
  - fab2 is a macOS-like login: its login shell is zsh (a copy of /etc/passwd with
    root's shell set to zsh is bind-mounted over /etc/passwd) and sshd gives its
    sessions macOS's non-login PATH, /usr/bin:/bin:/usr/sbin:/sbin (no venv, no
    Homebrew): everything the runbook runs there must name its programs by path.
  - a veth pair joins the host (`eth0`, 10.213.7.(10+N)/24 by default) to a
    bridge in the root namespace (10.213.7.1, the orchestrator, "Mac1"). The
    hosts get no default route and ip_forward is not touched: nothing routes
    outward.
  - Debian's /usr/sbin/sshd runs inside the anchor's namespaces (nsenter), with
    its own ed25519 host key, key-only root login, listening on the host's IP,
    offering curve25519 key exchange: Debian 12's OpenSSH 9.2 would otherwise pick
    sntrup761x25519, about 60 ms of CPU per connection at each end here, where a
    current OpenSSH (9.9+, mlkem768x25519) costs about what curve25519 does.
The network namespaces are anonymous (held by the anchor, not `ip netns add`),
so `ip netns list` and the mount table never change; `status` and `procs` show
the hosts. Every link carries the alias `thunder-fabric <dir>`; every pid is
recorded with its start time in <dir>/state.json, and `down` removes exactly
those objects (and any process inside the hosts' namespaces), then the files.

Client side, written to <dir> (runs/fabric by default): hostfile.json
(mlx.launch format, ring backend), ssh_config, known_hosts (StrictHostKeyChecking
stays on), id_ed25519, bin/ssh and bin/scp shims (`ssh -F ssh_config`), and
env.sh, which puts the shims first on PATH and exports HOSTFILE, REMOTE_ROOT,
SSH_CONFIG, PYTHON and RSYNC_RSH. ~/.ssh is never read or written.

Fault actions (also a Python API, `Fabric`): sshd-stop, sshd-start, link-cut,
link-throttle (--rate, tc tbf), link-restore, freeze, thaw, kill (processes matching --pattern on HOST),
disk (a tmpfs REMOTE_ROOT of --size), disk-restore, shadow (HOST's python sees
--package at --version), python-hide (the venv is absent on HOST),
python-restore, cpu-slow (HOST's new processes get --quota of a core: a slower
Mac), cpu-restore, restore-all.

Settings (flags, else environment, else defaults): --dir/FABRIC_DIR
(runs/fabric), --prefix/FABRIC_PREFIX (link names, thfab), --subnet/
FABRIC_SUBNET (10.213.7.0/24, or "auto": the first free 10.213.X.0/24, X >= 8).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lib.atomic import write_json, write_text  # noqa: E402
from lib.log import error, event  # noqa: E402

DOC = "tests/README.md"
DEFAULT_DIR = ROOT / "runs" / "fabric"
DEFAULT_PREFIX = "thfab"
DEFAULT_SUBNET = "10.213.7.0/24"
AUTO_THIRD_OCTETS = range(8, 255)
MAX_HOSTS = 4
HOST_OFFSET = 10  # fabN gets the subnet's address number 10 + N; the bridge gets 1
SSHD = "/usr/sbin/sshd"
STATE = "state.json"
STATE_VERSION = 1
DEFAULT_PYTHON = ROOT / ".venv" / "bin" / "python"
DISK_SOURCE = "thunder-fabric-disk"
# Everything the fabric writes in its dir; `down` removes these and nothing else.
OWN_ENTRIES = ("hosts", "bin", "remote_root", "id_ed25519", "id_ed25519.pub", "known_hosts",
               "ssh_config", "hostfile.json", "env.sh")
OWN_GLOBS = ("hostfile.*.json", ".*.tmp")
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "setsid": "util-linux",
         "mount": "mount", "umount": "mount", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "rsync": "rsync", "zsh": "zsh"}
# Hosts that log in like a Mac: zsh as the login shell and macOS's PATH for an ssh command.
ZSH_HOSTS = ("fab2",)
MACOS_SSH_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"

# The anchor: $1 backing dir, $2 REMOTE_ROOT, $3 hostname, $4 pid file, $5 the host's own shell
# profile (or -), $6 the login user's ~/.bashrc to mount it over, $7 the host's own passwd file
# (or -; mounted over /etc/passwd: a zsh login). No values in the script text.
ANCHOR_SH = r"""set -e
mount --bind "$1" "$2"
if [ "$5" != - ]; then mount --bind "$5" "$6"; fi
if [ "$7" != - ]; then mount --bind "$7" /etc/passwd; fi
mount -t tmpfs -o size=1m,mode=0755 thunder-fabric-run /run
mkdir -m 0755 /run/sshd
printf '%s\n' "$3" > /proc/sys/kernel/hostname
echo $$ > "$4.tmp"
mv "$4.tmp" "$4"
exec sleep infinity
"""


class FabricError(Exception):
    """A fabric failure: what went wrong and the tests/README.md section with the fix."""

    def __init__(self, message: str, anchor: str = "troubleshooting"):
        super().__init__(message)
        self.anchor = anchor

    def __str__(self) -> str:
        return f"{self.args[0]}; see {DOC}#{self.anchor}"


# ---- settings -------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """Which fabric: its dir (state and client files), link-name prefix, subnet ("auto" allowed)."""

    dir: Path
    prefix: str
    subnet: str

    @property
    def tag(self) -> str:
        return f"thunder-fabric {self.dir}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"


def make_spec(dir=None, prefix=None, subnet=None) -> Spec:
    d = Path(dir or os.environ.get("FABRIC_DIR") or DEFAULT_DIR).absolute()
    p = prefix or os.environ.get("FABRIC_PREFIX") or DEFAULT_PREFIX
    s = subnet or os.environ.get("FABRIC_SUBNET") or DEFAULT_SUBNET
    if not re.fullmatch(r"[a-z][a-z0-9]{0,8}", p):
        raise FabricError(f"fabric prefix {p!r}: use 1-9 lowercase letters/digits, starting with a letter "
                          "(link names are <prefix>-br and <prefix>-fabN, at most 15 characters)", "settings")
    if s != "auto":
        parse_subnet(s)
    return Spec(d, p, s)


def parse_subnet(s: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(s, strict=True)
    except ValueError as e:
        raise FabricError(f"fabric subnet {s!r} is not an IPv4 network like 10.213.7.0/24: {e}", "settings") from e
    if not net.is_private or net.num_addresses < 16:
        raise FabricError(f"fabric subnet {s}: use a private range of at least 16 addresses "
                          "(e.g. 10.213.7.0/24), never a routable one", "settings")
    return net


# ---- small system helpers ---------------------------------------------------------


def sh(argv, *, input=None, check=True, timeout=30) -> subprocess.CompletedProcess:
    """Run an argument list, capturing text; a failure names the command and its stderr."""
    p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip()
        raise FabricError(f"`{shlex.join(map(str, argv))}` exited {p.returncode}: {msg}")
    return p


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None if there is none."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return rest[0], int(rest[19])


def proc_record(pid: int) -> dict:
    st = proc_stat(pid)
    if st is None:
        raise FabricError(f"process {pid} exited right after it started")
    return {"pid": pid, "start": st[1]}


def alive(rec: dict | None) -> bool:
    """True if the recorded process (pid + start time) still runs: a reused pid is not it."""
    if not rec:
        return False
    st = proc_stat(rec["pid"])
    return st is not None and st[1] == rec["start"] and st[0] not in "ZX"


def ns_inode(pid: int | str, kind: str = "net") -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def pids_in_netns(ino: int) -> list[int]:
    if ino is None or ino == ns_inode(1) or ino == ns_inode("self"):
        return []  # never the machine's own namespace
    return [p for p in all_pids() if ns_inode(p) == ino]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def link_alias(name: str) -> str:
    try:
        return Path(f"/sys/class/net/{name}/ifalias").read_text().strip()
    except OSError:
        return ""


def link_up(name: str) -> bool:
    try:
        return bool(int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 1)
    except OSError:
        return False


def unescape_mount(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mounts_of(pid: int | str) -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) of every mount seen by a process, in mount order."""
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        mp = unescape_mount(left.split()[4])
        fstype, source = right.split()[:2]
        out.append((mp, fstype, unescape_mount(source)))
    return out


def tcp_open(ip: str, port: int = 22, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for(what: str, pred, deadline: float, log: Path | None = None):
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            tail = ""
            if log and log.exists():
                tail = " -- " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
            raise FabricError(f"timed out waiting for {what}{tail}")
        time.sleep(0.01)


def spawn_detached(argv: list[str], log: Path) -> None:
    """Start a daemon via `setsid -f` so it is re-parented to init (nobody's zombie later)."""
    with open(log, "ab") as f:
        subprocess.run(["setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                       check=True, timeout=10)


def read_pidfile(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def real_tool(name: str, shim_dir: Path | None = None) -> str:
    dirs = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
            if d and (shim_dir is None or Path(d).absolute() != shim_dir.absolute())]
    found = shutil.which(name, path=os.pathsep.join(dirs))
    if not found:
        raise FabricError(f"{name} not found on PATH: apt-get install {TOOLS.get(name, name)}", "requirements")
    return found


def unavailable() -> str | None:
    """Why a fabric cannot exist on this machine, or None if it can (tests skip with this reason)."""
    if sys.platform != "linux":
        return f"the fabric needs Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the fabric needs root (unshare --net, ip link, mount); run the fabric tests as root, as CI does"
    for tool, pkg in TOOLS.items():
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install {pkg}"
    if not os.access(SSHD, os.X_OK):
        return f"no sshd at {SSHD}: apt-get install openssh-server"
    p = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot create namespaces here (`unshare --net --mount --uts true`: {p.stderr.strip()})"
    return None


LOCK = Path("/run/lock/thunder-runbook-fabric.lock")  # one for the machine: every checkout's fabrics share
# its addresses and links (a fresh clone's tests bring theirs up beside this checkout's; see tests/conftest.py)


class lock:
    """Serialize fabric changes on this machine, across checkouts (flock on LOCK)."""

    def __enter__(self):
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(LOCK, "a")
        deadline = time.monotonic() + 120
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FabricError("another tests/fabric.py has held the fabric lock for 120 s") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        self.f.close()


# ---- state ------------------------------------------------------------------------


def load_state(sp: Spec) -> dict | None:
    path = sp.dir / STATE
    if not path.exists():
        return None
    try:
        st = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FabricError(f"{path} is unreadable ({e}); inspect it, remove what it lists by hand, delete it") from e
    if st.get("version") != STATE_VERSION:
        raise FabricError(f"{path} has state version {st.get('version')}, this script writes {STATE_VERSION}; "
                          "bring that fabric down with the script that made it")
    return st


def save_state(sp: Spec, st: dict) -> None:
    write_json(sp.dir / STATE, st)


def host_dir(sp: Spec, name: str) -> Path:
    return sp.dir / "hosts" / name


def client_env(st: dict) -> dict[str, str]:
    """The variables env.sh exports (PATH is given as the shim dir to prepend)."""
    d = Path(st["dir"])
    return {
        "FABRIC_DIR": str(d),
        "FABRIC_PREFIX": st["prefix"],
        "FABRIC_SUBNET": st["subnet"],
        "SSH_CONFIG": str(d / "ssh_config"),
        "HOSTFILE": str(d / "hostfile.json"),
        "REMOTE_ROOT": st["remote_root"],
        "PYTHON": st["python"],
        "RSYNC_RSH": shlex.quote(str(d / "bin" / "ssh")),
    }


# ---- down -------------------------------------------------------------------------


def kill_netns(ino: int | None, deadline_s: float = 3.0) -> set[int]:
    """SIGKILL every process in a (non-root) network namespace until none is left; the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + deadline_s
    while True:
        pids = pids_in_netns(ino)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise FabricError(f"processes {pids} survive SIGKILL in a fabric namespace (stuck in the kernel?)")
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def delete_link(sp: Spec, name: str, building: bool) -> bool:
    """Delete a recorded link if it carries our alias (or none, while `up` was still building)."""
    if not link_exists(name):
        return False
    alias = link_alias(name)
    if alias == sp.tag or (alias == "" and building):
        sh(["ip", "link", "del", "dev", name], check=False)
        return True
    error(f"fabric: link {name} has alias {alias!r}, not {sp.tag!r}: not ours, left alone")
    return False


def teardown(sp: Spec, st: dict) -> dict:
    """Delete the recorded links, then kill the recorded processes and everything else inside the
    hosts' namespaces (the namespaces die with their last process)."""
    building = st.get("phase") != "up"
    hosts = st.get("hosts", [])
    spaces = []
    for h in hosts:
        ns = None
        for key in ("anchor", "sshd"):
            if alive(h.get(key)):
                ns = ns or ns_inode(h[key]["pid"])
        # A veth lives only while its namespace does, so then the recorded inode is still that namespace's.
        if ns is None and h.get("netns") and link_exists(h["veth"]) and link_alias(h["veth"]) == sp.tag:
            ns = h["netns"]
        spaces.append(ns)
    links = [h["veth"] for h in hosts] + [st.get("bridge", sp.bridge)]
    n_link = sum(delete_link(sp, name, building) for name in links)
    killed: set[int] = set()
    for h, ns in zip(hosts, spaces, strict=True):
        for key in ("sshd", "anchor"):
            if alive(h.get(key)):
                os.kill(h[key]["pid"], signal.SIGKILL)
                killed.add(h[key]["pid"])
        killed |= kill_netns(ns)
    for f in st.get("faults", {}).values():  # a host made slow: its cgroup, now empty
        if f.get("cpu"):
            release_cgroup(Path(f["cpu"]["cgroup"]))
    return {"processes": len(killed), "links": n_link}


def sweep_lost(sp: Spec) -> dict:
    """Objects of this fabric whose state file is gone: links tagged with our dir, sshds using our configs."""
    n_proc = n_link = 0
    marker = str(sp.dir / "hosts") + "/"
    for p in all_pids():
        c = cmdline(p)
        if c.startswith(SSHD + " ") and marker in c:
            n_proc += len(kill_netns(ns_inode(p)))
    for name in os.listdir("/sys/class/net"):
        if link_alias(name) == sp.tag:
            sh(["ip", "link", "del", "dev", name], check=False)
            n_link += 1
    return {"processes": n_proc, "links": n_link}


def remove_files(sp: Spec) -> bool:
    """Remove what the fabric wrote in its dir (state last); the dir itself if then empty."""
    d = str(sp.dir) + "/"
    inside = [mp for mp, _, _ in mounts_of("self") if mp.startswith(d)]
    if inside:
        raise FabricError(f"mounts inside {sp.dir} in the root namespace ({inside}); unmount them, "
                          "then run `make fabric-down` again")
    for name in OWN_ENTRIES:
        p = sp.dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for pattern in OWN_GLOBS:
        for p in sp.dir.glob(pattern):
            p.unlink()
    (sp.dir / STATE).unlink(missing_ok=True)
    try:
        sp.dir.rmdir()
        return True
    except OSError:
        return False


def down(sp: Spec) -> int:
    t0 = time.monotonic()
    with lock():
        st = load_state(sp)
        counts = teardown(sp, st) if st else {"processes": 0, "links": 0}
        lost = sweep_lost(sp)
        # Files only where a state file proves the dir is a fabric's (never a mistyped FABRIC_DIR).
        removed = remove_files(sp) if (sp.dir / STATE).exists() else not sp.dir.exists()
    event("fabric down", dir=rel(sp.dir), state="found" if st else "none",
          processes=counts["processes"] + lost["processes"], links=counts["links"] + lost["links"],
          dir_removed=int(removed), seconds=round(time.monotonic() - t0, 2))
    return 0


# ---- up ---------------------------------------------------------------------------


def subnet_conflicts(net: ipaddress.IPv4Network, addrs=None, routes=None) -> list[str]:
    """Addresses or routes in the root namespace that overlap `net` (the default route aside)."""
    if addrs is None:
        addrs = json.loads(sh(["ip", "-j", "-4", "addr"]).stdout or "[]")
    if routes is None:
        routes = json.loads(sh(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    out = []
    for link in addrs:
        for a in link.get("addr_info", []):
            n = ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}").network
            if n.overlaps(net):
                out.append(f"address {a['local']}/{a['prefixlen']} on {link.get('ifname')}")
    for r in routes:
        dst = r.get("dst")
        if not dst or dst == "default":
            continue
        try:
            n = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            continue
        if n.prefixlen and n.overlaps(net):
            out.append(f"route {dst} dev {r.get('dev', '?')} table {r.get('table', 'main')}")
    return out


def choose_subnet(sp: Spec) -> ipaddress.IPv4Network:
    addrs = json.loads(sh(["ip", "-j", "-4", "addr"]).stdout or "[]")
    routes = json.loads(sh(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    if sp.subnet != "auto":
        net = parse_subnet(sp.subnet)
        bad = subnet_conflicts(net, addrs, routes)
        if bad:
            raise FabricError(f"fabric subnet {net} is already in use here ({'; '.join(bad)}); "
                              "pick a free one with FABRIC_SUBNET=10.213.X.0/24 or FABRIC_SUBNET=auto",
                              "when-fabric-up-refuses")
        return net
    for x in AUTO_THIRD_OCTETS:
        net = ipaddress.IPv4Network(f"10.213.{x}.0/24")
        if not subnet_conflicts(net, addrs, routes):
            return net
    raise FabricError("no free 10.213.X.0/24 for FABRIC_SUBNET=auto; give one explicitly",
                      "when-fabric-up-refuses")


def healthy(sp: Spec, st: dict, n: int, python: str) -> str | None:
    """Why the recorded fabric cannot be reused for `up --hosts n`, or None if it can."""
    if st.get("phase") != "up":
        return f"phase {st.get('phase')}"
    if len(st["hosts"]) != n:
        return f"hosts {len(st['hosts'])} -> {n}"
    if st["prefix"] != sp.prefix or (sp.subnet != "auto" and st["subnet"] != sp.subnet):
        return "prefix or subnet changed"
    if st["python"] != python:
        return "python changed"
    if not (link_exists(st["bridge"]) and link_up(st["bridge"])):
        return f"bridge {st['bridge']} missing or down"
    for h in st["hosts"]:
        if any(st.get("faults", {}).get(h["name"], {}).values()):
            return f"{h['name']} has faults {st['faults'][h['name']]}"
        if not (alive(h.get("anchor")) and alive(h.get("sshd"))):
            return f"{h['name']} anchor or sshd is gone"
        if not (link_exists(h["veth"]) and link_up(h["veth"])):
            return f"{h['name']} link {h['veth']} missing or down"
        if not tcp_open(h["ip"], timeout=1.0):
            return f"{h['name']} sshd does not answer on {h['ip']}:22"
    return None


def zsh_passwd(passwd: str, zsh: str) -> str:
    """/etc/passwd with root's login shell set to zsh (the fabric logs in as root)."""
    lines = passwd.splitlines()
    for i, line in enumerate(lines):
        f = line.split(":")
        if f[0] == "root" and len(f) == 7:
            lines[i] = ":".join(f[:6] + [zsh])
    return "\n".join(lines) + "\n"


def sshd_config(hd: Path, ip: str, macos_login: bool = False) -> str:
    q = lambda p: '"' + str(p) + '"'  # noqa: E731  (sshd_config quoting for paths)
    # sshd reads one SetEnv line: a Mac's PATH (fab2) and the caller's LD_PRELOAD share it
    head, setenv = [], []
    if macos_login:
        head.append("# a Mac's ssh command gets this PATH (no venv, no Homebrew); the login shell is zsh")
        setenv.append(f"PATH={MACOS_SSH_PATH}")
    preload = os.environ.get("LD_PRELOAD", "")
    if re.fullmatch(r"[\w./ -]+", preload):
        head.append("# the caller's LD_PRELOAD (under pytest, tests/waitpoll.c: a ring wait polls, not spins)")
        setenv.append(f'"LD_PRELOAD={preload}"')
    head += [f"SetEnv {' '.join(setenv)}"] if setenv else []
    return "\n".join(head + [
        f"# thunder-fabric host {hd.name}: generated by tests/fabric.py up, removed by fabric-down",
        f"ListenAddress {ip}:22",
        f"HostKey {q(hd / 'ssh_host_ed25519_key')}",
        f"PidFile {q(hd / 'sshd.pid')}",
        f"AuthorizedKeysFile {q(hd / 'authorized_keys')}",
        "PermitRootLogin prohibit-password",
        "AllowUsers root",
        "PubkeyAuthentication yes",
        "# Debian 12's OpenSSH 9.2 prefers sntrup761x25519, ~60 ms of CPU per connection at each end on",
        "# this box; OpenSSH 9.9+ (mlkem768x25519) makes the post-quantum exchange about as cheap as this:",
        "KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "# the checkout may live under a world-writable dir (/tmp in CI): skip the parent-dir mode checks",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "X11Forwarding no",
        "Subsystem sftp internal-sftp",
        "",
    ])


def write_client_files(st: dict) -> None:
    d = Path(st["dir"])
    q = lambda p: '"' + str(p) + '"'  # noqa: E731  (ssh_config quoting for paths)
    cfg = ["# thunder-fabric client config: generated by tests/fabric.py up, removed by fabric-down.",
           "# Used as `ssh -F <this file>` by bin/ssh; ~/.ssh is never read or written."]
    known = []
    for h in st["hosts"]:
        cfg += [f"Host {h['name']} {h['ip']}",
                f"    HostName {h['ip']}",
                "    User root",
                "    Port 22",
                f"    IdentityFile {q(d / 'id_ed25519')}",
                "    IdentitiesOnly yes",
                f"    UserKnownHostsFile {q(d / 'known_hosts')}",
                "    GlobalKnownHostsFile /dev/null",
                "    StrictHostKeyChecking yes",
                "    CheckHostIP no",
                "    BatchMode yes",
                "    ConnectTimeout 5",
                ""]
        keytype, key = (host_dir_of(st, h) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        known.append(f"{h['name']},{h['ip']} {keytype} {key}")
    write_text(d / "ssh_config", "\n".join(cfg))
    write_text(d / "known_hosts", "\n".join(known) + "\n")
    write_json(d / "hostfile.json", hostfile_dict(st, [h["name"] for h in st["hosts"]]))
    bindir = d / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("ssh", "scp"):
        real = real_tool(tool, bindir)
        shim = bindir / tool
        write_text(shim, "#!/bin/sh\n"
                   f"# thunder-fabric {tool} shim: generated by tests/fabric.py up, removed by fabric-down\n"
                   f"exec {shlex.quote(real)} -F {shlex.quote(str(d / 'ssh_config'))} \"$@\"\n")
        shim.chmod(0o755)
    env = client_env(st)
    lines = ["# thunder-fabric client environment: generated by tests/fabric.py up, removed by fabric-down.",
             f"# Source it (. {d / 'env.sh'}): ssh, scp, rsync, mlx.launch and the project's scripts",
             "# then reach the fabric hosts; ~/.ssh is untouched.",
             f"export FABRIC_DIR={shlex.quote(env['FABRIC_DIR'])}",
             'case ":$PATH:" in *":$FABRIC_DIR/bin:"*) ;; *) PATH="$FABRIC_DIR/bin:$PATH" ;; esac',
             "export PATH"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items() if k != "FABRIC_DIR"]
    write_text(d / "env.sh", "\n".join(lines) + "\n")


def host_dir_of(st: dict, h: dict) -> Path:
    return Path(st["dir"]) / "hosts" / h["name"]


def hostfile_dict(st: dict, names: list[str]) -> dict:
    by_name = {h["name"]: h for h in st["hosts"]}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise FabricError(f"no fabric host {unknown}; this fabric has {sorted(by_name)}", "faults")
    return {"backend": "ring", "envs": [],
            "hosts": [{"ssh": n, "ips": [by_name[n]["ip"]], "rdma": []} for n in names]}


def build(sp: Spec, n: int, python: str, owner: dict | None) -> dict:
    """Create a fresh fabric of n hosts; on any failure, remove what was made and re-raise."""
    net = choose_subnet(sp)
    hosts = []
    for i in range(1, n + 1):
        name = f"fab{i}"
        hosts.append({"name": name, "ip": str(net[HOST_OFFSET + i]), "veth": f"{sp.prefix}-{name}",
                      "anchor": None, "sshd": None, "netns": None})
    foreign = [f"{x} (alias {link_alias(x)!r})" for x in [sp.bridge] + [h["veth"] for h in hosts] if link_exists(x)]
    if foreign:
        raise FabricError(f"link names already in use by something that is not this fabric: {', '.join(foreign)}; "
                          f"if another checkout's fabric, run its `make fabric-down`; else use FABRIC_PREFIX=...",
                          "when-fabric-up-refuses")
    st = {"version": STATE_VERSION, "phase": "building", "dir": str(sp.dir), "prefix": sp.prefix,
          "subnet": str(net), "bridge": sp.bridge, "bridge_ip": str(net[1]),
          "remote_root": str(sp.dir / "remote_root"), "python": python, "owner": owner,
          "hosts": hosts, "faults": {h["name"]: {} for h in hosts}}
    sp.dir.mkdir(parents=True, exist_ok=True)
    save_state(sp, st)
    try:
        return _build(sp, st, net)
    except BaseException:
        try:
            teardown(sp, st)
            remove_files(sp)
        except Exception as e:  # report the first failure, not the cleanup's
            error(f"fabric: cleanup after a failed up also failed: {e}")
        raise


def _build(sp: Spec, st: dict, net: ipaddress.IPv4Network) -> dict:
    deadline = time.monotonic() + 10
    rr = Path(st["remote_root"])
    rr.mkdir()
    keygens = [subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "thunder-fabric client",
                                 "-f", str(sp.dir / "id_ed25519")], stdin=subprocess.DEVNULL)]
    rc = login_bashrc()
    for h in st["hosts"]:
        hd = host_dir(sp, h["name"])
        (hd / "root").mkdir(parents=True)
        if rc:
            write_text(hd / "bashrc", f"# {h['name']}'s own ~/.bashrc (thunder-fabric): empty, as on a fresh host\n")
        passwd = "-"
        if h["name"] in ZSH_HOSTS:
            passwd = str(hd / "passwd")
            write_text(hd / "passwd", zsh_passwd(Path("/etc/passwd").read_text(), shutil.which("zsh")))
        keygens.append(subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                                         f"thunder-fabric {h['name']}", "-f", str(hd / "ssh_host_ed25519_key")],
                                        stdin=subprocess.DEVNULL))
        spawn_detached(["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--",
                        "sh", "-c", ANCHOR_SH, "fabric-anchor", str(hd / "root"), str(rr), h["name"],
                        str(hd / "anchor.pid"), str(hd / "bashrc") if rc else "-", rc or "-", passwd],
                       hd / "anchor.log")
    for h in st["hosts"]:
        hd = host_dir(sp, h["name"])
        pid = wait_for(f"{h['name']}'s namespaces (anchor)", lambda hd=hd: read_pidfile(hd / "anchor.pid"),
                       deadline, hd / "anchor.log")
        h["anchor"] = proc_record(pid)
        h["netns"] = ns_inode(pid)
    save_state(sp, st)

    batch = [f"link add {sp.bridge} type bridge", f"link set {sp.bridge} alias {shlex.quote(sp.tag)}",
             f"addr add {net[1]}/{net.prefixlen} dev {sp.bridge}", f"link set {sp.bridge} up"]
    for h in st["hosts"]:
        batch += [f"link add {h['veth']} type veth peer name eth0 netns {h['anchor']['pid']}",
                  f"link set {h['veth']} alias {shlex.quote(sp.tag)}",
                  f"link set {h['veth']} master {sp.bridge} up"]
    sh(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
    for h in st["hosts"]:
        sh(["nsenter", "-t", str(h["anchor"]["pid"]), "-n", "--", "ip", "-batch", "-"],
           input=f"addr add {h['ip']}/{net.prefixlen} dev eth0\nlink set eth0 up\nlink set lo up\n")

    for k in keygens:
        if k.wait(timeout=10) != 0:
            raise FabricError(f"`{shlex.join(k.args)}` exited {k.returncode}")
    client_pub = (sp.dir / "id_ed25519.pub").read_text()
    for h in st["hosts"]:
        hd = host_dir(sp, h["name"])
        write_text(hd / "authorized_keys", client_pub)
        write_text(hd / "sshd_config", sshd_config(hd, h["ip"], macos_login=h["name"] in ZSH_HOSTS))
        start_sshd_process(h, hd)
    for h in st["hosts"]:
        hd = host_dir(sp, h["name"])
        h["sshd"] = proc_record(wait_for(f"{h['name']}'s sshd", lambda hd=hd: read_pidfile(hd / "sshd.pid"),
                                         deadline, hd / "sshd.log"))
    save_state(sp, st)
    for h in st["hosts"]:
        wait_for(f"{h['name']}'s sshd on {h['ip']}:22", lambda h=h: tcp_open(h["ip"]), deadline,
                 host_dir(sp, h["name"]) / "sshd.log")
    write_client_files(st)
    verify(st)
    st["phase"] = "up"
    save_state(sp, st)
    return st


def login_bashrc() -> str | None:
    """root's ~/.bashrc (the fabric logs in as root) when it is a regular file, else None."""
    import pwd

    rc = os.path.join(pwd.getpwuid(0).pw_dir, ".bashrc")
    return rc if os.path.isfile(rc) and not os.path.islink(rc) else None


PERIOD_US = 10_000  # cpu-slow's cgroup period


def cpu_cgroup() -> tuple[Path, bool] | None:
    """(the cgroup root that limits CPU time, whether it is v2), or None: no such controller writable here."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    with contextlib.suppress(OSError):
        if "cpu" in (v2 / "cgroup.controllers").read_text().split() and os.access(v2, os.W_OK):
            return v2, True
    return (v1, False) if (v1 / "cpu.cfs_quota_us").is_file() and os.access(v1, os.W_OK) else None


def release_cgroup(group: Path) -> None:
    """Move what is left in a fault's cgroup to its root, then remove it (gone already: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


def pin_prefix(name: str) -> list[str]:
    """With FABRIC_PIN=1 (or `up --pin`), host fabN's sshd, and so every process started over ssh,
    runs on core (N-1) % ncpu: each host its own core, like separate Macs. Default off."""
    if os.environ.get("FABRIC_PIN") != "1":
        return []
    return ["taskset", "-c", str((int(re.sub(r"\D", "", name) or 1) - 1) % (os.cpu_count() or 1))]


def start_sshd_process(h: dict, hd: Path) -> None:
    (hd / "sshd.pid").unlink(missing_ok=True)
    spawn_detached([*pin_prefix(h["name"]), "nsenter", "-t", str(h["anchor"]["pid"]), "-m", "-n", "-u", "--",
                    SSHD, "-D", "-f", str(hd / "sshd_config"), "-E", str(hd / "sshd.log")], hd / "sshd.out")


def verify(st: dict) -> None:
    """Log in to every host through the shim; check it sees its own REMOTE_ROOT and hostname."""
    shim = str(Path(st["dir"]) / "bin" / "ssh")
    rr = st["remote_root"]
    remote = shlex.join(["stat", "-c", "%d:%i", "--", rr]) + " && cat /proc/sys/kernel/hostname"
    procs = [(h, subprocess.Popen([shim, h["name"], remote], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)) for h in st["hosts"]]
    for h, p in procs:
        out, err = p.communicate(timeout=20)
        s = os.stat(host_dir_of(st, h) / "root")
        want = f"{s.st_dev}:{s.st_ino}\n{h['name']}"
        if p.returncode != 0 or out.strip() != want:
            raise FabricError(f"{h['name']}: `ssh {h['name']}` check failed (exit {p.returncode}): "
                              f"got {out.strip()!r}, want {want!r}; {err.strip()}; "
                              f"sshd log: {host_dir_of(st, h) / 'sshd.log'}")


def check_dir(sp: Spec) -> None:
    if sp.dir.exists() and not (sp.dir / STATE).exists() and any(sp.dir.iterdir()):
        raise FabricError(f"{sp.dir} exists, is not empty and holds no {STATE}: not a fabric dir, left alone; "
                          "point FABRIC_DIR at a new or empty dir", "when-fabric-up-refuses")


def up(sp: Spec, n: int, fresh: bool = False, python: str | None = None, owner_pid: int | None = None) -> dict:
    if not 1 <= n <= MAX_HOSTS:
        raise FabricError(f"HOSTS={n}: the fabric has 1 to {MAX_HOSTS} hosts", "settings")
    why = unavailable()
    if why:
        raise FabricError(f"the fabric cannot run here: {why}", "requirements")
    python = str(python or os.environ.get("FABRIC_PYTHON") or DEFAULT_PYTHON)
    owner = proc_record(owner_pid) if owner_pid else None
    t0 = time.monotonic()
    with lock():
        check_dir(sp)
        st = load_state(sp)
        if st is not None and not fresh:
            reason = healthy(sp, st, n, python)
            if reason is None:
                st["owner"] = owner or st.get("owner")
                save_state(sp, st)
                write_client_files(st)
                report_up(st, t0, reused=True)
                return st
            event("fabric rebuild", dir=rel(sp.dir), reason=json.dumps(reason))
        if st is not None:
            teardown(sp, st)
            remove_files(sp)
        lost = sweep_lost(sp)
        if lost["processes"] or lost["links"]:
            event("fabric swept", dir=rel(sp.dir), **lost)
        if not Path(python).exists():
            error(f"fabric: warning: no python at {python} (the hosts' PYTHON); run `make setup`")
        st = build(sp, n, python, owner)
    report_up(st, t0, reused=False)
    return st


def report_up(st: dict, t0: float, reused: bool) -> None:
    for h in st["hosts"]:
        event("fabric", host=h["name"], ip=h["ip"], anchor=h["anchor"]["pid"], sshd=h["sshd"]["pid"])
    event("fabric up", hosts=len(st["hosts"]), subnet=st["subnet"], reused=int(reused),
          seconds=round(time.monotonic() - t0, 2), env=rel(Path(st["dir"]) / "env.sh"))


def rel(p: Path) -> str:
    try:
        return os.path.relpath(p)
    except ValueError:
        return str(p)


# ---- the Python API (tests and reliability helpers) -------------------------------


REACH = """import socket, sys
try:
    socket.create_connection((sys.argv[1], 22), 1).close()
except ConnectionRefusedError:  # an answer all the same: the route is there
    pass
"""  # one TCP handshake to a host's sshd port; restore_link retries it with wait_for


class Fabric:
    """A running fabric, loaded from its state file. Fault methods record what they did
    so that `restore_all()` (and `down`) can undo it."""

    def __init__(self, dir=None):
        self.spec = make_spec(dir=dir)
        st = load_state(self.spec)
        if st is None or st.get("phase") != "up":
            raise FabricError(f"no fabric is up in {self.spec.dir}; run `make fabric-up`", "using-the-fabric-by-hand")
        self.state = st

    # -- facts
    @property
    def dir(self) -> Path:
        return Path(self.state["dir"])

    @property
    def hosts(self) -> list[str]:
        return [h["name"] for h in self.state["hosts"]]

    @property
    def remote_root(self) -> str:
        return self.state["remote_root"]

    @property
    def python(self) -> str:
        return self.state["python"]

    @property
    def hostfile_path(self) -> Path:
        return self.dir / "hostfile.json"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def bridge_ip(self) -> str:
        return self.state["bridge_ip"]

    def host(self, name: str) -> dict:
        for h in self.state["hosts"]:
            if h["name"] == name:
                return h
        raise FabricError(f"no fabric host {name!r}; this fabric has {self.hosts}", "faults")

    def ip(self, name: str) -> str:
        return self.host(name)["ip"]

    def backing_dir(self, name: str) -> Path:
        """Where host `name`'s REMOTE_ROOT lives on the real disk (seen from the orchestrator)."""
        return self.dir / "hosts" / name / "root"

    def env(self, base: dict | None = None) -> dict[str, str]:
        """os.environ (or `base`) plus what env.sh sets: the shim dir first on PATH, HOSTFILE, ..."""
        env = dict(os.environ if base is None else base)
        env.update(client_env(self.state))
        env["PATH"] = str(self.dir / "bin") + os.pathsep + env.get("PATH", os.defpath)
        return env

    def hostfile(self, names: list[str] | int) -> Path:
        """Write (and return) a hostfile for a subset of hosts, e.g. hostfile(2) or hostfile(["fab2", "fab3"])."""
        if isinstance(names, int):
            names = self.hosts[:names]
        path, want = self.dir / f"hostfile.{'-'.join(names)}.json", hostfile_dict(self.state, names)
        if not path.is_file() or json.loads(path.read_text()) != want:  # as is: a new mtime re-runs smoke
            write_json(path, want)
        return path

    # -- running things
    def ssh_argv(self, name: str, command: list[str] | str, tty: bool = False) -> list[str]:
        remote = command if isinstance(command, str) else shlex.join(command)
        return [str(self.dir / "bin" / "ssh"), *(["-tt"] if tty else []), self.host(name)["name"], remote]

    def ssh(self, name: str, command: list[str] | str, *, check: bool = False, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run(self.ssh_argv(name, command), input=input, capture_output=True, text=True,
                           timeout=timeout, env=self.env(), stdin=None if input is not None else subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise FabricError(f"ssh {name} {command!r} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def procs(self, name: str, pattern: str | None = None) -> list[dict]:
        """Processes inside host `name` (its network namespace) whose command line matches `pattern`
        (a regex), the fabric's own anchor and sshd listener excluded."""
        h = self.host(name)
        ns = self._netns(h)
        own = {h["anchor"]["pid"], (h.get("sshd") or {}).get("pid")}
        rx = re.compile(pattern) if pattern else None
        out = []
        for p in pids_in_netns(ns):
            c = cmdline(p)
            st = proc_stat(p)
            if p in own or st is None or not c or (rx and not rx.search(c)):
                continue
            out.append({"pid": p, "start": st[1], "state": st[0], "cmd": c})
        return out

    # -- faults
    @contextmanager
    def _locked(self):
        """Take the fabric lock and re-read the state (another process may have changed it)."""
        with lock():
            self.state = load_state(self.spec) or self.state
            yield self

    def _save(self) -> None:
        save_state(self.spec, self.state)

    def _faults(self, name: str) -> dict:
        return self.state.setdefault("faults", {}).setdefault(name, {})

    def _netns(self, h: dict) -> int:
        if not alive(h.get("anchor")):
            raise FabricError(f"{h['name']}'s anchor process is gone; run `make fabric-up` to rebuild", "faults")
        return ns_inode(h["anchor"]["pid"])

    def _in_host(self, name: str, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """Run argv in host `name`'s mount namespace (as root, no shell)."""
        h = self.host(name)
        self._netns(h)
        return sh(["nsenter", "-t", str(h["anchor"]["pid"]), "-m", "--", *argv], check=check)

    def stop_sshd(self, name: str) -> None:
        """Stop host `name`'s sshd listener (SIGTERM): new ssh connections are refused; sessions
        already open keep running, as with `service ssh stop` on a real machine."""
        with self._locked():
            h = self.host(name)
            rec = h.get("sshd")
            if alive(rec):
                os.kill(rec["pid"], signal.SIGTERM)
                try:
                    wait_for(f"{name}'s sshd to exit", lambda: not alive(rec), time.monotonic() + 3)
                except FabricError:
                    os.kill(rec["pid"], signal.SIGKILL)
            h["sshd"] = None
            self._faults(name)["sshd"] = "stopped"
            self._save()
        event("fabric fault", host=name, sshd="stopped")

    def start_sshd(self, name: str) -> None:
        with self._locked():
            h = self.host(name)
            if not alive(h.get("sshd")):
                self._netns(h)
                hd = self.dir / "hosts" / name
                start_sshd_process(h, hd)
                deadline = time.monotonic() + 5
                h["sshd"] = proc_record(wait_for(f"{name}'s sshd", lambda: read_pidfile(hd / "sshd.pid"),
                                                 deadline, hd / "sshd.log"))
                wait_for(f"{name}'s sshd on {h['ip']}:22", lambda: tcp_open(h["ip"]), deadline, hd / "sshd.log")
            self._faults(name).pop("sshd", None)
            self._save()
        event("fabric fault", host=name, sshd="started")

    def cut_link(self, name: str) -> None:
        """Take host `name`'s switch port down: no packet reaches it or leaves it (its own view is unchanged)."""
        with self._locked():
            sh(["ip", "link", "set", "dev", self.host(name)["veth"], "down"])
            self._faults(name)["link"] = "cut"
            self._save()
        event("fabric fault", host=name, link="cut")

    def throttle_link(self, name: str, rate: str = "2mbit") -> None:
        """A slow cable: host `name`'s switch port sends to it at `rate` (tc tbf), everything else as before."""
        with self._locked():
            sh(["tc", "qdisc", "replace", "dev", self.host(name)["veth"], "root", "tbf", "rate", rate,
                "burst", "32kbit", "latency", "400ms"])
            self._faults(name)["link"] = f"throttled {rate}"
            self._save()
        event("fabric fault", host=name, link=f"throttled-{rate}")

    def restore_link(self, name: str) -> None:
        """The port up and unthrottled."""
        with self._locked():
            veth = self.host(name)["veth"]
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)  # none: nothing to do
            sh(["ip", "link", "set", "dev", veth, "up"])
            wait_for(f"{veth} carrier", lambda: Path(f"/sys/class/net/{veth}/operstate").read_text().strip() == "up",
                     time.monotonic() + 3)
            # After a long cut the other hosts' entries for it (and its for them) are failed or between ARP
            # retries a second apart: a 1 s connect just after the restore could miss (check-parity's link.rtt)
            sh(["ip", "neigh", "flush", "dev", self.state.get("bridge", self.spec.bridge)])
            for h in self.state["hosts"]:
                sh(["nsenter", "-t", str(h["anchor"]["pid"]), "-n", "--", "ip", "neigh", "flush", "all"])
            for h in [h for h in self.state["hosts"] if h["name"] != name]:  # and each host reaches it again
                argv = ["nsenter", "-t", str(h["anchor"]["pid"]), "-n", "--", sys.executable, "-c", REACH,
                        self.host(name)["ip"]]
                wait_for(f"{h['name']} to reach {name}", lambda a=argv: sh(a, check=False).returncode == 0,
                         time.monotonic() + 5)
            self._faults(name).pop("link", None)
            self._save()
        event("fabric fault", host=name, link="restored")

    def _signal(self, name: str, pattern: str, sig: int) -> list[int]:
        if not pattern:
            raise FabricError("give a --pattern that matches the run's processes (e.g. the run id)", "faults")
        hit = []
        for p in self.procs(name, pattern):
            try:
                os.kill(p["pid"], sig)
                hit.append(p)
            except ProcessLookupError:
                pass
        if not hit:
            raise FabricError(f"no process on {name} matches {pattern!r} (see `tests/fabric.py procs {name}`)", "faults")
        return hit

    def freeze(self, name: str, pattern: str) -> list[int]:
        """SIGSTOP the processes on host `name` whose command line matches `pattern`."""
        with self._locked():
            hit = self._signal(name, pattern, signal.SIGSTOP)
            self._faults(name).setdefault("frozen", []).extend({"pid": p["pid"], "start": p["start"]} for p in hit)
            self._save()
        event("fabric fault", host=name, frozen=",".join(str(p["pid"]) for p in hit))
        return [p["pid"] for p in hit]

    def thaw(self, name: str, pattern: str | None = None) -> list[int]:
        """SIGCONT what freeze() stopped on host `name` (and whatever else matches `pattern`)."""
        with self._locked():
            pids = [r["pid"] for r in self._faults(name).pop("frozen", []) if alive(r)]
            if pattern:
                pids += [p["pid"] for p in self.procs(name, pattern)]
            for p in sorted(set(pids)):
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self._save()
        event("fabric fault", host=name, thawed=",".join(map(str, sorted(set(pids)))) or "-")
        return sorted(set(pids))

    def kill(self, name: str, pattern: str) -> list[int]:
        """SIGKILL the processes on host `name` whose command line matches `pattern`."""
        with self._locked():
            hit = self._signal(name, pattern, signal.SIGKILL)
        event("fabric fault", host=name, killed=",".join(str(p["pid"]) for p in hit))
        return [p["pid"] for p in hit]

    def slow_cpu(self, name: str, quota: float = 0.5) -> None:
        """A slower Mac: host `name`'s sshd, and so every process started over ssh from now on, gets `quota`
        of a core's time (a cgroup: v2 cpu.max, else v1 cpu.cfs_quota_us). With --pin, 0.5 is half speed."""
        found = cpu_cgroup()
        if not 0.05 <= quota <= 4 or found is None:
            raise FabricError(f"cpu-slow --quota {quota}: a share of a core from 0.05 to 4, on a machine with "
                              "cgroup v2's cpu controller or v1's cpu.cfs_quota_us (mounted rw: run as root)", "faults")
        root, v2 = found
        with self._locked():
            h = self.host(name)
            if not alive(h.get("sshd")):
                raise FabricError(f"{name}'s sshd is down: `fault sshd-start {name}` first", "faults")
            group = root / f"thfab-{hashlib.sha256(str(self.dir).encode()).hexdigest()[:8]}-{name}"
            group.mkdir(exist_ok=True)
            # A 10 ms period: a slower CPU, not one that stops for 50 ms in every 100 (the ranks' all-reduce
            # waits out each stop: with 100 ms, half a core cost a trainer step 1.4 s of waiting)
            if v2:
                (root / "cgroup.subtree_control").write_text("+cpu")
                (group / "cpu.max").write_text(f"{round(quota * PERIOD_US)} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(round(quota * PERIOD_US)))
            (group / "cgroup.procs").write_text(str(h["sshd"]["pid"]))
            self._faults(name)["cpu"] = {"quota": quota, "cgroup": str(group)}
            self._save()
        event("fabric fault", host=name, cpu=f"quota-{quota:g}")

    def restore_cpu(self, name: str) -> None:
        """Every process of host `name`'s CPU cgroup back to full speed (the root cgroup), the cgroup removed."""
        with self._locked():
            rec = self._faults(name).pop("cpu", None)
            if rec:
                release_cgroup(Path(rec["cgroup"]))
            self._save()
        event("fabric fault", host=name, cpu="restored")

    def small_disk(self, name: str, size: str) -> None:
        """Give host `name` an empty tmpfs of `size` (e.g. "8M") at REMOTE_ROOT; its files return on restore."""
        if not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", size):
            raise FabricError(f"disk size {size!r}: use a number with an optional k/m/g suffix, e.g. 8M", "faults")
        with self._locked():
            rr = self.remote_root
            if self._faults(name).get("disk"):
                self._in_host(name, ["mount", "-o", f"remount,size={size}", rr])
            else:
                self._in_host(name, ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", DISK_SOURCE, rr])
            self._faults(name)["disk"] = size
            self._save()
        event("fabric fault", host=name, disk=size)

    def restore_disk(self, name: str) -> None:
        with self._locked():
            rr = self.remote_root
            top = [m for m in mounts_of(self.host(name)["anchor"]["pid"]) if m[0] == rr]
            if top and top[-1][1] == "tmpfs" and top[-1][2] == DISK_SOURCE:
                self._in_host(name, ["umount", "-l", rr])
            self._faults(name).pop("disk", None)
            self._save()
        event("fabric fault", host=name, disk="restored")

    def _python_paths(self) -> tuple[Path, Path]:
        """(venv prefix, site-packages) of the hosts' PYTHON."""
        out = sh([self.python, "-c", "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_path('purelib'))"])
        prefix, purelib = out.stdout.strip().splitlines()
        return Path(prefix), Path(purelib)

    def shadow_package(self, name: str, package: str = "mlx", version: str = "0.0.0+fabric") -> None:
        """Make host `name`'s PYTHON see `package` at `version`: `import mlx; mlx.__version__`,
        `mlx.core.__version__` and `importlib.metadata.version("mlx")` all report it, and the
        package still works. Bind mounts in that host's mount namespace only: the venv is untouched."""
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", package) or not re.fullmatch(r"[A-Za-z0-9.+!_-]+", version):
            raise FabricError(f"shadow {package!r} {version!r}: give a package name and a version like 0.31.0", "faults")
        with self._locked():
            _, site = self._python_paths()
            real = site / package
            dists = sorted(site.glob(f"{package}-*.dist-info"))
            if not real.is_dir() or not dists or not (dists[0] / "METADATA").is_file():
                raise FabricError(f"{package} is not installed in {site}", "faults")
            self._unmount_python(name, lambda e: e.get("package") == package)
            sd = self.dir / "hosts" / name / "shadow" / package
            if sd.exists():
                shutil.rmtree(sd)
            top = sd / "top"
            top.mkdir(parents=True)
            if any(c in str(p) for p in (top, real) for c in ":,"):
                raise FabricError(f"paths with ':' or ',' cannot be overlay layers ({top}, {real})", "faults")
            init = (real / "__init__.py").read_text() if (real / "__init__.py").exists() else ""
            init += (f"\n# thunder-fabric fault (tests/fabric.py shadow): this host's {package} reports {version}\n"
                     f"__version__ = {version!r}\n")
            if package == "mlx":  # mlx is a namespace package; its version lives in mlx.core
                init += "from mlx import core as _core  # noqa: E402\n_core.__version__ = __version__\n"
            (top / "__init__.py").write_text(init)
            meta_real = dists[0] / "METADATA"
            meta = sd / "METADATA"
            meta.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", meta_real.read_text(), count=1))
            entry = {"what": f"shadow {package} {version}", "package": package, "mounts": []}
            self._faults(name).setdefault("python", []).append(entry)
            # A read-only overlay (our __init__.py over the real package) at the package's own path:
            # the real files keep their real path, so the extension's $ORIGIN rpath still resolves.
            self._in_host(name, ["mount", "-t", "overlay", "thunder-fabric-shadow",
                                 "-o", f"lowerdir={top}:{real}", str(real)])
            entry["mounts"].append(str(real))
            self._save()
            self._in_host(name, ["mount", "--bind", str(meta), str(meta_real)])
            entry["mounts"].append(str(meta_real))
            self._save()
        event("fabric fault", host=name, shadow=package, version=version)

    def hide_python(self, name: str) -> None:
        """Make the venv (PYTHON's prefix) absent on host `name`: an empty dir is mounted over it."""
        with self._locked():
            prefix, _ = self._python_paths()
            empty = self.dir / "hosts" / name / "empty"
            empty.mkdir(exist_ok=True)
            self._in_host(name, ["mount", "--bind", "-o", "ro", str(empty), str(prefix)])
            self._faults(name).setdefault("python", []).append({"what": "hide venv", "mounts": [str(prefix)]})
            self._save()
        event("fabric fault", host=name, python="hidden", prefix=prefix)

    def _unmount_python(self, name: str, which) -> None:
        entries = self._faults(name).get("python", [])
        for e in reversed([e for e in entries if which(e)]):
            for target in reversed(e["mounts"]):
                self._in_host(name, ["umount", "-l", target], check=False)
            entries.remove(e)
        if not entries:
            self._faults(name).pop("python", None)

    def restore_python(self, name: str) -> None:
        """Undo shadow_package() and hide_python() on host `name`."""
        with self._locked():
            self._unmount_python(name, lambda e: True)
            self._save()
        event("fabric fault", host=name, python="restored")

    def restore_all(self) -> None:
        """Undo every recorded fault on every host (tests call this in teardown)."""
        self.state = load_state(self.spec) or self.state
        for name in self.hosts:
            f = dict(self._faults(name))
            if f.get("frozen"):
                self.thaw(name)
            if f.get("link"):
                self.restore_link(name)
            if f.get("sshd") or not alive(self.host(name).get("sshd")):
                self.start_sshd(name)
            if f.get("disk"):
                self.restore_disk(name)
            if f.get("python"):
                self.restore_python(name)
            if f.get("cpu"):
                self.restore_cpu(name)


# ---- status, sweep, CLI ------------------------------------------------------------


def status(sp: Spec, as_json: bool) -> int:
    st = load_state(sp)
    if st is None:
        if as_json:
            print(json.dumps({"dir": str(sp.dir), "up": False}))
        else:
            event("fabric status", dir=rel(sp.dir), up=0)
        return 3
    rows = []
    for h in st["hosts"]:
        rows.append({"name": h["name"], "ip": h["ip"], "anchor": alive(h.get("anchor")),
                     "anchor_pid": (h.get("anchor") or {}).get("pid"), "sshd": alive(h.get("sshd")),
                     "sshd_pid": (h.get("sshd") or {}).get("pid"), "link": link_exists(h["veth"]) and link_up(h["veth"]),
                     "faults": st.get("faults", {}).get(h["name"], {})})
    ok = st.get("phase") == "up" and all(r["anchor"] and r["sshd"] and r["link"] and not any(r["faults"].values())
                                         for r in rows)
    if as_json:
        print(json.dumps({"dir": st["dir"], "up": st.get("phase") == "up", "healthy": ok, "subnet": st["subnet"],
                          "remote_root": st["remote_root"], "hosts": rows}, indent=2))
    else:
        event("fabric status", dir=rel(sp.dir), phase=st.get("phase"), hosts=len(rows), subnet=st["subnet"],
              healthy=int(ok))
        for r in rows:
            faults = ",".join(f"{k}={describe(v)}" for k, v in r["faults"].items() if v)
            event("fabric", host=r["name"], ip=r["ip"], anchor=r["anchor_pid"] if r["anchor"] else "gone",
                  sshd=r["sshd_pid"] if r["sshd"] else "down", link="up" if r["link"] else "down", faults=faults or "-")
    return 0 if ok else 1


def describe(v) -> str:
    if isinstance(v, list):
        return "+".join(e["what"].replace(" ", ":") if isinstance(e, dict) and "what" in e else str(e.get("pid", e))
                        for e in v)
    return str(v)


def sweep() -> int:
    """Bring down every fabric under runs/ whose recorded owner (a pytest session) is gone."""
    n = 0
    for state in sorted((ROOT / "runs").glob("fabric*/" + STATE)):
        try:
            st = json.loads(state.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if st.get("owner") and not alive(st["owner"]):
            down(make_spec(dir=state.parent, prefix=st.get("prefix")))
            n += 1
    event("fabric sweep", stale=n)
    return 0


FAULTS = ("sshd-stop", "sshd-start", "link-cut", "link-throttle", "link-restore", "freeze", "thaw", "kill", "disk",
          "disk-restore", "shadow", "python-hide", "python-restore", "cpu-slow", "cpu-restore", "restore-all")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tests/fabric.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dir", help="fabric dir (state, keys, ssh_config, env.sh); env FABRIC_DIR; default runs/fabric")
    p.add_argument("--prefix", help="link-name prefix; env FABRIC_PREFIX; default thfab")
    p.add_argument("--subnet", help="private IPv4 range or 'auto'; env FABRIC_SUBNET; default 10.213.7.0/24")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the fabric (idempotent)")
    u.add_argument("--hosts", type=int, default=2, help="number of hosts, 1 to 4 (default 2)")
    u.add_argument("--fresh", action="store_true", help="rebuild even if a healthy fabric is up")
    u.add_argument("--python", help="the hosts' PYTHON (default: this checkout's .venv/bin/python)")
    u.add_argument("--owner-pid", type=int, default=int(os.environ.get("FABRIC_OWNER_PID") or 0) or None,
                   help="a process whose exit makes this fabric stale for `sweep` (the pytest session)")
    u.add_argument("--pin", action="store_true", help="each host's processes on its own core (env FABRIC_PIN=1)")
    sub.add_parser("down", help="remove everything `up` made")
    s = sub.add_parser("status", help="one line per host; exit 0 healthy, 1 degraded, 3 not up")
    s.add_argument("--json", action="store_true")
    pr = sub.add_parser("procs", help="processes inside HOST (matching PATTERN)")
    pr.add_argument("host")
    pr.add_argument("pattern", nargs="?")
    f = sub.add_parser("fault", help="inject or undo a fault on HOST")
    f.add_argument("action", choices=FAULTS)
    f.add_argument("host", nargs="?")
    f.add_argument("--pattern", help="freeze/thaw/kill: regex over the command line (e.g. the run id)")
    f.add_argument("--size", default="8M", help="disk: tmpfs size (default 8M)")
    f.add_argument("--rate", default="2mbit", help="link-throttle: tc tbf rate towards HOST (default 2mbit)")
    f.add_argument("--quota", type=float, default=0.5, help="cpu-slow: HOST's share of a core (default 0.5)")
    f.add_argument("--package", default="mlx", help="shadow: package (default mlx)")
    f.add_argument("--version", default="0.0.0+fabric", help="shadow: version to report")
    sub.add_parser("sweep", help="down fabrics under runs/ whose owning pytest session is gone")
    return p


def run_fault(fab: Fabric, a) -> int:
    if a.action == "restore-all":
        fab.restore_all()
        return 0
    if not a.host:
        raise FabricError(f"fault {a.action} needs a HOST ({', '.join(fab.hosts)})", "faults")
    name = a.host
    fab.host(name)
    if a.action == "sshd-stop":
        fab.stop_sshd(name)
    elif a.action == "sshd-start":
        fab.start_sshd(name)
    elif a.action == "link-cut":
        fab.cut_link(name)
    elif a.action == "link-throttle":
        fab.throttle_link(name, a.rate)
    elif a.action == "link-restore":
        fab.restore_link(name)
    elif a.action == "freeze":
        fab.freeze(name, a.pattern)
    elif a.action == "thaw":
        fab.thaw(name, a.pattern)
    elif a.action == "kill":
        fab.kill(name, a.pattern)
    elif a.action == "disk":
        fab.small_disk(name, a.size)
    elif a.action == "disk-restore":
        fab.restore_disk(name)
    elif a.action == "shadow":
        fab.shadow_package(name, a.package, a.version)
    elif a.action == "python-hide":
        fab.hide_python(name)
    elif a.action == "python-restore":
        fab.restore_python(name)
    elif a.action == "cpu-slow":
        fab.slow_cpu(name, a.quota)
    elif a.action == "cpu-restore":
        fab.restore_cpu(name)
    return 0


def main() -> int:
    a = build_parser().parse_args()
    try:
        if a.cmd == "sweep":
            return sweep()
        sp = make_spec(a.dir, a.prefix, a.subnet)
        if a.cmd == "up":
            if a.pin:
                os.environ["FABRIC_PIN"] = "1"
            up(sp, a.hosts, fresh=a.fresh, python=a.python, owner_pid=a.owner_pid)
            return 0
        if a.cmd == "down":
            return down(sp)
        if a.cmd == "status":
            return status(sp, a.json)
        fab = Fabric(sp.dir)
        if a.cmd == "procs":
            for p in fab.procs(a.host, a.pattern):
                event("fabric proc", host=a.host, pid=p["pid"], state=p["state"], cmd=json.dumps(p["cmd"]))
            return 0
        return run_fault(fab, a)
    except FabricError as e:
        error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
