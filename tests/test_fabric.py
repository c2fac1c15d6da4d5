"""The multi-host test fabric (tests/fabric.py) and the first integration tests across it:
mlx.launch's ring backend over ssh to 2 and 3 fabric hosts, each rank on its own address.

Tests that use the `fabric` fixture share the session's 3-host fabric; the up/down tests
build their own instances (own dir, link prefix and subnet) through `make fabric-up`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, make, require_fabric, run
from support import path_without

pytestmark = pytest.mark.fabric

MLX_LAUNCH = Path(PY).parent / "mlx.launch"

# Each rank reports who and where it is; the address is the source address this host uses
# toward the orchestrator (the bridge), i.e. its own eth0 address in its own namespace.
RANK_SCRIPT = """\
import json, os, socket, sys
import mlx.core as mx

group = mx.distributed.init(backend="ring", strict=True)
total = mx.distributed.all_sum(mx.array([float(group.rank() + 1)]), group=group)
mx.eval(total)
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((sys.argv[1], 9))
print("RANK " + json.dumps({
    "rank": group.rank(), "size": group.size(), "sum": total.item(),
    "addr": probe.getsockname()[0], "hostname": socket.gethostname(),
    "netns": os.readlink("/proc/self/ns/net"), "cwd": os.getcwd(),
    "script_here": os.path.exists("fabric_rank_report.py"),
}), flush=True)
"""


def ssh_ok(fab, host, timeout=30):
    return fab.ssh(host, ["true"], timeout=timeout).returncode == 0


# ---- where a fabric cannot exist ---------------------------------------------------------


def test_unavailable_says_why_and_tests_skip_or_fail_under_require_fabric(monkeypatch):
    import fabric as fabric_mod

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in fabric_mod.unavailable()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert fabric_mod.unavailable() == "`ip` not found: apt-get install iproute2"
    monkeypatch.setattr(fabric_mod, "unavailable", lambda: "no sshd at /usr/sbin/sshd: apt-get install openssh-server")
    monkeypatch.delenv("REQUIRE_FABRIC", raising=False)
    with pytest.raises(pytest.skip.Exception, match="fabric unavailable: no sshd"):
        require_fabric()
    monkeypatch.setenv("REQUIRE_FABRIC", "1")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_FABRIC=1 but .* no sshd"):
        require_fabric()


def test_make_test_without_the_fabric_says_what_it_skipped_and_why(tmp_path):
    """Issue #25: without the fabric's tools, the summary says how many fabric tests it skipped and why."""
    env = {k: v for k, v in os.environ.items() if k != "REQUIRE_FABRIC"} | {"PATH": path_without("ip", tmp_path / "bin")}
    p = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fabric.py",
             "-k", "all_sum_across_two_hosts or each_host_has_its_own_address"], env=env, check=False)
    tail = p.stdout[p.stdout.rfind("fabric tests skipped") - 40:]
    assert p.returncode == 0 and re.search(r"= 2 fabric tests skipped =", p.stdout), p.stdout[-3000:]
    assert "`ip` not found: apt-get install iproute2" in tail and "README.md#requirements" in tail, tail


# ---- integration: mlx.launch across fabric hosts ----------------------------------------


def launch_all_sum(fab, names, tmp_path):
    """Put the rank script on each host's private REMOTE_ROOT with rsync through the fabric's ssh,
    then run it with mlx.launch --hostfile; returns ({rank: report}, seconds)."""
    script = tmp_path / "fabric_rank_report.py"
    script.write_text(RANK_SCRIPT)
    env = fab.env()
    for name in names:
        run(["rsync", "-a", str(script), f"{name}:{fab.remote_root}/"], env=env)
    hostfile = fab.hostfile(names)
    t0 = time.monotonic()
    p = run([str(MLX_LAUNCH), "--hostfile", str(hostfile), "--backend", "ring", "--python", fab.python,
             "--cwd", fab.remote_root, "--", "fabric_rank_report.py", fab.bridge_ip],
            env=env, stdin=subprocess.DEVNULL, timeout=180, check=False)
    seconds = time.monotonic() - t0
    assert p.returncode == 0, f"mlx.launch exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    reports = {}
    for line in p.stdout.replace("\r", "").splitlines():
        if line.startswith("RANK "):
            r = json.loads(line[5:])
            reports[r["rank"]] = r
    assert sorted(reports) == list(range(len(names))), p.stdout + p.stderr
    return reports, seconds


def check_reports(fab, names, reports):
    n = len(names)
    for rank, r in reports.items():
        assert r["size"] == n
        assert r["sum"] == n * (n + 1) / 2, r  # 1 + 2 + ... + n, summed across the hosts
        assert r["addr"] == fab.ip(names[rank]), r  # rank i runs on the i-th host of the hostfile
        assert r["hostname"] == names[rank], r
        assert r["cwd"] == fab.remote_root and r["script_here"], r
    assert len({r["addr"] for r in reports.values()}) == n
    assert len({r["netns"] for r in reports.values()}) == n
    assert all(r["netns"] != os.readlink("/proc/self/ns/net") for r in reports.values())


@pytest.mark.slow
def test_mlx_launch_all_sum_across_two_hosts(fabric, tmp_path):
    names = ["fab1", "fab2"]
    reports, seconds = launch_all_sum(fabric, names, tmp_path)
    check_reports(fabric, names, reports)
    print(f"launch ranks 2 seconds {seconds:.2f}")


@pytest.mark.slow
def test_mlx_launch_all_sum_across_three_hosts(fabric, tmp_path):
    names = fabric.hosts[:3]
    reports, seconds = launch_all_sum(fabric, names, tmp_path)
    check_reports(fabric, names, reports)
    print(f"launch ranks 3 seconds {seconds:.2f}")


# ---- the hosts are separate machines --------------------------------------------------


def test_each_host_has_its_own_address_name_route_and_remote_root(fabric):
    for name in fabric.hosts:
        p = fabric.ssh(name, "cat /proc/sys/kernel/hostname; ip -4 -o addr show dev eth0; ip -4 route",
                       check=True)
        lines = p.stdout.splitlines()
        assert lines[0] == name
        assert f"inet {fabric.ip(name)}/" in lines[1]
        routes = [ln for ln in lines[2:] if ln.strip()]
        assert len(routes) == 1 and routes[0].startswith(f"{fabric.state['subnet']} dev eth0"), routes
    marker = f"only-on-fab1-{os.getpid()}"
    fabric.ssh("fab1", ["sh", "-c", 'echo fab1 > "$1"', "sh", f"{fabric.remote_root}/{marker}"], check=True)
    assert fabric.ssh("fab1", ["cat", f"{fabric.remote_root}/{marker}"]).stdout == "fab1\n"
    for other in fabric.hosts[1:]:
        p = fabric.ssh(other, ["test", "-e", f"{fabric.remote_root}/{marker}"])
        assert p.returncode == 1, f"{marker} written on fab1 is visible on {other}"
    assert not (Path(fabric.remote_root) / marker).exists(), "it leaked to the orchestrator's REMOTE_ROOT"
    assert (fabric.backing_dir("fab1") / marker).read_text() == "fab1\n"


def test_each_host_runs_its_own_empty_shell_profile(fabric):
    """ssh commands on a host do not run this machine's ~/.bashrc (a Mac's shell would not):
    the host's own, empty one is mounted over it inside the host only."""


    rc = Path(pwd.getpwuid(0).pw_dir) / ".bashrc"
    if not rc.is_file():
        pytest.skip("this machine has no ~/.bashrc for root")
    mine = rc.read_bytes()
    for name in fabric.hosts:
        p = fabric.ssh(name, ["cat", str(rc)], check=True)
        assert p.stdout == f"# {name}'s own ~/.bashrc (thunder-fabric): empty, as on a fresh host\n"
    assert rc.read_bytes() == mine, "the machine's own ~/.bashrc changed"


def test_env_sh_targets_the_fabric_and_leaves_home_ssh_alone(fabric, tmp_path):
    home_ssh = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"

    def snapshot():
        if not home_ssh.exists():
            return None
        return sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in home_ssh.iterdir())

    before = snapshot()
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(100_000))
    env_sh = fabric.dir / "env.sh"
    script = (
        '. "$1" && test "$(command -v ssh)" = "$FABRIC_DIR/bin/ssh" '
        '&& ssh fab2 cat /proc/sys/kernel/hostname '
        '&& rsync -a "$2" "fab3:$REMOTE_ROOT/" '
        '&& ssh fab3 sha256sum "$REMOTE_ROOT/payload.bin" '
        '&& printf "%s\\n" "$HOSTFILE" "$SSH_CONFIG" "$PYTHON"'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    p = run(["bash", "-c", script, "bash", str(env_sh), str(payload)], env=env)
    lines = p.stdout.splitlines()
    assert lines[0] == "fab2"
    assert lines[1].split()[0] == hashlib.sha256(payload.read_bytes()).hexdigest()
    assert lines[2:] == [str(fabric.hostfile_path), str(fabric.ssh_config), fabric.python]
    hf = json.loads(fabric.hostfile_path.read_text())
    assert hf["backend"] == "ring" and [h["ssh"] for h in hf["hosts"]] == fabric.hosts
    assert [h["ips"] for h in hf["hosts"]] == [[fabric.ip(n)] for n in fabric.hosts]
    cfg = fabric.ssh_config.read_text()
    assert "StrictHostKeyChecking yes" in cfg and "BatchMode yes" in cfg
    assert snapshot() == before, "~/.ssh changed"


def test_host_key_checking_is_strict(fabric, tmp_path):
    """A host whose key is not the recorded one is refused, never silently accepted."""
    known = fabric.dir / "known_hosts"
    original = known.read_text()
    lines = original.splitlines()
    names = [ln.split(" ", 1)[0] for ln in lines]
    keys = [ln.split(" ", 1)[1] for ln in lines]
    lines[:2] = [f"{names[0]} {keys[1]}", f"{names[1]} {keys[0]}"]  # fab1 and fab2 swap keys
    try:
        known.write_text("\n".join(lines) + "\n")
        p = fabric.ssh("fab1", ["true"])
        assert p.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in p.stderr, p.stderr
    finally:
        known.write_text(original)
    assert ssh_ok(fabric, "fab1")


# ---- fault helpers, for real -------------------------------------------------------------


def test_sshd_stop_refuses_new_logins_keeps_sessions_and_start_restores(fabric_faults):
    fab = fabric_faults
    session = subprocess.Popen(fab.ssh_argv("fab2", "sleep 1.5; echo session-survived"), env=fab.env(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)  # let it log in
    fab.stop_sshd("fab2")
    p = fab.ssh("fab2", ["true"])
    assert p.returncode == 255 and "Connection refused" in p.stderr, p.stderr
    out, err = session.communicate(timeout=20)
    assert session.returncode == 0 and out.strip() == "session-survived", err
    assert ssh_ok(fab, "fab1")  # the others are untouched
    fab.start_sshd("fab2")
    assert ssh_ok(fab, "fab2")


def test_link_cut_partitions_a_host_and_restore_heals_it(fabric_faults):
    fab = fabric_faults
    probe = f"timeout 2 bash -c '</dev/tcp/{fab.ip('fab3')}/22' && echo reachable || echo unreachable"
    assert fab.ssh("fab1", probe, check=True).stdout.strip() == "reachable"
    fab.cut_link("fab3")
    t0 = time.monotonic()
    p = fab.ssh("fab3", ["true"])
    assert p.returncode == 255 and time.monotonic() - t0 < 10, p.stderr  # bounded by ConnectTimeout 5
    assert fab.ssh("fab1", probe, check=True).stdout.strip() == "unreachable"  # host to host too
    fab.restore_link("fab3")
    assert ssh_ok(fab, "fab3")
    assert fab.ssh("fab1", probe, check=True).stdout.strip() == "reachable"


SPIN = ("python3 -c 'import time\nt, c = time.monotonic(), time.process_time()\nwhile time.monotonic() - t < 1.5: pass"
        "\nprint(round((time.process_time() - c) / 1.5, 3))'; cat /proc/self/cgroup")


def test_cpu_slow_holds_a_hosts_new_processes_to_their_quota_and_restore_frees_them(fabric_faults):
    """#29's slower Mac: fab3 at 0.3 of a core. The quota is a ceiling, whatever else loads the machine,
    so a 1.5 s spin there gets at most about 0.3 s of CPU; after the restore its processes are back in
    the root cgroup."""
    import fabric as fabric_mod

    fab = fabric_faults
    fab.slow_cpu("fab3", 0.3)
    slow = fab.ssh("fab3", SPIN, check=True).stdout.split("\n", 1)
    assert float(slow[0]) <= 0.4 and "thfab-" in slow[1], slow
    assert "thfab-" not in fab.ssh("fab2", SPIN, check=True).stdout  # the other hosts as they were
    assert fab.state["faults"]["fab3"]["cpu"]["quota"] == 0.3
    fab.restore_cpu("fab3")
    assert "thfab-" not in fab.ssh("fab3", SPIN, check=True).stdout and not fab.state["faults"]["fab3"]
    with pytest.raises(fabric_mod.FabricError, match="cpu-slow --quota 9: a share of a core from 0.05 to 4"):
        fab.slow_cpu("fab3", 9)


def test_freeze_thaw_and_kill_the_processes_of_a_run(fabric_faults):
    fab = fabric_faults
    # the python itself, not the remote shell that may wrap it (bash -c does not always exec)
    tag = f"^{re.escape(fab.python)} .*fabric-run-{os.getpid()}"
    client = subprocess.Popen(fab.ssh_argv("fab2", [fab.python, "-c", "import time; time.sleep(120)", f"fabric-run-{os.getpid()}"]),
                              env=fab.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        found = []
        deadline = time.monotonic() + 15
        while not found and time.monotonic() < deadline:
            found = fab.procs("fab2", tag)
            time.sleep(0.1)
        assert len(found) == 1, found
        pid = found[0]["pid"]
        assert fab.procs("fab1", tag) == []  # it is fab2's, not fab1's
        assert fab.freeze("fab2", tag) == [pid]
        assert fab.procs("fab2", tag)[0]["state"] == "T"
        assert fab.thaw("fab2") == [pid]
        assert fab.procs("fab2", tag)[0]["state"] in "SR"
        assert fab.kill("fab2", tag) == [pid]
        client.wait(timeout=15)
        assert client.returncode != 0
        assert fab.procs("fab2", tag) == []
        with pytest.raises(Exception, match="no process on fab2 matches"):
            fab.kill("fab2", tag)
    finally:
        client.kill()
        client.wait()


def test_small_disk_is_a_tmpfs_of_that_size_and_restore_brings_the_files_back(fabric_faults):
    fab = fabric_faults
    rr = fab.remote_root
    fab.ssh("fab1", ["sh", "-c", 'echo kept > "$1"', "sh", f"{rr}/kept.txt"], check=True)
    fab.small_disk("fab1", "8M")
    df = fab.ssh("fab1", ["df", "-k", "--output=size,source", rr], check=True).stdout.split()
    assert df[-2:] == ["8192", "thunder-fabric-disk"], df
    full = fab.ssh("fab1", ["dd", "if=/dev/zero", f"of={rr}/big", "bs=1M", "count=16"])
    assert full.returncode != 0 and "No space left" in full.stderr, full.stderr
    other = fab.ssh("fab2", ["df", "-k", "--output=size", rr], check=True).stdout.split()
    assert other[-1] != "8192"  # only fab1 got the small disk
    fab.restore_disk("fab1")
    assert fab.ssh("fab1", ["cat", f"{rr}/kept.txt"], check=True).stdout == "kept\n"
    assert fab.ssh("fab1", ["test", "-e", f"{rr}/big"]).returncode == 1


VERSIONS = ("import importlib.metadata as m, mlx, mlx.core as mx; "
            "print(getattr(mlx, '__version__', '-'), mx.__version__, m.version('mlx'), "
            "mx.distributed.is_available() and int(mx.array([1, 2]).sum().item()))")


def test_shadowed_mlx_version_on_one_host_and_restore(fabric_faults):
    fab = fabric_faults
    real = fab.ssh("fab1", [fab.python, "-c", VERSIONS], check=True).stdout.split()
    assert real[0] == "-" and real[1] == real[2]
    fab.shadow_package("fab2", "mlx", "0.0.1")
    shadowed = fab.ssh("fab2", [fab.python, "-c", VERSIONS], check=True).stdout.split()
    assert shadowed == ["0.0.1", "0.0.1", "0.0.1", "3"]  # reports the other version, still computes
    assert fab.ssh("fab1", [fab.python, "-c", VERSIONS], check=True).stdout.split() == real
    # the orchestrator's venv itself is untouched
    assert run([fab.python, "-c", VERSIONS]).stdout.split() == real
    fab.restore_python("fab2")
    assert fab.ssh("fab2", [fab.python, "-c", VERSIONS], check=True).stdout.split() == real


def test_hidden_venv_on_one_host_and_restore(fabric_faults):
    fab = fabric_faults
    fab.hide_python("fab3")
    p = fab.ssh("fab3", [fab.python, "-c", "print(1)"])
    assert p.returncode == 127 and "No such file" in p.stderr, p.stderr
    assert fab.ssh("fab2", [fab.python, "-c", "print(1)"], check=True).stdout == "1\n"
    fab.restore_python("fab3")
    assert fab.ssh("fab3", [fab.python, "-c", "print(1)"], check=True).stdout == "1\n"


def test_status_and_fault_cli(fabric_faults):
    fab = fabric_faults
    env = dict(os.environ, FABRIC_DIR=str(fab.dir))
    st = json.loads(run([PY, "tests/fabric.py", "status", "--json"], env=env).stdout)
    assert st["healthy"] and [h["name"] for h in st["hosts"]] == fab.hosts
    run([PY, "tests/fabric.py", "fault", "link-cut", "fab2"], env=env)
    p = run([PY, "tests/fabric.py", "status"], env=env, check=False)
    assert p.returncode == 1 and "host fab2" in p.stdout and "link down faults link=cut" in p.stdout, p.stdout
    p = run([PY, "tests/fabric.py", "fault", "disk", "fab9"], env=env, check=False)
    assert p.returncode == 2 and "no fabric host 'fab9'" in p.stderr and "see tests/README.md#" in p.stderr
    run([PY, "tests/fabric.py", "fault", "restore-all"], env=env)
    assert run([PY, "tests/fabric.py", "status"], env=env).returncode == 0
    assert ssh_ok(fab, "fab2")


# ---- up and down: own instances, through make ------------------------------------------

_instances = itertools.count()


@pytest.fixture
def instance():
    """Settings for a private fabric instance (dir, link prefix, subnet); downed afterwards."""
    require_fabric()
    pid = os.getpid()
    d = ROOT / "runs" / f"fabric-selftest-{pid}-{next(_instances)}"
    env = {"FABRIC_DIR": str(d), "FABRIC_PREFIX": f"tx{pid}", "FABRIC_SUBNET": "auto",
           "FABRIC_OWNER_PID": str(pid)}
    yield env
    run([PY, "tests/fabric.py", "down"], env=dict(os.environ, **env), check=False)


def fabric_state(env) -> dict:
    return json.loads((Path(env["FABRIC_DIR"]) / "state.json").read_text())


def links() -> dict[str, str]:
    """{`ip -o link` line without counters: alias} for every link in the root namespace."""
    out = {}
    for line in run(["ip", "-o", "link"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        try:
            alias = Path(f"/sys/class/net/{name}/ifalias").read_text().strip()
        except OSError:
            alias = ""
        out[line] = alias
    return out


def processes() -> set[tuple[int, int, str]]:
    """(pid, start time, command line) of every user-space process (kernel threads have no cmdline)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        if cmd and rest[0] != "Z":
            out.add((int(name), int(rest[19]), cmd.replace(b"\0", b" ").decode(errors="replace")))
    return out


def beside(pid: int) -> bool:
    """A process of the tests running beside this session (tests/conftest.py): it, or a process it came
    from (a fabric's daemons are re-parented to init, and keep their environment), has THUNDER_TESTS_BESIDE."""
    while pid > 1:
        try:
            if b"\0THUNDER_TESTS_BESIDE=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                return True
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return False


def netns_of(pid) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def test_fabric_up_3_then_down_leaves_the_machine_as_it_was(instance):
    env = dict(os.environ, **instance)
    tag = f"thunder-fabric {instance['FABRIC_DIR']}"
    # sentinels that must survive: one in the root namespace, one in a foreign namespace
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    sentinels = [subprocess.Popen(["sleep", "300"], **quiet),
                 subprocess.Popen(["unshare", "--net", "sleep", "300"], **quiet)]
    try:
        time.sleep(0.1)
        others = lambda d: {k: v for k, v in d.items() if not (v.startswith("thunder-fabric ") and v != tag)}  # noqa: E731
        netns_before = run(["ip", "netns", "list"]).stdout
        links_before = others(links())
        mounts_before = Path("/proc/self/mountinfo").read_text()
        procs_before = {p for p in processes() if not beside(p[0])}  # the machine's, less the tests beside

        t0 = time.monotonic()
        make("fabric-up", "HOSTS=3", env=env)
        up_seconds = time.monotonic() - t0
        st = fabric_state(instance)
        ours = [h[k]["pid"] for h in st["hosts"] for k in ("anchor", "sshd")]
        spaces = {netns_of(h["anchor"]["pid"]) for h in st["hosts"]}
        assert len(spaces) == 3 and None not in spaces
        assert run([PY, "tests/fabric.py", "status"], env=env).returncode == 0
        assert mounts_before == Path("/proc/self/mountinfo").read_text()  # nothing mounted in the root ns

        t0 = time.monotonic()
        make("fabric-down", env=env)
        down_seconds = time.monotonic() - t0
        print(f"fabric-up HOSTS=3 seconds {up_seconds:.2f}; fabric-down seconds {down_seconds:.2f}")
        assert up_seconds < 5, f"make fabric-up HOSTS=3 took {up_seconds:.2f} s (limit 5 s)"

        assert run(["ip", "netns", "list"]).stdout == netns_before
        assert others(links()) == links_before
        assert Path("/proc/self/mountinfo").read_text() == mounts_before
        assert not Path(instance["FABRIC_DIR"]).exists()
        # processes: none of ours, nothing in our namespaces, nothing mentioning our dir; the sentinels live
        deadline = time.monotonic() + 10
        while True:
            now = {p for p in processes() if not beside(p[0])}
            leftover = [p for p in now if p[0] in ours or netns_of(p[0]) in spaces
                        or instance["FABRIC_DIR"] in p[2]]
            strict = os.environ.get("REQUIRE_FABRIC") == "1" and now != procs_before
            if not leftover and not strict:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"left behind: {leftover}; new: {sorted(now - procs_before)}; "
                                     f"gone: {sorted(procs_before - now)}")
            time.sleep(0.2)
        assert all(s.poll() is None for s in sentinels)
    finally:
        for s in sentinels:
            s.kill()
            s.wait()


def test_up_is_idempotent_and_recovers_from_a_crash(instance):
    env = dict(os.environ, **instance)
    first = make("fabric-up", "HOSTS=2", env=env).stdout
    assert "reused 0" in first
    st1 = fabric_state(instance)
    again = make("fabric-up", "HOSTS=2", env=env).stdout
    assert "reused 1" in again
    st2 = fabric_state(instance)
    assert [h["sshd"] for h in st2["hosts"]] == [h["sshd"] for h in st1["hosts"]]

    # a crash: fab1's anchor and sshd SIGKILLed, fab2's link downed behind the script's back,
    # a stray process left inside fab2
    fab = require_fabric().Fabric(instance["FABRIC_DIR"])
    stray = subprocess.Popen(fab.ssh_argv("fab2", ["sleep", "300"]), env=fab.env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not fab.procs("fab2", "^sleep 300") and time.monotonic() < deadline:
            time.sleep(0.1)
        stray_pid = fab.procs("fab2", "^sleep 300")[0]["pid"]
        for key in ("anchor", "sshd"):
            os.kill(st2["hosts"][0][key]["pid"], signal.SIGKILL)
        run(["ip", "link", "set", "dev", st2["hosts"][1]["veth"], "down"])
        p = run([PY, "tests/fabric.py", "status"], env=env, check=False)
        assert p.returncode == 1

        rebuilt = make("fabric-up", "HOSTS=2", env=env).stdout
        assert "fabric rebuild" in rebuilt and "reused 0" in rebuilt
        assert not Path(f"/proc/{stray_pid}").exists() or Path(f"/proc/{stray_pid}/stat").read_text().split()[2] == "Z"
        fab = require_fabric().Fabric(instance["FABRIC_DIR"])
        assert all(ssh_ok(fab, n) for n in fab.hosts)
        assert run([PY, "tests/fabric.py", "status"], env=env).returncode == 0
    finally:
        stray.kill()
        stray.wait()
    make("fabric-down", env=env)
    assert not Path(instance["FABRIC_DIR"]).exists()


def test_down_and_up_leave_what_is_not_theirs_alone(instance):
    env = dict(os.environ, **instance)
    d = Path(instance["FABRIC_DIR"])
    prefix = instance["FABRIC_PREFIX"]
    foreign = f"{prefix}-fab1"
    sentinel = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run(["ip", "link", "add", foreign, "type", "bridge"])  # (dummy links need a module CI may lack)
        run(["ip", "link", "set", "dev", foreign, "alias", "someone else's"])
        # a state file (as if from a crash long ago) naming a pid now reused by another process,
        # and a link name now used by someone else
        start = int(Path(f"/proc/{sentinel.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({
            "version": 1, "phase": "up", "dir": str(d), "prefix": prefix, "subnet": "10.213.251.0/24",
            "bridge": f"{prefix}-br", "bridge_ip": "10.213.251.1", "remote_root": str(d / "remote_root"),
            "python": PY, "owner": None, "faults": {},
            "hosts": [{"name": "fab1", "ip": "10.213.251.11", "veth": foreign, "netns": 1,
                       "anchor": {"pid": sentinel.pid, "start": start + 1}, "sshd": None}]}))
        p = run([PY, "tests/fabric.py", "down"], env=env)
        assert sentinel.poll() is None, "down killed a process that was not its own"
        assert Path(f"/sys/class/net/{foreign}").exists(), "down deleted a link that was not its own"
        assert "not ours, left alone" in p.stderr
        assert not d.exists()

        p = make("fabric-up", env=env, check=False)
        assert p.returncode != 0 and foreign in p.stderr and "fabric-down" in p.stderr, p.stderr
        assert "see tests/README.md#when-fabric-up-refuses" in p.stderr
        assert not Path(f"/sys/class/net/{prefix}-br").exists()
    finally:
        run(["ip", "link", "del", "dev", foreign], check=False)
        sentinel.kill()
        sentinel.wait()

    # a subnet already in use here is refused, naming the address
    taken = f"{prefix}-x"
    try:
        run(["ip", "link", "add", taken, "type", "bridge"])
        run(["ip", "addr", "add", "10.213.252.1/24", "dev", taken])
        p = make("fabric-up", env=dict(env, FABRIC_SUBNET="10.213.252.0/24"), check=False)
        assert p.returncode != 0 and f"10.213.252.1/24 on {taken}" in p.stderr, p.stderr
    finally:
        run(["ip", "link", "del", "dev", taken], check=False)
    p = make("fabric-up", env=dict(env, FABRIC_SUBNET="8.8.8.0/24"), check=False)
    assert p.returncode != 0 and "private range" in p.stderr
    # a non-empty dir that is not a fabric's is never taken over (nor deleted by down)
    d.mkdir(parents=True)
    (d / "precious.txt").write_text("keep me")
    p = make("fabric-up", env=env, check=False)
    assert p.returncode != 0 and "not a fabric dir" in p.stderr
    run([PY, "tests/fabric.py", "down"], env=env)
    assert (d / "precious.txt").read_text() == "keep me"
    (d / "precious.txt").unlink()
    d.rmdir()
