"""lib/batching.py, the trainer's batches under `batching: length` (issue 39).

What is proven here:
- every epoch is a seeded permutation cut into full global batches, another each epoch, the
  same for the same seed, each batch records of similar length;
- a micro-batch's targets are its records' target spans with their weights: no pad, no prompt;
- on the sample corpus the padding is at most 10% of the positions, where mlx-lm's own
  iterate_batches pads about 40% of them (both counted here from the arrays the batchers yield).
"""

from __future__ import annotations

import types

import pytest
from conftest import ROOT, SAMPLE_DATASET
from test_train import load_trainer

from lib import batching, chat, jsonl
from lib import config as C

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)


def test_each_epoch_is_a_seeded_permutation_cut_into_full_batches():
    lengths = [(i * 37) % 101 + 1 for i in range(203)]
    plan = batching.Plan(lengths, batch_size=8, seed=4)
    n = plan.batches_per_epoch()
    assert n == 203 // 8
    epochs = [plan.epoch(e) for e in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(batches) == n and all(len(b) == 8 for b in batches)
        assert len(set(flat)) == len(flat)  # no record twice in an epoch
        assert all(lengths[b[0]] <= lengths[b[-1]] for b in batches)  # sorted inside the batch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    again = batching.Plan(lengths, batch_size=8, seed=4)
    assert [again.at_step(it) for it in range(1, 3 * n + 1)] == [b for e in epochs for b in e]
    assert batching.Plan(lengths, batch_size=8, seed=5).epoch(0) != epochs[0]
    spread = [lengths[b[-1]] - lengths[b[0]] for b in epochs[0]]
    assert sum(spread) / len(spread) < 10  # similar lengths together (lengths span 1..101)
    scoring = batching.Plan(lengths, batch_size=8, seed=4, drop_last=False)
    assert sorted(i for b in scoring.epoch(0) for i in b) == list(range(203))  # every record scored


def test_a_micro_batch_holds_the_targets_with_their_weights_and_nothing_else():
    a = batching.Record([2, 10, 11, 12, 13, 14], [(3, 6)], 1.0)
    b = batching.Record([2, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [(2, 4), (8, 12)], 0.5)
    micro = batching.collate([a, b])
    tokens, weights = (x.tolist() for x in micro.arrays)
    assert len(tokens[0]) == 1 + 16 and len(weights[0]) == 16  # inputs rounded up to PAD_TO (8)
    assert tokens[0] == [2, 10, 11, 12, 13, 14] + [0] * 11
    assert weights[0] == [0, 0, 1, 1, 1] + [0] * 11  # tokens 3..5 are predicted at inputs 2..4
    assert weights[1] == [0, 0.5, 0.5, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5] + [0] * 5  # no pad target
    assert (micro.records, micro.real_tokens, micro.positions) == (2, 18, 34)
    cut = batching.truncated(b.tokens, b.spans, 0.5, 6)
    assert cut.tokens == b.tokens[:6] and cut.spans == [(2, 4)]
    assert batching.truncated(b.tokens, b.spans, 0.5, 8).spans == [(2, 4)]
    assert batching.truncated(a.tokens, a.spans, 1.0, 3).spans == []  # the whole answer lost


@pytest.fixture(scope="module")
def sample(demo_inputs):
    """The sample corpus's train split as the trainer renders it (mask_prompt: true, thinking off)."""
    from mlx_lm.utils import load

    _, tok = load(str(ROOT / "models" / "tiny-gemma4"))
    cfg = {**C.DEFAULTS, "mask_prompt": True, "chat_template_args": {"enable_thinking": False},
           "max_seq_length": 192}
    renderer = chat.Renderer(tok, cfg)
    records = list(jsonl.read(ROOT / "datasets" / SAMPLE_DATASET / "train.jsonl"))
    return tok, cfg, [batching.truncated(*renderer_parts(renderer, r), 1.0, 192) for r in records]


def renderer_parts(renderer, record):
    rendered = renderer.record(record)
    return rendered.tokens, rendered.spans


def test_padding_on_the_sample_corpus_is_a_tenth_of_mlx_lms(sample):
    """Two ranks' micro-batches over one epoch, counted from the arrays each batcher yields."""
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    tok, cfg, records = sample
    cfg = {**cfg, "batch_size": 8, "seed": 0}
    trainer = load_trainer()
    ranks = [trainer.LengthBatches(records, cfg, [j], 2) for j in (0, 1)]
    n = ranks[0].plan.batches_per_epoch()
    real, positions = 0, 0
    for it in range(1, n + 1):
        for rank in ranks:
            (micro,) = rank.next(it)
            tokens = micro.arrays[0]
            real += int((tokens != 0).sum().item())  # no record token is 0 (<pad>)
            positions += tokens.size
    ours = 1 - real / positions
    # mlx-lm's own batches of the same records: its CacheDataset, whose itemlen counts a raw record's
    # keys (mlx-lm #596), so its sort by length sorts nothing
    raw = list(jsonl.read(ROOT / "datasets" / SAMPLE_DATASET / "train.jsonl"))
    ds = chat.dataset(raw, tok, {**cfg, "batching": "mlx_lm"})
    real_m, positions_m = 0, 0
    for j in (0, 1):
        group = types.SimpleNamespace(rank=lambda j=j: j, size=lambda: 2)
        np.random.seed(0)
        for tokens, lengths in iterate_batches(ds, 8, 192, comm_group=group):
            real_m += int(lengths[:, 1].sum().item())
            positions_m += tokens.size
    theirs = 1 - real_m / positions_m
    print(f"padding over one epoch of the sample corpus: ours {ours:.3f}, mlx-lm's {theirs:.3f}")
    assert ours <= 0.10 and theirs >= 0.35

