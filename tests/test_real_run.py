"""RUNBOOK.md's "The real run", executed as written against two fresh fabric hosts.

The command block is read from RUNBOOK.md and typed line by line; only the values of the
operator's settings file differ from Mac1's (the fabric's hostfile, REMOTE_ROOT and PYTHON,
the tiny model and the demo config). The hosts start with nothing: no venv, no code, no
dataset. Before every step, `make -n <step>` is captured and must be exactly the commands the
step then runs (issue #13: reproduction commands that are what ran). Driven by macOS's own
make 3.81 where it is built (conftest.MAKE), and fab2 logs in with zsh and macOS's PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from conftest import PY, ROOT, SESSION, make, require_fabric, run
from support import wandb_mismatches
from test_demo import check_report
from test_model import hub_cache
from test_stages_fabric import check_smoke

HUB_REPO = "thunder-test/realrun-gemma4"
NAME = f"realrun-{SESSION}"
# The demo recipe at 8 steps (make test's budget), in configs/ as an operator's own config would be (sync
# sends configs/ with the code; conftest writes it before the first test); CONFIG is a setting like the others.
# It tracks with W&B as configs/stage1.yaml does; no API key here, so online fails and it goes offline.
OPERATOR_CONFIGS = {f"{NAME}.yaml": (ROOT / "configs/demo.yaml").read_text().replace("iters: 20", "iters: 8")
                    .replace("save_every: 10", "save_every: 4").replace("steps_per_eval: 10", "steps_per_eval: 4")
                    + "report_to: wandb\nproject_name: thunder-test\n"}

pytestmark = [pytest.mark.fabric, pytest.mark.slow, pytest.mark.beside]  # a fabric of its own (conftest.py)


def runbook_block() -> list[str]:
    text = (ROOT / "RUNBOOK.md").read_text()
    section = text.split("\n## The real run\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "RUNBOOK.md's 'The real run' has no ```sh block"
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines and all(ln.startswith("make ") for ln in lines), lines
    return lines


def test_runbook_block_is_the_plans_order():
    targets = [ln.split()[1] for ln in runbook_block()]
    order = ["setup", "model", "provision", "export", "sync", "check-parity", "smoke", "train", "control", "compare"]
    assert targets == order, targets


def dry_run(*args, env=None) -> list[str]:
    """`make -n <args>`: the commands it lists (make's own 'Nothing to be done' notes dropped)."""
    out = make("-n", *args, env=env, timeout=120).stdout
    return [ln for ln in out.splitlines() if ln and not re.match(r"^\S*make(\[\d+\])?: ", ln)]


def commands_run(stdout: str, dry: list[str]) -> list[str]:
    """The recipe lines a real make run echoed, in order: every line that `make -n` listed, plus
    any other line that looks like one (a script under bin/ or a stamp), which would be extra."""
    want = set(dry)
    return [ln for ln in stdout.splitlines()
            if ln in want or re.match(r"^(\S*/)?python\S* bin/\w+\.py |^touch \.stamps/", ln)]


@pytest.fixture
def fresh_fabric():
    fabric_mod = require_fabric()
    pid = os.getpid()
    env = {"FABRIC_DIR": str(ROOT / "runs" / f"fabric-realrun-{pid}"), "FABRIC_PREFIX": f"tr{pid}",
           "FABRIC_SUBNET": "auto", "FABRIC_OWNER_PID": str(pid)}
    make("fabric-up", "HOSTS=2", env=env)
    try:
        yield fabric_mod.Fabric(env["FABRIC_DIR"])
    finally:
        make("fabric-down", env=env)


def test_the_real_run_as_written_on_fresh_hosts(fresh_fabric, tmp_path):
    fab = fresh_fabric
    name = NAME
    model = f"models/{name}-released-q4"
    for h in fab.hosts:  # fresh: nothing under REMOTE_ROOT
        assert not any(fab.backing_dir(h).iterdir()), f"{h} is not fresh"
    # The model comes the way the real one does: `make model` from a Hugging Face cache (built here,
    # offline) holding Gemma 4's released layout, quantized to 4 bits by mlx-lm's convert.
    model_src = tmp_path / "released"
    run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--layout", "released", "--out", str(model_src)])
    hub_cache(tmp_path / "hf" / "hub", HUB_REPO, model_src, "3" * 40, ("main",))
    settings = tmp_path / "settings.mk"
    settings.write_text("\n".join([
        f"HOSTFILE    = {fab.hostfile(2)}",
        f"HF_REPO     = {HUB_REPO}",
        "REVISION    = main",
        "QUANTIZE    = 4",
        f"MODEL       = {model}",
        "CORPUS      = datasets/sample/corpus.jsonl",
        f"DATASET     = {name}",
        f"REMOTE_ROOT = {fab.remote_root}",
        f"PYTHON      = {fab.remote_root}/.venv/bin/python",
        f"RUN         = {name}",
        f"CONFIG      = configs/{name}.yaml",
        "MIN_SPEEDUP = 0",  # the fabric's hosts share this machine's cores
        "TEST_BATCHES = 4",  # compare scores 32 test records per model: the verdict, in a third of the time
        "",
    ]))
    env = dict(fab.env(), HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
               HF_HUB_OFFLINE="1")
    try:
        for line in runbook_block():
            args = line.split()[1:] + [f"SETTINGS={settings}"]
            dry = dry_run(*args, env=env)
            p = make(*args, env=env, check=False, timeout=900)
            assert p.returncode == 0, f"`{line}` failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
            assert commands_run(p.stdout, dry) == dry, f"`make -n` differs from what `{line}` ran"
            if args[0] == "provision":
                assert not (fab.backing_dir("fab1") / "datasets").exists(), "provision synced data"
        check_report(name)  # pass; base, control and dual on the same batches; both adapters beat base
        check_smoke(name, fab, fab.hosts[:2])  # every criterion; logs and checkpoint came home; no rank left
        summary = json.loads((ROOT / "runs" / name / "train.json").read_text())
        assert summary["ok"] and summary.get("world_size", 2) == 2
        check_tracking(name, fab)
        config = json.loads((ROOT / model / "config.json").read_text())
        assert config["model_type"] == "gemma4" and config["quantization"]["bits"] == 4  # what trained

        # Nothing left to do: every stage's stamp stands, and make -n says so.
        for target in ("smoke", "train", "control"):
            assert dry_run(target, f"SETTINGS={settings}", env=env) == []
        # A stamp cannot outlive its run: without the run folder, smoke (and what follows) re-runs.
        shutil.rmtree(ROOT / "runs" / name)
        dry = "\n".join(dry_run("train", f"SETTINGS={settings}", env=env))
        assert "bin/smoke.py" in dry and "bin/run.py --stage train" in dry, dry
    finally:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
        shutil.rmtree(ROOT / "runs" / f"{name}-control", ignore_errors=True)
        shutil.rmtree(ROOT / "datasets" / name, ignore_errors=True)
        shutil.rmtree(ROOT / model, ignore_errors=True)
        for st in (ROOT / ".stamps").glob(f"*{name}*"):
            st.unlink()


def check_tracking(name: str, fab) -> None:
    """#28: rank 0 (fab1) tracked the train and the control offline, the folders came home, W&B holds what
    metrics.jsonl holds, and train.json, control.json and the report say where."""
    report = (ROOT / "runs" / name / "compare" / "report.md").read_text()
    for run_id, stage in ((name, "train"), (f"{name}-control", "control")):
        t = json.loads((ROOT / "runs" / run_id / f"{stage}.json").read_text())["tracking"]
        assert t["mode"] == "offline" and re.fullmatch(r"[a-z0-9]{8}", t["id"]) and t["url"] is None, t
        assert t["dir"].startswith(f"runs/{run_id}/wandb/offline-run-") and t["dir"].endswith(t["id"]), t
        assert (fab.backing_dir("fab1") / t["dir"] / f"run-{t['id']}.wandb").is_file(), "rank 0 did not write it"
        assert not wandb_mismatches(ROOT / "runs" / run_id, ROOT / t["dir"])  # home, and all of it
        kinds = [json.loads(x)["kind"] for x in (ROOT / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
        assert kinds.count("step") == 8 and kinds.count("tracking") == 1, kinds
        warned = [w["message"] for w in json.loads((ROOT / "runs" / run_id / f"{stage}.json").read_text())["warnings"]]
        assert any("W&B online did not start" in w and f".venv/bin/wandb sync {t['dir']}" in w for w in warned), warned
        assert f"W&B offline run {t['id']}: `.venv/bin/wandb sync {t['dir']}` uploads it" in report
    assert not (fab.backing_dir("fab2") / "runs" / name / "wandb").exists(), "rank 1 tracked too"
    assert not (ROOT / "runs" / name / "smoke" / "wandb").exists(), "the smoke is a gate: not tracked"


def test_a_stamp_without_its_run_folder_re_runs(tmp_path):
    """Observation 4 of #13: remove runs/X/ and `make smoke RUN=X` used to say nothing to do."""
    name = f"stamp-{os.getpid()}"
    stamps = ROOT / ".stamps"
    stamps.mkdir(exist_ok=True)
    variables = [f"RUN={name}", "HOSTFILE=hostfile.local.json", "MODEL=models/tiny-gemma4",
                 "DATASET=domain_sft_v1_high_signal_thunder"]
    try:
        (stamps / f"smoke.{name}").touch()
        run_dir = ROOT / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "smoke.json").write_text(json.dumps({"ok": True, "why": ""}, indent=2, sort_keys=True) + "\n")
        assert dry_run("smoke", *variables) == [], "a passing run's stamp stands"
        (run_dir / "smoke.json").write_text(json.dumps({"ok": False, "why": "x"}, indent=2, sort_keys=True) + "\n")
        assert "bin/smoke.py" in make("-n", "smoke", *variables).stdout, "a failed run's stamp stood"
        shutil.rmtree(run_dir)
        assert "bin/smoke.py" in make("-n", "smoke", *variables).stdout, "a removed run's stamp stood"
    finally:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
        (stamps / f"smoke.{name}").unlink(missing_ok=True)


def test_no_stage_re_exports_and_make_n_shows_only_the_stage(tmp_path):
    """Observations 1 and 3 of #13: a plain `make sync`/`make -n smoke` re-exported the sample
    corpus into the operator's dataset. Now the dataset is whatever `make export` made, and a
    stage without its dataset says how to export it."""
    variables = ["RUN=noexport", "HOSTFILE=hostfile.local.json", "MODEL=models/tiny-gemma4",
                 f"REMOTE_ROOT={ROOT}", f"PYTHON={PY}"]
    for target in ("sync", "smoke", "train", "control", "calibrate"):
        out = make("-n", target, *variables, "DATASET=domain_sft_v1_high_signal_thunder").stdout
        assert "bin/export.py" not in out and "make_tiny_model" not in out and "make_sample_corpus" not in out, out
    p = make("sync", *variables, "DATASET=never-exported", check=False)
    assert p.returncode != 0
    assert "make export CORPUS=<files> DATASET=never-exported" in p.stderr and "RUNBOOK.md#export" in p.stderr
    assert not (ROOT / "datasets" / "never-exported").exists()


def test_without_settings_the_demo_model_never_reaches_the_macs(tmp_path):
    none = f"SETTINGS={tmp_path}/settings.mk"  # no settings file written yet
    p = make("sync", none, check=False)
    assert p.returncode != 0 and "MODEL is not set" in p.stderr and "settings.mk" in p.stderr, p.stderr
    p = make("smoke", "MODEL=models/tiny-gemma4", none, check=False)
    assert p.returncode != 0 and "names the real Macs" in p.stderr and "RUNBOOK.md#settings" in p.stderr, p.stderr
    p = make("export", none, check=False)
    assert p.returncode != 0 and "CORPUS is not set" in p.stderr, p.stderr
