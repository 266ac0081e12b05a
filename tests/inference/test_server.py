"""The engine as the API sees it: a real `python -m inference.server` process, driven by the official
openai SDK (and httpx for vLLM's adapter endpoints, which the SDK does not have). It runs with a key
(FTUNE_INFERENCE_API_KEY) and a generation deadline of GENERATION_S."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.inference.conftest import BASE

REPO = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "Name a river."}]
KEY = "engine-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATION_S = 10
SHORT_DEADLINE_S = 0.5  # the deadline's own test: 16 x LONG tokens take 1.2-6 s on 2 cores
LONG = 480  # tokens: about the tiny model's whole context (512), several seconds on a CPU

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_engine(
    tiny_model: Path, tmp: Path, generation_s: float, key: str = KEY, flags: tuple[str, ...] = ()
) -> Iterator[str]:
    """The engine on a free port over the tiny model's catalog, at most 2 requests waiting, with a key."""
    port = free_port()
    env = {
        **os.environ,
        "FTUNE_MODELS_DIR": str(tiny_model.parent),
        "FTUNE_HF_CACHE_DIR": str(tmp / "no-hf-cache"),
        "FTUNE_INFERENCE_API_KEY": key,
        "FTUNE_INFERENCE_GENERATION_SECONDS": str(generation_s),
    }
    log = (tmp / "engine.log").open("w")
    cmd = [sys.executable, "-m", "inference.server", "--port", str(port), "--max-waiting", "2", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp / "engine.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).json() == {"status": "ok"}:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's engine's directory: its output is in engine.log there."""
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path, engine_dir: Path) -> Iterator[str]:
    with running_engine(tiny_model, engine_dir, GENERATION_S) as url:
        yield url


@pytest.fixture
def client(engine_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=BASE, messages=USER, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.model == BASE
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=BASE,
            messages=USER,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, "tokens arrive one by one"
    assert "".join(pieces) == choice.message.content  # greedy: the same answer
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    two = client.chat.completions.create(model=BASE, messages=USER, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content  # greedy twice
    assert two.usage is not None and two.usage.completion_tokens % 2 == 0  # two equal answers
    assert 0 < two.usage.completion_tokens <= 10


def test_load_lora_adapter_then_chat_with_its_name(
    client: openai.OpenAI, engine_url: str, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(42)
    body = {"lora_name": "ft:tiny:test::abc", "lora_path": str(adapter)}
    assert httpx.post(f"{engine_url}/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 200
    assert (
        httpx.post(f"{engine_url}/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 200
    )  # idempotent
    listed = {m.id: m for m in client.models.list()}
    assert BASE in listed and "ft:tiny:test::abc" in listed

    tuned = client.chat.completions.create(
        model="ft:tiny:test::abc", messages=USER, max_tokens=8, temperature=0
    )
    base = client.chat.completions.create(model=BASE, messages=USER, max_tokens=8, temperature=0)
    assert tuned.model == "ft:tiny:test::abc"
    assert tuned.choices[0].message.content != base.choices[0].message.content

    bad = httpx.post(
        f"{engine_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(REPO)}, headers=AUTH
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_adapter" and bad.json()["error"]["param"] == "lora_path"

    unload = {"lora_name": "ft:tiny:test::abc"}
    assert httpx.post(f"{engine_url}/v1/unload_lora_adapter", json=unload, headers=AUTH).status_code == 200
    assert httpx.post(f"{engine_url}/v1/unload_lora_adapter", json=unload, headers=AUTH).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ft:tiny:test::abc", messages=USER, max_tokens=2)


def test_unknown_model_and_bad_input(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2)
    assert missing.value.code == "model_not_found"
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=BASE, messages=USER, max_tokens=2, temperature=3)
    assert bad.value.code == "invalid_value" and bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=BASE, messages=USER, max_tokens=100_000)
    assert long.value.code == "context_length_exceeded"


def test_beyond_max_waiting_is_429_and_the_rest_are_answered(client: openai.OpenAI) -> None:
    """--max-waiting 2: of 8 requests sent at once while each takes a while, at least the two let in line
    are answered (more when the batch took some before the others arrived), the others are refused with
    429 engine_overloaded at once. None is lost, none 5xx."""
    tokens = 120

    def ask(i: int) -> tuple[str, object]:
        try:
            reply = client.chat.completions.create(
                model=BASE,
                messages=[{"role": "user", "content": f"Request {i}"}],
                max_tokens=tokens,
                temperature=0,
                extra_body={"ignore_eos": True},  # vLLM's extension: exactly max_tokens, so each is slow
            )
            return "ok", reply
        except openai.RateLimitError as e:
            return "429", e
        except openai.APIStatusError as e:  # anything else is a failure of the test
            return str(e.status_code), e

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    kinds = [k for k, _ in results]
    assert set(kinds) <= {"ok", "429"}, kinds
    assert kinds.count("ok") >= 2 and kinds.count("429") >= 1, kinds
    for kind, r in results:
        if kind == "ok":
            assert r.usage.completion_tokens == tokens  # type: ignore[attr-defined]
        else:
            assert r.code == "engine_overloaded"  # type: ignore[attr-defined]
            assert r.response.headers["retry-after"] == "1"  # type: ignore[attr-defined]
    # the line drained: a new request is answered
    after = client.chat.completions.create(model=BASE, messages=USER, max_tokens=2, temperature=0)
    assert after.choices[0].message.content is not None


def test_every_route_but_health_wants_the_key_and_models_show_no_paths(
    engine_url: str, make_adapter: Callable[..., Path]
) -> None:
    assert httpx.get(f"{engine_url}/health").status_code == 200
    chat = {"model": BASE, "messages": USER, "max_tokens": 1}
    adapter = make_adapter(7)
    load = {"lora_name": "ft:tiny:keyed::abc", "lora_path": str(adapter)}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/load_lora_adapter", load),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
            ("GET", "/openapi.json", None),
        ):
            r = httpx.request(method, f"{engine_url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()

    assert httpx.post(f"{engine_url}/v1/load_lora_adapter", json=load, headers=AUTH).status_code == 200
    listed = httpx.get(f"{engine_url}/v1/models", headers=AUTH)
    assert listed.status_code == 200 and "ft:tiny:keyed::abc" in listed.text
    assert str(adapter) not in listed.text and str(adapter.parent) not in listed.text
    assert all(not str(m["root"]).startswith("/") for m in listed.json()["data"])


def test_a_non_streaming_client_that_goes_away_frees_the_engine(
    client: openai.OpenAI, engine_url: str
) -> None:
    """n=16 choices of LONG tokens each (seconds), dropped by its client after 0.5 s: the engine stops
    generating it, and the next request is answered within seconds (well before the deadline)."""
    hog = {"model": BASE, "messages": USER, "n": 16, "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # 16 x LONG tokens take 1.2-6 s; once, on a quiet machine, < 1.5 s
        httpx.post(f"{engine_url}/v1/chat/completions", json=hog, headers=AUTH, timeout=0.5)
    started = time.monotonic()
    quick = client.chat.completions.create(model=BASE, messages=USER, max_tokens=1, temperature=0)
    assert quick.choices[0].message.content is not None
    assert time.monotonic() - started < GENERATION_S / 2


def test_a_dropped_chat_logs_one_line_and_no_traceback(engine_url: str, engine_dir: Path) -> None:
    """Two chats dropped mid-generation by their clients, one plain and one streamed: the engine says so
    in one line each, and logs no traceback (once ~80 lines of InvalidStateError per plain drop)."""
    log = engine_dir / "engine.log"
    before = len(log.read_text())
    hog = {"model": BASE, "messages": USER, "n": 16, "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # 16 x LONG tokens take 1.2-6 s; once, on a quiet machine, < 1.5 s
        httpx.post(f"{engine_url}/v1/chat/completions", json=hog, headers=AUTH, timeout=0.5)
    streamed = {**hog, "stream": True}
    with httpx.stream("POST", f"{engine_url}/v1/chat/completions", json=streamed, headers=AUTH) as r:
        assert r.status_code == 200
        assert sum(1 for _, line in zip(range(20), r.iter_lines(), strict=False) if line) > 3  # mid-stream

    def dropped() -> list[str]:
        return [line for line in log.read_text()[before:].splitlines() if "went away" in line]

    deadline = time.monotonic() + 20
    while len(dropped()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # anything the engine would log after its line
    new = log.read_text()[before:]
    assert "Traceback" not in new and "InvalidStateError" not in new, new[-3000:]
    assert len(dropped()) == 2, new[-3000:]
    assert any("before its answer" in line for line in dropped())
    assert any("mid-stream" in line for line in dropped())


def test_the_generation_deadline_ends_a_long_generation(tiny_model: Path, tmp_path: Path) -> None:
    """16 x LONG tokens (1.2-6 s on 2 cores, quiet or busy) against an engine whose deadline is
    SHORT_DEADLINE_S: the answer comes at the deadline, cut short with finish_reason "length" (the choices
    it left no time for are empty)."""
    with running_engine(tiny_model, tmp_path, SHORT_DEADLINE_S) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        _ends_at_the_deadline(client)


def _ends_at_the_deadline(client: openai.OpenAI) -> None:
    client.chat.completions.create(model=BASE, messages=USER, max_tokens=1)  # the base loaded first
    started = time.monotonic()
    reply = client.chat.completions.create(
        model=BASE, messages=USER, n=16, max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True}
    )
    elapsed = time.monotonic() - started
    assert SHORT_DEADLINE_S - 0.5 < elapsed < SHORT_DEADLINE_S + 8, elapsed
    assert [c.finish_reason for c in reply.choices] == ["length"] * 16
    assert reply.usage is not None and 0 < reply.usage.completion_tokens < 16 * LONG
    # the engine is free again
    assert client.chat.completions.create(model=BASE, messages=USER, max_tokens=1).choices


def test_stop_strings_are_bounded_as_openai_bounds_them(client: openai.OpenAI) -> None:
    for stop in (["a", "b", "c", "d", "e"], "x" * 65, ["ok", "y" * 60_000]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=BASE, messages=USER, max_tokens=1, stop=stop)
        assert e.value.body["param"] == "stop"  # type: ignore[index]
    four = client.chat.completions.create(
        model=BASE, messages=USER, max_tokens=2, stop=["a", "b", "c", "d" * 64]
    )
    assert four.choices


def test_without_a_key_the_engine_starts_only_when_told_and_only_on_loopback(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`ftune inference` with no FTUNE_INFERENCE_API_KEY refuses to start (it would serve anyone who
    reaches it); --insecure-no-key lets it start on a loopback host only."""
    env = {**os.environ, "FTUNE_MODELS_DIR": str(tiny_model.parent), "FTUNE_DATA_DIR": str(tmp_path / "d")}
    env.pop("FTUNE_INFERENCE_API_KEY", None)
    port = str(free_port())
    for flags, said in (
        ([], "FTUNE_INFERENCE_API_KEY is not set"),
        (["--insecure-no-key", "--host", "0.0.0.0"], "only on a loopback host"),
        (["--insecure-no-key", "--host", "10.1.2.3"], "only on a loopback host"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "cli", "inference", "--port", port, *flags],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, (flags, done.stderr[-2000:])
        assert said in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "Uvicorn running" not in done.stderr
    with running_engine(tiny_model, tmp_path, GENERATION_S, key="", flags=("--insecure-no-key",)) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 200  # open, on 127.0.0.1 alone
