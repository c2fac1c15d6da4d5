"""`make demo`: the whole chain, end to end, on the embedded default. (The same chain on two fabric
hosts is tests/test_real_run.py: RUNBOOK's real run, checked with check_report below.)"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, make

pytestmark = pytest.mark.slow


def check_report(run: str) -> dict:
    cdir = ROOT / "runs" / run / "compare"
    report = json.loads((cdir / "report.json").read_text())
    assert report["verdict"] == "pass", report.get("why")
    models = report["evaluation"]["models"]
    losses = {k: models[k]["loss"] for k in ("base", "control", "dual")}
    assert len({m["batches_sha256"] for m in models.values()}) == 1, "the three models saw different batches"
    # The adapted models beat the base model on the test split.
    assert losses["dual"] < losses["base"] and losses["control"] < losses["base"], losses
    png = (cdir / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (cdir / "report.md").read_text()
    for needle in ("dataset_sha256", "make train", "make control", run):
        assert needle in md, needle
    return report


def fresh(run: str) -> None:
    for d in (ROOT / "runs" / run, ROOT / "runs" / f"{run}-control"):
        shutil.rmtree(d, ignore_errors=True)
    for stamp in (ROOT / ".stamps").glob(f"*.{run}"):
        stamp.unlink()


def test_demo_on_embedded_default():
    fresh("demo-test")
    p = make("demo", "DEMO_RUN=demo-test", timeout=900)
    assert "demo: report at runs/demo-test/compare/report.md" in p.stdout
    check_report("demo-test")
    # Every stage left its summary and the reproduction script names each stage's make line.
    rdir = ROOT / "runs" / "demo-test"
    for f in ("sync.json", "smoke.json", "train.json", "manifest.json", "reproduce.sh"):
        assert (rdir / f).is_file(), f
    repro = (rdir / "reproduce.sh").read_text()
    assert "make smoke" in repro and "make train" in repro and "mlx.launch" in repro
