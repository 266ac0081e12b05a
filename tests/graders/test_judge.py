"""The operator's bounds on model graders (graders.judge, graders.policy): the allow-list of judge
models and the per-call token bound at admission, and the judge itself bounding each call, a tenant's calls
at once, a run's tokens, naming the grading tenant to ftune's own /v1 only, and never relaying the judge's
error body."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from core.errors import InvalidInput
from core.judge_config import JudgeConfig
from core.run_protocol import GradingConfig, RunConfig
from core.settings import Settings
from core.spec import JobSpec
from graders import ChatError, ChatReply, GradeContext, grade, grade_many, make_sample, parse_grader
from graders.judge import BoundedJudge, connect, tenant_slots
from graders.policy import admitted
from tests.graders.chat_stub import chat_stub, completion

JUDGE_KEY = "ftk_0123456789ab_" + "x" * 32  # an ftune key: the judge is ftune's own /v1
SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Rate {{ sample.output_text }}"}],
}
LABEL = {
    "type": "label_model",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Is {{ sample.output_text }} right?"}],
    "labels": ["good", "bad"],
    "passing_labels": ["good"],
}


def config(**changes: Any) -> JudgeConfig:
    fields: dict[str, Any] = {"base_url": "http://judge.invalid/v1", "allowed_models": ("judge-model",)}
    return JudgeConfig(**(fields | changes))


def refusal(raw: Any, judge: JudgeConfig | None) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        admitted(raw, python_enabled=False, judge=judge)
    return info.value


def multi(**graders: Any) -> dict[str, Any]:
    return {"type": "multi", "graders": graders, "calculate_output": " + ".join(graders)}


# -- admission: validate, run and a job's submission alike -------------------------------------------------


def test_a_model_off_the_allow_list_is_refused_naming_its_field() -> None:
    raw = multi(a=SCORE, b={**LABEL, "model": "gpt-5-pro"})
    error = refusal(raw, config())
    assert (error.code, error.param) == ("grader_model_not_allowed", "grader.graders.b.model")
    assert "'gpt-5-pro'" in error.message and "judge-model" in error.message
    error = refusal({**SCORE, "model": "ft:tiny:acme::x"}, config())
    assert (error.code, error.param) == ("grader_model_not_allowed", "grader.model")
    assert admitted(raw, python_enabled=False, judge=config(allowed_models=("judge-model", "gpt-5*")))
    assert admitted(
        {**SCORE, "model": "ft:tiny:acme::x"}, python_enabled=False, judge=config(allowed_models=("ft:*",))
    )


def test_no_listed_model_refuses_every_model_grader() -> None:
    error = refusal(SCORE, config(allowed_models=()))
    assert (error.code, error.param) == ("grader_model_not_allowed", "grader.model")
    assert "FTUNE_GRADER_MODEL_ALLOWED_MODELS" in error.message
    error = refusal(multi(a=LABEL), None)  # no judge at all: as before
    assert (error.code, error.param) == ("grader_model_not_configured", "grader.graders.a.type")


def test_a_grader_asking_more_tokens_than_the_bound_is_refused() -> None:
    asking = {**SCORE, "sampling_params": {"max_completions_tokens": 4097}}
    error = refusal(multi(ok=SCORE, big=asking), config(max_completion_tokens=4096))
    assert error.code == "grader_model_tokens_over_limit"
    assert error.param == "grader.graders.big.sampling_params.max_completions_tokens"
    assert "4096" in error.message
    at_bound = {**SCORE, "sampling_params": {"max_completions_tokens": 4096}}
    assert admitted(at_bound, python_enabled=False, judge=config(max_completion_tokens=4096))


def test_reasoning_effort_is_openais_enum() -> None:
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        parse_grader({**SCORE, "sampling_params": {"reasoning_effort": effort}}, allow_python=False)
    with pytest.raises(InvalidInput) as info:
        parse_grader({**SCORE, "sampling_params": {"reasoning_effort": "ultra"}}, allow_python=False)
    assert info.value.param == "grader.sampling_params.reasoning_effort"


def test_settings_travel_to_the_judge_and_to_training() -> None:
    settings = Settings(
        grader_model_base_url="http://judge/v1",
        grader_model_api_key=JUDGE_KEY,
        grader_model_allowed_models=["judge-model", "ft:*"],
        grader_model_max_completion_tokens=512,
        grader_model_max_concurrent_per_tenant=3,
        grader_model_max_tokens_per_run=10_000,
    )
    judge = JudgeConfig.from_settings(settings)
    assert judge == JudgeConfig(
        base_url="http://judge/v1",
        api_key=JUDGE_KEY,
        allowed_models=("judge-model", "ft:*"),
        max_completion_tokens=512,
        max_concurrent_per_tenant=3,
        max_tokens_per_run=10_000,
    )
    grading = GradingConfig.from_settings(settings)
    assert GradingConfig.model_validate_json(grading.model_dump_json()) == grading
    assert grading.judge == judge
    assert (
        JudgeConfig.from_settings(Settings()) is None
        and GradingConfig.from_settings(Settings()).judge is None
    )


# -- the judge: each call bounded ------------------------------------------------------------------------


class Recorder:
    """A ChatFn double: records each call, answers `reply`, optionally waits on `gate` (counting calls in
    flight)."""

    def __init__(self, reply: ChatReply | None = None, gate: threading.Event | None = None) -> None:
        self.reply = reply or ChatReply('{"result": 1}', prompt_tokens=10, completion_tokens=6)
        self.gate = gate
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any]) -> ChatReply:
        with self.lock:
            self.calls.append((model, params))
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            if self.gate is not None:
                self.gate.wait(0.05)
            return self.reply
        finally:
            with self.lock:
                self.in_flight -= 1


def bounded(chat: Recorder, **changes: Any) -> BoundedJudge:
    judge = config(**changes)
    return BoundedJudge(chat, judge, tenant_slots(uuid.uuid4().hex, judge.max_concurrent_per_tenant))


def errors_of(result: Any) -> dict[str, Any]:
    return {k: v for k, v in result.errors.to_json().items() if v}


def test_each_call_asks_at_most_the_bound_and_only_listed_models() -> None:
    chat = Recorder()
    judge = bounded(chat, max_completion_tokens=300)
    judge("judge-model", [], {"temperature": 0})
    judge("judge-model", [], {"max_completion_tokens": 100})
    judge("judge-model", [], {"max_completion_tokens": 900})  # a grader admitted under another bound
    assert [params["max_completion_tokens"] for _, params in chat.calls] == [300, 100, 300]
    assert chat.calls[0][1]["temperature"] == 0
    with pytest.raises(ChatError, match="not one of this server's judge models"):
        judge("gpt-5-pro", [], {})
    assert len(chat.calls) == 3  # never asked


def test_a_tenants_judge_calls_at_once_are_bounded() -> None:
    """Eight grading threads of one tenant: at most max_concurrent_per_tenant judge calls at once, also
    across two runs of the tenant in one process; another tenant's calls are not held by them."""
    chat = Recorder(gate=threading.Event())
    tenant = uuid.uuid4().hex
    judge = config(max_concurrent_per_tenant=2)
    first = BoundedJudge(chat, judge, tenant_slots(tenant, 2))
    second = BoundedJudge(chat, judge, tenant_slots(tenant, 2))
    grader = parse_grader(SCORE, allow_python=False)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [(make_sample("x"), {})] * 8
    threads = [
        threading.Thread(
            target=grade_many, args=(grader, pairs, GradeContext(chat=j)), kwargs={"max_workers": 8}
        )
        for j in (first, second)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(chat.calls) == 16 and chat.most == 2
    assert tenant_slots(tenant, 2) is tenant_slots(tenant, 2)
    assert tenant_slots(tenant, 2) is not tenant_slots(uuid.uuid4().hex, 2)


def test_a_run_stops_asking_once_its_tokens_are_spent() -> None:
    chat = Recorder()  # 16 tokens a call
    judge = bounded(chat, max_tokens_per_run=40)
    grader = parse_grader(SCORE, allow_python=False)
    results = [grade(grader, make_sample("x"), {}, GradeContext(chat=judge)) for _ in range(4)]
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 0.0]  # 48 >= 40 after the third
    assert len(chat.calls) == 3
    assert "40 tokens" in errors_of(results[3])["model_grader_server_error_details"]
    unbounded = bounded(Recorder(), max_tokens_per_run=0)
    assert all(
        grade(grader, make_sample("x"), {}, GradeContext(chat=unbounded)).reward == 1.0 for _ in range(5)
    )


# -- the judge over HTTP: the grading tenant named to ftune's own /v1 only, errors summarised --------------


def test_ftunes_own_judge_is_told_the_grading_tenant() -> None:
    with chat_stub() as stub:
        stub.answer = lambda body: (200, completion("1"))
        own = connect(config(base_url=stub.base_url, api_key=JUDGE_KEY), "tenant-a")
        other = connect(config(base_url=stub.base_url, api_key="sk-openai"), "tenant-a")
        try:
            own("judge-model", [{"role": "user", "content": "hi"}], {})
            other("judge-model", [{"role": "user", "content": "hi"}], {})
        finally:
            own.close()
            other.close()
        ftune, openai = stub.requests
    assert ftune["tenant"] == "tenant-a" and ftune["auth"] == f"Bearer {JUDGE_KEY}"
    assert openai["tenant"] is None  # a third party never learns ftune's tenant ids
    assert ftune["body"]["max_completion_tokens"] == 4096


@pytest.mark.parametrize(
    ("status", "body", "summary", "leaks"),
    [
        (500, {"error": {"message": "boom at /srv/judge/x.py"}}, "the judge answered HTTP 500", "/srv/judge"),
        (
            404,
            {"error": {"message": "The model `ft:x` of org-judge does not exist"}},
            "HTTP 404",
            "org-judge",
        ),
        (401, "bad key sk-live-123", "HTTP 401", "sk-live"),
        (200, "<html>proxy page of judge.internal</html>", "not a chat completion", "judge.internal"),
    ],
)
def test_the_judges_error_body_is_never_relayed(status: int, body: Any, summary: str, leaks: str) -> None:
    with chat_stub() as stub:
        stub.answer = lambda request: (status, body)
        judge = connect(config(base_url=stub.base_url), "t")
        try:
            grader = parse_grader(SCORE, allow_python=False)
            result = grade(grader, make_sample("x"), {}, GradeContext(chat=judge))
        finally:
            judge.close()
    details = errors_of(result)["model_grader_server_error_details"]
    assert summary in details
    assert leaks not in details and "127.0.0.1" not in details, details


# -- training: the job's tenant and the operator's bounds reach the run's judge ---------------------------


def test_a_runs_judge_acts_for_the_jobs_tenant(tmp_path: Path) -> None:
    from training.grading import grade_context

    with chat_stub() as stub:
        stub.answer = lambda body: (200, completion("0.5"))
        judge = config(base_url=stub.base_url, api_key=JUDGE_KEY, max_completion_tokens=64)
        run = RunConfig(
            job_id="j",
            spec=JobSpec.model_validate({"base_model": "tiny", "dataset_id": "d" * 32}),
            model_dir=str(tmp_path),
            dataset_path=str(tmp_path / "d.jsonl"),
            output_dir=str(tmp_path / "out"),
            grading=GradingConfig(judge=judge, tenant_id="tenant-b"),
        )
        ctx = grade_context(run)
        grader = parse_grader(SCORE, allow_python=False)
        assert grade(grader, make_sample("x"), {}, ctx).reward == 0.5
        off_list = grade(
            parse_grader({**SCORE, "model": "gpt-5"}, allow_python=False), make_sample("x"), {}, ctx
        )
        (asked,) = stub.requests
    assert asked["tenant"] == "tenant-b" and asked["body"]["max_completion_tokens"] == 64
    assert off_list.reward == 0.0 and errors_of(off_list)["model_grader_server_error"]


def test_the_worker_writes_the_jobs_tenant_into_run_json(tmp_path: Path, sqlite_url: str) -> None:
    from core.catalog import Catalog
    from core.storage import Storage
    from models.db import make_engine, make_session_factory, session_scope
    from models.migrate import upgrade
    from models.tables import Job
    from models.tenants import get_or_create_tenant
    from tests.rows import valid_dataset
    from worker.run_config import write_run_config

    upgrade(sqlite_url)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    engine = make_engine(sqlite_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        tenant_id = get_or_create_tenant(s, "acme").id
        s.add(valid_dataset(tenant_id, "d" * 32))
        s.flush()
        spec = {"base_model": "tiny", "dataset_id": "d" * 32}
        s.add(
            Job(
                id="j" * 32,
                tenant_id=tenant_id,
                status="queued",
                spec=spec,
                dataset_id="d" * 32,
                base_model="tiny",
                method="lora",
            )
        )
    storage = Storage(tmp_path / "data")
    grading = GradingConfig(judge=config())
    path = write_run_config(
        sessions, storage=storage, catalog=Catalog(tmp_path / "models"), job_id="j" * 32, grading=grading
    )
    engine.dispose()
    written = RunConfig.model_validate_json(path.read_text()).grading
    assert written.tenant_id == tenant_id and written.judge == config()
