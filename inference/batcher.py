"""Continuous batching: the generation thread decodes every running row together, one token per step.

A request's `n` choices are rows. The scheduler (inference.scheduler) offers each waiting request to
`admit`, then calls `step`, again and again:
  - admit: render the prompt (a 400 here, before a stream starts), pin its adapter and reserve room for as
    many of its rows as the KV budget allows; the rest of its rows join in later steps, before any newer
    request (first come, first served)
  - step: prefill the prompts admitted since the last step together (one forward, left-padded, each row
    with its own adapter: requests that arrive together cost one forward, not one each), then one forward
    over all rows, each with its own adapter (peft's mixed-batch `adapter_names`; one adapter, or none, is
    the plain forward of a lone request), each row's next token chosen with its own sampling
    (inference.sampler) and streamed as soon as it is text; rows that end (stop string, end token,
    max_tokens, the request's deadline, a client gone) leave at once and the others go on
The KV budget bounds the padded cache (inference.kv): rows x the longest any of them may grow (prompt +
max_tokens) stays within `max_batch_tokens`, so decoding never runs out of room midway; a row over the
budget alone runs alone. Requests for another base wait until the batch has drained (one base at a time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.data.examples import Message
from inference.engine import Engine, LoadedBase, Target
from inference.errors import Busy, EngineError
from inference.generation import Completion, Sampling, TextStream, device_of, eos_ids
from inference.kv import BatchCache, batchable
from inference.lora_rows import AdapterRows
from inference.sampler import next_tokens, row_generator
from inference.scheduler import DONE, Outbox, Ticket

log = logging.getLogger("ftune.inference")


@dataclass
class Chat:
    """A chat completion as the server submits it (a ticket's work)."""

    target: Target
    messages: Sequence[Message]
    sampling: Sampling
    n: int = 1
    seed: int | None = None
    generation_seconds: float = 120.0
    rendered: tuple[LoadedBase, list[int], Sampling] | None = None  # kept while it waits for room


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

    @property
    def need(self) -> int:
        """Cache columns one row of this job may reach."""
        return len(self.prompt) + (self.sampling.max_tokens or 0)

    @property
    def ended(self) -> bool:
        return self.ticket.cancelled.is_set() or time.monotonic() >= self.deadline


@dataclass
class _Row:
    job: _Job
    choice: int
    text: TextStream
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    last: int = 0  # the newest token, not yet in the cache


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
        self._rows: list[_Row] = []
        self._prefill: list[tuple[_Job, list[int]]] = []  # choices admitted, prefilled at the next step
        self._cache = BatchCache()
        self._loaded: LoadedBase | None = None  # the base the jobs run on
        self._alone = False  # the base's cache cannot be batched: one row at a time
        self._adapters = AdapterRows()
        self._out = Outbox()  # events of an admission or a step, handed over at its end
        self.steps = 0  # decoding steps run (for tests)

    @property
    def busy(self) -> bool:
        return any(job.open for job in self._jobs)

    @property
    def running(self) -> int:
        """Rows decoding or about to (their prefill waits for the next step)."""
        return len(self._rows) + sum(len(choices) for _, choices in self._prefill)

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
            request.rendered = self.engine.render(request.target, request.messages, request.sampling)
        loaded, prompt, sampling = request.rendered
        if self._room(len(prompt) + (sampling.max_tokens or 0)) < 1:
            return False
        try:
            slot = self.engine.pin(request.target)
        except Busy:
            return False
        eos = set() if sampling.ignore_eos else eos_ids(loaded.model, loaded.tokenizer)
        deadline = time.monotonic() + request.generation_seconds  # for all its choices together
        job = _Job(ticket, request, prompt, sampling, slot, deadline, eos, list(range(request.n)), request.n)
        if loaded is not self._loaded:
            self._loaded, self._alone = loaded, not batchable(loaded.model.config)  # type: ignore[attr-defined]
        self._jobs.append(job)
        self._out.put(ticket, ("ready", len(prompt)))
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
        choice's first token from its prompt's logits; the rows still going join the batch's cache."""
        admitted, self._prefill = self._prefill, []
        if not admitted:
            return
        assert self._loaded is not None
        from transformers.cache_utils import DynamicCache

        prompts = [job.prompt for job, _ in admitted]
        width = max(len(p) for p in prompts)
        device = device_of(self._loaded.model)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        cache = DynamicCache(config=self._loaded.model.config)  # type: ignore[attr-defined]
        inputs = {"input_ids": ids, "attention_mask": mask, "cache": cache}
        if len(admitted) > 1:  # each row counts its own tokens (a lone prompt has no padding)
            inputs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self._forward([job.slot for job, _ in admitted], **inputs)
        going: list[_Row] = []
        sources: list[int] = []  # each going row's prompt in the prefill
        for i, (job, choices) in enumerate(admitted):
            rows = [self._row(job, c) for c in choices]
            first = next_tokens(logits[i : i + 1].expand(len(rows), -1), [job.sampling] * len(rows),
                                [r.generator for r in rows])  # fmt: skip
            for row, token in zip(rows, first, strict=True):
                if not self._add(row, token):
                    going.append(row)
                    sources.append(i)
        if going:
            self._cache.join(cache, mask, sources)
            self._rows += going

    def _row(self, job: _Job, choice: int) -> _Row:
        assert self._loaded is not None
        ticket = job.ticket

        def emit(text: str) -> None:
            self._out.put(ticket, ("delta", choice, text))

        text = TextStream(self._loaded.tokenizer, job.sampling.stop, job.eos, emit)
        generator = None if job.sampling.greedy else row_generator(job.request.seed, choice)
        return _Row(job, choice, text, generator)

    # -- decoding -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit the queued choices that now fit, then one token for every running row."""
        try:
            self._step()
        finally:
            self._out.flush()

    def _step(self) -> None:
        self._start_queued()
        self._prefill_admitted()
        self._leave([i for i, row in enumerate(self._rows) if row.job.ended and self._cut(row)])
        if not self._rows:
            return
        rows = self._rows
        mask, positions = self._cache.step_inputs()
        ids = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=mask.device)
        logits = self._forward(
            [r.job.slot for r in rows],
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self._cache.cache,
        )
        self._cache.advanced(mask)
        self.steps += 1
        tokens = next_tokens(logits, [r.job.sampling for r in rows], [r.generator for r in rows])
        ended = [i for i, (row, token) in enumerate(zip(rows, tokens, strict=True)) if self._add(row, token)]
        self._leave(ended)

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

    def _add(self, row: _Row, token: int) -> bool:
        """Record a row's new token (streamed as text); True when the row has ended."""
        row.tokens.append(token)
        row.text.add(token)
        job = row.job
        if not (row.text.stopped or len(row.tokens) >= (job.sampling.max_tokens or 0) or job.ended):
            row.last = token
            return False
        row.text.finish()
        reason = "stop" if row.text.stopped else "length"
        self._finish(job, row.choice, Completion(row.text.text, row.tokens, reason))
        return True

    def _cut(self, row: _Row) -> bool:
        """A row whose request ended between steps (deadline, client gone): finished as it stands."""
        row.text.finish()
        self._finish(row.job, row.choice, Completion(row.text.text, row.tokens, "length"))
        return True

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

    def _leave(self, ended: list[int]) -> None:
        """These rows leave the batch (each already finished); the others keep their cache."""
        if not ended:
            return
        gone = set(ended)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._rows = [self._rows[i] for i in keep]
        self._cache.keep(keep)
        self._jobs = [job for job in self._jobs if job.open]

    def _forward(self, slots: Sequence[str], **inputs) -> torch.Tensor:
        """The model's last-position logits (float32) for rows using these adapter slots."""
        assert self._loaded is not None
        model = self._loaded.model
        inputs |= {"use_cache": True, "logits_to_keep": 1}
        with torch.inference_mode():
            out = self._adapters.forward(model, slots, inputs)
        return out.logits[:, -1].to(dtype=torch.float32)

    def abort(self, error: EngineError) -> None:
        """Fail every started request (a bug in a step) and start afresh."""
        for job in self._jobs:
            self.engine.unpin(job.request.target)
            self._out.put(job.ticket, ("error", error))
            self._out.put(job.ticket, DONE)
        self._jobs, self._rows, self._prefill, self._cache = [], [], [], BatchCache()
        self._out.flush()
