"""sync, smoke and their failure modes across the multi-host test fabric, through make.

Every stage runs exactly as an operator runs it against the Macs: `make <stage>` with the
fabric's hostfile, REMOTE_ROOT, PYTHON and ssh config (env.sh's environment); only the
hostfile and the ssh config differ from the real thing.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time

import pytest
from conftest import PY, ROOT, kill_sync_mid_transfer, losses, make, require_fabric, wait_step

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

DATASET = "domain_sft_v1_high_signal_thunder"
MODEL = "models/tiny-gemma4"


@pytest.fixture(autouse=True)
def fresh_runs():
    """Each test starts without the run folders and stamps of an earlier session."""
    import shutil

    for d in (ROOT / "runs").glob("fab-*"):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink()
    for st in (ROOT / ".stamps").glob("*.fab-*"):
        st.unlink()
    yield


def fab_vars(fabric, hosts, run, **extra):
    hf = fabric.hostfile(hosts)
    v = {"RUN": run, "HOSTFILE": str(hf), "REMOTE_ROOT": fabric.remote_root, "PYTHON": fabric.python,
         "MODEL": MODEL, "DATASET": DATASET}
    v.update(extra)
    return [f"{k}={val}" for k, val in v.items()]


def fmake(fabric, *args, check=True, timeout=600):
    return make(*args, check=check, env=fabric.env(), timeout=timeout)


def host_file(fabric, host, rel):
    return fabric.backing_dir(host) / rel


def no_trainer_left(fabric, hosts):
    return {h: fabric.procs(h, r"bin/train\.py") for h in hosts}


def parity(fabric, hosts, run="parity"):
    return fmake(fabric, "check-parity", *fab_vars(fabric, hosts, run), "JSON=1", check=False)


def test_sync_then_parity_then_byte_flip_and_repair(fabric_faults):
    fabric = fabric_faults
    hosts = ["fab1", "fab2"]
    p = fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-sync"))
    assert len(re.findall(r"status verified", p.stdout)) == 2, p.stdout
    local_manifest = (ROOT / "datasets" / DATASET / "manifest.json").read_bytes()
    for h in hosts:
        assert host_file(fabric, h, f"datasets/{DATASET}/manifest.json").read_bytes() == local_manifest
    p = parity(fabric, hosts)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["status"] == "OK", p.stdout

    # Nothing changed: the re-sync transfers nothing.
    p = fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-sync"))
    assert p.stdout.count("actions none bytes 0") == 2, p.stdout

    # Flip one byte of a split on fab2 (same size, same mtime): parity names the host and file.
    target = host_file(fabric, "fab2", f"datasets/{DATASET}/valid.jsonl")
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[5] ^= 0x20
    target.write_bytes(bytes(data))
    import os
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    p = parity(fabric, hosts)
    out = json.loads(p.stdout)
    assert p.returncode == 2, p.stdout
    bad = [c for c in out["checks"] if c["status"] == "fail"]
    assert bad and all(c["host"] == "fab2" for c in bad) and any("valid.jsonl" in c["detail"] for c in bad), bad
    # sync repairs it.
    p = fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-sync"))
    assert "fab2 status verified actions dataset" in p.stdout
    assert parity(fabric, hosts).returncode == 0
    sync_json = json.loads((ROOT / "runs/fab-sync/sync.json").read_text())
    assert [h["host"] for h in sync_json["hosts"]] == hosts and sync_json["ok"]


def test_sync_killed_mid_transfer_keeps_previous_dataset(fabric_faults, tmp_path):
    fabric = fabric_faults
    hosts = ["fab3"]
    fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-sync-kill"))
    ddir = host_file(fabric, "fab3", f"datasets/{DATASET}")
    before = {f.name: f.read_bytes() for f in ddir.iterdir()}
    # Make the host's copy stale so the next sync must transfer, slowed so the kill lands mid-way.
    (ddir / "train.jsonl").write_bytes(b"")
    stale = {f.name: f.read_bytes() for f in ddir.iterdir()}
    hf = fabric.hostfile(hosts)
    kill_sync_mid_transfer([PY, "bin/sync.py", "--hostfile", str(hf), "--remote-root", fabric.remote_root,
                            "--dataset", DATASET, "--bwlimit", "100"], ddir.parent / f".{DATASET}.incoming",
                           env=fabric.env(), wait_s=30)
    # The receiving side of the killed transfer, fab3's alone (pkill would reach every rsync of this machine);
    # none left is fine: it may have ended with its sender
    with contextlib.suppress(require_fabric().FabricError):
        fabric.kill("fab3", r"\brsync\b")
    assert {f.name: f.read_bytes() for f in ddir.iterdir()} == stale, "the dataset changed mid-sync"
    fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-sync-kill"))
    assert {f.name: f.read_bytes() for f in ddir.iterdir()} == before


# The 2-host smoke runs inside tests/test_real_run.py (check_smoke: the same checks).
# 3 and 4 hosts with unequal shares (#29), the chain as an operator types it: `make smoke` (every rank
# joined, real data, a checkpoint, validation, a second launch resuming to the end), `make train` with the
# last host's rank killed mid-run (RESTARTS), then `make control` on fab1 and `make compare`. On 3 hosts
# the last host's cable is then cut for good as well (FALLBACK=1): the two left keep their shares 3 : 2,
# re-normalized over the same global batch of 6 (4 and 2 records). With token-weighted gradients every
# split computes the control's step, so the adapter and every step's loss equal the control's.
SHARES = {3: [3, 2, 1], 4: [3, 1, 1, 1]}
_smoke = {n: (ROOT / "configs" / "smoke.yaml").read_text() + f"rank_shares: {s}\n" for n, s in SHARES.items()}
# In configs/, as an operator's own (sync sends them with the code); conftest writes them before the first test
OPERATOR_CONFIGS = {**{f"fab-hosts-{n}-smoke.yaml": text for n, text in _smoke.items()},
                    **{f"fab-hosts-{n}-train.yaml": text.replace("iters: 6", "iters: 12") for n, text in _smoke.items()}}


@pytest.mark.parametrize("n", [3, 4])
def test_shares_on_n_hosts_smoke_train_killed_rank_control_compare(fabric_faults, n):
    import numpy as np
    from safetensors.numpy import load_file

    fabric, hosts, run = fabric_faults, fabric_faults.hosts[:n], f"fab-hosts-{n}"
    v = fab_vars(fabric, hosts, run, SMOKE_CONFIG=f"configs/{run}-smoke.yaml", CONFIG=f"configs/{run}-train.yaml")
    p = fmake(fabric, "smoke", *v, timeout=900)
    assert f"{n}/{n} ranks joined with world size [{n}]" in p.stdout
    check_smoke(run, fabric, hosts)
    logs = ROOT / f"runs/{run}/smoke/logs"
    assert [json.loads((logs / f"rank-{r}.joined.json").read_text())["rank_batch"] for r in range(n)] == SHARES[n]

    out = {}
    # WATCHDOG short enough to see the cut cable soon, long enough for 3 ranks loading on 2 cores; 4
    # ranks on 2 cores go quiet for 20 s while loading: the default window (300 s) for the kill alone
    extra = ["RESTARTS=2", "FALLBACK=1", "WATCHDOG=30"] if n == 3 else ["RESTARTS=1"]
    t = threading.Thread(target=lambda: out.__setitem__("p", fmake(fabric, "train", *v, *extra, check=False,
                                                                   timeout=900)))
    t.start()
    wait_step(run, 4)
    assert fabric.kill(hosts[-1], r"bin/train\.py"), f"no rank process on {hosts[-1]}"
    if n == 3:
        wait_step(run, 8)  # the relaunch, past the checkpoint at step 6
        fabric.cut_link(hosts[-1])
    t.join(timeout=900)
    assert not t.is_alive(), f"make train {run} did not end"
    summary = json.loads((ROOT / f"runs/{run}/train.json").read_text())
    assert out["p"].returncode == 0 and summary["ok"], (out["p"].stdout[-3000:], summary)
    assert len(summary["attempts"]) == (2 if n == 3 else 1), summary["attempts"]
    if n == 3:
        assert summary["fallback"]["lost"] == [hosts[-1]] and summary["world_size"] == 2, summary
        assert summary["rank_batches"] == [4, 2], summary["rank_batches"]  # 3 : 2 of the same 6
    else:
        assert summary["world_size"] == 4 and summary["rank_batches"] == SHARES[4], summary
    fabric.restore_all()  # the control and compare run on fab1, as they would after a bad night

    fmake(fabric, "control", *v, "CONTROL_HOST=fab1")
    p = fmake(fabric, "compare", *v, "MIN_SPEEDUP=0", "TEST_BATCHES=4", "SAMPLES=1", "MAX_TOKENS=8", check=False)
    rep = json.loads((ROOT / f"runs/{run}/compare/report.json").read_text())
    assert p.returncode == 0 and rep["verdict"] == "pass", (p.stdout[-3000:], rep["reasons"])
    exact = rep["loss"]["exact"]
    assert exact["ok"] and exact["steps"] == 12 and exact["max_rel"] <= 1e-5, exact
    assert rep["runs"]["dual"]["rank_batches"] == summary["rank_batches"], rep["runs"]["dual"]
    # Validation splits each global batch as training does (6 records need not divide by 4 ranks):
    # every validation loss is the control's.
    dval, cval = (losses(r, "val") for r in (run, f"{run}-control"))
    assert dval.keys() == cval.keys() and len(dval) >= 2, (dval, cval)
    assert all(abs(dval[k] - cval[k]) <= 1e-5 * abs(cval[k]) for k in dval), (dval, cval)
    dual, ctl = (load_file(str(ROOT / f"runs/{r}/adapters/adapters.safetensors")) for r in (run, f"{run}-control"))
    assert dual.keys() == ctl.keys()
    diff = max(float(np.max(np.abs(dual[k].astype(np.float64) - ctl[k].astype(np.float64)))) for k in dual)
    assert diff <= 1e-5, diff
    assert not any(no_trainer_left(fabric, hosts).values()), "a rank process outlived the run"


def check_smoke(run, fabric, hosts):
    """The smoke verdict holds every criterion, and the run folder came home from the hosts."""
    n = len(hosts)
    summary = json.loads((ROOT / f"runs/{run}/smoke.json").read_text())
    assert summary["ok"] and summary["world_size"] == n, summary
    for name in ("joined", "real_data", "checkpoint", "validation", "resume"):
        assert summary["criteria"][name]["ok"], (name, summary["criteria"][name])
    # The chat format the ranks trained in (#26): the config's choice, the first record as rendered
    fmt, man = summary["chat_format"], json.loads((ROOT / f"runs/{run}/manifest.json").read_text())
    assert fmt["chat_template_args"] == summary["chat_template_args"] == man["chat_template_args"] \
        == {"enable_thinking": False} and fmt["has_thinking"] is True
    rec = fmt["first_record"]
    assert rec["text"].startswith("<bos><|turn>") and "<|think|>" not in rec["text"]
    assert rec["text"].endswith("<turn|>\n") and rec["tokens"] > 0
    # answers only, as the train config (#39): the one target is the answer and its <turn|>, at the end
    # the epochs the real run's CONFIG makes of this train split, printed by smoke (#39)
    epochs = summary["train_epochs"]
    assert epochs["epochs"] == round(epochs["iters"] * epochs["batch_size"] / epochs["train_records"], 4)
    (answer,) = rec["targets"]
    assert answer.endswith("<turn|>") and "<|turn>" not in answer and rec["text"].endswith(answer + "\n")
    # Every rank's log came home; the checkpoint came from rank 0's host.
    logs = ROOT / f"runs/{run}/smoke/logs"
    assert {f"rank-{r}.log" for r in range(n)} <= {f.name for f in logs.iterdir()}
    assert (ROOT / f"runs/{run}/smoke/checkpoints/latest").is_file()
    # Rank 0 ran on fab1 and rank n-1 on its own host.
    joined = {r: json.loads((logs / f"rank-{r}.joined.json").read_text()) for r in range(n)}
    assert len({j["host"] for j in joined.values()}) == n
    assert (ROOT / f"runs/{run}/reproduce.sh").read_text().count("make smoke") == 1
    assert not any(no_trainer_left(fabric, hosts).values())


def smoke_fail(fabric, hosts, run, timeout=600, **extra):
    p = fmake(fabric, "smoke", *fab_vars(fabric, hosts, run, **extra), check=False, timeout=timeout)
    assert p.returncode != 0
    summary_path = ROOT / f"runs/{run}/smoke.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return p, summary


def test_rank_killed_mid_run_ends_launch_promptly(fabric_faults):
    fabric = fabric_faults
    hosts = ["fab1", "fab2"]
    run = "fab-kill"
    # A long smoke (many steps) so the kill lands mid-run.
    result = {}
    cfg = ROOT / "runs" / "fab-kill.yaml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text((ROOT / "configs/smoke.yaml").read_text().replace("iters: 6", "iters: 400")
                   .replace("save_every: 3", "save_every: 200"))
    t = threading.Thread(target=lambda: result.__setitem__("p", fmake(
        fabric, "smoke", *fab_vars(fabric, hosts, run, SMOKE_CONFIG=str(cfg)), check=False, timeout=600)))
    t.start()
    log = ROOT / f"runs/{run}/smoke/logs/launch-1.log"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and re.search(r"iter [3-9]\d* rank", log.read_text())):
        time.sleep(0.2)
    killed_at = time.time()
    assert fabric.kill("fab2", r"bin/train\.py"), "no rank process found on fab2"
    t.join(timeout=120)
    assert not t.is_alive(), "the launch did not end after rank 1 was killed"
    ended = time.time() - killed_at
    assert ended < 60, f"the launch took {ended:.0f} s to end after rank 1 died"
    assert result["p"].returncode != 0
    assert not any(no_trainer_left(fabric, hosts).values()), "a rank process outlived the launch"


def test_absurd_learning_rate_is_stability(fabric_faults):
    fabric = fabric_faults
    cfg = ROOT / "runs" / "fab-lr.yaml"
    cfg.write_text((ROOT / "configs/smoke.yaml").read_text().replace("learning_rate: 1e-5", "learning_rate: 1e30"))
    p, summary = smoke_fail(fabric, ["fab1", "fab2"], "fab-lr", SMOKE_CONFIG=str(cfg))
    assert summary["category"] == "learning rate or quantized LoRA stability", summary
    assert "RUNBOOK.md#learning-rate-or-lora-stability" in p.stderr


def train_directly(fabric, hosts, run):
    """bin/run.py --stage train on the hosts without make (so no sync or check-parity repairs or
    refuses the fault first)."""
    return subprocess.run([PY, "bin/run.py", "--stage", "train", "--run", run,
                           "--hostfile", str(fabric.hostfile(hosts)), "--config", "configs/smoke.yaml",
                           "--model", MODEL, "--dataset", DATASET, "--remote-root", fabric.remote_root,
                           "--python", fabric.python],
                          cwd=ROOT, env=fabric.env(), capture_output=True, text=True, timeout=600)


def test_dataset_missing_on_one_host_is_path_category(fabric_faults):
    fabric = fabric_faults
    hosts = ["fab1", "fab2"]
    fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-nodata"))
    # Remove the dataset on fab2 behind make's back, then launch the trainer directly (smoke
    # itself would re-sync and repair it first: that is the point of re-syncing).
    import shutil
    shutil.rmtree(host_file(fabric, "fab2", f"datasets/{DATASET}"))
    p = train_directly(fabric, hosts, "fab-nodata")
    assert p.returncode != 0
    summary = json.loads((ROOT / "runs/fab-nodata/train.json").read_text())
    assert summary["category"] == "export format or path consistency", summary
    assert "RUNBOOK.md#export-format-or-path-consistency" in p.stderr


def test_wrong_interpreter_on_one_host_is_runtime_parity(fabric_faults):
    fabric = fabric_faults
    hosts = ["fab1", "fab2"]
    fmake(fabric, "sync", *fab_vars(fabric, hosts, "fab-nopy"))
    fabric.hide_python("fab2")
    p = train_directly(fabric, hosts, "fab-nopy")
    assert p.returncode != 0
    summary = json.loads((ROOT / "runs/fab-nopy/train.json").read_text())
    assert summary["category"] == "runtime parity", summary
    assert "RUNBOOK.md#runtime-parity" in p.stderr
    # And make smoke refuses before launching: check-parity fails on that host.
    p = fmake(fabric, "smoke", *fab_vars(fabric, hosts, "fab-nopy"), check=False)
    assert p.returncode != 0 and "fab2" in p.stdout + p.stderr
    assert not (ROOT / "runs/fab-nopy/smoke.json").exists()
