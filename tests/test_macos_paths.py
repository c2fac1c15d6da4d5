"""The branches macOS takes, forced here where Linux can run them (issue #14 item 5).

What cannot run here (Metal, F_FULLFSYNC reaching the disk, Thunderbolt, JACCL, caffeinate,
pmset, TCC) is parsed from recorded output elsewhere (tests/test_check_parity.py) or said
plainly in RUNBOOK.md; these tests take the macOS side of each branch that is plain Python.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys

from conftest import ROOT

from lib import atomic


def test_fsync_takes_f_fullfsync_on_macos_and_falls_back_when_refused(tmp_path, monkeypatch):
    """macOS: fsync does not reach the platter, F_FULLFSYNC does; a filesystem that refuses it
    (e.g. some network mounts) falls back to fsync."""
    calls = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)  # its value in <sys/fcntl.h>
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, op: calls.append(("fcntl", op)))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)))
    with open(tmp_path / "f", "w") as f:
        atomic.fsync_fd(f.fileno())
        assert calls == [("fcntl", 51)], calls

        def refuse(fd, op):
            raise OSError(45, "Operation not supported")
        monkeypatch.setattr(fcntl, "fcntl", refuse)
        calls.clear()
        atomic.fsync_fd(f.fileno())
        assert calls == [("fsync", f.fileno())], calls


def test_an_atomic_write_works_through_the_macos_branch(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)
    real = fcntl.fcntl
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, op, *a: real(fd, fcntl.F_GETFD) if op == 51 else real(fd, op, *a))
    atomic.write_json(tmp_path / "x.json", {"ok": True})
    assert (tmp_path / "x.json").read_text() == '{\n  "ok": true\n}\n'


def load_calibrate():
    spec = importlib.util.spec_from_file_location("calibrate_script", ROOT / "bin" / "calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeMx:
    def __init__(self, info):
        self.info = info

    def device_info(self):
        return self.info


def test_calibrate_takes_metals_working_set_where_there_is_one():
    """On a Mac the memory ceiling is Metal's recommended working set (16 GB Mac: 10922.67 MB,
    as reported in abetlen/llama-cpp-python#687); /proc/meminfo is Linux's fallback."""
    cal = load_calibrate()
    size, why = cal.memory_ceiling(FakeMx({"max_recommended_working_set_size": 11453251584}))
    assert (size, why) == (11453251584, "metal max_recommended_working_set_size")
    size, why = cal.memory_ceiling(FakeMx({}))
    assert why == "MemAvailable at probe start" and size > 0
