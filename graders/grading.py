"""Grading samples: one (grade) or many on a bounded thread pool (grade_many)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from graders.base import Batch, GradeContext, Grader, Item, Pair, Sample
from graders.results import GradeResult


def grade(grader: Grader, sample: Sample, item: Item, ctx: GradeContext) -> GradeResult:
    """One sample's grade; never raises for the sample's sake: failures are a 0 reward and a flag."""
    return grader.grade_batch([(sample, item)], Batch(ctx))[0]


def grade_many(
    grader: Grader, pairs: Sequence[Pair], ctx: GradeContext, max_workers: int = 8
) -> list[GradeResult]:
    """Each (sample, item)'s grade, in order. Model graders' requests and python batches run on at most
    `max_workers` threads; the sandbox gets one run() call per python_batch_size samples."""
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="grader") as pool:
        return grader.grade_batch(pairs, Batch(ctx, pool))
