"""The orchestrator's pure parts: failure categories, the pkill pattern, reproduce.sh (with the
dataset's export command, replayed through bin/export.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from lib import launch, supervisor
from lib.hostfile import parse


def res(rc=0, watchdog=False, done=True):
    return launch.LaunchResult(returncode=rc, wall_s=1.0, watchdog_fired=watchdog, steps=[1, 2], done=done)


def test_categories():
    ok = {"joined": {0: {}, 1: {}}, "failures": {}}
    assert launch.categorize(res(0), ok, 2) == (None, "")
    cat, why = launch.categorize(res(1), {"joined": {0: {}}, "failures": {}}, 2)
    assert cat == "runtime parity" and "[1]" in why
    cat, _ = launch.categorize(res(1), {"joined": {}, "failures": {}}, 2)
    assert cat == "runtime parity"
    nan = {"joined": {0: {}, 1: {}}, "failures": {0: {"category": "learning rate or quantized LoRA stability",
                                                        "message": "loss nan at step 3"}}}
    assert launch.categorize(res(1), nan, 2)[0] == "learning rate or quantized LoRA stability"
    data = {"joined": {0: {}}, "failures": {1: {"category": "export format or path consistency", "message": "x"}}}
    assert launch.categorize(res(1), data, 2)[0] == "export format or path consistency"
    assert launch.categorize(res(-15, watchdog=True), ok, 2)[0] == "hang / link partition"
    cfg = {"joined": {0: {}, 1: {}}, "failures": {0: {"category": None, "kind": "config", "message": "batch"}}}
    assert launch.categorize(res(2), cfg, 2) == ("config error", "rank 0: batch")
    oom = {"joined": {0: {}, 1: {}}, "failures": {1: {"category": None, "kind": "oom", "message": "x"}}}
    assert launch.categorize(res(13), oom, 2)[0] == "out of memory"
    assert launch.summarize(res(13), "out of memory", "x", {})["anchor"] == "out-of-memory"
    assert launch.categorize(res(137), ok, 2)[0] == "hang / link partition"
    # mlx.launch can exit 0 although a rank never started: joined markers decide.
    assert launch.categorize(res(0), {"joined": {0: {}}, "failures": {}}, 2)[0] == "runtime parity"
    assert launch.categorize(res(0, done=False), ok, 2)[0] == "hang / link partition"


def test_trainer_pattern_matches_only_this_run():
    pat = supervisor.pattern("stage1.a")  # its train, smoke and control ranks: one supervisor per RUN (#27)
    line = "/x/.venv/bin/python bin/train.py --config c --run-dir runs/stage1.a --seed 0"
    assert re.search(pat, line)
    for same in ("python bin/train.py --run-dir runs/stage1.a", "python bin/train.py --run-dir runs/stage1.a/smoke",
                 "bin/train.py --run-dir runs/stage1.a-control --seed 0"):
        assert re.search(pat, same), same
    for other in ("python bin/train.py --run-dir runs/stage1.a/smokey", "python bin/train.py --run-dir runs/stage1xa",
                  "python bin/train.py --run-dir runs/stage1.ab", "sh -c pkill " + pat):
        assert not re.search(pat, other), other
    # pkill's own regex engine (POSIX ERE) agrees.
    p = subprocess.run(["grep", "-E", "-c", pat], input=line + "\n" + "bin/train.py --run-dir runs/stage1.ab\n",
                       capture_output=True, text=True)
    assert p.stdout.strip() == "1"


def test_launch_argv_lists_not_strings():
    hf = parse({"backend": "ring", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]})
    argv = launch.launch_argv("h.json", hf, "/r/.venv/bin/python", "/r", ["--run-dir", "runs/x"], 40000)
    assert argv[:3] == ["nice", "-n", "19"] and argv[3].endswith("mlx.launch")  # its polling yields to the ranks
    assert argv[argv.index("--python") + 1] == "/r/.venv/bin/python"
    assert argv[argv.index("--") + 1] == "bin/train.py" and "--starting-port" in argv
    local = parse({"hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]})
    argv = launch.launch_argv("h.json", local, "/r/py", "/r", ["--run-dir", "runs/x"])
    assert argv[0].endswith("mlx.launch"), argv  # its local ranks are its children: never niced
    one = parse({"hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]})
    argv = launch.launch_argv("h.json", one, "/r/py", "/r", ["--run-dir", "runs/x"])
    assert argv[:2] == ["sh", "-c"] and "mlx.launch" not in " ".join(argv)
    remote = parse({"hosts": [{"ssh": "mac4", "ips": ["10.0.5.4"]}]})
    argv = launch.launch_argv("h.json", remote, "/r/py", "/r", ["--run-dir", "runs/x"])
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[argv.index("--") + 1] == "mac4"


def test_reproduce_keeps_each_stage(tmp_path):
    launch.write_reproduce(tmp_path, "smoke", ["make", "smoke", "RUN=r"], [["mlx.launch", "--", "bin/train.py"]])
    launch.write_reproduce(tmp_path, "train", ["make", "train", "RUN=r", "CONFIG=a b"], [["x"]])
    launch.write_reproduce(tmp_path, "smoke", ["make", "smoke", "RUN=r2"], [["y"]])
    text = (tmp_path / "reproduce.sh").read_text()
    assert text.count("# --- stage: smoke") == 1 and "RUN=r2" in text and "'CONFIG=a b'" in text
    assert "# --- stage: train" in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "reproduce.sh")]).returncode == 0


def test_reproduce_runs_stages_in_pipeline_order(tmp_path):
    for stage in ("train", "control", "smoke"):
        launch.write_reproduce(tmp_path, stage, ["make", stage], [])
    text = (tmp_path / "reproduce.sh").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("make ")]
    assert lines == ["make smoke", "make train", "make control"]


def test_an_oom_death_without_failure_file_is_named_and_gets_the_ladder(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("iter 3 rank 0 loss 2.0\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("libc++abi: terminating due to uncaught exception of type std::runtime_error: "
                "[metal::malloc] Attempting to allocate 9000000000 bytes\n")
    line = launch.oom_line(log, offset)
    assert line and "metal::malloc" in line
    assert launch.oom_line(log, log.stat().st_size) is None  # an earlier launch's text does not count
    ev = {"joined": {0: {}, 1: {}}, "failures": {}, "oom_line": line}
    assert launch.categorize(res(-11), ev, 2)[0] == "out of memory"
    cfg = {"batch_size": 8, "grad_accumulation_steps": 1, "iters": 100, "save_every": 10,
           "steps_per_eval": 10, "steps_per_report": 5, "max_seq_length": 2048}
    argv = ["mlx.launch", "--hostfile", "h.json", "--", "bin/train.py", "--config", "c.yaml",
            "--run-dir", "runs/x", "--expect-world-size", "2"]
    lines = launch.oom_ladder(cfg, argv, 2)
    cmds = [ln for ln in lines if not ln.startswith("#")]
    assert len(cmds) == 2 and all(c.startswith("mlx.launch --hostfile h.json -- bin/train.py") for c in cmds)
    assert "--batch-size 2" in cmds[0] and "--grad-accumulation-steps 4" in cmds[0] and "runs/x-oom1" in cmds[0]
    assert "--max-seq-length 1024" in cmds[1]
    # One remote host (the control on mac4): the rung is the same ssh command, its remote line changed.
    one = launch.launch_argv("h.json", parse([{"ssh": "mac4"}]), "/p/python", "/r",
                             ["--config", "c.yaml", "--run-dir", "runs/x-control"])
    cmds = [shlex.split(ln) for ln in launch.oom_ladder(cfg, one, 1) if not ln.startswith("#")]
    assert len(cmds) == 2 and all(c[:-1] == one[:-1] for c in cmds), cmds
    remote = shlex.split(cmds[0][-1])
    assert remote[:7] == shlex.split(one[-1])[:7] and "runs/x-control-oom1" in remote and "--batch-size" in remote


def test_reproduce_starts_with_the_export_that_made_the_dataset(tmp_path, monkeypatch):
    """reproduce.sh's first make line is the dataset's export (corpus, settings, sha256 from
    its manifest); run with the same corpus it gives the same dataset_sha256."""
    import json
    import shlex
    import sys

    from conftest import ROOT

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join((ROOT / "datasets" / "sample" / "corpus.jsonl").read_text().splitlines(True)[:120]))
    flags = ["--ratios", "80,10,10", "--max-chars", "4000", "--text-user-prompt",
             "Say it: 'quoted' & $HOME", "--split-by", "record"]  # not the default: carried
    subprocess.run([sys.executable, "bin/export.py", str(corpus), "--out", str(tmp_path / "orig"), *flags],
                   cwd=ROOT, check=True, capture_output=True)
    monkeypatch.setattr(launch.paths, "DATASETS", tmp_path)
    (tmp_path / "run").mkdir()
    launch.write_reproduce(tmp_path / "run", "train", ["make", "train", "DATASET=orig"], [], dataset="orig")
    text = (tmp_path / "run" / "reproduce.sh").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "reproduce.sh")]).returncode == 0
    makes = [ln for ln in text.splitlines() if ln.startswith("make ")]
    assert makes[0].startswith("make export ") and makes[1] == "make train DATASET=orig"
    man = json.loads((tmp_path / "orig" / "manifest.json").read_text())
    assert man["corpus_sha256"] in text and man["dataset_sha256"] in text
    words = dict(w.split("=", 1) for w in shlex.split(makes[0])[2:])
    assert words["DATASET"] == "orig" and words["CORPUS"] == man["sources"][0]["path"]
    # What make's recipe runs with those variables reproduces the dataset byte for byte.
    subprocess.run([sys.executable, "bin/export.py", *words["CORPUS"].split(), "--out", str(tmp_path / "again"),
                    *shlex.split(words["EXPORT_ARGS"])], cwd=ROOT, check=True, capture_output=True)
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert again["dataset_sha256"] == man["dataset_sha256"] and again["settings"] == man["settings"]


def test_a_corpus_name_with_a_newline_cannot_become_a_command_in_reproduce_sh(tmp_path, monkeypatch):
    """reproduce.sh names each corpus file in a comment; a newline in the name must not end it."""
    import json
    import shlex

    monkeypatch.setattr(launch.paths, "DATASETS", tmp_path)
    (tmp_path / "d").mkdir()
    evil = "a.jsonl\ntouch pwned\n#"
    (tmp_path / "d" / "manifest.json").write_text(json.dumps({"sources": [{"path": evil, "sha256": "ab"}]}))
    launch.write_reproduce(tmp_path, "smoke", ["make", "smoke"], [], dataset="d")
    lines = (tmp_path / "reproduce.sh").read_text().split("\n# --- stage: export ---\n", 1)[1].split("\n\n")[0]
    cmds = [w for w in shlex.split(lines, comments=True)]
    assert cmds[:2] == ["make", "export"] and f"CORPUS={evil}" in cmds and "touch" not in cmds, cmds


def test_reproduce_exports_a_dataset_of_exporter_2_0_by_record(tmp_path, monkeypatch):
    """#39: a manifest without split_by was split by record; its export line says so, or the new
    default (split_by source) would make another dataset."""
    import json
    import shlex

    monkeypatch.setattr(launch.paths, "DATASETS", tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({
        "sources": [{"path": "c.jsonl", "sha256": "ab"}], "settings": {"max_chars": 900},
        "split": {"key": "record_id"}}))
    line = launch.export_section("old")[-1]
    words = dict(w.split("=", 1) for w in shlex.split(line)[2:])
    assert shlex.split(words["EXPORT_ARGS"]) == ["--max-chars=900", "--split-by=record"], line


def test_reproduce_says_when_the_corpus_is_not_recorded(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(launch.paths, "DATASETS", tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({"dataset_sha256": "ab" * 32}))
    launch.write_reproduce(tmp_path, "smoke", ["make", "smoke"], [], dataset="old")
    text = (tmp_path / "reproduce.sh").read_text()
    assert "corpus not recorded" in text and text.index("stage: export") < text.index("stage: smoke")
    assert [ln for ln in text.splitlines() if ln.startswith("make ")] == ["make smoke"]


def test_operator_sees_one_step_line_per_report_not_the_per_rank_lines():
    w = launch.Watch(launch.LaunchResult(returncode=-1, wall_s=0), total=100)
    assert w.saw("iter 1 rank 1 loss 8.1 rank_loss 8.2 tokens 900 step_s 0.5\n", 10.0) is None
    assert w.saw("iter 2 rank 0 loss 8.0 rank_loss 8.0 tokens 900 step_s 0.5\n", 12.0) is None
    line = w.saw("iter 2 train_loss 8.05 lr 1e-05 tok/s 1800.4 peak_mem_gb 1.25 trained_tokens 3600 it/s 2\n", 12.0)
    assert line == "step 2/100 loss 8.05 tok/s 1800 eta 00:03:16 peak_mem_gb 1.25"  # 98 steps x 2 s
    assert w.saw("val step 2 val_loss 7.9 val_s 0.1\n", 12.5) == "val step 2 val_loss 7.9 val_s 0.1"
    assert w.res.steps == [1, 2] and w.res.step_times == [2.0]


def test_conclude_puts_the_trainers_no_improvement_warning_in_the_summary(tmp_path, capsys):
    """#18: a run whose final validation loss is not below step 0's says so in train.json and on Mac1."""
    import json

    warn = {"step": 20, "kind": "warning", "what": "no-improvement", "loss": 8.1, "val_loss_step0": 8.0,
            "message": "the final validation loss 8.1 (step 20) is not below step 0's 8.0"}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "step", "loss": 8.0}) + "\n"
                                            + json.dumps(warn) + "\n")
    (tmp_path / "manifest.json").write_text("{}")
    summary = {"ok": True, "category": None, "why": "", "run": "r", "total_wall_s": 1.0, "test_loss": 8.2}
    assert launch.conclude(tmp_path, "train", summary, {}, [], 2) == 0
    assert json.loads((tmp_path / "train.json").read_text())["warnings"] == [warn]
    out = capsys.readouterr().out
    assert "warning stage train what no-improvement" in out and "not below step 0" in out


def test_each_stages_make_line_sets_the_config_its_recipe_reads():
    """reproduce.sh's `make smoke` line must set SMOKE_CONFIG (what the smoke recipe passes as
    --config), train's and control's CONFIG: else the copied line runs another config."""
    from argparse import Namespace

    from conftest import ROOT

    text = (ROOT / "Makefile").read_text()
    args = Namespace(run="r", hostfile="h.json", config="runs/c.yaml", model="m", dataset="d", remote_root="/r",
                     python="py", seed=None, watchdog=None, port=None)
    for stage, script in (("smoke", r"bin/smoke\.py"), ("train", r"bin/run\.py --stage train"),
                          ("control", r"bin/run\.py --stage control")):
        var = re.search(script + r" --config \$\((\w+)\)", text)[1]
        v = launch.variables(args, stage)
        assert v[var] == "runs/c.yaml" and list(v.values()).count("runs/c.yaml") == 1, (stage, var, v)
    args.seed = 0  # a seed of 0 is a value the make line must carry, not an unset one
    assert launch.variables(args, "train")["SEED"] == "0" and "SEED" not in launch.variables(
        Namespace(**{**vars(args), "seed": None}), "train")


def load_run_py():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("run_stage", ROOT / "bin" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


JACCL = {"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
    {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3", "rdma_en4"]},
    {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None, "rdma_en5"]},
    {"ssh": "c", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en5", None]}]}


def test_the_controls_one_host_hostfile_parses_for_every_backend(tmp_path, monkeypatch):
    """A jaccl hostfile's control gets a 1 x 1 rdma matrix ([null]); ring's keeps none."""
    from argparse import Namespace

    mod = load_run_py()
    monkeypatch.setattr(mod.paths, "RUNS", tmp_path)
    ring = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]}
    for data, host, want in ((JACCL, "", ("a", ["10.0.0.1"], [None])), (JACCL, "b", ("b", ["10.0.0.2"], [None])),
                             (JACCL, "mac9", ("mac9", [], [None])), (ring, "", ("a", ["10.0.0.1"], []))):
        args = Namespace(run="r", hostfile="h.json", control_host=host, rank_batches=[5, 3], rank_shares=[5, 3])
        dual, one = mod.control_setup(args, parse(data, "h.json"))
        assert (args.rank_batches, args.rank_shares) == ([8], None)  # the control: one rank, the whole batch
        assert dual == {"RUN": "r", "HOSTFILE": "h.json", "CONTROL_HOST": host} and args.run == "r-control"
        assert one.size == 1 and one.backend == data["backend"] and one.envs == data.get("envs", [])
        assert (one.hosts[0].ssh, one.hosts[0].ips, one.hosts[0].rdma) == want
        assert args.hostfile == str(tmp_path / "r-control" / "hostfile.json")


def test_a_fallback_drops_the_lost_hosts_rdma_columns_too(tmp_path, monkeypatch):
    from argparse import Namespace
    from types import SimpleNamespace

    mod = load_run_py()
    monkeypatch.setattr(mod.paths, "RUNS", tmp_path)
    monkeypatch.setattr(mod, "run_on", lambda host, argv, timeout: SimpleNamespace(ok=False))
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    monkeypatch.setattr(mod.subprocess, "run", lambda argv, **kw: SimpleNamespace(returncode=0))
    args = Namespace(run="r", hostfile="h.json", fallback=True, restarts=1, python="py", remote_root="/r",
                     rank_shares=[2, 1, 1], rank_batches=[4, 2, 2])
    swept = {"a": "clean", "b": "unreachable: x", "c": "clean"}  # the launch's sweep
    hf, rec, go = mod.recover(args, parse(JACCL, "h.json"), 1, swept)
    assert go and rec["fallback"]["lost"] == ["b"] and [h.ssh for h in hf.hosts] == ["a", "c"]
    # #29: the hosts left keep their shares (2:1), re-normalized over the same global batch of 8
    assert args.rank_shares == [2, 1] and rec["fallback"]["rank_batches"] == args.rank_batches == [5, 3]
    assert [h.rdma for h in hf.hosts] == [[None, "rdma_en4"], ["rdma_en4", None]] and hf.backend == "jaccl"


def test_shares_that_do_not_fit_the_hostfile_are_refused_before_a_launch(tmp_path):
    """#29: a rank_shares list of another length than the hostfile's ranks, or auto with no calibration of
    these hosts, stops `make train` before anything starts on a host (no manifest, no launch log). The
    hosts are names no calibration in runs/ has, and nothing reaches them."""
    import json

    from conftest import PY, ROOT, run

    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "mac4-nowhere", "ips": ["10.9.0.1"]},
                                                                 {"ssh": "mac5-nowhere", "ips": ["10.9.0.2"]}]}))
    run_id = f"shares-refused-{os.getpid()}"
    for shares, want in (("[2, 1, 1]", r"rank_shares \[2, 1, 1\] is not one share per rank: the hostfile has 2"),
                         ("auto", r"rank_shares: auto, but runs/ has no calibration of these hosts \(mac4-nowhere, "
                                  r"mac5-nowhere\) at batch_size 8 \(and this config's max_seq_length, .*\): run `make calibrate` "
                                  r"with it first")):
        cfg = tmp_path / "shares.yaml"
        cfg.write_text((ROOT / "configs" / "demo.yaml").read_text() + f"rank_shares: {shares}\n")
        p = run([PY, "bin/run.py", "--stage", "train", "--run", run_id, "--hostfile", str(hostfile), "--config",
                 str(cfg), "--model", "models/tiny-gemma4", "--dataset", "demo", "--remote-root", str(ROOT),
                 "--python", PY], check=False)
        assert p.returncode == 2 and re.search(want, p.stderr), p.stderr
        assert not (ROOT / "runs" / run_id).exists(), "something was written before the refusal"


def test_auto_shares_come_from_the_newest_calibration_of_these_hosts_at_this_batch(tmp_path, monkeypatch):
    """#29: rank_shares: auto takes the shares of the newest calibration whose hosts (in rank order) and
    step settings are the run's; a newer one of other hosts, another batch or sequence length is not it."""
    import json

    from lib import config as C
    from lib import paths

    def cal(name, hosts, batch, shares):
        doc = {"hostfile": {"hosts": [{"ssh": h} for h in hosts]}, "config": {"batch_size": batch},
               "rank_shares": {"shares": shares, "rule": "proportional"}}
        (tmp_path / f"calibration-{name}.json").write_text(json.dumps(doc))

    monkeypatch.setattr(paths, "RUNS", tmp_path)
    cal("20261201T000000Z", ["mac4", "mac5"], 8, [5, 3])
    cal("20261202T000000Z", ["mac4", "mac5"], 8, [3, 1])
    cal("20261203T000000Z", ["mac5", "mac4"], 8, [1, 3])  # the same Macs, other ranks
    cal("20261204T000000Z", ["mac4", "mac5"], 16, [9, 7])  # another batch
    assert C.calibrated_shares(["mac4", "mac5"], {"batch_size": 8}, "c.yaml") == [3, 1]
    # calibrated at another sequence length (the docs above have none): not this config's shares
    with pytest.raises(C.ConfigError, match=r"at batch_size 8 \(and this config's max_seq_length, num_layers"):
        C.calibrated_shares(["mac4", "mac5"], {"batch_size": 8, "max_seq_length": 512}, "c.yaml")

    with pytest.raises(C.ConfigError, match=r"c.yaml: rank_shares: auto, but runs/ has no calibration of these "
                                            r"hosts \(mac4, mac6\) at batch_size 8"):
        C.calibrated_shares(["mac4", "mac6"], {"batch_size": 8}, "c.yaml")


def test_auto_shares_that_come_out_even_still_reach_every_rank(tmp_path, monkeypatch):
    """#29: a calibration that finds the Macs equal resolves rank_shares: auto to even shares. The ranks
    still get them as --rank-shares (they read the config themselves and cannot resolve auto): before, the
    launcher passed none and every rank stopped with "rank_shares auto is not one share per rank"."""
    import argparse
    import json

    import yaml
    from conftest import ROOT

    from lib import config as C
    from lib import paths

    monkeypatch.setattr(paths, "RUNS", tmp_path)
    monkeypatch.setattr(supervisor, "hold", lambda args, stage: None)
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()) | {"rank_shares": "auto"}
    (config := tmp_path / "auto.yaml").write_text(yaml.safe_dump(cfg))
    loaded = C.load_config(str(config))  # a calibration of this config: its keys that shape a step
    (tmp_path / "calibration-20261201T000000Z.json").write_text(json.dumps(
        {"hostfile": {"hosts": [{"ssh": "mac4"}, {"ssh": "mac5"}]}, "config": {k: loaded[k] for k in C.SHARE_KEYS},
         "rank_shares": {"shares": [1, 1], "rule": "equal"}}))
    (hostfile := tmp_path / "hostfile.json").write_text(json.dumps(
        {"backend": "ring", "hosts": [{"ssh": "mac4", "ips": ["10.9.0.1"]}, {"ssh": "mac5", "ips": ["10.9.0.2"]}]}))
    args = argparse.Namespace(run="auto-even", hostfile=str(hostfile), config=str(config), watchdog=None,
                              model="models/m", dataset="d", seed=None)
    launch.load_inputs(args, "train")
    assert args.rank_batches == [cfg["batch_size"] // 2] * 2
    targs = launch.trainer_args(args, "runs/auto-even", str(config))
    assert targs[targs.index("--rank-shares") + 1] == "[1, 1]", targs
    with pytest.raises(C.ConfigError, match="rank_shares: auto reached a rank unresolved: launch through make"):
        C.rank_batches(cfg, 2)  # what a rank without them would meet, said plainly
