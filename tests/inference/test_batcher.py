"""Continuous batching (inference.batcher) driven step by step on the tiny model: every batched answer is
what transformers' generate() gives that request alone (the engine before batching), token for token and
piece for piece, whoever shares the batch; requests join mid-decode and leave when done; the KV budget
makes rows wait; a client gone or a deadline ends its rows at once. Then the same through the scheduler's
thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from core.catalog import Catalog
from core.data.examples import Message
from inference.batcher import Batcher, Chat
from inference.engine import Engine
from inference.errors import EngineError
from inference.scheduler import DONE, Scheduler, Ticket
from tests.inference.conftest import BASE
from tests.training.reference_decoding import generate_alone
from training.decoding.engine import Completion, Decoder, eos_ids
from training.decoding.sampling import Sampling

PROMPTS = ["Hi", "What is a tree made of, in a few words?", "Name a river.", "Tell me a story about the sea."]


class Now:
    """An event loop stand-in that runs at once what it is handed (the batcher runs on the test's thread)."""

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)


@dataclass
class Recorded(Ticket):
    """A ticket whose events so far are read as a list."""

    seen: list = field(default_factory=list)

    @property
    def log(self) -> list:
        while not self.events.empty():
            self.seen.append(self.events.get_nowait())
        return self.seen

    def deltas(self, choice: int = 0) -> list[str]:
        return [e[2] for e in self.log if e is not DONE and e[0] == "delta" and e[1] == choice]

    def finished(self) -> dict[int, Completion]:
        return {e[1]: e[2] for e in self.log if e is not DONE and e[0] == "finish"}

    @property
    def done(self) -> bool:
        return bool(self.log) and self.log[-1] is DONE


def chat(engine: Engine, model: str, text: str, sampling: Sampling, n: int = 1, **kw) -> Recorded:
    work = Chat(engine.resolve(model), [Message(role="user", content=text)], sampling, n, **kw)
    return Recorded(work=work, loop=Now())  # type: ignore[arg-type]


def prompt_tokens(engine: Engine, model: str, text: str) -> int:
    return len(engine.render(engine.resolve(model), [Message(role="user", content=text)], Sampling(1))[1])


def alone(engine: Engine, model: str, text: str, sampling: Sampling) -> tuple[Completion, list[str]]:
    """The engine before batching: transformers' generate() for this request alone (on the model the
    engine sets for it), and its text pieces."""
    p = engine.start(engine.resolve(model), [Message(role="user", content=text)], sampling)
    net = p.model
    setting = nullcontext()
    if hasattr(net, "peft_config"):
        if p.base_only:
            setting = net.disable_adapter()  # type: ignore[attr-defined]
        else:  # the batched path switches peft's layers off (training.decoding.lora_rows)
            net.base_model.enable_adapter_layers()  # type: ignore[attr-defined]
    eos = set() if sampling.ignore_eos else eos_ids(net, p.tokenizer)
    pieces: list[str] = []
    with setting:
        ids, out, reason = generate_alone(net, p.tokenizer, p.prompt, p.sampling, eos, pieces.append)
    return Completion(out, ids, reason), pieces


@pytest.fixture(scope="module")
def engine(catalog: Catalog, make_adapter: Callable[..., Path]) -> Engine:
    engine = Engine(catalog)
    for seed in (11, 12):
        engine.register(f"ad{seed}", str(make_adapter(seed)))
    return engine


def drain(batcher: Batcher, limit: int = 500) -> None:
    for _ in range(limit):
        if not batcher.busy:
            return
        batcher.step()
    raise AssertionError("the batch did not drain")


def test_mixed_adapters_joining_at_different_steps_answer_as_alone(engine: Engine) -> None:
    """Base and two adapters, prompts of different lengths, joining one or two steps apart: each row's
    tokens, text, finish reason and streamed pieces are those of the request generated alone."""
    sampling = Sampling(max_tokens=10, temperature=0)
    stop = Sampling(max_tokens=10, temperature=0, stop=("e",))
    jobs = [
        (m, p, s) for m in (BASE, "ad11", "ad12") for p, s in zip(PROMPTS, (sampling, stop) * 2, strict=False)
    ]
    batcher = Batcher(engine)
    tickets, together = [], 0
    for i, (model, text, s) in enumerate(jobs):
        tickets.append(chat(engine, model, text, s))
        assert batcher.admit(tickets[-1])
        together = max(together, batcher.running)
        for _ in range(i % 3):
            batcher.step()
    assert together >= 6, "they ran together"
    drain(batcher)
    for (model, text, s), ticket in zip(jobs, tickets, strict=True):
        expected, pieces = alone(engine, model, text, s)
        got = ticket.finished()[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
        ), (model, text, s.stop)
        assert ticket.deltas() == pieces  # streamed piece for piece
        # no tools: no call format
        assert ticket.log[0] == ("ready", prompt_tokens(engine, model, text), None)
        assert ticket.done
    assert {ticket.finished()[0].finish_reason for ticket in tickets} == {"stop", "length"}
    assert engine._pinned == {}  # every adapter released


def test_prompts_admitted_together_are_prefilled_in_one_forward_and_answer_as_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrive together (a burst of clients): their prompts, of different lengths and for
    different adapters, are prefilled in one left-padded forward; each answers as it would alone, and a
    request with n=2 gets both rows from its one prefilled prompt."""
    sampling = Sampling(max_tokens=8, temperature=0, ignore_eos=True)
    jobs = [(m, p) for m in ("ad11", BASE, "ad12") for p in PROMPTS]
    batcher = Batcher(engine)
    forwards = 0
    forward = Decoder._forward

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(Decoder, "_forward", counted)
    tickets = [
        chat(engine, model, text, sampling, n=2 if i == 0 else 1) for i, (model, text) in enumerate(jobs)
    ]
    assert all(batcher.admit(t) for t in tickets)
    assert batcher.running == len(jobs) + 1
    batcher.step()
    assert forwards == 2  # one prefill for all, one decoding step
    drain(batcher)
    for (model, text), ticket in zip(jobs, tickets, strict=True):
        expected = alone(engine, model, text, sampling)[0].token_ids
        assert [c.token_ids for c in ticket.finished().values()] == [expected] * (
            2 if ticket is tickets[0] else 1
        )
    assert forwards == 1 + 7  # nothing prefilled twice: 8 tokens, the first from the prefill


def test_a_request_joining_mid_decode_finishes_first_and_nobody_stalls(engine: Engine) -> None:
    long = Sampling(max_tokens=30, temperature=0, ignore_eos=True)
    short = Sampling(max_tokens=4, temperature=0, ignore_eos=True)
    batcher = Batcher(engine)
    first = chat(engine, "ad11", PROMPTS[3], long)
    assert batcher.admit(first)
    for _ in range(5):
        batcher.step()
    second = chat(engine, "ad12", PROMPTS[0], short)
    assert batcher.admit(second)
    assert batcher.running == 2
    for _ in range(3):  # the joiner's first token came from its prefill: three more steps finish it
        batcher.step()
    assert second.done and second.finished()[0].tokens == 4
    assert not first.done and batcher.running == 1  # it left; the first goes on
    drain(batcher)
    assert first.finished()[0].token_ids == alone(engine, "ad11", PROMPTS[3], long)[0].token_ids
    assert second.finished()[0].token_ids == alone(engine, "ad12", PROMPTS[0], short)[0].token_ids
    assert batcher.steps == 29  # one step per token after the prefill's: the first was never stalled


def test_the_kv_budget_makes_rows_wait_and_n_choices_are_rows(engine: Engine) -> None:
    """A budget of two rows: n=3 runs two choices, the third joins when one leaves; a newer request
    waits behind it (first come, first served); greedy choices are equal."""
    sampling = Sampling(max_tokens=6, temperature=0, ignore_eos=True)
    batcher = Batcher(engine, max_batch_tokens=2 * (prompt_tokens(engine, BASE, PROMPTS[2]) + 6) + 1)
    three = chat(engine, BASE, PROMPTS[2], sampling, n=3)
    assert batcher.admit(three)
    assert batcher.running == 2
    later = chat(engine, BASE, PROMPTS[2], sampling)
    assert not batcher.admit(later)  # no room, and three's last choice goes first
    drain(batcher)
    assert batcher.admit(later)
    drain(batcher)
    expected = alone(engine, BASE, PROMPTS[2], sampling)[0].token_ids
    assert [three.finished()[i].token_ids for i in range(3)] == [expected] * 3
    assert later.finished()[0].token_ids == expected

    one_row = Batcher(engine, max_batch_tokens=10)  # under one row: a row alone still runs, alone
    big, other = chat(engine, BASE, PROMPTS[1], sampling), chat(engine, BASE, PROMPTS[0], sampling)
    assert one_row.admit(big) and not one_row.admit(other)
    drain(one_row)
    assert one_row.admit(other)
    drain(one_row)


def test_sampled_rows_depend_on_their_seed_only(engine: Engine) -> None:
    sampled = Sampling(max_tokens=8, temperature=1.0, top_p=0.9, ignore_eos=True)
    greedy = Sampling(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for mates in (0, 3):
        batcher = Batcher(engine)
        for i in range(mates):
            batcher.admit(chat(engine, "ad11", PROMPTS[i], greedy))
            batcher.step()
        ticket = chat(engine, "ad12", PROMPTS[1], sampled, n=2, seed=7)
        assert batcher.admit(ticket)
        drain(batcher)
        runs.append([ticket.finished()[i].token_ids for i in range(2)])
    assert runs[0] == runs[1]  # alone or among three others: the same tokens
    assert runs[0][0] != runs[0][1]  # each choice its own draws


def test_a_cancelled_request_leaves_at_the_next_step_and_a_deadline_cuts(engine: Engine) -> None:
    forever = Sampling(max_tokens=400, temperature=0, ignore_eos=True)
    batcher = Batcher(engine)
    gone = chat(engine, "ad11", PROMPTS[0], forever, n=2)
    stays = chat(engine, "ad12", PROMPTS[1], Sampling(max_tokens=6, temperature=0))
    assert batcher.admit(gone) and batcher.admit(stays)
    batcher.step()
    gone.cancelled.set()  # what Scheduler.withdraw does for a client that went away
    batcher.step()
    assert gone.done and batcher.running == 1 and engine._pinned == {"ad12": 1}
    assert [c.finish_reason for c in gone.finished().values()] == ["length", "length"]
    drain(batcher)
    assert engine._pinned == {}

    # the deadline (FTUNE_INFERENCE_GENERATION_SECONDS) covers all choices: those it leaves no time are empty
    tight = Batcher(engine, max_batch_tokens=prompt_tokens(engine, BASE, PROMPTS[0]) + 401)  # one row
    cut = chat(engine, BASE, PROMPTS[0], forever, n=3, generation_seconds=0.1)
    started = time.monotonic()
    assert tight.admit(cut)
    drain(tight, limit=10_000)
    assert time.monotonic() - started < 10  # cut at its deadline, not at 400 tokens
    done = cut.finished()
    assert [c.finish_reason for c in done.values()] == ["length"] * 3
    assert 0 < done[0].tokens < 400 and done[1].tokens == done[2].tokens == 0


def test_a_pinned_adapter_is_not_evicted_its_successor_waits(
    catalog: Catalog, make_adapter: Callable[..., Path]
) -> None:
    engine = Engine(catalog, max_adapters=1)
    engine.register("p1", str(make_adapter(21)))
    engine.register("p2", str(make_adapter(22)))
    batcher = Batcher(engine)
    sampling = Sampling(max_tokens=5, temperature=0, ignore_eos=True)
    first, second = chat(engine, "p1", PROMPTS[0], sampling), chat(engine, "p2", PROMPTS[0], sampling)
    assert batcher.admit(first)
    assert not batcher.admit(second)  # p1 is decoding: p2 cannot take its place yet
    assert engine.resident_adapters(BASE) == ["p1"]
    drain(batcher)
    assert batcher.admit(second)
    drain(batcher)
    assert engine.evictions == ["p1"]
    assert second.finished()[0].token_ids == alone(engine, "p2", PROMPTS[0], sampling)[0].token_ids


def test_through_the_scheduler_thread_queue_bound_and_withdrawal(engine: Engine) -> None:
    """The generation thread: a long request runs, a short one joins and is answered before it ends, the
    line holds one more (429 beyond it), and a withdrawn request frees its row at once."""

    async def events(ticket: Ticket) -> list:
        out = []
        while (event := await ticket.events.get()) is not DONE:
            out.append(event)
        return out

    async def scenario() -> None:
        batcher = Batcher(engine, max_running=2)
        scheduler = Scheduler(max_waiting=2, timeout_seconds=30, executor=batcher)
        msgs = [Message(role="user", content=PROMPTS[1])]
        long = Chat(engine.resolve("ad11"), msgs, Sampling(max_tokens=400, temperature=0, ignore_eos=True), 2)
        first = scheduler.submit(long)
        await scheduler.wait_start(first)
        short = scheduler.submit(Chat(engine.resolve(BASE), msgs, Sampling(max_tokens=3, temperature=0)))
        waits = scheduler.submit(Chat(engine.resolve(BASE), msgs, Sampling(max_tokens=3, temperature=0)))
        with pytest.raises(EngineError) as full:
            scheduler.submit(Chat(engine.resolve(BASE), msgs, Sampling(max_tokens=3, temperature=0)))
        assert (full.value.status, full.value.code) == (429, "engine_overloaded")
        # the long request's two rows fill the batch (max_running 2): withdraw it, the others run
        await asyncio.sleep(0.2)
        assert not short.started.is_set()
        assert scheduler.withdraw(first) is False  # running: stopped at its next token
        got = await asyncio.wait_for(events(first), 10)
        assert [e[0] for e in got if e[0] == "finish"] == ["finish", "finish"]
        for ticket in (short, waits):
            await asyncio.wait_for(scheduler.wait_start(ticket), 10)
            assert [e[0] for e in await asyncio.wait_for(events(ticket), 10)][-1] == "finish"
        assert scheduler.waiting == 0 and not batcher.busy
        scheduler.close()

    asyncio.run(scenario())
