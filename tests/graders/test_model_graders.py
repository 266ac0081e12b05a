"""score_model and label_model against a local HTTP judge, through openai_compatible_chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.fine_tuning.alpha import GraderRunResponse

from graders import (
    ChatError,
    ChatReply,
    GradeContext,
    OpenAICompatibleChat,
    grade,
    grade_many,
    make_sample,
    openai_compatible_chat,
    parse_grader,
)
from graders.model_graders import read_label, read_score
from tests.graders.chat_stub import ChatStub, chat_stub, completion

SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "judge-model",
    "input": [
        {"role": "system", "content": "Score the answer from 0 to 1."},
        {"role": "user", "content": "Reference: {{ item.reference }}. Answer: {{ sample.output_text }}"},
    ],
    "sampling_params": {"temperature": 0.0, "seed": 1, "max_completions_tokens": 64, "top_p": 1},
}
LABEL = {
    "type": "label_model",
    "name": "sentiment",
    "model": "label-model",
    "input": [{"role": "user", "content": "Label the sentiment of: {{ sample.output_text }}"}],
    "labels": ["positive", "neutral", "negative"],
    "passing_labels": ["positive", "neutral"],
}


@pytest.fixture(scope="module")
def server() -> Iterator[ChatStub]:
    with chat_stub() as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ChatStub) -> Iterator[OpenAICompatibleChat]:
    chat = openai_compatible_chat(server.base_url, "sk-test", timeout=5.0)
    yield chat
    chat.close()


@pytest.fixture
def stub(server: ChatStub) -> ChatStub:
    server.reset()
    return server


@pytest.fixture
def chat(stub: ChatStub, client: OpenAICompatibleChat) -> OpenAICompatibleChat:
    return client


def run(grader_json: dict[str, Any], chat: Any, text: str = "Paris", item: Any = None) -> dict[str, Any]:
    grader = parse_grader(grader_json, allow_python=False)
    result = grade(grader, make_sample(text), item or {"reference": "Paris"}, GradeContext(chat=chat))
    response = result.to_run_response()
    GraderRunResponse.model_validate(response)
    return response


def errors_set(response: dict[str, Any]) -> list[str]:
    return [k for k, v in response["metadata"]["errors"].items() if v is True]


def test_score_model_asks_the_judge(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    stub.answer = lambda body: (200, completion(json.dumps({"steps": [], "result": 0.75})))
    response = run(SCORE, chat)
    assert response["reward"] == 0.75
    assert errors_set(response) == []
    assert response["metadata"]["scores"] == {"result": 0.75}
    assert response["metadata"]["token_usage"] == 16
    assert response["model_grader_token_usage_per_model"] == {
        "judge-model": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    }
    (request,) = stub.requests
    assert request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "judge-model"
    assert body["messages"] == [
        {"role": "system", "content": "Score the answer from 0 to 1."},
        {"role": "user", "content": "Reference: Paris. Answer: Paris"},
    ]
    assert (body["temperature"], body["seed"], body["max_completion_tokens"], body["top_p"]) == (
        0.0,
        1,
        64,
        1.0,
    )
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["result"] == {"type": "number"} and schema["required"] == ["steps", "result"]


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ('{"steps": [{"description": "d", "conclusion": "c"}], "result": 1}', 1.0),
        ("0.25", 0.25),
        (" .5 \n", 0.5),
        ('```json\n{"result": 0.4}\n```', 0.4),
        ('{"result": 7}', 1.0),  # clamped into the range
        ('{"result": -2}', 0.0),
    ],
)
def test_score_replies(stub: ChatStub, chat: OpenAICompatibleChat, reply: str, reward: float) -> None:
    stub.answer = lambda body: (200, completion(reply))
    assert run(SCORE, chat)["reward"] == reward


def test_score_range(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    stub.answer = lambda body: (200, completion('{"result": 8}'))
    response = run({**SCORE, "range": [-1, 10]}, chat)
    assert response["reward"] == 8.0


@pytest.mark.parametrize(
    "reply", ["I think 0.5", '{"result": "high"}', '{"score": 1}', "NaN", "", None, '{"result": true}']
)
def test_score_parse_errors(stub: ChatStub, chat: OpenAICompatibleChat, reply: str | None) -> None:
    stub.answer = lambda body: (200, completion(reply))
    response = run(SCORE, chat)
    assert (response["reward"], errors_set(response)) == (0.0, ["model_grader_parse_error"])
    assert response["metadata"]["token_usage"] == 16  # the judge's tokens were spent all the same


def test_refusal(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    stub.answer = lambda body: (200, completion(None, refusal="I can't grade this."))
    response = run(SCORE, chat)
    assert (response["reward"], errors_set(response)) == (0.0, ["model_grader_refusal_error"])


@pytest.mark.parametrize(
    ("status", "body", "details"),
    [
        (500, {"error": {"message": "boom"}}, "the judge answered HTTP 500: the judge failed"),
        (429, "slow down", "the judge answered HTTP 429: the judge is busy or over its rate limit"),
        (200, "not json", "the judge's answer is not a chat completion"),
        (200, {"choices": []}, "the judge's answer is not a chat completion"),
    ],
)
def test_server_errors(
    stub: ChatStub, chat: OpenAICompatibleChat, status: int, body: Any, details: str
) -> None:
    """Summarised: the status and a fixed message, never the judge's body."""
    stub.answer = lambda request: (status, body)
    response = run(SCORE, chat)
    assert (response["reward"], errors_set(response)) == (0.0, ["model_grader_server_error"])
    assert response["metadata"]["errors"]["model_grader_server_error_details"] == details


def test_unreachable_endpoint_and_no_chat() -> None:
    client = openai_compatible_chat("http://127.0.0.1:9/v1", None, timeout=2.0)
    with pytest.raises(ChatError):
        client("m", [{"role": "user", "content": "hi"}], {})
    response = run(SCORE, client)
    client.close()
    assert errors_set(response) == ["model_grader_server_error"]
    assert "ConnectError" in response["metadata"]["errors"]["model_grader_server_error_details"]
    response = run(SCORE, None)
    assert errors_set(response) == ["model_grader_server_error"]


def test_without_structured_outputs(stub: ChatStub) -> None:
    client = openai_compatible_chat(stub.base_url, None, timeout=5.0, structured_outputs=False)
    stub.answer = lambda body: (200, completion("1"))
    assert run(SCORE, client)["reward"] == 1.0
    client.close()
    assert "response_format" not in stub.requests[0]["body"] and stub.requests[0]["auth"] is None


def test_missing_variable_asks_no_judge(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    response = run(SCORE, chat, item={"answer": "Paris"})
    assert errors_set(response) == ["invalid_variable_error"]
    assert stub.requests == []


def multi_with_label(formula: str = "sentiment") -> dict[str, Any]:
    return {"type": "multi", "name": "m", "graders": {"sentiment": LABEL}, "calculate_output": formula}


@pytest.mark.parametrize(
    ("reply", "reward", "flags"),
    [
        ('{"steps": [], "result": "positive"}', 1.0, []),
        ('{"steps": [], "result": "neutral"}', 1.0, []),
        ('{"steps": [], "result": "negative"}', 0.0, []),
        ("negative", 0.0, []),
        ('"positive"', 1.0, []),
        ("Positive", 0.0, ["model_grader_parse_error"]),
        ('{"result": "great"}', 0.0, ["model_grader_parse_error"]),
    ],
)
def test_label_model(
    stub: ChatStub, chat: OpenAICompatibleChat, reply: str, reward: float, flags: list[str]
) -> None:
    stub.answer = lambda body: (200, completion(reply))
    response = run(multi_with_label(), chat, text="I love it")
    assert (response["reward"], errors_set(response)) == (reward, flags)
    assert response["sub_rewards"] == {"sentiment": reward}
    body = stub.requests[0]["body"]
    assert body["messages"] == [{"role": "user", "content": "Label the sentiment of: I love it"}]
    result_schema = body["response_format"]["json_schema"]["schema"]["properties"]["result"]
    assert result_schema == {"type": "string", "enum": ["positive", "neutral", "negative"]}
    assert response["model_grader_token_usage_per_model"]["label-model"]["total_tokens"] == 16


def test_content_parts_and_images(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    message = {
        "role": "user",
        "type": "message",
        "content": [
            "Is {{ item.reference }} in the picture?",
            {"type": "input_image", "image_url": "{{ item.url }}", "detail": "low"},
            {"type": "output_text", "text": "Answer: {{ sample.output_text }}"},
        ],
    }
    text_only = {
        "role": "developer",
        "content": [{"type": "input_text", "text": "a"}, "b {{ item.reference }}"],
    }
    run({**SCORE, "input": [text_only, message]}, chat, item={"reference": "Paris", "url": "http://x/p.png"})
    assert stub.requests[0]["body"]["messages"] == [
        {"role": "developer", "content": "a\nb Paris"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Is Paris in the picture?"},
                {"type": "image_url", "image_url": {"url": "http://x/p.png", "detail": "low"}},
                {"type": "text", "text": "Answer: Paris"},
            ],
        },
    ]


def test_grade_many_runs_judges_concurrently_in_order(stub: ChatStub, chat: OpenAICompatibleChat) -> None:
    def echo_length(body: dict[str, Any]) -> tuple[int, Any]:
        answer = body["messages"][1]["content"].split("Answer: ")[1]
        return 200, completion(json.dumps({"result": len(answer) / 10}))

    stub.answer = echo_length
    grader = parse_grader(SCORE, allow_python=False)
    pairs = [(make_sample("x" * n), {"reference": "r"}) for n in range(10)]
    results = grade_many(grader, pairs, GradeContext(chat=chat), max_workers=4)
    assert [r.reward for r in results] == [n / 10 for n in range(10)]
    assert len(stub.requests) == 10


def test_a_chat_callable_is_all_a_model_grader_needs() -> None:
    asked: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []

    def chat(model: str, messages: list[dict[str, Any]], params: dict[str, Any]) -> ChatReply:
        asked.append((model, messages, params))
        return ChatReply("0.5", prompt_tokens=3, completion_tokens=1)

    response = run({**SCORE, "sampling_params": {"reasoning_effort": "low"}}, chat)
    assert response["reward"] == 0.5 and response["metadata"]["token_usage"] == 4
    assert asked[0][2]["reasoning_effort"] == "low"


def test_readers() -> None:
    assert read_score("1e-1") == 0.1
    assert read_score("[0.5]") is None
    assert read_label("  'neutral' ", ("neutral",)) == "neutral"
    assert read_label(None, ("neutral",)) is None
