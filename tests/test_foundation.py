"""Foundation: the lock, the venv, the Makefile conventions, lib's shared pieces."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest
from conftest import ROOT, make, run

from lib import atomic, hostfile, jsonl, paths
from lib.log import RunbookError

LOCK = (ROOT / "requirements.lock").read_text()


def locked_versions() -> dict[str, str]:
    """name -> version for the requirements whose marker applies to this platform."""
    out = {}
    for m in re.finditer(r"^([A-Za-z0-9_.-]+)==([^ ;\\\n]+)(?: ; ([^\\\n]+))?", LOCK, re.M):
        name, ver, marker = m.groups()
        if marker:
            from packaging.markers import Marker

            if not Marker(marker.strip()).evaluate():
                continue
        out[name.lower().replace("_", "-")] = ver
    return out


def test_lock_is_hashed_and_universal():
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", LOCK)) >= 100
    assert re.search(r"^mlx-metal==[\d.]+ ; sys_platform == 'darwin'", LOCK, re.M)
    assert re.search(r"^mlx-cpu==[\d.]+ ; sys_platform == 'linux'", LOCK, re.M)
    assert "uv pip compile --universal --generate-hashes" in LOCK.splitlines()[1]
    # Every requirement carries at least one hash (pip --require-hashes needs them all).
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", LOCK.split("\n", 2)[2])
    for b in blocks:
        if "==" in b.splitlines()[0]:
            assert "--hash=sha256:" in b, b.splitlines()[0]
    for tool in ("pytest", "ruff", "uv"):
        assert re.search(rf"^{tool}==", LOCK, re.M), f"{tool} is not locked"


def test_venv_matches_lock():
    """What is installed in the venv is exactly what the lock pins for this platform."""
    from importlib.metadata import distributions

    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
    locked = locked_versions()
    assert locked, "no requirement parsed from requirements.lock"
    wrong = {n: (v, installed.get(n)) for n, v in locked.items() if installed.get(n) != v}
    assert not wrong, f"venv differs from requirements.lock: {wrong}"


def test_setup_is_up_to_date_after_setup():
    """A second `make setup` does nothing: its stamp is newer than the lock."""
    p = make("-q", "setup", check=False)
    assert p.returncode == 0, "make setup would re-run although the lock did not change"


def test_help_is_default_and_lists_every_target():
    out = make().stdout
    documented = re.findall(r"^## ([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
    assert {"setup", "lock", "tiny-model", "sample-corpus", "export", "check-parity", "sync",
            "smoke", "train", "compare", "demo", "test", "lint"} <= set(documented)
    for t in documented:
        assert re.search(rf"^\s+{re.escape(t)}\s+\S", out, re.M), f"make help does not list {t}"


def test_makefile_runs_on_make_381():
    """No GNU make 4 only features: macOS ships 3.81."""
    text = (ROOT / "Makefile").read_text()
    for bad in (".ONESHELL", ".RECIPEPREFIX", "$(file ", "undefine ", "!=", "$(intcmp", "$(let "):
        assert bad not in text, f"Makefile uses {bad!r}, which GNU make 3.81 lacks"
    for line in ("SHELL := bash -eu -o pipefail", ".SHELLFLAGS := -c", ".DELETE_ON_ERROR:",
                 ".DEFAULT_GOAL := help", ".SUFFIXES:"):
        assert line in text


def test_find_python_refuses_old_or_missing_python(tmp_path):
    old = tmp_path / "python3"
    old.write_text("#!/bin/sh\nexec " + sys.executable + " -c 'import sys; sys.exit(1)' \"$@\"\n")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    p = run(["bash", "bin/find_python.sh"], check=False, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    # /usr/bin may hold a real python3 >= 3.11; either it is found or the error names the fix.
    if p.returncode == 0:
        out = subprocess.run([p.stdout.strip(), "-c", "import sys; print(sys.version_info >= (3, 11))"],
                             capture_output=True, text=True)
        assert out.stdout.strip() == "True"
    else:
        assert "no Python >= 3.11 found" in p.stderr and "BOOTSTRAP_PYTHON" in p.stderr
    p = run(["bash", "bin/find_python.sh", "no-such-python"], check=False)
    assert p.returncode == 1 and "fix:" in p.stderr and "RUNBOOK.md#prerequisites" in p.stderr
    p = run(["bash", "bin/find_python.sh", sys.executable])
    assert p.stdout.strip() == sys.executable


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "a.json"
    atomic.write_json(target, {"v": 1})
    with pytest.raises(ValueError):
        atomic.write_json(target, {"v": float("nan")})
    assert jsonl.json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_dir_swaps_whole_or_not_at_all(tmp_path):
    d = tmp_path / "ds"
    with atomic.atomic_dir(d) as t:
        (t / "x").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(d) as t:
            (t / "x").write_text("2")
            raise RuntimeError("interrupted")
    assert (d / "x").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_run_ids_are_safe_folder_names():
    assert paths.check_run_id("stage1-2026.11_21") == "stage1-2026.11_21"
    for bad in ("../x", "-rf", "a b", "a/b", "", "x;rm"):
        with pytest.raises(ValueError):
            paths.check_run_id(bad)


@pytest.mark.parametrize("name", ["-oProxyCommand=touch /tmp/pwned", "a b", "a;b", "$(x)", "a'b", "`id`", "-x"])
def test_hostfile_refuses_dangerous_hostnames(name):
    with pytest.raises(RunbookError) as e:
        hostfile.parse({"backend": "ring", "hosts": [{"ssh": name, "ips": ["10.0.0.1"]}]}, "h.json")
    assert "refused" in str(e.value) and "RUNBOOK.md#hostfile" in str(e.value)


def test_hostfile_shapes():
    hf = hostfile.load(ROOT / "hostfile.json")
    assert [h.ssh for h in hf.hosts] == ["mac4", "mac5"] and hf.backend == "ring"
    assert all(ip.startswith("10.0.5.") for h in hf.hosts for ip in h.ips)
    local = hostfile.load(ROOT / "hostfile.local.json")
    assert local.size == 2 and local.unique_ssh() == ["127.0.0.1"]
    assert hostfile.parse([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]).size == 2
    with pytest.raises(RunbookError, match="needs 'ips'"):
        hostfile.parse({"backend": "ring", "hosts": [{"ssh": "a"}, {"ssh": "b"}]})
    with pytest.raises(RunbookError, match="rdma"):
        hostfile.parse({"backend": "jaccl", "hosts": [{"ssh": "a", "rdma": ["x", "y"]}, {"ssh": "b", "rdma": ["y", None]}]})
    ok = hostfile.parse({"backend": "jaccl", "hosts": [{"ssh": "a", "rdma": [None, "rdma_en2"]},
                                                         {"ssh": "b", "rdma": ["rdma_en2", None]}]})
    assert ok.size == 2
    with pytest.raises(RunbookError, match="duplicate"):
        hostfile.parse({"hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "a", "ips": ["10.0.0.1"]}]})
    with pytest.raises(RunbookError, match="env entry"):
        hostfile.parse({"envs": ["X=$(id)"], "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]})


def test_hostfiles_are_mlx_launch_format():
    """mlx.launch's own parser reads both hostfiles."""
    from mlx._distributed_utils.common import Hostfile

    for name in ("hostfile.json", "hostfile.local.json"):
        hf = Hostfile.from_file(ROOT / name)
        assert len(hf.hosts) == 2 and hf.backend == "ring"


def test_no_machine_paths_in_repo():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    here = str(ROOT)
    for f in tracked:
        p = ROOT / f
        if p.is_file() and p.suffix not in (".lock",) and os.path.getsize(p) < 2_000_000:
            assert here not in p.read_text(errors="ignore"), f"{f} contains this machine's path {here}"


def test_atomic_writes_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "f", "x")
        with atomic.atomic_dir(tmp_path / "d") as t:
            (t / "x").write_text("1")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755


@pytest.mark.parametrize("beside_passes", [True, False])
def test_tests_marked_beside_run_beside_and_their_failure_is_the_sessions(beside_passes):
    """#25: tests marked `beside` run in a second pytest beside the rest (make test's wall time); the
    session waits for them, shows their report, and fails when they failed, though its own passed. A
    module's OPERATOR_CONFIGS stand in configs/ for both, from before the first test to after the last."""
    name = f"test_beside_{os.getpid()}_{int(beside_passes)}"
    files = [ROOT / "tests" / f"{name}_a.py", ROOT / "tests" / f"{name}_b.py"]
    cfg = ROOT / "configs" / f"{name}.yaml"
    stands = f"    assert Path({str(cfg)!r}).read_text() == 'iters: 3\\n'\n"
    files[0].write_text(f"import os\nfrom pathlib import Path\n\nOPERATOR_CONFIGS = {{{cfg.name!r}: 'iters: 3\\n'}}\n\n\n"
                        f"def test_here():\n{stands}    assert not os.environ.get('THUNDER_TESTS_BESIDE')\n")
    files[1].write_text(f"import os\nfrom pathlib import Path\n\nimport pytest\n\n\n@pytest.mark.beside\n"
                        f"def test_beside():\n{stands}"
                        "    assert os.environ.get('THUNDER_TESTS_BESIDE') == '1'\n"
                        f"    assert {beside_passes}, 'the test beside failed'\n")
    try:
        p = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, files)], check=False,
                timeout=300)
    finally:
        for f in files:
            f.unlink()
    out = p.stdout
    assert not cfg.exists(), "the session left its config in configs/"
    own, last = out.strip().splitlines()[-2:]
    assert re.fullmatch(r"1 passed in \S+", own), out  # this session's own test, here
    assert re.fullmatch(rf"=+ beside: 1 {'passed' if beside_passes else 'failed'} in \S+ \(the 1 tests marked "
                        r"`beside`\) =+", last), out
    if beside_passes:
        assert p.returncode == 0 and "1 tests marked `beside`, run in a second pytest: passed" in out, out
    else:
        assert p.returncode == 1 and "run in a second pytest: exit 1" in out, out
        assert "AssertionError: the test beside failed" in out, out
