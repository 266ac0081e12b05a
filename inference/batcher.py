"""Continuous batching: the generation thread decodes every running row together, one token per step.

A request's `n` choices are rows of the decoding engine (training.decoding.engine.Decoder). The scheduler
(inference.scheduler) offers each waiting request to `admit`, then calls `step`, again and again:
  - admit: render the prompt (a 400 here, before a stream starts), pin its adapter and reserve room for as
    many of its rows as the KV budget allows; the rest of its rows join in later steps, before any newer
    request (first come, first served)
  - step: prefill the prompts admitted since the last step together (one forward, left-padded, each row
    with its own adapter: requests that arrive together cost one forward, not one each), then one forward
    over all rows, each with its own adapter (training.decoding.lora_rows; one adapter, or none, is the
    plain forward of a lone request), each row's next token chosen with its own sampling and generator
    (training.decoding.sampling) and streamed as soon as it is text; rows that end (stop string, end
    token, max_tokens, the request's deadline, a client gone) leave at once and the others go on
The KV budget bounds the padded cache (training.decoding.kv): rows x the longest any of them may grow
(prompt + max_tokens) stays within `max_batch_tokens`, so decoding never runs out of room midway; a row over
the budget alone runs alone. Requests for another base wait until the batch has drained (one base at a
time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.data.examples import Message
from inference.engine import Engine, LoadedBase, Rendered, Target
from inference.errors import Busy, EngineError
from inference.scheduler import DONE, Outbox, Ticket
from inference.structured import Shape
from inference.tool_calls import ToolFormat
from training.decoding.constraint import Grammar
from training.decoding.engine import Completion, Decoder, Media, Row, eos_ids
from training.decoding.kv import batchable
from training.decoding.sampling import Sampling, row_generator
from training.decoding.text import TextStream

log = logging.getLogger("ftune.inference")


@dataclass
class Chat:
    """A chat completion as the server submits it (a ticket's work)."""

    target: Target
    messages: Sequence[Message] | Sequence[dict[str, Any]]  # dicts with image parts: a vision base's
    sampling: Sampling
    n: int = 1
    seed: int | None = None
    generation_seconds: float = 120.0
    shape: Shape = field(default_factory=Shape)  # what its answer must be (tools, JSON)
    rendered: Rendered | None = None  # kept while it waits for room
    shaped: tuple[Grammar | None, ToolFormat | None] = (None, None)  # on the base it renders for


@dataclass
class _Job:
    """A started request: its rendered prompt, its pinned adapter slot and the choices not yet running."""

    ticket: Ticket
    request: Chat
    prompt: list[int]
    sampling: Sampling  # max_tokens filled in
    slot: str
    deadline: float
    eos: set[int]
    queued: list[int]  # choices waiting for room
    open: int  # choices not finished
    media: Media | None = None  # the prompt's images, on a vision-language base

    @property
    def need(self) -> int:
        """Cache columns one row of this job may reach."""
        return len(self.prompt) + (self.sampling.max_tokens or 0)

    @property
    def ended(self) -> bool:
        return self.ticket.cancelled.is_set() or time.monotonic() >= self.deadline


@dataclass(kw_only=True, eq=False)
class _Row(Row):
    """A choice of a request, as the engine decodes it."""

    job: _Job
    choice: int


class Batcher:
    def __init__(
        self, engine: Engine, *, max_batch_tokens: int | None = None, max_running: int | None = None
    ) -> None:
        """The bounds default to the engine's (those its memory bound was planned for)."""
        self.engine = engine
        self.max_batch_tokens = engine.max_batch_tokens if max_batch_tokens is None else max_batch_tokens
        self.max_running = engine.max_running if max_running is None else max_running
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be at least 1")
        self._jobs: list[_Job] = []
        self._prefill: list[tuple[_Job, list[int]]] = []  # choices admitted, prefilled at the next step
        self._decoder: Decoder | None = None  # the running rows, on the base the jobs run on
        self._loaded: LoadedBase | None = None  # that base
        self._alone = False  # the base's cache cannot be batched: one row at a time
        self._out = Outbox()  # events of an admission or a step, handed over at its end

    @property
    def busy(self) -> bool:
        return any(job.open for job in self._jobs)

    @property
    def running(self) -> int:
        """Rows decoding or about to (their prefill waits for the next step)."""
        return len(self._rows) + sum(len(choices) for _, choices in self._prefill)

    @property
    def steps(self) -> int:
        """Decoding steps run on the current base (for tests)."""
        return self._decoder.steps if self._decoder else 0

    @property
    def _rows(self) -> list[_Row]:
        return self._decoder.rows if self._decoder else []  # type: ignore[return-value]  # all _Row

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, ticket: Ticket) -> bool:
        """Start this request now (True), or leave it waiting (False: no room, another base, its adapter's
        place held). EngineError for a request refused outright."""
        try:
            return self._admit(ticket)
        finally:
            self._out.flush()

    def _admit(self, ticket: Ticket) -> bool:
        request: Chat = ticket.work
        if any(job.queued for job in self._jobs):
            return False
        if self.busy and self._loaded is not None and request.target.base != self._loaded.info.name:
            return False
        if request.rendered is None:
            rendered = self.engine.render(
                request.target, request.messages, request.sampling, request.shape.tools
            )
            request.shaped = self.engine.shaped(request.target, rendered[0], request.shape)
            request.rendered = rendered
        loaded, prompt, sampling, media = request.rendered
        if self._room(len(prompt) + (sampling.max_tokens or 0)) < 1:
            return False
        try:
            slot = self.engine.pin(request.target)
        except Busy:
            return False
        eos = set() if sampling.ignore_eos else eos_ids(loaded.model, loaded.tokenizer)
        deadline = time.monotonic() + request.generation_seconds  # for all its choices together
        choices = list(range(request.n))
        job = _Job(ticket, request, prompt, sampling, slot, deadline, eos, choices, request.n, media)
        if loaded is not self._loaded:
            self._loaded, self._alone = loaded, not batchable(loaded.model.config)  # type: ignore[attr-defined]
            self._decoder = Decoder(loaded.model, per_row_adapters=True)
        self._jobs.append(job)
        self._out.put(ticket, ("ready", len(prompt), request.shaped[1]))
        self._start_rows(job)
        return True

    def _room(self, need: int) -> int:
        """How many more rows reaching `need` cache columns may join now."""
        rows = self.running
        if self._alone:
            return 0 if rows else 1
        jobs = [r.job for r in self._rows] + [job for job, _ in self._prefill]
        widest = max([need, *(job.need for job in jobs)])
        room = min(self.max_batch_tokens // widest, self.max_running) - rows
        return max(room, 0 if rows else 1)  # alone, a row always runs (the engine's one-request bound)

    def _start_rows(self, job: _Job) -> None:
        """Reserve room for as many of the job's queued choices as fit: prefilled at the next step."""
        count = min(self._room(job.need), len(job.queued))
        if count >= 1:
            self._prefill.append((job, job.queued[:count]))
            job.queued = job.queued[count:]

    def _prefill_admitted(self) -> None:
        """One forward over the prompts admitted since the last step (left-padded to the longest); each
        choice's first token from its prompt's logits; the rows still going join the batch."""
        admitted, self._prefill = self._prefill, []
        if admitted:
            rows = [[self._row(job, c) for c in choices] for job, choices in admitted]
            # a vision-language base's prompts carry their images (None: a prompt without any)
            media = [job.media for job, _ in admitted] if self._vision() else None
            self._decoding().prefill([job.prompt for job, _ in admitted], rows, media)

    def _row(self, job: _Job, choice: int) -> _Row:
        assert self._loaded is not None
        ticket = job.ticket

        def emit(text: str) -> None:
            self._out.put(ticket, ("delta", choice, text))

        grammar, fmt = job.request.shaped
        text = TextStream(
            self._loaded.tokenizer, job.sampling.stop, job.eos, emit, keep_special=fmt is not None
        )
        return _Row(
            sampling=job.sampling,
            stops=job.eos,
            text=text,
            constraint=grammar.constraint() if grammar is not None else None,
            generator=None if job.sampling.greedy else row_generator(job.request.seed, choice),
            adapter=job.slot,
            ended=lambda: job.ended,
            on_finish=self._finished,
            job=job,
            choice=choice,
        )

    def _vision(self) -> bool:
        return self._loaded is not None and self._loaded.processor is not None

    def _decoding(self) -> Decoder:
        """The decoder, on the loaded model (peft wraps the base in a new object when its first adapter
        is attached: the same weights, so the rows' cache holds)."""
        assert self._decoder is not None and self._loaded is not None
        self._decoder.model = self._loaded.model
        return self._decoder

    # -- decoding -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit the queued choices that now fit, then one token for every running row."""
        try:
            self._step()
        finally:
            self._out.flush()

    def _step(self) -> None:
        self._start_queued()
        if self._decoder is None:
            return
        with torch.inference_mode():
            self._prefill_admitted()
            self._decoding().step()
        self._jobs = [job for job in self._jobs if job.open]

    def _start_queued(self) -> None:
        for job in self._jobs:
            if job.queued and job.ended:  # no time left for them (or nobody waits): empty, cut short
                for choice in job.queued:
                    self._finish(job, choice, Completion())
                job.queued = []
            if job.queued:
                self._start_rows(job)
                if job.queued:
                    return  # the next job's choices wait behind these
        self._jobs = [job for job in self._jobs if job.open]

    def _finished(self, row: Row) -> None:
        assert isinstance(row, _Row)
        self._finish(row.job, row.choice, row.completion())

    def _finish(self, job: _Job, choice: int, done: Completion) -> None:
        self._out.put(job.ticket, ("finish", choice, done))
        job.open -= 1
        if job.open == 0:
            self.engine.unpin(job.request.target)
            if time.monotonic() >= job.deadline:
                target = job.request.target
                name = target.adapter.name if target.adapter else target.base
                seconds = job.request.generation_seconds
                log.warning("a request for %s was cut at its %g s generation deadline", name, seconds)
            self._out.put(job.ticket, DONE)

    def abort(self, error: EngineError) -> None:
        """Fail every started request (a bug in a step) and start afresh."""
        for job in self._jobs:
            self.engine.unpin(job.request.target)
            self._out.put(job.ticket, ("error", error))
            self._out.put(job.ticket, DONE)
        self._jobs, self._prefill = [], []
        if self._decoder is not None:
            self._decoder = Decoder(self._decoder.model, per_row_adapters=True)
        self._out.flush()
