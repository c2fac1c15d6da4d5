"""Shared pytest fixtures. Tests run through the same entry points an operator uses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PY = sys.executable
SESSION = os.environ.setdefault("THUNDER_TEST_SESSION", str(os.getpid()))  # the tests beside take this one's


def ring_wait_preload() -> str | None:
    """Build tests/waitpoll.c (a would-block recv/send of MLX's ring waits in poll(2), not a spin;
    why, in its header) into a folder of this session's, or None where no C compiler exists."""
    import atexit

    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if not cc or sys.platform != "linux":
        return None
    out = Path(tempfile.mkdtemp(prefix="thunder-waitpoll-")) / "libwaitpoll.so"
    atexit.register(shutil.rmtree, out.parent, True)
    p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(ROOT / "tests" / "waitpoll.c"), "-ldl"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cc} could not build tests/waitpoll.c:\n{p.stderr}")
    return str(out)


# Every process the tests start (and, through tests/fabric.py's sshd_config, every fabric session)
# preloads it: two to four ranks share this machine's 2 cores, where a Mac gives each its own.
WAITPOLL = os.environ.get("THUNDER_WAITPOLL") or ring_wait_preload()  # the tests beside share this session's
if WAITPOLL and WAITPOLL not in os.environ.get("LD_PRELOAD", "").split():
    os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), WAITPOLL]))


def run(cmd, check=True, **kw):
    """Run a command (argument list) from the repo root, capturing text output."""
    kw.setdefault("cwd", ROOT)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    if Path(str(cmd[0])).name == "mlx.launch" and "stdin" not in kw and "input" not in kw:
        from lib import launch  # its stdin and ssh let mlx.launch's select() wait instead of spinning a core

        p = launch.run_launcher(cmd, **kw)
    else:
        p = subprocess.run(cmd, **kw)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
        )
    return p


def kill_sync_mid_transfer(argv: list[str], staging: Path, env: dict | None = None, wait_s: float = 20) -> None:
    """Start a (bandwidth-limited) `bin/sync.py` argv, wait until its transfer has created the
    staging folder, let it run half a second more, then SIGKILL its whole process group."""
    import time

    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    deadline = time.time() + wait_s
    while time.time() < deadline and not staging.exists():
        time.sleep(0.05)
    assert staging.exists(), "the transfer never started"
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def wait_step(run: str, step: int, timeout: float = 300) -> None:
    """Wait until rank 1 of `make train RUN=run` has logged iter `step` (or a later one)."""
    import re
    import time

    log, deadline = ROOT / f"runs/{run}/logs/launch-train.log", time.time() + timeout
    while time.time() < deadline:
        if log.is_file() and any(int(n) >= step for n in re.findall(r"iter (\d+) rank 1 ", log.read_text())):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run} never reached step {step}")


def losses(run: str, kind: str = "train") -> dict[int, float]:
    """A run's loss per step from its metrics.jsonl: kind "train" or "val"."""
    import json

    metrics = (ROOT / f"runs/{run}/metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, metrics) if m.get("kind") == kind}


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def macos_tools() -> Path | None:
    """The bin dir of macOS's own GNU make 3.81, rsync 2.6.9 and openrsync built from Apple's
    sources (`.ci/macos-tools.sh`; CI exports MACOS_TOOLS), or None where they are not built."""
    d = os.environ.get("MACOS_TOOLS")
    if not d:
        p = subprocess.run(["bash", str(ROOT / ".ci" / "macos-tools.sh"), "--cached"], capture_output=True, text=True)
        d = p.stdout.strip() if p.returncode == 0 else ""
    if d and all((Path(d) / t).is_file() for t in ("make", "rsync269", "openrsync")):
        return Path(d)
    if os.environ.get("REQUIRE_MACOS_TOOLS") == "1":
        raise RuntimeError(f"REQUIRE_MACOS_TOOLS=1 but macOS's tools are not built (MACOS_TOOLS={d!r}): "
                           "bash .ci/macos-tools.sh (needs clang and libbsd-dev)")
    return None


# The make the operator's Mac runs (/usr/bin/make is GNU make 3.81) drives every make-based test
# where it is built; tests/test_macos_tools.py runs the make-only behaviour under both makes.
_TOOLS = macos_tools()
MAKE = str(_TOOLS / "make") if _TOOLS else "make"


def make(*args, check=True, make_bin=None, **kw):
    """`make <args>` from the repo root (macOS's make 3.81 where built, else this machine's)."""
    env = dict(os.environ, **(kw.pop("env", None) or {}))
    # A developer's own settings.mk never leaks into a test: a test that wants one says SETTINGS=.
    own = [] if any(str(a).startswith("SETTINGS=") for a in args) else ["SETTINGS=/dev/null"]
    return run([make_bin or MAKE, "--no-print-directory", *args, *own], check=check, env=env, **kw)


SAMPLE_DATASET = "domain_sft_v1_high_signal_thunder"


@pytest.fixture(scope="session", autouse=True)
def demo_inputs():
    """The generated tiny model and the sample corpus exported to datasets/{SAMPLE_DATASET}, as
    explicit `make` steps: no stage exports or generates anything behind the operator's back."""
    make("tiny-model", "sample-corpus", "ARCH=gemma4")
    make("export", "CORPUS=datasets/sample/corpus.jsonl", f"DATASET={SAMPLE_DATASET}")


# ---- tests marked `beside` run in a second pytest (issue #25: make test within 15 minutes) ----------
BESIDE = "THUNDER_TESTS_BESIDE"  # set in the second pytest: it runs what it is given, nothing beside


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(session, config, items):
    """Tests marked `beside` share nothing with the others: a fresh clone of their own, or run names,
    models, datasets and a fabric of their own. So when they come with others they run in a second pytest
    beside this one (_beside), which uses the core this one leaves idle while it waits on links, watchdogs
    and ssh. This one waits for it at the end, shows its report and fails when it failed."""
    if os.environ.get(BESIDE) or config.option.collectonly:
        return
    write_operator_configs(config, {i.module for i in items})
    beside = [i.nodeid for i in items if i.get_closest_marker("beside")]
    if not beside or len(beside) == len(items):
        return
    items[:] = [i for i in items if not i.get_closest_marker("beside")]
    tmp = Path(tempfile.mkdtemp(prefix="thunder-beside-"))
    config.beside = {"ids": beside, "proc": None, "tmp": tmp, "log": tmp / "pytest.log"}


@pytest.fixture(autouse=True)
def _beside(request, demo_inputs):
    """Start the tests beside, once: after demo_inputs, which they would otherwise build at the same time
    (theirs are then no-ops)."""
    b = getattr(request.config, "beside", None)
    if b and b["proc"] is None:
        with open(b["log"], "w") as log:
            b["proc"] = subprocess.Popen(
                [PY, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(b["tmp"] / "t"), *b["ids"]],
                cwd=ROOT, env=dict(os.environ, **{BESIDE: "1", "THUNDER_WAITPOLL": WAITPOLL or ""}),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if tr := request.config.pluginmanager.get_plugin("terminalreporter"):
            tr.write_line(f"\n{len(b['ids'])} tests marked `beside` run in a second pytest: tail -f {b['log']}")


def write_operator_configs(config, modules) -> None:
    """The configs a test module's runs read from configs/ (its OPERATOR_CONFIGS: {file name: text}), where an
    operator's own go: sync sends them with the code. configs/ is part of every smoke stamp and every
    code-parity check, so they are all written before the first test and removed after the last (and after
    the tests beside): no test changes configs/ while another runs."""
    config.operator_configs = []
    for name, text in sorted({k: v for m in modules for k, v in getattr(m, "OPERATOR_CONFIGS", {}).items()}.items()):
        path = ROOT / "configs" / name
        if path.exists() and path.read_text() != text:
            raise pytest.UsageError(f"{path} exists with other content, and a test's config would replace it: "
                                    "move it away (a test session stopped by kill -9 leaves its own there)")
        path.write_text(text)
        config.operator_configs.append(path)


def pytest_sessionfinish(session, exitstatus):
    """Wait for the tests beside (stop them on an interrupt); their failure is this session's. Then remove
    the configs written for this session (write_operator_configs)."""
    try:
        wait_beside(session, exitstatus)
    finally:
        for path in getattr(session.config, "operator_configs", []):
            path.unlink(missing_ok=True)


def wait_beside(session, exitstatus):
    if not (b := getattr(session.config, "beside", None)):
        return
    if b["proc"] is None:  # no test of this session got as far as demo_inputs
        b["log"].write_text("not started: this session's demo_inputs did not stand\n")
        b["rc"] = 2
    else:
        if exitstatus == pytest.ExitCode.INTERRUPTED:  # as ctrl-c gives it: its fixtures bring their fabrics down
            b["proc"].send_signal(signal.SIGINT)
        b["rc"] = b["proc"].wait()
    if b["rc"] != 0 and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- the multi-host test fabric (tests/fabric.py; issue #3) --------------------------------
def require_fabric():
    """tests/fabric.py as a module, or skip (fail under REQUIRE_FABRIC=1) saying why a fabric
    cannot exist on this machine."""
    import fabric as fabric_mod

    why = fabric_mod.unavailable()
    if why:
        if os.environ.get("REQUIRE_FABRIC") == "1":
            pytest.fail(f"REQUIRE_FABRIC=1 but the multi-host fabric cannot exist here: {why}")
        pytest.skip(f"multi-host fabric unavailable: {why}")
    return fabric_mod


@pytest.fixture(scope="session")
def fabric():
    """A 4-host fabric (fab1..fab4) of this pytest session, up once and down at the session's end.

    It is this session's own instance (runs/fabric-test-<pid>, its own link names and a free
    10.213.X.0/24), so it neither disturbs nor is disturbed by a fabric brought up by hand.
    Where a fabric cannot exist (not root, no ip/unshare/sshd) the tests skip saying why;
    with REQUIRE_FABRIC=1 (CI) that is a failure. Use `fabric.hostfile(2)` for a 2-host subset.
    """
    fabric_mod = require_fabric()
    pid = os.getpid()
    env = {"FABRIC_DIR": str(ROOT / "runs" / f"fabric-test-{pid}"), "FABRIC_PREFIX": f"ts{pid}",
           "FABRIC_SUBNET": "auto", "FABRIC_OWNER_PID": str(pid)}
    run([PY, "tests/fabric.py", "sweep"])  # fabrics left by crashed sessions
    make("fabric-up", "HOSTS=4", env=env)
    fab = fabric_mod.Fabric(env["FABRIC_DIR"])
    yield fab
    make("fabric-down", env=env)


@pytest.fixture
def fabric_faults(fabric):
    """The session fabric, with every fault a test injected undone afterwards (pass or fail)."""
    yield fabric
    fabric.restore_all()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """Say, at the end, how many fabric tests were skipped and why (README.md#requirements); then the
    report of the tests that ran beside (pytest_collection_modifyitems)."""
    fabric_skips(terminalreporter)
    if b := getattr(config, "beside", None):
        rc = b["rc"]
        terminalreporter.write_sep("=", f"{len(b['ids'])} tests marked `beside`, run in a second pytest: "
                                        f"{'passed' if rc == 0 else f'exit {rc}'}", green=rc == 0, red=rc != 0)
        terminalreporter.write(b["log"].read_text(errors="replace"))


def pytest_unconfigure(config):
    """The last line: the tests beside, after this session's own count (pytest's line above this)."""
    if (b := getattr(config, "beside", None)) and (tr := config.pluginmanager.get_plugin("terminalreporter")):
        lines = b["log"].read_text(errors="replace").splitlines() if b["log"].exists() else []
        last = ([ln.strip(" =") for ln in lines if ln.startswith("=")] or [f"exit {b.get('rc')}"])[-1]
        tr.write_sep("=", f"beside: {last} (the {len(b['ids'])} tests marked `beside`)", green=b.get("rc") == 0,
                     red=b.get("rc") != 0)
        shutil.rmtree(b["tmp"], ignore_errors=True)


def fabric_skips(terminalreporter):
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "multi-host fabric unavailable" in str(getattr(r, "longrepr", ""))]
    if skipped:
        why = sorted({str(r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr) for r in skipped})
        terminalreporter.write_sep("=", f"{len(skipped)} fabric tests skipped", yellow=True)
        for w in why:
            terminalreporter.write_line(w.removeprefix("Skipped: "))
        terminalreporter.write_line("what the fabric needs, and its one-line install: README.md#requirements "
                                    "(CI sets REQUIRE_FABRIC=1, where a skip is a failure)")
