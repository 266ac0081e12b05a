"""The largest micro-batch the planner re-plans with (training.memory.batch_shape) is the one the engine
forms: checked against the tensors training.step.make_batch collates for every micro-batch of the run."""

from __future__ import annotations

import numpy as np
import pytest

from core.spec import JobSpec
from training import batches
from training.data import IGNORE, PAD_MULTIPLE, Tokenized
from training.memory import batch_shape
from training.objectives.dpo.pairs import Pair, Sequences, sequence_indices
from training.rollouts import Completion, PromptItem
from training.step import count_targets, make_batch

PAD = 0


def spec(**kw) -> JobSpec:
    base = {"base_model": "tiny", "dataset_id": "testdata01", "max_seq_len": 96, "epochs": 2}
    return JobSpec(**{**base, **kw})


def examples(n: int = 90, seed: int = 3) -> list[Tokenized]:
    """Examples of varied lengths, a prompt (no targets) then a reply."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        total, prompt = int(rng.integers(6, 96)), int(rng.integers(1, 5))
        ids = rng.integers(1, 50, total).tolist()
        out.append(Tokenized(ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def pairs(n: int = 60) -> list[Pair]:
    sides = examples(2 * n, seed=5)
    return [Pair(chosen=sides[2 * i], rejected=sides[2 * i + 1], prompt_len=1) for i in range(n)]


def engine_micro_batches(s: JobSpec, items: list, dpo: bool) -> list[dict]:
    """Every micro-batch the run trains on, collated as training does (dpo: both sides of each pair)."""
    lengths = [x.length for x in items]
    seqs = Sequences(items) if dpo else items
    steps = [step for epoch in range(s.epochs) for step in batches.epoch_steps(s, lengths, epoch)]
    out = []
    for step in steps[: s.max_steps]:
        for micro in batches.split_step(s, lengths, step):
            indices = sequence_indices(micro) if dpo else micro
            out.append(make_batch(s, seqs, indices, PAD))
    return out


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("objective", ["sft", "dpo"])
@pytest.mark.parametrize("micro", [1, 4])
def test_the_shape_is_the_largest_micro_batch_the_engine_collates(
    packing: bool, objective: str, micro: int
) -> None:
    dpo = objective == "dpo"
    s = spec(packing=packing, objective=objective, micro_batch_size=micro, gradient_accumulation_steps=2)
    items = pairs() if dpo else examples()
    shape = batch_shape(s, items)
    assert shape is not None
    collated = engine_micro_batches(s, items, dpo)
    assert shape.tokens == max(b["input_ids"].numel() for b in collated)
    assert shape.targets == max(count_targets(b) for b in collated)
    widths = [max(p.chosen.length, p.rejected.length) for p in items] if dpo else [x.length for x in items]
    assert shape.seq_len == max(widths)
    # never more than the worst case admission plans with; padded, less (no example is max_seq_len long,
    worst = micro * s.sequences_per_example * s.max_seq_len
    assert shape.tokens <= worst
    # but a width rounds up to PAD_MULTIPLE: within that of max_seq_len it reaches it)
    assert packing or shape.tokens < worst or max(widths) > s.max_seq_len - PAD_MULTIPLE


def test_max_steps_ends_the_scan_where_the_run_ends() -> None:
    s = spec(micro_batch_size=2, gradient_accumulation_steps=2, packing=False, max_steps=3)
    items = examples()
    shape = batch_shape(s, items)
    assert shape is not None
    collated = engine_micro_batches(s, items, dpo=False)
    assert len(collated) == 3 * 2  # 3 steps x accumulation 2
    assert shape.tokens == max(b["input_ids"].numel() for b in collated)


@pytest.mark.parametrize("packing", [False, True])
def test_grpo_shape_is_the_largest_micro_batch_of_full_length_completions(packing: bool) -> None:
    """grpo's completions are sampled in the step: at their longest (max_completion_tokens each), the
    micro-batches the engine trains are those of the shape; its width is the longest prompt of either split
    plus the completions."""
    n, completion = 4, 16
    s = spec(
        objective="grpo", grader={"type": "string_check", "name": "x", "operation": "eq", "input": "a",
                                  "reference": "a"},
        num_generations=n, max_completion_tokens=completion, micro_batch_size=2,
        gradient_accumulation_steps=2, packing=packing,
    )  # fmt: skip
    rng = np.random.default_rng(7)
    prompts = [PromptItem(rng.integers(1, 50, int(rng.integers(4, 60))).tolist(), {}) for _ in range(30)]
    held_out = [PromptItem([1] * 70, {})]  # evaluation samples it too
    shape = batch_shape(s, prompts, held_out)
    assert shape is not None
    lengths = [p.length for p in prompts]
    full = Completion(ids=[7] * completion, text="", truncated=True)
    collated = []
    for epoch in range(s.epochs):
        for step in batches.epoch_steps(s, lengths, epoch):
            for micro in batches.split_step(s, lengths, step):
                seqs = [full.sequence(prompts[i].input_ids) for i in micro for _ in range(n)]
                collated.append(make_batch(s, seqs, range(len(seqs)), PAD))
    assert shape.tokens == max(b["input_ids"].numel() for b in collated)
    assert shape.targets == max(count_targets(b) for b in collated) == 2 * n * completion
    assert shape.seq_len == 70 + completion
    assert shape.tokens < s.batch.worst_case_tokens
