"""Each step's global batch is fixed before it is split: the same examples whatever the micro-batch
size, accumulation and number of ranks; padded steps are length-grouped, packed ones full."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.spec import JobSpec
from training.batches import epoch_steps, rank_share, split_step, total_steps

# The same effective batch of 4 split three ways: micro x accumulation x ranks.
SPLITS = [
    {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "num_gpus": 1},
    {"micro_batch_size": 1, "gradient_accumulation_steps": 4, "num_gpus": 1},
    {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
]


def spec(**kw) -> JobSpec:
    return JobSpec(**{"base_model": "tiny", "dataset_id": "testdata01", "max_seq_len": 128, **kw})


def lengths(n: int = 300) -> list[int]:
    rng = np.random.default_rng(1)
    return np.clip(rng.lognormal(np.log(40), 0.7, n), 4, 128).astype(int).tolist()


@pytest.mark.parametrize("packing", [False, True])
def test_a_steps_examples_do_not_depend_on_the_split(packing: bool) -> None:
    lens = lengths()
    for epoch in (0, 3):
        per_split = [epoch_steps(spec(packing=packing, **s), lens, epoch) for s in SPLITS]
        assert per_split[0] == per_split[1] == per_split[2]
        assert len(per_split[0]) == total_steps(spec(packing=packing, epochs=1, **SPLITS[0]), lens)
    # ...but they do depend on the effective batch
    assert epoch_steps(spec(packing=packing, micro_batch_size=8), lens, 0) != per_split[0]


@pytest.mark.parametrize("split", SPLITS)
def test_splits_partition_each_step(split: dict) -> None:
    lens = lengths()
    for packing in (False, True):
        s = spec(packing=packing, **split)
        steps = epoch_steps(s, lens, 0)
        assert sorted(i for step in steps for row in step for i in row) == list(range(len(lens)))
        for step in steps:
            micro = split_step(s, lens, step)
            assert sorted(i for m in micro for i in m) == sorted(i for row in step for i in row)
            assert all(sum(lens[i] for i in row) <= s.max_seq_len for row in step)
            assert all(sum(lens[i] for i in m) <= s.micro_batch_size * s.max_seq_len for m in micro)
            assert packing or all(len(m) <= s.micro_batch_size for m in micro)
            # no fragmentation: a full step is exactly accumulation x ranks micro-batches
            assert len(micro) == math.ceil(len(step) / s.micro_batch_size)
        assert sum(len(step) != 4 for step in steps) <= 1  # one shorter step: the epoch's remainder


def test_padded_steps_are_a_seeded_length_grouped_partition() -> None:
    lens = [(i * 37) % 101 + 1 for i in range(200)]
    s = spec(packing=False, micro_batch_size=4, seed=7)
    b0 = epoch_steps(s, lens, 0)
    assert b0 == epoch_steps(s, lens, 0)  # resumable: a pure function
    assert b0 != epoch_steps(s, lens, 1)
    assert b0 != epoch_steps(spec(packing=False, micro_batch_size=4, seed=8), lens, 0)
    assert all(len(row) == 1 for b in b0 for row in b)  # a padded row is one example
    b0 = [[row[0] for row in b] for b in b0]
    assert sorted(i for b in b0 for i in b) == list(range(200))
    spread = sum(max(lens[i] for i in b) - min(lens[i] for i in b) for b in b0) / len(b0)
    assert spread < 10  # random batches of 4 would spread ~50 on lengths 1..101
    # Within a step, micro-batches are cut from the examples sorted by length.
    wide = spec(packing=False, micro_batch_size=2, gradient_accumulation_steps=8)
    for step in epoch_steps(wide, lens, 0):
        micro = split_step(wide, lens, step)
        assert [lens[i] for m in micro for i in m] == sorted((lens[row[0]] for row in step), reverse=True)


def test_rank_share_deals_micro_batches_and_pads_the_short_rank() -> None:
    assert rank_share(5, 0, 2) == ([0, 2, 4], 0)
    assert rank_share(5, 1, 2) == ([1, 3], 1)
    assert rank_share(1, 1, 2) == ([], 1)


def short_lengths(n: int = 160) -> list[int]:
    """`n` short examples (25-49 tokens): many fit a packed row of 512."""
    return np.random.default_rng(0).integers(25, 50, n).tolist()


@pytest.mark.parametrize(("per_step", "steps"), [(None, 9), (1, 480), (8, 60)])
def test_examples_per_step_counts_examples_not_packed_rows(per_step: int | None, steps: int) -> None:
    """160 short examples, 3 epochs: a step of 4 packed rows (today's native default) holds ~50 examples,
    so 9 steps; with examples_per_step (/v1's batch_size) a step is that many examples: 480 or 60."""
    lens = short_lengths()
    s = spec(max_seq_len=512, epochs=3, examples_per_step=per_step)
    assert total_steps(s, lens) == steps == sum(len(epoch_steps(s, lens, e)) for e in range(3))
    if per_step is None:
        return
    for epoch in range(3):
        epoch_of = epoch_steps(s, lens, epoch)
        sizes = [sum(len(row) for row in step) for step in epoch_of]
        assert sizes == [per_step] * len(sizes)  # 160 divides evenly: every step holds exactly that many
        assert sorted(i for step in epoch_of for row in step for i in row) == list(range(160))
        assert all(sum(lens[i] for i in row) <= 512 for step in epoch_of for row in step)


@pytest.mark.parametrize("packing", [False, True])
def test_an_examples_per_step_batch_does_not_depend_on_the_split(packing: bool) -> None:
    """The same examples at every step whatever micro x accumulation x ranks; packed, a step runs as many
    micro-batches as its rows fill (at most ceil(examples / micro)); the last step holds the rest."""
    lens = lengths(302)
    per_split = []
    for split in SPLITS:
        s = spec(packing=packing, examples_per_step=12, **split)
        steps = epoch_steps(s, lens, 1)
        per_split.append(steps)
        sizes = sorted(sum(len(row) for row in step) for step in steps)
        assert sizes == [2] + [12] * 25  # 302 = 25 x 12 + 2
        for step in steps:
            micro = split_step(s, lens, step)
            assert sorted(i for m in micro for i in m) == sorted(i for row in step for i in row)
            assert len(micro) <= math.ceil(12 / s.micro_batch_size)
            assert all(sum(lens[i] for i in m) <= s.micro_batch_size * s.max_seq_len for m in micro)
    assert per_split[0] == per_split[1] == per_split[2]
    other = spec(packing=packing, examples_per_step=12, micro_batch_size=8, gradient_accumulation_steps=3)
    assert epoch_steps(other, lens, 1) == per_split[0]  # micro x accumulation need not be the batch
    assert epoch_steps(spec(packing=packing, examples_per_step=6), lens, 1) != per_split[0]
