"""The host side of check-parity: a self-contained probe (standard library and packaging) that only reads and
prints one JSON object of facts; lib/parity.py's PROBE_SH runs it (`PYTHON -c <source> <params>`); by hand:
    python lib/parity_probe.py '{"remote_root": "/Users/op/thunder-runbook", "parts": ["runtime"]}'
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import re
import socket
import sys
import time

MACOS_TOOLS = {  # their raw output; lib/parity.py parses it on the orchestrator (ibv_devices: jaccl only)
    "networksetup": "networksetup -listallhardwareports", "ifconfig": "ifconfig", "pmset": "pmset -g",
    "system_profiler": "system_profiler SPThunderboltDataType -json", "pmset_ps": "pmset -g ps",
    "wired_limit": "sysctl -n iogpu.wired_limit_mb", "ibv_devices": "ibv_devices"}


def iter_files(root, parts):
    """lib.hashing.iter_files's rule (a test keeps them in step): hidden files and __pycache__ skipped."""
    out = {part for part in parts if os.path.isfile(os.path.join(root, part))}
    for part in parts:
        for top, dirs, names in os.walk(os.path.join(root, part)):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            out.update(os.path.relpath(os.path.join(top, n), root).replace(os.sep, "/") for n in names
                       if not n.startswith(".") and os.path.isfile(os.path.join(top, n)))
    return sorted(out)


def installed_dists():
    """{normalized name: version} of the distributions on sys.path; the first wins, as for import."""
    from importlib import metadata
    return {re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower(): d.version
            for d in reversed(list(metadata.distributions()))}


def probe_mlx():
    """Import mlx.core from the interpreter under test, compute one small op, read Metal's working set."""
    t0 = time.monotonic()
    import mlx.core as mx
    value = (mx.array([1.0, 2.0, 3.0]) * 2).sum().item()
    return {"ok": abs(value - 12.0) < 1e-6, "version": getattr(mx, "__version__", None), "result": value,
            "file": getattr(mx, "__file__", None), "device": str(mx.default_device()),
            "working_set": mx.device_info().get("max_recommended_working_set_size"),
            "seconds": round(time.monotonic() - t0, 3)}


def probe_files(base, parts, hashed):
    """{rel: [size, sha256 or None]} of the files of `parts` under `base` (sha256 when `hashed`)."""
    files = {}
    for rel in iter_files(base, parts):
        with open(os.path.join(base, rel), "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest() if hashed else None
            files[rel] = [os.fstat(f.fileno()).st_size, digest]
    return files


def probe_root(root):
    """Free disk at REMOTE_ROOT (or its nearest parent) and whether this session may list it (TCC: EPERM)."""
    path = root
    while path != os.path.dirname(path) and not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    out = {"path": path, "free_bytes": st.f_bavail * st.f_frsize, "home": os.path.expanduser("~")}
    try:
        os.listdir(root)
    except OSError as e:
        out["errno"], out["error"] = errno.errorcode.get(e.errno, str(e.errno)), str(e)[:200]
    return out


def probe_memory():
    """Total and available bytes (Linux: MemAvailable; macOS: free, inactive, purgeable, speculative)."""
    out = {"total_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")}
    if sys.platform != "darwin":
        with open("/proc/meminfo") as f:
            return dict(out, available_bytes=int(re.search(r"MemAvailable:\s*(\d+) kB", f.read())[1]) << 10)
    text = run(["vm_stat"])
    pages = re.findall(r"(?m)^Pages (?:free|inactive|purgeable|speculative):\s+(\d+)", text)
    return dict(out, available_bytes=sum(map(int, pages)) * int(re.search(r"page size of (\d+)", text)[1]))


def probe_link(peers, enough_ms, tries=7):
    """Each peer IP's fastest of up to `tries` TCP handshakes to port 22 (refused is an answer too); two
    under `enough_ms` end it (each accepted one starts a peer sshd process)."""
    out = {}
    for ip in peers:
        times, err = [], None
        while len(times) < tries and not (len(times) >= 2 and min(times) * 1000 < enough_ms):
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
                s.settimeout(1.0)
                t0 = time.perf_counter()
                try:
                    s.connect((ip, 22))
                except ConnectionRefusedError:
                    pass
                except OSError as e:
                    err = f"{type(e).__name__}: {e}"
                    break
                times.append(time.perf_counter() - t0)
        out[ip] = {"rtt_ms": round(min(times) * 1000, 3) if times else None, "tries": len(times),
                   "error": None if times else err}
    return out


def probe_ranks(pattern):
    """[pid, launch id] of each process matching the launch gate's pattern; where one kernel holds several
    hosts (Linux network namespaces: containers, the test fabric), only this host's."""
    out, own = [], os.stat("/proc/self/ns/net").st_ino if os.path.exists("/proc/self/ns/net") else None
    for ln in run(["ps", "axww", "-o", "pid=,command="]).splitlines():
        pid, _, cmd = ln.strip().partition(" ")
        with contextlib.suppress(OSError):  # gone since ps, or not ours to see
            if re.search(pattern, cmd) and (own is None or os.stat(f"/proc/{pid}/ns/net").st_ino == own):
                out.append([int(pid), (re.search(r"--launch-id (\S+)", cmd) or [None, "-"])[1]])
    return out


def run(argv):
    import subprocess  # macOS and the launch gate only: not imported on the common path
    return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=8).stdout


def guard(fn, *args):
    """fn(*args), or {"error": ...}: one failing fact must not hide the others."""
    try:
        return fn(*args)
    except BaseException as e:  # ImportError, a crash in a broken wheel, a missing tool, anything
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main(argv):
    t0, p = time.monotonic(), json.loads(argv[1]) if len(argv) > 1 else {}
    root, parts = p.get("remote_root") or "/", p.get("parts") or ["runtime", "content"]
    python = p.get("python") or sys.executable
    from packaging.markers import default_environment  # the lock's pins depend on it; transformers needs it
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    res = {"probe_version": 5, "system": platform.system(), "marker_env": default_environment(), "env": env,
           "python": {"requested": python, "realpath": os.path.realpath(python),
                      "version": platform.python_version()}, "disk": guard(probe_root, root)}
    if "runtime" in parts:
        res.update(packages=guard(installed_dists), mlx=guard(probe_mlx), memory=guard(probe_memory),
                   link=guard(probe_link, p.get("peers", []), float(p.get("link_enough_ms", 0.5))))
        if sys.platform == "darwin":
            res["macos"] = {k: guard(run, cmd.split()) for k, cmd in MACOS_TOOLS.items() if p.get("rdma") or
                            k != "ibv_devices"}
    if p.get("ranks"):
        res["ranks"] = guard(probe_ranks, p["ranks"])
    if "content" in parts:  # {name: [its folder here, on this host, parts, hashed]}: the model with --deep
        for name, (_, base, names, hashed) in p.get("content", {}).items():
            res[name] = guard(probe_files, base, names, hashed)
    res["seconds"] = round(time.monotonic() - t0, 3)
    sys.stdout.write(json.dumps(res, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
