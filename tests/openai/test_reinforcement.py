"""The official openai SDK's reinforcement fine-tuning against `ftune up` (the package's stack): create with
every hyperparameter, the job object's method echoed, reinforcement metrics events, pause/resume, cancel,
and the refusals that queue nothing."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from tests.openai.conftest import EXAMPLES, Stack, wait_for

pytestmark = pytest.mark.slow

GRADER: dict[str, Any] = {
    "type": "text_similarity",
    "name": "match",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}
# ftune's own settings for a quick run of the demo model
QUICK = {"max_seq_len": 64, "max_completion_tokens": 6, "lora_r": 8, "lora_dropout": 0.0}


def reinforcement(**hyperparameters: Any) -> Any:
    return {"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": hyperparameters}}


@pytest.fixture(scope="module")
def rft(stack: Stack) -> Any:
    sdk, native, _ = stack.tenant()
    with (EXAMPLES / "rft_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
    file = sdk.files.wait_for_processing(file_id, poll_interval=0.2)
    assert file.status == "processed", file
    yield sdk, native, file.id
    sdk.close()
    native.close()


def test_create_with_every_hyperparameter_runs_and_reports_rewards(rft: Any) -> None:
    sdk, native, file_id = rft
    method = reinforcement(
        n_epochs=1,
        batch_size=2,
        learning_rate_multiplier=10,
        eval_interval=2,
        eval_samples=4,
        compute_multiplier=0.5,
        reasoning_effort="low",
    )
    method["reinforcement"]["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object"}},
    }
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo",
        training_file=file_id,
        validation_file=file_id,
        seed=3,
        method=method,
        extra_body={**QUICK, "max_steps": 4},
    )
    shown = job.method.reinforcement
    assert job.method.type == "reinforcement"
    assert shown.grader.type == "text_similarity" and shown.grader.evaluation_metric == "fuzzy_match"
    hp = shown.hyperparameters
    assert (hp.n_epochs, hp.batch_size, hp.eval_interval, hp.eval_samples) == (1, 2, 2, 4)
    assert hp.compute_multiplier == 0.5 and hp.reasoning_effort == "low"  # 2 generations a prompt
    assert hp.learning_rate_multiplier == pytest.approx(10)
    spec = native.get(f"/jobs/{job.id}").json()["spec"]
    assert spec["num_generations"] == 2
    assert spec["response_format"] == method["reinforcement"]["response_format"]  # rollouts keep to it
    done = wait_for(sdk, job.id, {"succeeded"}, timeout=400)
    assert done.fine_tuned_model
    # the result answers through chat completions (`ftune up`'s engine), as a supervised job's does
    question = [{"role": "user", "content": "What is the capital of France? Answer with the city only."}]
    reply = sdk.chat.completions.create(
        model=done.fine_tuned_model, messages=question, max_tokens=6, temperature=0
    )
    assert reply.model == done.fine_tuned_model and reply.usage and reply.usage.completion_tokens > 0
    events = sdk.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]  # 0: the evaluation before training
    assert set(metrics.pop(0)["scores"]) == {"valid_reward_mean"}
    for m in metrics:
        assert 0 <= m["scores"]["train_reward_mean"] <= 1
        assert set(m["timing"]["step"]) >= {"sampling", "grading", "training", "full_iteration"}
        assert m["usage"]["samples"] == 2 * 2  # two prompts, two completions each
    evaluated = [m for m in metrics if "valid_reward_mean" in m["scores"]]
    assert [m["step"] for m in evaluated] == [2, 4]
    assert all("eval" in m["timing"]["step"] for m in evaluated)


def test_rollouts_keep_to_the_response_format(rft: Any) -> None:
    """Every rollout of the random demo model is the schema's JSON (constrained decoding): a grader that
    reads `sample.output_json` scores all of them 1; free text would score 0."""
    sdk, _, file_id = rft
    method = {
        "type": "reinforcement",
        "reinforcement": {
            "grader": {
                "type": "string_check",
                "name": "verdict",
                "input": "{{sample.output_json.verdict}}",
                "reference": "yes",
                "operation": "eq",
            },
            "hyperparameters": {"n_epochs": 1, "batch_size": 2},
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "verdict",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"verdict": {"type": "string", "enum": ["yes"]}},
                        "required": ["verdict"],
                        "additionalProperties": False,
                    },
                },
            },
        },
    }
    settings = {**QUICK, "max_completion_tokens": 24, "max_steps": 2}
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=file_id, seed=3, method=method, extra_body=settings
    )
    assert wait_for(sdk, job.id, {"succeeded"}, timeout=400).status == "succeeded"
    events = sdk.fine_tuning.jobs.list_events(job.id, limit=100).data
    rewards = [e.data["scores"]["train_reward_mean"] for e in events if e.type == "metrics"]
    assert rewards == [1.0, 1.0], rewards


def test_pause_resume_and_cancel(rft: Any) -> None:
    sdk, native, file_id = rft
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo",
        training_file=file_id,
        seed=5,
        method=reinforcement(batch_size=2),
        extra_body={**QUICK, "max_steps": 40},
    )
    deadline = time.monotonic() + 300
    while native.get(f"/jobs/{job.id}").json()["progress"]["step"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sdk.fine_tuning.jobs.pause(job.id)
    assert wait_for(sdk, job.id, {"paused"}).status == "paused"
    sdk.fine_tuning.jobs.resume(job.id)
    wait_for(sdk, job.id, {"running", "succeeded"})
    assert sdk.fine_tuning.jobs.cancel(job.id).status in ("cancelled", "running", "succeeded")
    assert wait_for(sdk, job.id, {"cancelled", "succeeded"}).status in ("cancelled", "succeeded")


@pytest.mark.parametrize(
    ("grader", "code", "param"),
    [
        ({"type": "nope"}, "unknown_grader_type", "grader.type"),
        ({**GRADER, "input": "{{model.x}}"}, "invalid_template", "grader.input"),
        (
            {"type": "multi", "graders": {"a": GRADER}, "calculate_output": "a + bogus"},
            "formula_parse_error",
            "grader.calculate_output",
        ),
        (
            {
                "type": "python",
                "name": "p",
                "source": "def grade(sample, item):\n    return 1.0\n" + "#" * 300_000,
            },
            "python_source_too_large",
            "grader.source",
        ),
        (
            {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"},
            "python_grader_disabled",
            None,
        ),
    ],
)
def test_a_bad_grader_is_a_400_naming_its_field_and_nothing_is_queued(
    rft: Any, grader: dict[str, Any], code: str, param: str | None
) -> None:
    sdk, native, file_id = rft
    before = native.get("/jobs").json()["data"]
    method = {"type": "reinforcement", "reinforcement": {"grader": grader}}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=file_id, method=method)
    assert e.value.code == code
    if param is not None:
        assert e.value.param == param
    assert native.get("/jobs").json()["data"] == before


def test_hyperparameters_out_of_range_and_a_supervised_file(rft: Any, stack: Stack) -> None:
    sdk, _, file_id = rft
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(
            model="ftune-demo", training_file=file_id, method=reinforcement(compute_multiplier=100)
        )
    assert "compute_multiplier" in str(e.value)
    with (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        sft_file = sdk.files.wait_for_processing(sdk.files.create(file=f, purpose="fine-tune").id).id
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=sft_file, method=reinforcement())
    assert e.value.code == "dataset_not_prompts"


def test_the_native_api_takes_the_same_objective(rft: Any) -> None:
    _, native, file_id = rft
    spec = {"base_model": "ftune-demo", "dataset_id": file_id, "objective": "grpo", "grader": GRADER}
    r = native.post("/plan", json={**spec, **QUICK, "num_generations": 4})
    assert r.status_code == 200, r.text
    r = native.post("/jobs", json={**spec, "grader": {"type": "string_check"}})
    # the native API answers a spec it cannot take with 422, as for every other spec field
    assert r.status_code == 422 and r.json()["error"]["param"] == "grader.input", r.text
