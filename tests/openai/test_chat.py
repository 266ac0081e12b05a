"""The official openai SDK's `client.chat.completions` against a real API (uvicorn, SQLite) forwarding to a
test double of the inference engine (tests/openai/engine_double.py) over real sockets.

What the API owns is tested here: who may call which model (404 model_not_found for another organization's
`ft:` name, an unknown one, a pruned checkpoint's), the adapter registered from the job id (path under the
job's directory, base model from the job; a kept checkpoint's laid out as PEFT's), registered again when
the engine forgot it, the body forwarded as sent as read (the fields ftune supports, re-serialised), SSE
passed through, the engine's errors passed on with their status (429 with Retry-After), 503
inference_unavailable without an engine (never its address), cheap bounds as 400 with the parameter named,
the engine's key sent, and a hostile tenant held: its requests past its share wait their turn (the fair
queue, api/chat_queue.py) and past its line's bound are 429, n x max_tokens capped, stop strings bounded,
ignore_eos refused unless allowed, and a client that goes away cancelling the engine's request.
The real engine answering is tests/e2e/test_chat_e2e.py.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.numpy import load_file

from core import ft_names
from core.storage import Storage
from tests.e2e.stack import TEST_ADMIN_KEY, free_port
from tests.openai.conftest import Server
from tests.openai.engine_double import (  # noqa: F401  (fixture)
    ENGINE_KEY,
    ChatStack,
    EngineDouble,
    chat_stack,
    serve,
    start_api,
)

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hello there"}]


def ft_name(tenant_id: str, job_id: str) -> str:
    return ft_names.fine_tuned_model("tiny", tenant_id, "demo", job_id)


def test_a_base_model_answers_and_streams(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, _ = chat_stack.tenant()
    with sdk:
        answer = sdk.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0, seed=3)
        assert answer.choices[0].message.content == "echo tiny: hello there"
        assert answer.usage is not None and answer.usage.total_tokens == 5
        forwarded = chat_stack.engine.chats[-1]
        assert forwarded == {"model": "tiny", "messages": HI, "max_tokens": 5, "temperature": 0, "seed": 3}

        with sdk.chat.completions.with_streaming_response.create(
            model="tiny", messages=HI, stream=True
        ) as raw:
            assert raw.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in raw.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5  # a chunk per word

        stream = sdk.chat.completions.create(model="tiny", messages=HI, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text == "echo tiny: hello there"


def test_a_fine_tuned_model_registers_its_adapter_from_the_job_id(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, tenant_id = chat_stack.tenant()
    job_id = chat_stack.finished_job(tenant_id)
    model = ft_name(tenant_id, job_id)
    engine = chat_stack.engine
    with sdk:
        for _ in range(2):  # registered once, then remembered
            answer = sdk.chat.completions.create(model=model, messages=HI)
            assert answer.choices[0].message.content == f"echo {model}: hello there"
        loads = [b for b in engine.loads if b["lora_name"] == model]
        adapter = Storage(chat_stack.data_dir).adapter_dir(job_id)
        assert loads == [{"lora_name": model, "lora_path": str(adapter), "base_model": "tiny"}]

        engine.restart()  # the engine forgot it: 404, registered again, the request retried once
        stream = sdk.chat.completions.create(model=model, messages=HI, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == f"echo {model}: hello there"
        assert len([b for b in engine.loads if b["lora_name"] == model]) == 2


def test_another_organizations_or_unknown_model_is_404_model_not_found(chat_stack: ChatStack) -> None:  # noqa: F811
    owner_sdk, owner = chat_stack.tenant()
    sdk, tenant_id = chat_stack.tenant()
    theirs = ft_name(owner, chat_stack.finished_job(owner))
    failed = ft_name(tenant_id, chat_stack.finished_job(tenant_id, status="failed"))
    mine = ft_name(tenant_id, chat_stack.finished_job(tenant_id))
    unknown = ft_name(tenant_id, "0" * 32)
    renamed = mine.replace(":demo:", ":other:")  # the right job id under another name
    before = len(chat_stack.engine.chats)
    with sdk, owner_sdk:
        for model in (theirs, failed, unknown, renamed, "no-such-base", "ft:garbage"):
            with pytest.raises(openai.NotFoundError) as e:
                sdk.chat.completions.create(model=model, messages=HI)
            assert e.value.code == "model_not_found" and e.value.param == "model", model
            assert e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as e:  # a checkpoint it never saved
            sdk.chat.completions.create(model=f"{mine}:ckpt-step-10", messages=HI)
        assert e.value.code == "model_not_found"
        assert len(chat_stack.engine.chats) == before  # none reached the engine
        assert owner_sdk.chat.completions.create(model=theirs, messages=HI).choices  # the owner's does answer


def test_a_kept_checkpoint_answers_from_its_own_adapter_until_pruned(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, tenant_id = chat_stack.tenant()
    other_sdk, _ = chat_stack.tenant()
    job_id = chat_stack.finished_job(tenant_id)
    ckpt = chat_stack.checkpoint(job_id, 20)
    model = ft_names.checkpoint_model(ft_name(tenant_id, job_id), 20)
    storage = Storage(chat_stack.data_dir)
    with sdk, other_sdk:
        answer = sdk.chat.completions.create(model=model, messages=HI)
        assert answer.choices[0].message.content == f"echo {model}: hello there"
        view = storage.checkpoint_adapter_dir(job_id, 20)
        loads = [b for b in chat_stack.engine.loads if b["lora_name"] == model]
        assert loads == [{"lora_name": model, "lora_path": str(view), "base_model": "tiny"}]
        # PEFT's layout of the checkpoint's weights, under the final adapter's names and config
        weights = load_file(view / "adapter_model.safetensors")
        assert set(weights) == set(load_file(storage.adapter_dir(job_id) / "adapter_model.safetensors"))
        assert all((w == 20).all() for w in weights.values())
        assert (view / "adapter_config.json").read_text() == "{}"

        with pytest.raises(openai.NotFoundError) as e:  # another organization's checkpoint
            other_sdk.chat.completions.create(model=model, messages=HI)
        assert e.value.code == "model_not_found"

        shutil.rmtree(ckpt)  # pruned, as keep_checkpoints does
        before = len(chat_stack.engine.chats)
        with pytest.raises(openai.NotFoundError) as e:
            sdk.chat.completions.create(model=model, messages=HI)
        assert (e.value.code, e.value.param, e.value.body["type"]) == (
            "model_not_found",
            "model",
            "invalid_request_error",
        )
        assert len(chat_stack.engine.chats) == before


def test_the_engines_errors_pass_through_with_their_status_and_retry_after(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, _ = chat_stack.tenant()
    with sdk:
        with pytest.raises(openai.RateLimitError) as e:
            sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "overload"}])
        assert e.value.status_code == 429 and e.value.code == "engine_overloaded"
        assert e.value.response.headers["retry-after"] == "7"
        with pytest.raises(openai.RateLimitError) as e:
            sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "overload"}], stream=True
            )
        assert e.value.code == "engine_overloaded"
        with pytest.raises(openai.InternalServerError) as e:
            sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "slow"}])
        assert e.value.status_code == 504 and e.value.code == "engine_timeout"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"n": 0}, "n"),
        ({"n": 100}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        # n x max_tokens over FTUNE_CHAT_MAX_TOTAL_TOKENS (4096)
        ({"n": 4, "max_tokens": 2000}, "max_tokens"),
        ({"n": 2, "max_completion_tokens": 4000, "max_tokens": 10}, "max_completion_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        # OpenAI's bounds on stop: 4 strings of at most 64 characters
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 65}, "stop"),
        ({"stop": ["y" * 60_000] * 16}, "stop"),
        ({"stop": [""]}, "stop"),
        # vLLM's ignore_eos only where the operator allows it (FTUNE_CHAT_ALLOW_IGNORE_EOS)
        ({"extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ],
)
def test_cheap_bounds_are_400_with_the_parameter(
    chat_stack: ChatStack,  # noqa: F811
    extra: dict[str, object],
    param: str,
) -> None:
    sdk, _ = chat_stack.tenant()
    before = len(chat_stack.engine.chats)
    with sdk, pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(**({"model": "tiny", "messages": HI} | extra))  # type: ignore[call-overload]
    assert e.value.param == param and e.value.code == "invalid_request"
    assert len(chat_stack.engine.chats) == before


def test_no_engine_configured_is_503_inference_unavailable(server: Server) -> None:
    sdk, native = server.tenant()
    with sdk, native, pytest.raises(openai.InternalServerError) as e:
        sdk.chat.completions.create(model="tiny", messages=HI)
    assert e.value.status_code == 503 and e.value.code == "inference_unavailable"
    assert "FTUNE_INFERENCE_URL" in e.value.message


def test_an_engine_that_is_down_is_503_inference_unavailable(tmp_path: Path) -> None:
    # nothing listens on the port: connection refused
    api, base, _ = start_api(tmp_path, FTUNE_INFERENCE_URL=f"http://127.0.0.1:{free_port()}")
    try:
        with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{base}/v1", max_retries=0) as sdk:
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as e:
                    sdk.chat.completions.create(model="tiny", messages=HI, stream=stream)
                assert e.value.status_code == 503 and e.value.code == "inference_unavailable"
                assert "the inference engine is unavailable" in e.value.message
                assert "127.0.0.1" not in e.value.response.text and "http" not in e.value.response.text
    finally:
        api.stop()


def test_the_body_is_forwarded_as_read_never_as_sent(chat_stack: ChatStack) -> None:  # noqa: F811
    """Only the fields ftune supports reach the engine, re-serialised: extras of the body and of its messages
    (vLLM's guided decoding, a lora path, anything) are dropped."""
    sdk, _ = chat_stack.tenant()
    with sdk:
        sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}], "secret": "s"}],  # type: ignore[list-item]
            stop=["\n"],
            user="someone",
            extra_body={"lora_path": "/etc", "guided_regex": ".*", "priority": -100, "max_tokens": 3},
        )
    assert chat_stack.engine.chats[-1] == {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3,
        "stop": ["\n"],
    }


def test_a_tenants_requests_past_its_share_wait_and_past_its_line_are_429(tmp_path: Path) -> None:
    """FTUNE_CHAT_MAX_RUNNING=3 (a tenant alone runs 2), FTUNE_CHAT_MAX_QUEUED_PER_TENANT=1: a third request
    while two are held waits for its turn (it does not reach the engine), a fourth is 429 with Retry-After;
    another tenant starts at once (the place kept free); once the held end, the one waiting is answered."""
    engine = EngineDouble(key=ENGINE_KEY)
    server = serve(engine)
    bounds = {"FTUNE_CHAT_MAX_RUNNING": "3", "FTUNE_CHAT_MAX_QUEUED_PER_TENANT": "1"}
    url = f"http://127.0.0.1:{server.server_port}"
    api, base, database_url = start_api(
        tmp_path, FTUNE_INFERENCE_URL=url, FTUNE_INFERENCE_API_KEY=ENGINE_KEY, **bounds
    )
    stack = ChatStack(base, tmp_path / "data", database_url, engine)
    (sdk, _), (other, _) = stack.tenant(), stack.tenant()
    hold = [{"role": "user", "content": "hold"}]
    try:
        with sdk, other, ThreadPoolExecutor(4) as pool:
            try:
                held = [
                    pool.submit(sdk.chat.completions.create, model="tiny", messages=hold),
                    pool.submit(
                        lambda: list(sdk.chat.completions.create(model="tiny", messages=hold, stream=True))
                    ),
                ]
                deadline = time.monotonic() + 20
                while engine.holding < 2:
                    assert time.monotonic() < deadline, "the two requests never reached the engine"
                    time.sleep(0.05)
                extra = [pool.submit(sdk.chat.completions.create, model="tiny", messages=hold) for _ in "34"]
                done, _ = wait(extra, timeout=20, return_when=FIRST_COMPLETED)
                assert len(done) == 1, "one of the two past the share must wait, the other be refused"
                with pytest.raises(openai.RateLimitError) as e:
                    done.pop().result()
                assert e.value.code == "too_many_concurrent_requests"
                assert int(e.value.response.headers["retry-after"]) >= 1
                (waiting,) = [f for f in extra if not f.done()]
                assert other.chat.completions.create(model="tiny", messages=HI).choices  # not this one's line
                assert engine.holding == 2 and not waiting.done()  # it waits in the API, not the engine
            finally:
                engine.release.set()
            assert held[0].result(timeout=20).choices[0].message.content == "echo tiny: hold"
            assert held[1].result(timeout=20)
            assert waiting.result(timeout=20).choices[0].message.content == "echo tiny: hold"
            for _ in range(3):  # the places came back
                assert sdk.chat.completions.create(model="tiny", messages=HI).choices
    finally:
        api.stop()
        server.shutdown()


def test_a_non_streaming_client_that_goes_away_cancels_the_engines_request(chat_stack: ChatStack) -> None:  # noqa: F811
    """The client drops a held (long) non-streaming request after 1 s: the API closes its request to the
    engine at once (the engine then stops generating), and frees the tenant's slot: three times in a row
    would exhaust a limit of 2 if it did not."""
    engine = chat_stack.engine
    engine.release.clear()
    sdk, _ = chat_stack.tenant()
    key = sdk.api_key
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hold"}]}
    with sdk:
        for attempt in range(3):
            dropped = engine.dropped
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{chat_stack.base}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=1,
                )
            deadline = time.monotonic() + 5
            while engine.dropped == dropped:
                assert time.monotonic() < deadline, f"attempt {attempt}: the engine's request was kept open"
                time.sleep(0.05)
        assert sdk.chat.completions.create(model="tiny", messages=HI).choices


def test_operator_settings_allow_ignore_eos_and_set_the_token_cap(tmp_path: Path) -> None:
    engine = EngineDouble(key=ENGINE_KEY)
    server = serve(engine)
    url = f"http://127.0.0.1:{server.server_port}"
    env = {
        "FTUNE_INFERENCE_URL": url,
        "FTUNE_CHAT_ALLOW_IGNORE_EOS": "true",
        "FTUNE_CHAT_MAX_TOTAL_TOKENS": "10",
    }
    api, base, _ = start_api(tmp_path / "allowed", FTUNE_INFERENCE_API_KEY=ENGINE_KEY, **env)
    wrong, wrong_base, _ = start_api(
        tmp_path / "wrong", FTUNE_INFERENCE_URL=url, FTUNE_INFERENCE_API_KEY="nope"
    )
    try:
        with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{base}/v1", max_retries=0) as sdk:
            sdk.chat.completions.create(
                model="tiny", messages=HI, max_tokens=5, extra_body={"ignore_eos": True}
            )
            assert engine.chats[-1]["ignore_eos"] is True
            with pytest.raises(openai.BadRequestError) as e:
                sdk.chat.completions.create(model="tiny", messages=HI, n=2, max_tokens=6)
            assert e.value.param == "max_tokens" and "10" in e.value.message
        # an API with the wrong engine key: the engine's 401 is the tenant's 503, without the engine's address
        with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{wrong_base}/v1", max_retries=0) as sdk:
            with pytest.raises(openai.InternalServerError) as unavailable:
                sdk.chat.completions.create(model="tiny", messages=HI)
            assert unavailable.value.status_code == 503 and unavailable.value.code == "inference_unavailable"
            assert url not in unavailable.value.response.text
    finally:
        api.stop()
        wrong.stop()
        server.shutdown()
