"""Three tenants on one `ftune up`, one of them hostile: a webhook receiver that answers one byte a
second, long non-streaming chats dropped after a second, bursts of job creates and uploads. The other two
each train a job and chat with it within a bound, and no worker's heartbeat goes stale meanwhile."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.stack import AUTH
from tests.openai.conftest import ALPACA, SUPERVISED, Stack, wait_for
from tests.slow_loris import SlowLoris

RUN = {"max_steps": 8, "max_seq_len": 96, "lora_r": 8, "lora_dropout": 0.0, "checkpoint_every_steps": 4}
JOB_BOUND_S = 300  # both polite tenants' jobs succeed within this, hostile load and all
CHAT_BOUND_S = 30  # and each answers a chat within this
STALE_S = 20  # a heartbeat older than this would mean a stalled worker loop


@pytest.fixture
def slow_receiver() -> Iterator[SlowLoris]:
    receiver = SlowLoris()
    yield receiver
    receiver.close()


def _repeat(stop: threading.Event, action: Callable[[], Any]) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a hostile client's requests may fail in any way
                action()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _train(stack_tenant: tuple[openai.OpenAI, httpx.Client, str], suffix: str) -> Any:
    sdk, _, _ = stack_tenant
    file_id = sdk.files.create(file=("train.jsonl", ALPACA * 8), purpose="fine-tune").id
    sdk.files.wait_for_processing(file_id, poll_interval=0.2)
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=file_id, suffix=suffix, seed=3, method=SUPERVISED, extra_body=RUN
    )
    return job


def test_a_hostile_tenant_does_not_stall_the_others(stack: Stack, slow_receiver: SlowLoris) -> None:
    hostile = stack.tenant()
    polite = [stack.tenant(), stack.tenant()]
    h_sdk, h_native, h_key = hostile
    assert h_native.post("/webhooks", json={"url": slow_receiver.url}).status_code == 201
    h_job = _train(hostile, "hostile")  # queued first: its success sends an event to the slow receiver

    stop = threading.Event()
    heartbeat_ages: list[float] = []
    admin = httpx.Client(base_url=stack.base, headers=AUTH, timeout=10)

    def watch_heartbeats() -> None:
        for w in admin.get("/workers").json():
            if w["alive"]:
                heartbeat_ages.append(w["heartbeat_age_seconds"])
        time.sleep(0.5)

    long_chat = {"model": "ftune-demo", "messages": [{"role": "user", "content": "Tell a long story."}]}
    long_chat |= {"n": 4, "max_tokens": 1000}
    dropping = httpx.Client(base_url=stack.base, headers={"Authorization": f"Bearer {h_key}"}, timeout=1.0)
    threads = [
        _repeat(stop, watch_heartbeats),
        _repeat(stop, lambda: dropping.post("/v1/chat/completions", json=long_chat)),
        _repeat(stop, lambda: dropping.post("/v1/chat/completions", json=long_chat)),
    ]
    try:
        jobs = [_train(t, f"polite{i}") for i, t in enumerate(polite)]
        with ThreadPoolExecutor(8) as pool:  # bursts of uploads and creates
            uploads = [
                pool.submit(h_sdk.files.create, file=("b.jsonl", ALPACA), purpose="fine-tune")
                for _ in range(8)
            ]
            burst_file = next(u.result().id for u in uploads if u.exception() is None)
            h_sdk.files.wait_for_processing(burst_file, poll_interval=0.2)
            creates = [
                pool.submit(
                    h_sdk.fine_tuning.jobs.create,
                    model="ftune-demo",
                    training_file=burst_file,
                    method=SUPERVISED,
                    extra_body=RUN,
                )
                for _ in range(8)
            ]
            for created in creates:  # accepted ones are called off: the burst is the point, not the runs
                if created.exception() is None:
                    h_sdk.fine_tuning.jobs.cancel(created.result().id)

        start = time.monotonic()
        for (sdk, _, _), job in zip(polite, jobs, strict=True):
            done = wait_for(sdk, job.id, {"succeeded"}, timeout=JOB_BOUND_S - (time.monotonic() - start))
            asked = time.monotonic()
            answer = sdk.with_options(timeout=CHAT_BOUND_S).chat.completions.create(
                model=done.fine_tuned_model,
                messages=[{"role": "user", "content": "Add 2 and 1."}],
                max_tokens=8,
            )
            assert answer.choices[0].message.content is not None
            assert time.monotonic() - asked < CHAT_BOUND_S
        wait_for(h_sdk, h_job.id, {"succeeded"}, timeout=60)
        time.sleep(3)  # the hostile job's event is being dripped to by now; the heartbeats keep coming
        assert slow_receiver.connections >= 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        dropping.close()
        admin.close()
    assert heartbeat_ages and max(heartbeat_ages) < STALE_S, max(heartbeat_ages, default=None)
