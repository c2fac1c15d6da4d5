"""lib/checkpoint.py: atomic write, verification, fallback, retention, and SIGKILL while writing.

No mlx here: the checkpoint files are written by callables, so the same code path the
trainer uses is exercised with plain bytes (the trainer's own kill/resume tests are in
test_train.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import PY, ROOT

from lib import checkpoint as ckpt

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)


def payload(step: int, name: str, size: int = 4096) -> bytes:
    """Deterministic content of file `name` of checkpoint `step`."""
    seed = hashlib.sha256(f"{step}:{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def writers(step: int, size: int = 4096) -> dict:
    return {n: (lambda p, n=n: p.write_bytes(payload(step, n, size)))
            for n in ("adapters.safetensors", "optimizer.safetensors")}


def save(root, step, **state):
    return ckpt.save(root, step, writers(step), {"val_loss": None, **state})


def test_save_layout_and_verify(tmp_path):
    path = save(tmp_path, 3, val_loss=1.5)
    assert path.name == "step-0000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "adapters.safetensors", "manifest.json", "optimizer.safetensors", "state.json"]
    man = json.loads((path / "manifest.json").read_text())
    assert set(man["files"]) == {"adapters.safetensors", "optimizer.safetensors", "state.json"}
    assert man["files"]["adapters.safetensors"]["sha256"] == hashlib.sha256(
        payload(3, "adapters.safetensors")).hexdigest()
    assert ckpt.verify(path) == (True, "ok")
    assert ckpt.read_state(path)["step"] == 3
    assert (tmp_path / "latest").read_text() == "step-0000003\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporaries left"


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "adapters.safetensors").write_bytes(b"\0" + payload(4, "adapters.safetensors")[1:]),
     "sha256 mismatch in adapters.safetensors"),
    (lambda p: (p / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
    (lambda p: (p / "manifest.json").write_text('{"files": {"adapters.safet'), "manifest.json is unreadable"),
    (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda p: (p / "state.json").write_text("{}"), "sha256 mismatch in state.json"),
])
def test_damage_is_detected_and_resume_falls_back(tmp_path, damage, reason):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    damage(newest)
    ok, why = ckpt.verify(newest)
    assert not ok and why.startswith(reason), why
    chosen, skipped, notes = ckpt.find_resume(tmp_path)
    assert chosen.name == "step-0000002"
    assert skipped == [("step-0000004", why)]
    assert notes == ["`latest` says step-0000004; the newest verified checkpoint is step-0000002"]


def test_state_step_must_match_folder(tmp_path):
    p = save(tmp_path, 5)
    os.replace(p, tmp_path / "step-0000006")
    ok, why = ckpt.verify(tmp_path / "step-0000006")
    assert not ok and "says step 5" in why


def test_no_checkpoint_and_missing_pointer(tmp_path):
    assert ckpt.find_resume(tmp_path / "nothing") == (None, [], [])
    save(tmp_path, 1)
    (tmp_path / "latest").unlink()
    chosen, skipped, notes = ckpt.find_resume(tmp_path)
    assert chosen.name == "step-0000001" and not skipped and "missing" in notes[0]


def test_pick_quarantines_a_bad_one_out_of_the_listing(tmp_path):
    state = {"config": {}, "files_sha256": "f" * 64, "data": {"n_batches": 9}}
    save(tmp_path, 1, **state)
    bad = save(tmp_path, 2, **state)
    (bad / "adapters.safetensors").write_bytes(b"bad")
    said = []
    chosen, st = ckpt.pick(tmp_path, {}, "f" * 64, 9, lambda what, **kw: said.append(what))
    assert chosen.name == "step-0000001" and st["step"] == 1 and said == ["checkpoint-skip", "warning", "resume"]
    assert [p.name for p in ckpt.listing(tmp_path)] == ["step-0000001"]
    assert len(list(tmp_path.glob("quarantine-step-0000002-*"))) == 1


def test_prune_keeps_last_k_best_final_and_latest(tmp_path):
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: None, 5: 2.5, 6: None}
    for s, loss in losses.items():
        save(tmp_path, s, val_loss=loss, final=(s == 3))
    deleted = ckpt.prune(tmp_path, keep_last_k=2)
    assert sorted(deleted) == ["step-0000001", "step-0000004"]
    assert [p.name for p in ckpt.listing(tmp_path)] == ["step-0000006", "step-0000005", "step-0000003",
                                                        "step-0000002"]
    assert ckpt.best(tmp_path) == ("step-0000002", 1.0)
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, keep_last_k=1)


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    p = save(tmp_path, 2)
    (p / "adapters.safetensors").write_bytes(b"damaged")
    save(tmp_path, 2)
    assert ckpt.verify(p) == (True, "ok")
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]


WRITER = textwrap.dedent("""
    import hashlib, sys
    sys.path.insert(0, {root!r})
    from lib import checkpoint as ckpt
    root, size = sys.argv[1], int(sys.argv[2])
    def payload(step, name):
        seed = hashlib.sha256(f"{{step}}:{{name}}".encode()).digest()
        return (seed * (size // len(seed) + 1))[:size]
    ckpt.sweep_temporaries(root)
    chosen, _, _ = ckpt.find_resume(root)
    step = ckpt.read_state(chosen)["step"] if chosen else 0
    print("ready", flush=True)
    while True:
        step += 1
        ws = {{n: (lambda p, n=n: p.write_bytes(payload(step, n)))
              for n in ("adapters.safetensors", "optimizer.safetensors")}}
        ckpt.save(root, step, ws, {{"val_loss": 1.0 / step, "final": False}})
        ckpt.prune(root, 2)
""")


def test_sigkill_while_writing_never_yields_a_damaged_checkpoint(tmp_path):
    """A child writes (and prunes) checkpoints in a loop; it is SIGKILLed at random moments,
    over many trials. After each kill, the resume pick verifies, its content is exactly what
    was written for its step, the `latest` target verifies, and steps only move forward."""
    trials = 60
    size = 1 << 17  # 128 KiB per file: a write takes long enough to be hit mid-way
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(root=str(ROOT)))
    root = tmp_path / "checkpoints"
    rng = random.Random(7)
    last_step, hit_tmp = 0, 0
    for _ in range(trials):
        p = subprocess.Popen([PY, str(script), str(root), str(size)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))
        p.send_signal(signal.SIGKILL)
        p.wait()
        hit_tmp += any(x.name.startswith(".") for x in root.iterdir()) if root.is_dir() else 0
        chosen, skipped, _ = ckpt.find_resume(root)
        assert not skipped, f"a checkpoint-named folder failed verification: {skipped}"
        if chosen is None:
            continue
        step = ckpt.read_state(chosen)["step"]
        for name in ("adapters.safetensors", "optimizer.safetensors"):
            assert (chosen / name).read_bytes() == payload(step, name, size)
        pointer = ckpt.latest_pointer(root)
        assert pointer is not None and ckpt.verify(root / pointer)[0]
        assert step >= last_step
        last_step = step
    assert last_step > trials // 2, "the writer should make progress between kills"
    print(f"{trials} kills, {hit_tmp} landed mid-write (a temporary was left), newest step {last_step}")
    assert hit_tmp > 0, "no kill landed while a checkpoint was being written; the test did not test"


def test_sweep_removes_only_temporaries(tmp_path):
    save(tmp_path, 1)
    (tmp_path / ".step-0000002.abc.tmp").mkdir()
    (tmp_path / ".deleting-step-0000000.1").mkdir()
    assert sorted(ckpt.sweep_temporaries(tmp_path)) == [".deleting-step-0000000.1", ".step-0000002.abc.tmp"]
    assert [p.name for p in ckpt.listing(tmp_path)] == ["step-0000001"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---- the trainer's start: world size, archive, metrics -------------------------------------------
def test_world_change_needs_the_flag_token_weighting_and_a_divisor():
    from lib.log import RunbookError

    st = {"world_size": 2, "step": 3}
    assert ckpt.shards_for(st, 2, False, "mlx_lm") == (2, None)
    assert ckpt.shards_for(st, 1, True, "tokens") == (2, {"shards": 2, "world_size_from": 2, "world_size": 1,
                                                          "micro_batches": 2})
    # a checkpoint written after a world change keeps the run's shares: resuming it asks for the flag again
    assert ckpt.shards_for({"world_size": 1, "shards": 2}, 1, True, "tokens")[1]["micro_batches"] == 2
    for size, allow, avg in ((1, False, "tokens"), (1, True, "mlx_lm"), (3, True, "tokens")):
        with pytest.raises(RunbookError, match="--allow-world-change") as e:
            ckpt.shards_for({"world_size": 2}, size, allow, avg)
        assert e.value.anchor == "resume"


def test_archive_run_and_supersede_metrics(tmp_path):
    assert ckpt.archive_run(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "kind": k}) + "\n"
                                                    for s, k in ((1, "step"), (2, "step"), (3, "step"), (3, "done"))))
    assert ckpt.supersede_metrics(tmp_path, 1) == 3
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 3
    dest = ckpt.archive_run(tmp_path)
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoints", "metrics.jsonl", "metrics.superseded.jsonl"]
    assert not (tmp_path / "checkpoints").exists()
