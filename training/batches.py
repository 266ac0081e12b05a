"""Which examples train together: each optimizer step's global batch is fixed first, then split.

A step's global batch is a list of rows: a padded row is one example; a packed row is examples
packed (best-fit decreasing) into at most max_seq_len tokens. With objective dpo an example is a
preference pair (training.objectives.dpo.pairs), its length both sides' tokens, and a packed row holds
2 x max_seq_len tokens: a step then counts pairs, and a pair is never split. With objective grpo a row
is one prompt (its completions are sampled during the step, training.objectives.grpo), never packed.
A step holds micro x accumulation x num_gpus rows, or with examples_per_step (what /v1's batch_size
sets) that many examples, and an epoch's steps are a pure function of (seed, epoch, lengths, max_seq_len
and that step size), never of how the step is split:
- padded: a seeded permutation is cut into chunks of GROUP_STEPS steps' worth of examples; each chunk
  is sorted by length and cut into steps, so a step holds similar lengths and its micro-batches carry
  little padding.
- packed: a seeded permutation is cut into chunks of about GROUP_ROWS rows' worth of tokens; each chunk
  is packed into rows, which are shuffled, and the epoch's rows are cut into steps.
- packed, examples_per_step: a seeded permutation is cut into steps of examples_per_step examples, and
  each step's examples are packed into as many rows as they fill (best-fit decreasing).
The steps of an epoch are then shuffled. Only then is a step split (`split_step`): a micro-batch is
micro_batch_size consecutive rows (packed: one row of up to micro x max_seq_len tokens), and the
micro-batches are dealt to ranks (`rank_share`). So micro 4 x accumulation 1, micro 1 x accumulation 4
and 2 ranks x micro 2 train on the same examples at every step, every full step splits into exactly
accumulation x num_gpus micro-batches (with examples_per_step: as many as its rows fill, at most
ceil(examples_per_step / micro)), and the loss, normalised by the step's target tokens, is the same.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from itertools import islice

import numpy as np

from core.spec import JobSpec
from training.data import padded_width

Lengths = Sequence[int] | Mapping[int, int]  # tokens of example i: lengths[i]
Row = list[int]  # example indices: one (padded) or packed into max_seq_len tokens
Step = list[Row]  # an optimizer step's global batch
GROUP_STEPS = 32  # padded: steps sorted by length together; bigger = less padding, less randomness
GROUP_ROWS = 128  # packed: rows packed together; bigger = fuller rows, less randomness


def epoch_steps(spec: JobSpec, lengths: Sequence[int], epoch: int) -> list[Step]:
    """The global batches of one epoch's optimizer steps."""
    rng = np.random.default_rng([spec.seed, epoch])
    order = rng.permutation(len(lengths)).tolist()
    batch = spec.batch
    size = batch.step_size
    if batch.packing and batch.examples_per_step is not None:
        steps = _packed_example_steps(order, lengths, size, batch.row_capacity)
    elif batch.packing:
        rows = _packed_rows(order, lengths, batch.row_capacity, rng)
        steps = [rows[j : j + size] for j in range(0, len(rows), size)]
    else:
        steps = _padded_steps(order, lengths, size)
    return [steps[k] for k in rng.permutation(len(steps)).tolist()]


def _packed_example_steps(order: list[int], lengths: Sequence[int], size: int, capacity: int) -> list[Step]:
    """Steps of `size` examples each (the last of an epoch: the rest), each packed into its own rows."""
    _check_fits(lengths, capacity)
    return [best_fit_decreasing(order[j : j + size], lengths, capacity) for j in range(0, len(order), size)]


def _check_fits(lengths: Sequence[int], capacity: int) -> None:
    if lengths and max(lengths) > capacity:
        raise ValueError(f"an example of {max(lengths)} tokens does not fit a row of {capacity}")


def _padded_steps(order: list[int], lengths: Sequence[int], size: int) -> list[Step]:
    steps: list[Step] = []
    group = size * GROUP_STEPS
    for start in range(0, len(order), group):
        chunk = sorted(order[start : start + group], key=lambda i: (-lengths[i], i))
        steps.extend([[i] for i in chunk[j : j + size]] for j in range(0, len(chunk), size))
    return steps


def _packed_rows(
    order: list[int], lengths: Sequence[int], capacity: int, rng: np.random.Generator
) -> list[Row]:
    _check_fits(lengths, capacity)
    rows: list[Row] = []
    chunk: list[int] = []
    tokens = 0
    for n, i in enumerate(order):
        chunk.append(i)
        tokens += lengths[i]
        if tokens >= GROUP_ROWS * capacity or n == len(order) - 1:
            packed = best_fit_decreasing(chunk, lengths, capacity)
            rows.extend(packed[k] for k in rng.permutation(len(packed)).tolist())  # mix long and short
            chunk, tokens = [], 0
    return rows


def split_step(spec: JobSpec, lengths: Lengths, step: Step) -> list[list[int]]:
    """A step's micro-batches (example indices), over all ranks: micro_batch_size rows each (padded rows
    sorted by length first, so similar lengths share a micro-batch)."""
    if not spec.batch.packing:
        step = sorted(step, key=lambda row: (-lengths[row[0]], row[0]))
    size = spec.micro_batch_size
    return [[i for row in step[j : j + size] for i in row] for j in range(0, len(step), size)]


def rank_share(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """Which of a step's `n` micro-batches this rank runs (every world-th), and how many padding
    batches it adds so all ranks run the same number (FSDP's collectives must match)."""
    mine = list(range(rank, n, world))
    return mine, math.ceil(n / world) - len(mine)


def total_steps(spec: JobSpec, lengths: Sequence[int]) -> int:
    """Optimizer steps of the run: max_steps, or the steps of all epochs (the last step of an epoch
    may hold fewer rows; packed epochs may differ by a step or so, unless a step is examples_per_step
    examples)."""
    if spec.max_steps is not None:
        return spec.max_steps
    if not spec.batch.packing or spec.examples_per_step is not None:
        return spec.epochs * math.ceil(len(lengths) / spec.batch.step_size)
    return sum(len(epoch_steps(spec, lengths, e)) for e in range(spec.epochs))


# The epochs scanned for the largest micro-batch (each epoch forms its own; more scan little more: with
# enough data nearly every packed row is full, with little data a micro-batch holds all of it).
SHAPE_EPOCHS = 3


def largest_micro_batch(
    spec: JobSpec,
    lengths: Sequence[int],
    widths: Sequence[int],
    targets: Sequence[int],
    sampled: Sequence[int] | None = None,
) -> tuple[int, int, int]:
    """(tokens, widest sequence, target tokens) of the largest micro-batches the run forms, what the
    planner counts activations and logits with (each the largest over the micro-batches, so together
    a bound). `lengths`: what batching counts per example (a pair: both sides); `widths`: an example's
    longest sequence (a pair: its longer side); `targets`: its scored tokens, the only positions the
    engine computes logits for (training.objectives.sft.loss).
    Padded: a micro-batch is its rows padded to their longest, rounded up (a pair: both sides). Packed:
    one row of its examples' tokens, in which attention runs per example. The run's steps in order
    (max_steps may end it early), over its first SHAPE_EPOCHS epochs.
    `sampled` (grpo): each prompt's group at its longest, num_generations x (prompt + completion): batched
    by its prompts, a micro-batch trains those sequences, packed into one row when spec.packing."""
    if not lengths:
        return 0, 0, 0
    epochs = SHAPE_EPOCHS if spec.max_steps is not None else min(spec.epochs, SHAPE_EPOCHS)
    steps = (step for epoch in range(epochs) for step in epoch_steps(spec, lengths, epoch))
    tokens = scored = 0
    per_example = spec.batch.sequences_per_example
    packed = spec.packing if sampled is not None else spec.batch.packing
    sizes = lengths if sampled is None else sampled
    for step in islice(steps, spec.max_steps):
        for micro in split_step(spec, lengths, step):
            rows = len(micro) * per_example
            padded = rows * padded_width(max(widths[i] for i in micro), spec.max_seq_len)
            tokens = max(tokens, sum(sizes[i] for i in micro) if packed else padded)
            scored = max(scored, sum(targets[i] for i in micro))
    return tokens, max(widths), scored


def best_fit_decreasing(items: Sequence[int], lengths: Lengths, capacity: int) -> list[list[int]]:
    """Bins of at most `capacity` tokens: longest first, each into the fullest bin it fits (ties keep
    the items' order, so a shuffled input gives a seeded result)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin number), sorted
    for j in sorted(range(len(items)), key=lambda j: -lengths[items[j]]):
        i, n = items[j], lengths[items[j]]
        k = bisect_left(free, (n, -1))
        if k < len(free):
            space, b = free.pop(k)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if space > n:
            insort(free, (space - n, b))
    return bins
