"""The host side of check-parity: one self-contained probe, printed as one JSON object.

bin/check_parity.py sends this file's source to `<python> -c <source> '<params json>'` on every host
over one ssh call (lib/parity.py's PROBE_SH runs it with PYTHON, and again with the host's
python3 when PYTHON is missing or crashes, so disk, code and link facts are still reported).
It must stay standard-library only and run on any Python >= 3.8 (macOS's /usr/bin/python3
is 3.9), because it runs before the host's venv is known to be good. It only reads: nothing
on the host is changed.

Local use (what the orchestrator runs for 127.0.0.1 hosts, and a debugging aid):
    python lib/parity_probe.py '{"remote_root": "/path/to/repo", "python": "/path/to/python"}'
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import sys
import time

PROBE_VERSION = 1
CHUNK = 1 << 20
CMD_TIMEOUT = 8  # seconds, for each macOS tool


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def iter_files(root, parts):
    """Same rule as lib.hashing.iter_files: sorted relative paths, hidden files and
    __pycache__ skipped. Kept in step with it by tests/test_check_parity.py."""
    out = set()
    for part in parts:
        p = os.path.join(root, part)
        if os.path.isfile(p):
            out.add(part)
        elif os.path.isdir(p):
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
                for name in filenames:
                    if name.startswith("."):
                        continue
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, root).replace(os.sep, "/")
                    if os.path.isfile(full):
                        out.add(rel)
    return sorted(out)


def marker_env():
    """PEP 508 marker variables, as packaging.markers.default_environment() computes them."""
    impl = sys.implementation
    iver = f"{impl.version.major}.{impl.version.minor}.{impl.version.micro}"
    if impl.version.releaselevel != "final":
        iver += impl.version.releaselevel[0] + str(impl.version.serial)
    return {
        "implementation_name": impl.name,
        "implementation_version": iver,
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def probe_python(params, fallback, why=""):
    want = params.get("python") or ""
    out = {
        "why": why[-600:],
        "requested": want,
        "exists": bool(want) and os.path.exists(want),
        "executable": os.path.exists(want) and os.access(want, os.X_OK),
        "realpath": os.path.realpath(want) if want and os.path.exists(want) else None,
        "running": sys.executable,
        "running_realpath": os.path.realpath(sys.executable),
        "fallback": fallback,
        "version": platform.python_version(),
        "prefix": sys.prefix,
        "base_prefix": getattr(sys, "base_prefix", sys.prefix),
    }
    return out


def dist_version(folder, fallback):
    """The Version header of a dist-info's METADATA (an egg-info's PKG-INFO): what pip and
    importlib.metadata report, even when the folder name says otherwise."""
    for meta in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(folder, meta), encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
                    if not line.strip():
                        break
        except OSError:
            continue
    return fallback


def installed_dists():
    """{normalized name: version} of every distribution on sys.path, first one wins (the one
    `import` and importlib.metadata see). Read straight from the *.dist-info / *.egg-info
    folders: importing importlib.metadata alone costs ~0.1 s, a tenth of the time budget."""
    dists = {}
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for n in names:
            if n.endswith(".dist-info"):
                stem = n[: -len(".dist-info")]
            elif n.endswith(".egg-info"):
                stem = n[: -len(".egg-info")]
            else:
                continue
            parts = stem.split("-")
            if len(parts) < 2:
                continue
            name = re.sub(r"[-_.]+", "-", parts[0]).lower()
            if name not in dists:
                dists[name] = dist_version(os.path.join(entry or ".", n), parts[1])
    return dists


def probe_packages(names):
    dists = installed_dists()
    wanted = {}
    for name in names:
        wanted[name] = dists.get(re.sub(r"[-_.]+", "-", name).lower())
    return {"wanted": wanted, "all": dists}


def probe_mlx():
    """Import mlx.core from the interpreter under test and compute one small op."""
    t0 = time.monotonic()
    try:
        import mlx.core as mx

        a = mx.array([1.0, 2.0, 3.0])
        value = (a * 2).sum().item()
        return {
            "ok": abs(value - 12.0) < 1e-6,
            "version": getattr(mx, "__version__", None),
            "file": getattr(mx, "__file__", None),
            "result": value,
            "device": str(mx.default_device()),
            "seconds": round(time.monotonic() - t0, 3),
        }
    except BaseException as e:  # ImportError, a crash in a broken wheel, anything
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def probe_code(root, parts):
    if not os.path.isdir(root):
        return {"root_exists": False, "hashes": {}}
    hashes = {}
    for rel in iter_files(root, parts):
        try:
            hashes[rel] = sha256_file(os.path.join(root, rel))
        except OSError as e:
            hashes[rel] = "error: " + str(e)[:100]
    return {"root_exists": True, "hashes": hashes}


def probe_model(path, deep):
    """{rel: [size, mtime, sha256 or None]} for every file of the model folder."""
    if not path:
        return None
    if not os.path.isdir(path):
        return {"exists": False, "files": {}}
    files = {}
    for rel in iter_files(path, ["."]):
        rel = rel[2:] if rel.startswith("./") else rel
        full = os.path.join(path, rel)
        st = os.stat(full)
        files[rel] = [st.st_size, int(st.st_mtime), sha256_file(full) if deep else None]
    return {"exists": True, "files": files}


def probe_dataset(ddir):
    """The host's manifest (sha256 of its bytes) and whether each split file matches it."""
    if not ddir:
        return None
    mpath = os.path.join(ddir, "manifest.json")
    if not os.path.isfile(mpath):
        return {"exists": os.path.isdir(ddir), "manifest_sha256": None}
    out = {"exists": True, "manifest_sha256": sha256_file(mpath), "bad": {}}
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest.get("files") or {}
    except (OSError, ValueError, AttributeError) as e:
        out["error"] = "manifest.json unreadable: " + str(e)[:200]
        return out
    for name in sorted(files):
        meta = files[name] if isinstance(files[name], dict) else {}
        full = os.path.join(ddir, name)
        if not os.path.isfile(full):
            out["bad"][name] = "missing"
            continue
        size = os.path.getsize(full)
        if "bytes" in meta and meta["bytes"] != size:
            out["bad"][name] = f"{size} bytes, manifest says {meta['bytes']}"
            continue
        got = sha256_file(full)
        if meta.get("sha256") != got:
            out["bad"][name] = f"sha256 {got[:12]}, manifest says {str(meta.get('sha256'))[:12]}"
    out["checked"] = len(files)
    return out


def probe_disk(root):
    path = root
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or "/")
    except OSError as e:
        return {"error": str(e)}
    return {"path": path, "free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize}


def probe_memory():
    if sys.platform.startswith("linux"):
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    info[k] = int(v.split()[0]) * 1024
        except (OSError, ValueError) as e:
            return {"error": str(e)}
        return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable")}
    if sys.platform == "darwin":
        out = {}
        try:
            out["total_bytes"] = int(run(["sysctl", "-n", "hw.memsize"]).strip())
            vm = run(["vm_stat"])
            page = 16384
            pages = {}
            for line in vm.splitlines():
                if "page size of" in line:
                    page = int(line.split("page size of")[1].split()[0])
                k, _, v = line.partition(":")
                v = v.strip().rstrip(".")
                if v.isdigit():
                    pages[k.strip()] = int(v)
            # What macOS can hand out without swapping: free + inactive + purgeable + speculative.
            avail = sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages purgeable",
                                                   "Pages speculative"))
            out["available_bytes"] = avail * page
        except Exception as e:  # OSError, ValueError, subprocess errors
            out["error"] = str(e)[:200]
        return out
    return {"error": "unsupported platform " + sys.platform}


def probe_ips(ips):
    """An address is this host's exactly when a socket can bind to it."""
    out = {}
    for ip in ips:
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.bind((ip, 0))
            out[ip] = True
        except OSError:
            out[ip] = False
        finally:
            s.close()
    return out


def probe_link(peers, port, timeout, tries=7, enough_ms=None):
    """Round trip to each peer IP as the TCP handshake time to `port`, the minimum of up to
    `tries`: the handshake is answered by the peer's kernel, so the minimum is the wire's round
    trip and the rest is this host's scheduling (a busy host wakes the prober late). A refused
    connection still answered, so it still measures the round trip. Once two handshakes are
    in and the best is under `enough_ms` (far below any threshold), the rest are skipped: each
    accepted connection makes the peer's sshd start a process."""
    out = {}
    for ip in peers:
        best, err, n = None, None, 0
        for _ in range(tries):
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(timeout)
            t0 = time.perf_counter()
            try:
                s.connect((ip, port))
                dt = time.perf_counter() - t0
            except ConnectionRefusedError:
                dt = time.perf_counter() - t0
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
                dt = None
            finally:
                s.close()
            if dt is None:
                break  # a dead peer costs one timeout, not `tries` of them
            best = dt if best is None else min(best, dt)
            n += 1
            if enough_ms is not None and n >= 2 and best * 1000 < enough_ms:
                break
        out[ip] = {"rtt_ms": None if best is None else round(best * 1000, 3), "tries": n,
                   "error": None if best is not None else err}
    return out


def run(argv):
    import subprocess  # macOS only: not imported on the common path

    return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CMD_TIMEOUT).stdout


def probe_macos(want_rdma):
    """Raw output of the macOS network tools; lib/parity.py parses it on the orchestrator."""
    out = {}
    cmds = {
        "networksetup": ["networksetup", "-listallhardwareports"],
        "ifconfig": ["ifconfig"],
        "system_profiler": ["system_profiler", "SPThunderboltDataType", "-json"],
    }
    if want_rdma:
        cmds["ibv_devices"] = ["ibv_devices"]
    for key, argv in cmds.items():
        try:
            out[key] = run(argv)
        except Exception as e:  # OSError, subprocess errors (a missing tool, a timeout)
            out[key] = None
            out[key + "_error"] = str(e)[:200]
    return out


def main(argv):
    t0 = time.monotonic()
    params = json.loads(argv[1]) if len(argv) > 1 else {}
    fallback = len(argv) > 2 and argv[2] == "--fallback"
    why = argv[3] if fallback and len(argv) > 3 else ""
    root = params.get("remote_root") or ""
    res = {"probe_version": PROBE_VERSION}

    def guard(key, fn, *a):
        try:
            res[key] = fn(*a)
        except Exception as e:  # one failing fact must not hide the others
            res[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    res["host"] = {"hostname": socket.gethostname(), "system": platform.system(),
                   "machine": platform.machine(), "pid": os.getpid()}
    guard("python", probe_python, params, fallback, why)
    res["marker_env"] = marker_env()
    if not fallback:
        guard("packages", probe_packages, params.get("packages", []))
        guard("mlx", probe_mlx)
    guard("code", probe_code, root, params.get("code_parts", []))
    guard("model", probe_model, params.get("model_path"), bool(params.get("deep")))
    guard("dataset", probe_dataset, params.get("dataset_path"))
    guard("disk", probe_disk, root)
    guard("memory", probe_memory)
    guard("ips", probe_ips, params.get("own_ips", []))
    guard("link", probe_link, params.get("peers", []), int(params.get("link_port", 22)),
          float(params.get("link_timeout", 1.0)), 7, params.get("link_enough_ms"))
    if sys.platform == "darwin":
        guard("macos", probe_macos, bool(params.get("rdma")))
    res["seconds"] = round(time.monotonic() - t0, 3)
    sys.stdout.write(json.dumps(res, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
