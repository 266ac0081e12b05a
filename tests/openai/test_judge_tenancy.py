"""Model graders judged by ftune's own /v1, on a real server: the judge acts for the grading tenant.

One uvicorn server (in-process, SQLite) is both the graders' API and their judge: FTUNE_GRADER_MODEL_BASE_URL
is its own /v1 with the operator's judge key (tenant "ftune-judge"), and its chat completions go to the
inference engine double (tests/openai/engine_double.py), which records what reaches it. A tenant's
score_model grader reaches that tenant's own `ft:` models and no one else's (another tenant's, the judge
key's tenant's), the judge's calls take the grading tenant's place in the chat queue, the grading-tenant
header counts only with the judge key, and the operator's allow-list and token bound are enforced at
validate, run and a job's submission, naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from api.main import create_app
from core import ft_names
from core.judge_config import GRADING_TENANT_HEADER
from core.settings import Settings
from models.db import session_scope
from models.migrate import upgrade
from models.tenants import ensure_key, get_or_create_tenant
from tests.api.conftest import RecordingEnqueuer, RecordingTokenStats
from tests.e2e.stack import free_port, uvicorn_thread
from tests.openai.conftest import TINY
from tests.openai.engine_double import ENGINE_KEY, ChatStack, EngineDouble, serve

pytestmark = pytest.mark.slow

JUDGE_KEY = "ftk_0123456789ab_judgejudgejudgejudgejudgejudge12"
MAX_TOKENS = 64
HI: Any = [{"role": "user", "content": "hello there"}]
NOT_FOUND = "the judge answered HTTP 404: the judge has no such model, or not for this tenant"


@dataclass
class Judged:
    base: str
    stack: ChatStack
    judge_tenant: str

    @property
    def engine(self) -> EngineDouble:
        return self.stack.engine

    def asked(self, model: str) -> list[dict[str, Any]]:
        return [body for body in self.engine.chats if body["model"] == model]

    def ft_model(self, tenant_id: str) -> str:
        job_id = self.stack.finished_job(tenant_id)
        return ft_names.fine_tuned_model("tiny", tenant_id, "demo", job_id)


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judged]:
    engine = EngineDouble(key=ENGINE_KEY)
    double = serve(engine)
    tmp = tmp_path_factory.mktemp("judge")
    (tmp / "models" / "tiny").mkdir(parents=True)
    (tmp / "models" / "tiny" / "config.json").write_text(json.dumps(TINY))
    database_url = f"sqlite:///{tmp / 'ftune.db'}"
    upgrade(database_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    settings = Settings(
        data_dir=tmp / "data",
        models_dir=tmp / "models",
        database_url=database_url,
        inference_url=f"http://127.0.0.1:{double.server_port}",
        inference_api_key=ENGINE_KEY,
        grader_model_base_url=f"{base}/v1",
        grader_model_api_key=JUDGE_KEY,
        grader_model_structured_outputs=False,  # ftune's /v1 answers text
        grader_model_allowed_models=["tiny", "ft:*"],
        grader_model_max_completion_tokens=MAX_TOKENS,
        chat_max_running=3,  # a tenant alone runs two chats at once
        chat_max_queued_per_tenant=0,  # and none waits: a third is 429
        chat_share_linger_seconds=0,  # the tenants of earlier tests do not share the queue
    )
    app = create_app(settings, enqueue=RecordingEnqueuer(), token_stats=RecordingTokenStats())
    with session_scope(app.state.services.sessions) as s:
        ensure_key(s, JUDGE_KEY, "ftune-judge", is_admin=False)
        judge_tenant = get_or_create_tenant(s, "ftune-judge").id
    try:
        with uvicorn_thread(app, port):
            try:
                yield Judged(base, ChatStack(base, tmp / "data", database_url, engine), judge_tenant)
            finally:
                engine.release.set()  # a request still held by the engine double ends before the server
    finally:
        double.shutdown()
        double.server_close()
        app.state.services.engine.dispose()


def score(model: str, content: str = "grade {{ sample.output_text }}", **extra: Any) -> dict[str, Any]:
    return {"type": "score_model", "model": model, "input": [{"role": "user", "content": content}]} | extra


def run(sdk: openai.OpenAI, grader: Any) -> Any:
    return sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="x")


def server_error(result: Any) -> str | None:
    errors = result.metadata.errors
    return errors.model_grader_server_error_details if errors.model_grader_server_error else None


def test_a_tenants_grader_reaches_its_own_models_and_no_one_elses(judged: Judged) -> None:
    a_sdk, a = judged.stack.tenant()
    b_sdk, b = judged.stack.tenant()
    mine, theirs = judged.ft_model(a), judged.ft_model(b)
    judges = judged.ft_model(judged.judge_tenant)  # the judge key's tenant's model
    with a_sdk, b_sdk:
        own = run(a_sdk, score(mine))
        # reached: the engine double's echo is no score, so a parse error (not a server error)
        assert own.metadata.errors.model_grader_parse_error and server_error(own) is None
        (asked,) = judged.asked(mine)
        assert asked["messages"] == [{"role": "user", "content": "grade x"}]
        assert asked["max_completion_tokens"] == MAX_TOKENS  # the operator's bound, the grader set none
        for model in (theirs, judges):
            result = run(a_sdk, score(model))
            assert result.reward == 0.0
            assert server_error(result) == NOT_FOUND
            assert judged.asked(model) == []  # never reached the engine
        assert run(b_sdk, score(theirs)).metadata.errors.model_grader_parse_error  # B's own: reached


def test_the_grading_tenant_header_counts_only_with_the_judge_key(judged: Judged) -> None:
    a_sdk, _ = judged.stack.tenant()
    _, b = judged.stack.tenant()
    theirs = judged.ft_model(b)
    judge = openai.OpenAI(api_key=JUDGE_KEY, base_url=f"{judged.base}/v1", max_retries=0, timeout=30)
    with a_sdk, judge:
        with pytest.raises(openai.NotFoundError):  # a tenant's key naming another tenant: still itself
            a_sdk.chat.completions.create(model=theirs, messages=HI, extra_headers={GRADING_TENANT_HEADER: b})
        assert judged.asked(theirs) == []
        answer = judge.chat.completions.create(
            model=theirs, messages=HI, extra_headers={GRADING_TENANT_HEADER: b}
        )
        assert answer.choices[0].message.content == f"echo {theirs}: hello there"
        with pytest.raises(openai.AuthenticationError):  # acting for no tenant there is
            judge.chat.completions.create(
                model="tiny", messages=HI, extra_headers={GRADING_TENANT_HEADER: "x"}
            )


def test_judge_calls_take_the_grading_tenants_chat_slots(judged: Judged) -> None:
    """Tenant A's two chats hold its share of the chat queue (a tenant alone runs 2 of
    FTUNE_CHAT_MAX_RUNNING=3, and FTUNE_CHAT_MAX_QUEUED_PER_TENANT=0 lets none wait): A's grader gets the
    judge's 429 (summarised), while tenant B's grader is judged at once (the place kept free)."""
    a_sdk, _ = judged.stack.tenant()
    b_sdk, _ = judged.stack.tenant()
    hold: Any = [{"role": "user", "content": "hold"}]
    engine = judged.engine
    with a_sdk, b_sdk, ThreadPoolExecutor(2) as pool:
        chat = lambda: a_sdk.chat.completions.create(model="tiny", messages=hold)  # noqa: E731
        held = [pool.submit(chat) for _ in range(2)]
        try:
            deadline = time.monotonic() + 20
            while engine.holding < 2:
                assert time.monotonic() < deadline, "the held chats never reached the engine"
                time.sleep(0.02)
            busy = run(a_sdk, score("tiny"))
            assert (
                server_error(busy) == "the judge answered HTTP 429: the judge is busy or over its rate limit"
            )
            assert run(b_sdk, score("tiny")).metadata.errors.model_grader_parse_error
        finally:
            engine.release.set()
        assert all(f.result(30).choices for f in held)


def test_the_operators_list_and_bound_are_enforced_naming_the_field(judged: Judged) -> None:
    sdk, _ = judged.stack.tenant()
    graders = sdk.fine_tuning.alpha.graders
    paid = {
        "type": "multi",
        "graders": {"a": score("tiny"), "b": score("gpt-5-pro")},
        "calculate_output": "a",
    }
    greedy = score("tiny", sampling_params={"max_completions_tokens": MAX_TOKENS + 1})
    cases = [
        (paid, "grader_model_not_allowed", "grader.graders.b.model"),
        (greedy, "grader_model_tokens_over_limit", "grader.sampling_params.max_completions_tokens"),
    ]
    calls = (lambda grader: graders.validate(grader=grader), lambda grader: run(sdk, grader))
    with sdk:
        for grader, code, param in cases:
            for call in calls:
                with pytest.raises(openai.BadRequestError) as info:
                    call(grader)
                body = info.value.body
                assert isinstance(body, dict) and (body["code"], body["param"]) == (code, param), body
    assert judged.asked("gpt-5-pro") == []
    key = sdk.api_key
    spec = {"base_model": "tiny", "dataset_id": "0" * 32, "objective": "grpo", "grader": paid}
    r = httpx.post(f"{judged.base}/jobs", json=spec, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 422, r.text  # the native API's status for invalid input
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("grader_model_not_allowed", "grader.graders.b.model")
