"""tests/waitpoll.c, the suite's LD_PRELOAD: a would-block recv/send of MLX's ring backend waits
in poll(2) instead of spinning a core, and changes nothing else.

What is proven here:
- on a non-blocking socket, a recv with no data still fails with EAGAIN (after its short wait),
  and the bytes sent arrive whole and in order;
- a rank of a real 2-rank mlx.launch (ring) that waits in all_sum for a rank still working
  uses a small part of a core, where without the library it spins most of one;
- every fabric host's ssh session gets the library preloaded (tests/fabric.py's sshd_config);
- and, without it: mlx.launch as lib/launch.py runs it (launch_env: its ssh with -n) neither spins
  nor sends a byte of stdin to a remote rank; without launch_env it spins over a core and the ranks'
  terminals echo stdin back into the output.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import PY, ROOT, WAITPOLL, run

needs_it = pytest.mark.skipif(not WAITPOLL, reason="no C compiler here: the ring's waits spin (slower tests)")

SOCKETS = r"""
import socket, time
a, b = socket.socketpair()
b.setblocking(False)
t0 = time.perf_counter()
for _ in range(200):
    try:
        b.recv(16)
        raise SystemExit("recv returned with no data sent")
    except BlockingIOError:
        pass
waited = time.perf_counter() - t0
a.sendall(bytes(range(256)) * 64)
got = b""
while len(got) < 256 * 64:
    try:
        got += b.recv(65536)
    except BlockingIOError:
        pass
print(waited, got == bytes(range(256)) * 64)
"""

WAITER = r"""
import resource, time
import mlx.core as mx
g = mx.distributed.init()
for _ in range(2):
    if g.rank() == 0:
        time.sleep(1.5)   # rank 0 works; rank 1 waits in all_sum
    mx.eval(mx.distributed.all_sum(mx.ones((64,)), stream=mx.cpu))
r = resource.getrusage(resource.RUSAGE_SELF)
print(f"rank {g.rank()} cpu {r.ru_utime + r.ru_stime:.3f}")
"""


def env_with(preload: bool) -> dict:
    env = dict(os.environ)
    env["LD_PRELOAD"] = WAITPOLL if preload else ""
    return env


@needs_it
def test_recv_would_block_still_fails_and_the_bytes_arrive_whole():
    plain, shimmed = (subprocess.run([PY, "-c", SOCKETS], env=env_with(p), capture_output=True, text=True,
                                     check=True).stdout.split() for p in (False, True))
    assert plain[1] == shimmed[1] == "True"
    # 200 misses: the plain ones return at once; past the 64th, each shimmed one waits up to 1 ms
    assert float(plain[0]) < 0.05 and float(shimmed[0]) > 0.1, (plain, shimmed)


@needs_it
def test_a_rank_waiting_in_all_sum_sleeps_instead_of_spinning(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    cpu = {}
    for preload in (False, True):
        p = run([str(Path(PY).with_name("mlx.launch")), "--hostfile", "hostfile.local.json", "--backend", "ring",
                 "--", PY, str(script)], env=env_with(preload), timeout=120)
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith("rank 1 cpu"))
        cpu[preload] = float(line.split()[-1])
    # 3 s of waiting: spinning costs most of a core, polling a small part of one
    assert cpu[False] > 1.0 and cpu[True] < 0.5, cpu


@needs_it
@pytest.mark.fabric
def test_every_fabric_session_preloads_it(fabric):
    for host in fabric.hosts:
        p = fabric.ssh(host, ["cat", "/proc/self/maps"], check=True)
        assert WAITPOLL in p.stdout, f"{host}: {WAITPOLL} not mapped"


LAUNCHER = r"""
import os, resource, sys
sys.path.insert(0, sys.argv[1])
from lib import launch
if sys.argv[2] == "plain":  # the same stdin, with the environment as it is (the real ssh, no -n)
    launch.launch_env = lambda env=None: dict(os.environ if env is None else env)
p = launch.run_launcher([sys.argv[3], "--hostfile", sys.argv[4], "--backend", "ring", "--", "/bin/sleep", "4"],
                        capture_output=True, check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(r.ru_utime + r.ru_stime, len(p.stdout))
"""


@pytest.mark.fabric
def test_mlx_launch_over_ssh_waits_and_sends_nothing(fabric):
    """mlx.launch as run_launcher runs it (its stdin, launch_env's ssh -n) against without launch_env."""
    got = {how: run([PY, "-c", LAUNCHER, str(ROOT), how, str(Path(PY).with_name("mlx.launch")),
                     str(fabric.hostfile(2))], env=fabric.env(), timeout=60).stdout.split()
           for how in ("plain", "launch_env")}
    (cpu_plain, echoed_plain), (cpu, echoed) = ((float(c), int(n)) for c, n in got.values())
    # 4 s of two ranks over ssh (mlx.launch and its ssh clients): spinning, that is over a core, and the
    # ranks' terminals echo the stdin bytes that reached them before `stty -echo` as blank lines
    assert cpu_plain > 2.0 and echoed_plain > 1000, got
    assert cpu < 1.0 and echoed == 0, got
