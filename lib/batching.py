"""batching: the trainer's own batches (`batching: length`), cut by real token length.

mlx-lm 0.32.2 sorts records by `CacheDataset.itemlen`, which is the number of keys of the raw record,
so its batches are consecutive records in file order, fixed for the whole run (mlx-lm #596), and about
half of every position is padding on the sample corpus. Here, for each epoch:

1. a permutation of the trainable records, seeded by (seed, epoch), so an epoch's order is a
   function of the seed alone and a resume needs no replay;
2. within windows of WINDOW_BATCHES global batches, the records sorted by real token length;
3. the window cut into global batches of `batch_size` records (the epoch's last incomplete batch
   is left out, as mlx-lm leaves it out), and the batches taken in a seeded, shuffled order;
4. each micro-batch padded to its longest record, the inputs rounded up to a multiple of PAD_TO.

A global batch is split into shards as mlx-lm splits it (shard j of S takes records j, j + S, ...),
and each rank takes its shards, so the token-weighted gradient is the same for any split.

    plan = Plan(records, batch_size=8, seed=0)
    plan.epoch(0)[3]            # the record indices of epoch 0's fourth global batch
    collate([records[i] for i in batch[0::2]])  # a MicroBatch of (tokens, weights)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Inputs are padded to a multiple of PAD_TO. Each new shape costs the compiled step one trace and
# compile: measured here (tiny-gemma4, LoRA on every layer, chunked loss, 4 rows, CPU) about 0.2 s
# over a 0.3-0.4 s step once the kernels exist. For E2B on Metal the trace of 35 layers is the larger
# part: we estimate 1-2 s a shape against a step of several seconds at 4 x 2048 tokens. At 2048
# tokens PAD_TO 8 allows at most 256 shapes, met once each early in a run (under 5% of a 1,000-step
# run at the worst), while padding the sample corpus's short records to 32 would waste 21% of the
# positions instead of 7%.
PAD_TO = 8
# Records are sorted by length within windows of this many global batches (256 records at batch 8):
# long enough to leave little padding (7% on the sample corpus with PAD_TO 8, against 46% with
# mlx-lm's batches; 10% at 16 batches, 1.6% at 50 with PAD_TO 1), short enough that each window is
# a random draw from the whole corpus, so a batch holds records of similar length from any document.
WINDOW_BATCHES = 32


@dataclass(frozen=True)
class Record:
    """One record as trained: tokens (cut at max_seq_length), target spans, and its loss weight."""

    tokens: list[int]
    spans: list[tuple[int, int]]
    weight: float

    def targets(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True)
class MicroBatch:
    """What one forward pass takes: the arrays after the model (tokens, then weights or mlx-lm's
    lengths) and the counts that padding_fraction and the real-token throughput need."""

    arrays: tuple
    records: int
    real_tokens: int
    positions: int


def truncated(tokens: list[int], spans: list, weight: float, max_seq_length: int) -> Record:
    """The record cut from the right at max_seq_length, its spans cut with it (empty ones dropped)."""
    cut = [(a, min(b, max_seq_length)) for a, b in spans if a < max_seq_length]
    return Record(tokens[:max_seq_length], [(a, b) for a, b in cut if b > a], weight)


def padded_length(longest: int) -> int:
    """Tokens per row: the inputs (all but the last token) rounded up to a multiple of PAD_TO."""
    inputs = max(longest - 1, 1)
    return 1 + PAD_TO * ((inputs + PAD_TO - 1) // PAD_TO)


def collate(records: list[Record]) -> MicroBatch:
    """The records as (tokens [n, L] int32, weights [n, L - 1] float32): weights[r, j - 1] is the
    record's weight where token j is a target, else 0, so no pad and no prompt token is a target."""
    import mlx.core as mx

    width = padded_length(max(len(r.tokens) for r in records))
    tokens = np.zeros((len(records), width), np.int32)
    weights = np.zeros((len(records), width - 1), np.float32)
    for row, record in enumerate(records):
        tokens[row, : len(record.tokens)] = record.tokens
        for start, end in record.spans:
            weights[row, start - 1 : end - 1] = record.weight
    real = sum(len(r.tokens) for r in records)
    return MicroBatch((mx.array(tokens), mx.array(weights)), len(records), real, tokens.size)


def merge(batches: list[MicroBatch]) -> MicroBatch:
    """Several shards' micro-batches as one (rank_shares), each padded to the widest."""
    import mlx.core as mx

    width = max(b.arrays[0].shape[1] for b in batches)
    tokens = [mx.pad(b.arrays[0], [(0, 0), (0, width - b.arrays[0].shape[1])]) for b in batches]
    weights = [mx.pad(b.arrays[1], [(0, 0), (0, width - b.arrays[1].shape[1] - 1)]) for b in batches]
    arrays = (mx.concatenate(tokens), mx.concatenate(weights))
    records = sum(b.records for b in batches)
    real = sum(b.real_tokens for b in batches)
    return MicroBatch(arrays, records, real, records * width)


class Plan:
    """The global batches of every epoch: record indices, a function of (seed, epoch) alone."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, drop_last: bool = True):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.cached: tuple[int, list] | None = None

    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return len(self.lengths) // self.batch_size
        return -(-len(self.lengths) // self.batch_size)

    def epoch(self, epoch: int) -> list[list[int]]:
        if self.cached is None or self.cached[0] != epoch:
            self.cached = (epoch, self.build(epoch))
        return self.cached[1]

    def build(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths)).tolist()
        window = WINDOW_BATCHES * self.batch_size
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start : start + window], key=lambda i: (self.lengths[i], i))
            for at in range(0, len(chunk), self.batch_size):
                batches.append(chunk[at : at + self.batch_size])
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return [batches[i] for i in rng.permutation(len(batches)).tolist()]

    def at_step(self, it: int) -> list[int]:
        """The global batch of training iteration `it` (1-based), epochs following one another."""
        n = self.batches_per_epoch()
        return self.epoch((it - 1) // n)[(it - 1) % n]


def shard(batch: list[int], j: int, shards: int) -> list[int]:
    """Shard j of a global batch split in `shards`: mlx-lm's rule (records j, j + shards, ...)."""
    return batch[j::shards]

