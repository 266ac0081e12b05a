"""grpo's rollouts: answers sampled from the policy being trained (training.rollouts) and graded by the
spec's grader (graders; OpenAI's grader JSON) against their dataset rows, in a bounded thread pool.
A failed grade scores 0 and counts its error (metrics.summarize)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from core.response_format import schema_of
from graders import GradeContext, Grader, GradeResult, grade_many, make_sample, parse_grader
from training import rollouts
from training.decoding.constraint import Grammar
from training.grading import grade_context
from training.objectives.base import Context
from training.rollouts import Completion, PromptItem


def sample(
    ctx: Context,
    prompts: Sequence[PromptItem],
    n: int,
    temperature: float,
    seed: Sequence[int],
    chunk: int,
) -> list[list[Completion]]:
    """`n` answers to each prompt (temperature 0: greedy), seeded by `seed` ((spec seed, step): a resumed
    run samples what an uninterrupted one would), `chunk` prompts per generate() call. Every answer grpo
    trains on or evaluates comes from this one call; under the spec's response_format each keeps to its
    JSON (constrained decoding)."""
    parts, spec = ctx.parts, ctx.spec
    return rollouts.sample(
        parts.model,
        ctx.tokenizer,
        [p.input_ids for p in prompts],
        n=n,
        temperature=temperature,
        max_new_tokens=spec.max_completion_tokens,
        seed=seed,
        device=parts.device,
        autocast=parts.autocast,
        chunk=chunk,
        grammar=response_grammar(ctx.tokenizer, spec.rl.response_format),
    )


def response_grammar(tokenizer: Any, response_format: dict[str, Any] | None) -> Grammar | None:
    """The grammar of a reinforcement job's response_format (None: free text), compiled once a run."""
    return None if response_format is None else _grammar(tokenizer, json.dumps(response_format))


@lru_cache(maxsize=4)
def _grammar(tokenizer: Any, response_format: str) -> Grammar:
    return Grammar.json_schema(tokenizer, schema_of(json.loads(response_format)))


@dataclass(frozen=True)
class Grading:
    """The spec's grader and how it runs: the run's grading context (python sandbox, judge) and threads."""

    grader: Grader
    context: GradeContext
    workers: int

    @classmethod
    def of(cls, ctx: Context) -> Grading:
        grader = ctx.spec.rl.grader
        assert grader is not None  # the spec's check
        return cls(
            parse_grader(grader, allow_python=True), grade_context(ctx.config), ctx.config.grading.concurrency
        )

    def grade(self, answers: Sequence[tuple[PromptItem, Completion]]) -> list[GradeResult]:
        """Each (prompt, answer)'s grade against the prompt's dataset row, in order."""
        samples = [(make_sample(c.text), p.item) for p, c in answers]
        return grade_many(self.grader, samples, self.context, max_workers=self.workers)
