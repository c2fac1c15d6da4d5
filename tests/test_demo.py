"""What a passing demo (or RUNBOOK's real run) leaves behind: the promotion report, checked by
check_report. `make demo` itself is typed as README.md writes it, in a fresh clone of HEAD, by
tests/test_fresh_clone.py; the same chain on two fabric hosts is tests/test_real_run.py."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT


def check_report(run: str, root: Path = ROOT) -> dict:
    cdir = root / "runs" / run / "compare"
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
    for needle in ("dataset_sha256", "make train", "make control", run, "## Test loss by source",
                   "## Sample answers", "| reference | base | control | dual |"):
        assert needle in md, needle
    # Sample answers of the three models beside the reference, and the test loss by record source (#28).
    samples, by = report["samples"], report["by_source"]
    assert len(samples) == 4 and all(isinstance(x[k], str) for x in samples for k in ("base", "control", "dual"))
    assert by and all(isinstance(r[k], float) for r in by for k in ("base", "control", "dual")), by
    # What both runs trained on (issue 39): the trainer's batches, answers only, little padding.
    for role in ("dual", "control"):
        facts = report["runs"][role]
        assert facts["batching"] == "length" and facts["mask_prompt"] is True, facts
        assert 0 < facts["padding_fraction"] <= 0.10 and facts["epochs"] > 0, facts
        assert facts["train_records_trained"] > 0, facts
    assert "| padding_fraction |" in md and "| epochs |" in md
    return report


def check_run_folder(run: str, root: Path = ROOT) -> None:
    """Every stage left its summary, and the reproduction script names each stage's make line."""
    rdir = root / "runs" / run
    for f in ("sync.json", "smoke.json", "train.json", "manifest.json", "reproduce.sh"):
        assert (rdir / f).is_file(), f
    repro = (rdir / "reproduce.sh").read_text()
    assert "make smoke" in repro and "make train" in repro and "mlx.launch" in repro
