"""/v1/fine_tuning/alpha/graders/validate and /run through the official openai SDK, on real servers.

`graders`: an API server of its own with the python sandbox enabled and a judge endpoint (a local stub of
/v1/chat/completions), one grader run at a time per tenant. The package's shared `server` has neither, as
a default deployment: there python graders are refused and model graders need a judge.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.graders import LabelModelGrader, MultiGrader

from tests.e2e.stack import REPO, Proc, env_for, free_port
from tests.graders.chat_stub import ChatStub, chat_stub, completion
from tests.openai.conftest import Server

pytestmark = pytest.mark.slow

JUDGE_KEY = "judge-secret"
CAPITAL = {"type": "string_check", "name": "capital", "input": "{{ sample.output_text }}"}
CAPITAL |= {"reference": "{{ item.answer }}", "operation": "eq"}
EXACT_PY = "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['answer'] else 0.25\n"
SCORE = {"type": "score_model", "name": "judge", "model": "judge-model", "range": [0, 1]}
SCORE |= {"input": [{"role": "user", "content": "Rate {{ sample.output_text }} against {{ item.answer }}"}]}
LABEL = {"type": "label_model", "model": "judge-model", "labels": ["good", "bad"], "passing_labels": ["good"]}
LABEL |= {"input": [{"role": "user", "content": "Is {{ sample.output_text }} right?"}]}


@pytest.fixture(scope="module")
def judge() -> Iterator[ChatStub]:
    with chat_stub() as stub:
        yield stub


@pytest.fixture
def stub(judge: ChatStub) -> ChatStub:
    judge.reset()
    return judge


@pytest.fixture(scope="module")
def graders(tmp_path_factory: pytest.TempPathFactory, judge: ChatStub) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("graders")
    (tmp / "models").mkdir()
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    env |= {"FTUNE_PYTHON_GRADER_ENABLED": "1", "FTUNE_GRADER_RUN_MAX_CONCURRENT_PER_TENANT": "1"}
    env |= {"FTUNE_GRADER_MODEL_BASE_URL": judge.base_url, "FTUNE_GRADER_MODEL_API_KEY": JUDGE_KEY}
    env |= {"FTUNE_GRADER_MODEL_ALLOWED_MODELS": '["judge-model"]'}
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    api = Proc(["api"], env, tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, api)
        yield Server(base, tmp / "data", database_url)
    finally:
        api.stop()


def wait_healthy(base: str, api: Proc) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert api.p.poll() is None and time.monotonic() < deadline, api.tail()
        time.sleep(0.2)


@pytest.fixture
def sdk(graders: Server) -> Iterator[openai.OpenAI]:
    client, native = graders.tenant()
    native.close()
    with client:
        yield client


@pytest.fixture
def plain(tenant: tuple[openai.OpenAI, httpx.Client]) -> openai.OpenAI:
    """A tenant of the shared server: no sandbox, no judge."""
    return tenant[0]


def refused(call: Any, code: str, param: str | None) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert isinstance(error, dict), error
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error"), error
    return str(error["message"])


# -- validate ------------------------------------------------------------------------------------------------


def test_validate_echoes_every_grader_type_normalised(sdk: openai.OpenAI) -> None:
    for operation in ("eq", "ne", "like", "ilike"):
        grader = sdk.fine_tuning.alpha.graders.validate(grader={**CAPITAL, "operation": operation}).grader
        assert grader is not None and grader.type == "string_check"
        assert (grader.operation, grader.reference) == (operation, "{{ item.answer }}")
    similar = {
        "type": "text_similarity",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
    }
    grader = sdk.fine_tuning.alpha.graders.validate(grader={**similar, "evaluation_metric": "rouge_l"}).grader
    assert grader is not None and grader.type == "text_similarity"
    assert (grader.name, grader.evaluation_metric) == ("text_similarity", "rouge_l")  # the name filled in
    python = {"type": "python", "name": "exact", "source": EXACT_PY}
    grader = sdk.fine_tuning.alpha.graders.validate(grader=python).grader
    assert grader is not None and grader.type == "python" and grader.source == EXACT_PY
    grader = sdk.fine_tuning.alpha.graders.validate(grader=SCORE).grader
    assert grader is not None and grader.type == "score_model" and grader.model == "judge-model"
    assert grader.range == [0, 1] and grader.input[0].content == SCORE["input"][0]["content"]
    multi = {"type": "multi", "graders": {"exact": CAPITAL, "ok": LABEL}, "calculate_output": "exact + ok"}
    raw = sdk.fine_tuning.alpha.graders.with_raw_response.validate(grader=multi)
    echoed = raw.http_response.json()["grader"]  # a named map, as OpenAI's guide and ftune's jobs have it
    assert (echoed["type"], echoed["name"], echoed["calculate_output"]) == ("multi", "multi", "exact + ok")
    assert echoed["graders"]["exact"]["operation"] == "eq" and echoed["graders"]["ok"]["name"] == "ok"
    assert echoed["graders"]["ok"]["passing_labels"] == ["good"]
    # One grader object (the form the SDK's types declare) comes back as one: the SDK reads it typed.
    single = {"type": "multi", "name": "m", "graders": {**LABEL, "name": "ok"}, "calculate_output": "ok"}
    grader = sdk.fine_tuning.alpha.graders.validate(grader=single).grader
    assert isinstance(grader, MultiGrader) and isinstance(grader.graders, LabelModelGrader)
    assert (grader.graders.name, grader.graders.labels) == ("ok", ["good", "bad"])


def test_validate_names_the_field_at_fault(sdk: openai.OpenAI) -> None:
    validate = sdk.fine_tuning.alpha.graders.validate
    refused(lambda: validate(grader={"type": "regex"}), "unknown_grader_type", "grader.type")
    refused(lambda: validate(grader=[1]), "invalid_grader", "grader")
    nested = {"type": "multi", "graders": {"a": CAPITAL, "b": {"type": "nope"}}, "calculate_output": "a"}
    refused(lambda: validate(grader=nested), "unknown_grader_type", "grader.graders.b.type")
    bad_template = {**CAPITAL, "reference": "{{ answer.key }}"}
    message = refused(lambda: validate(grader=bad_template), "invalid_template", "grader.reference")
    assert "unknown namespace 'answer'" in message
    formula = {"type": "multi", "graders": {"a": CAPITAL}, "calculate_output": "a + b"}
    refused(lambda: validate(grader=formula), "formula_parse_error", "grader.calculate_output")
    typo = {**CAPITAL, "refrence": "x"}
    refused(lambda: validate(grader=typo), "invalid_grader", "grader.refrence")
    refused(lambda: validate(grader=LABEL), "label_model_outside_multi", "grader.type")
    huge = {"type": "python", "source": EXACT_PY + "#" * (256 * 1024)}
    refused(lambda: validate(grader=huge), "python_source_too_large", "grader.source")
    no_grade = {"type": "python", "source": "def score(sample, item):\n    return 1\n"}
    refused(lambda: validate(grader=no_grade), "invalid_python_source", "grader.source")


def test_what_a_default_server_refuses(plain: openai.OpenAI) -> None:
    """No sandbox and no judge: python graders and model graders are refused by validate and run alike, as
    a job with them would be at admission; everything else grades."""
    graders = plain.fine_tuning.alpha.graders
    python = {"type": "python", "source": EXACT_PY}
    for call in (
        lambda: graders.validate(grader=python),
        lambda: graders.run(grader=python, model_sample="x"),
    ):
        refused(call, "python_grader_disabled", "grader.type")
    message = refused(
        lambda: graders.run(grader=SCORE, model_sample="x"), "grader_model_not_configured", "grader.type"
    )
    assert "FTUNE_GRADER_MODEL_BASE_URL" in message
    multi = {"type": "multi", "graders": {"exact": CAPITAL, "ok": LABEL}, "calculate_output": "exact * ok"}
    refused(lambda: graders.validate(grader=multi), "grader_model_not_configured", "grader.graders.ok.type")
    single = {"type": "multi", "graders": {**LABEL, "name": "ok"}, "calculate_output": "ok"}
    refused(lambda: graders.validate(grader=single), "grader_model_not_configured", "grader.graders.type")
    result = graders.run(grader=CAPITAL, model_sample="Paris", item={"answer": "Paris"})
    assert result.reward == 1.0


def test_auth_is_the_api_key(graders: Server) -> None:
    stranger = openai.OpenAI(api_key="ftk_nope", base_url=f"{graders.base}/v1", max_retries=0)
    with stranger, pytest.raises(openai.AuthenticationError):
        stranger.fine_tuning.alpha.graders.validate(grader=CAPITAL)


# -- run ---------------------------------------------------------------------------------------------------


def test_run_string_check_operations(sdk: openai.OpenAI) -> None:
    cases = [("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "Paris", 0.0), ("ne", "Lyon", 1.0)]
    cases += [("like", "It is Paris.", 1.0), ("like", "It is PARIS.", 0.0), ("ilike", "It is PARIS.", 1.0)]
    cases += [("ilike", "It is Lyon.", 0.0)]
    for operation, answer, reward in cases:
        grader = {**CAPITAL, "operation": operation}
        result = sdk.fine_tuning.alpha.graders.run(
            grader=grader, model_sample=answer, item={"answer": "Paris"}
        )
        assert result.reward == reward, (operation, answer)
        meta = result.metadata
        assert (meta.name, meta.type, meta.token_usage, meta.sampled_model_name) == (
            "capital",
            "string_check",
            None,
            None,
        )
        assert meta.execution_time >= 0 and not any(v for v in meta.errors.model_dump().values() if v is True)
        assert result.sub_rewards == {} and result.api_model_grader_token_usage_per_model == {}


def test_run_text_similarity(sdk: openai.OpenAI) -> None:
    similar = {
        "type": "text_similarity",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
    }
    item = {"answer": "the cat sat on the mat"}
    run = sdk.fine_tuning.alpha.graders.run
    for metric in ("fuzzy_match", "bleu", "rouge_l"):
        grader = {**similar, "evaluation_metric": metric}
        assert run(grader=grader, model_sample=item["answer"], item=item).reward == pytest.approx(1.0)
        partial = run(grader=grader, model_sample="the cat sat on a rug", item=item).reward
        assert 0.0 <= partial < 1.0, metric
    fuzzy = {**similar, "evaluation_metric": "fuzzy_match"}
    assert run(grader=fuzzy, model_sample="the cat sat on the hat", item=item).reward > 0.9


def test_run_python_in_the_sandbox(sdk: openai.OpenAI) -> None:
    run = sdk.fine_tuning.alpha.graders.run
    python = {"type": "python", "name": "exact", "source": EXACT_PY}
    assert run(grader=python, model_sample="42", item={"answer": "42"}).reward == 1.0
    result = run(grader=python, model_sample="41", item={"answer": "42"})
    assert (result.reward, result.metadata.name, result.metadata.type) == (0.25, "exact", "python")
    json_py = "def grade(sample, item):\n    return sample['output_json']['n'] / 10\n"
    grader = {"type": "python", "source": json_py}
    assert run(grader=grader, model_sample='{"n": 7}').reward == pytest.approx(0.7)
    failing = run(grader=python, model_sample="42", item={})  # item['answer']: KeyError
    errors = failing.metadata.errors
    assert failing.reward == 0.0 and errors.python_grader_runtime_error
    assert "KeyError" in (errors.python_grader_runtime_error_details or "")
    escape = "import socket\ndef grade(sample, item):\n    socket.socket()\n    return 1.0\n"
    blocked = run(grader={"type": "python", "source": escape}, model_sample="x")
    assert blocked.reward == 0.0 and blocked.metadata.errors.python_grader_runtime_error


def test_run_score_model_asks_the_judge(sdk: openai.OpenAI, stub: ChatStub) -> None:
    stub.answer = lambda body: (200, completion('{"steps": [], "result": 0.7}', prompt_tokens=20))
    result = sdk.fine_tuning.alpha.graders.run(grader=SCORE, model_sample="Paris", item={"answer": "Paris"})
    assert result.reward == pytest.approx(0.7)
    assert (result.metadata.type, result.metadata.scores, result.metadata.token_usage) == (
        "score_model",
        {"result": 0.7},
        25,
    )
    usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
    assert result.api_model_grader_token_usage_per_model == {"judge-model": usage}
    (asked,) = stub.requests
    assert asked["auth"] == f"Bearer {JUDGE_KEY}" and asked["body"]["model"] == "judge-model"
    assert asked["body"]["messages"] == [{"role": "user", "content": "Rate Paris against Paris"}]

    stub.answer = lambda body: (500, "judge down")
    down = sdk.fine_tuning.alpha.graders.run(grader=SCORE, model_sample="Paris", item={"answer": "Paris"})
    assert down.reward == 0.0 and down.metadata.errors.api_model_grader_server_error


def test_run_multi_with_a_label_model_and_a_formula(sdk: openai.OpenAI, stub: ChatStub) -> None:
    multi = {
        "type": "multi",
        "name": "blend",
        "graders": {"exact": CAPITAL, "ok": LABEL, "close": {**SCORE, "name": "close"}},
        "calculate_output": "0.5 * exact + 0.25 * ok + 0.25 * min(close, 1)",
    }
    run = sdk.fine_tuning.alpha.graders.run

    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        label = body["response_format"]["json_schema"]["name"] == "label"
        return 200, completion(json.dumps({"steps": [], "result": "good" if label else 0.4}))

    stub.answer = answer
    result = run(grader=multi, model_sample="Paris", item={"answer": "Paris"})
    assert result.reward == pytest.approx(0.5 + 0.25 + 0.1)
    assert result.sub_rewards == {"exact": 1.0, "ok": 1.0, "close": pytest.approx(0.4)}
    assert (result.metadata.name, result.metadata.type, result.metadata.token_usage) == ("blend", "multi", 32)
    usage = {"prompt_tokens": 22, "completion_tokens": 10, "total_tokens": 32}
    assert result.api_model_grader_token_usage_per_model == {"judge-model": usage}
    wrong = run(grader=multi, model_sample="Lyon", item={"answer": "Paris"})
    assert wrong.reward == pytest.approx(0.35) and wrong.sub_rewards["exact"] == 0.0


def test_a_failing_sample_is_a_zero_with_its_flag(sdk: openai.OpenAI) -> None:
    run = sdk.fine_tuning.alpha.graders.run
    missing = run(grader=CAPITAL, model_sample="Paris", item={"question": "?"})
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error
    assert not missing.metadata.errors.sample_parse_error
    on_json = {**CAPITAL, "input": "{{ sample.output_json.city }}"}
    unparsed = run(grader=on_json, model_sample="Paris, not JSON", item={"answer": "Paris"})
    assert unparsed.reward == 0.0 and unparsed.metadata.errors.sample_parse_error
    parsed = run(grader=on_json, model_sample='{"city": "Paris"}', item={"answer": "Paris"})
    assert parsed.reward == 1.0
    no_item = run(grader=CAPITAL, model_sample="Paris")  # item left out: {}
    assert no_item.reward == 0.0 and no_item.metadata.errors.invalid_variable_error
    division = {"type": "multi", "graders": {"a": CAPITAL}, "calculate_output": "1 / a"}
    zero = run(grader=division, model_sample="Lyon", item={"answer": "Paris"})
    assert zero.reward == 0.0 and zero.metadata.errors.formula_parse_error


def test_run_bounds_sizes(sdk: openai.OpenAI) -> None:
    run = sdk.fine_tuning.alpha.graders.run
    refused(
        lambda: run(grader=CAPITAL, model_sample="x" * (64 * 1024 + 1)), "invalid_request", "model_sample"
    )
    refused(
        lambda: run(grader=CAPITAL, model_sample="x", item={"a": "x" * 70_000}), "invalid_request", "item"
    )
    refused(lambda: run(grader=CAPITAL, model_sample="x", item=[1]), "invalid_request", "item")
    # A template that repeats the sample multiplies it: refused before grading.
    repeated = {**CAPITAL, "input": "{{ sample.output_text }}" * 10}
    message = refused(
        lambda: run(grader=repeated, model_sample="x" * 60_000), "grader_input_too_large", "grader"
    )
    assert "262144" in message
    assert run(grader=repeated, model_sample="x" * 1000, item={"answer": "x" * 10_000}).reward == 1.0


def test_runs_of_a_tenant_are_bounded(graders: Server, sdk: openai.OpenAI, stub: ChatStub) -> None:
    """One run at a time per tenant on this server (FTUNE_GRADER_RUN_MAX_CONCURRENT_PER_TENANT=1): a second
    while a slow judge holds the first is 429 with Retry-After; another tenant is not held up."""
    answered = threading.Event()

    def slow(body: dict[str, Any]) -> tuple[int, Any]:
        answered.wait(10)
        return 200, completion("1")

    stub.answer = slow
    first: list[Any] = []
    thread = threading.Thread(
        target=lambda: first.append(
            sdk.fine_tuning.alpha.graders.run(grader=SCORE, model_sample="a", item={"answer": "a"})
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not stub.requests:  # the first run holds its slot, waiting on the judge
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as info:
            sdk.fine_tuning.alpha.graders.run(grader=CAPITAL, model_sample="a", item={"answer": "a"})
        assert info.value.response.headers["retry-after"] == "1"
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "too_many_concurrent_requests"
        other, native = graders.tenant()
        with other, native:
            assert (
                other.fine_tuning.alpha.graders.run(
                    grader=CAPITAL, model_sample="a", item={"answer": "a"}
                ).reward
                == 1.0
            )
    finally:
        answered.set()
        thread.join(30)
    assert first and first[0].reward == 1.0
    assert (
        sdk.fine_tuning.alpha.graders.run(grader=CAPITAL, model_sample="a", item={"answer": "a"}).reward
        == 1.0
    )


def test_nothing_is_stored(graders: Server, sdk: openai.OpenAI) -> None:
    before = (
        sorted(p.name for p in Path(graders.data_dir).rglob("*")) if Path(graders.data_dir).exists() else []
    )
    sdk.fine_tuning.alpha.graders.run(grader=CAPITAL, model_sample="a", item={"answer": "a"})
    after = (
        sorted(p.name for p in Path(graders.data_dir).rglob("*")) if Path(graders.data_dir).exists() else []
    )
    assert before == after
