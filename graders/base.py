"""What every grader is, and what grading needs from the service (a judge model, a Python sandbox)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from graders.results import GradeErrors, GradeFailure, GradeResult, TokenUsage

if TYPE_CHECKING:
    from graders.chat import ChatFn
    from graders.python_grader import PythonRunner

Sample = dict[str, Any]
Item = dict[str, Any]
Pair = tuple[Sample, Item]
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class GradeContext:
    """Injected by the caller: `chat` answers model graders, `python` runs python graders in a sandbox
    (`python_batch_size` samples per run() call). A grader whose part is None scores 0 with a server
    error, so a deployment without a judge or a sandbox still grades everything else."""

    chat: ChatFn | None = None
    python: PythonRunner | None = None
    python_batch_size: int = 64


@dataclass(frozen=True)
class Batch:
    """Grading a list of pairs: the context, and the thread pool row work may fan out on (None: inline).
    Only the caller's thread submits to the pool, so nested graders never wait on their own pool."""

    ctx: GradeContext
    pool: Executor | None = None

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        if self.pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self.pool.map(fn, items))


@dataclass(frozen=True)
class Scored:
    """One sample's score before it becomes a GradeResult."""

    reward: float
    scores: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, TokenUsage] = field(default_factory=dict)


class Grader(ABC):
    """A parsed, validated grader. Subclasses score one pair (`score`), or override grade_batch when
    grading many at once is cheaper (python: one sandbox call per batch; multi: sub-grader by sub-grader)."""

    type: ClassVar[str]
    concurrent: ClassVar[bool] = False  # spread rows over the pool (graders that wait on a network)
    name: str

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The normalised grader JSON (what graders/validate echoes)."""

    def score(self, sample: Sample, item: Item, ctx: GradeContext) -> Scored:
        raise NotImplementedError

    def grade_batch(self, pairs: Sequence[Pair], batch: Batch) -> list[GradeResult]:
        def one(pair: Pair) -> GradeResult:
            return self.timed(lambda: self.score(pair[0], pair[1], batch.ctx))

        return batch.map(one, pairs) if self.concurrent else [one(pair) for pair in pairs]

    def timed(self, work: Callable[[], Scored]) -> GradeResult:
        """Run `work`, turning any failure into a 0 reward with its flag (an unexpected one: other_error)."""
        start = time.perf_counter()
        try:
            scored = work()
            return self.result(
                scored.reward, time.perf_counter() - start, scores=scored.scores, usage=scored.usage
            )
        except GradeFailure as failure:
            return self.result(0.0, time.perf_counter() - start, errors=failure.errors, usage=failure.usage)
        except Exception:  # a grader's bug or a library's surprise must not sink the whole batch
            return self.result(0.0, time.perf_counter() - start, errors=GradeErrors.of("other_error"))

    def result(
        self,
        reward: float,
        execution_time: float,
        *,
        errors: GradeErrors | None = None,
        scores: dict[str, Any] | None = None,
        usage: dict[str, TokenUsage] | None = None,
        sub_rewards: dict[str, float] | None = None,
    ) -> GradeResult:
        return GradeResult(
            name=self.name,
            type=self.type,
            reward=reward,
            errors=errors or GradeErrors(),
            execution_time=execution_time,
            sub_rewards=sub_rewards or {},
            scores=scores or {},
            token_usage_per_model=usage or {},
        )
