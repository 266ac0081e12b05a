"""OpenAI's create-job request mapped onto JobSpec (api/openai/hyperparameters.py), without a server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.openai.hyperparameters import (
    CreateJobRequest,
    auto_batch_size,
    build_spec,
    map_request,
    per_gpu_batch,
    resolved,
)
from core.errors import InvalidInput, Unsupported
from core.spec import JobSpec

FILE = "a" * 32


def mapped(**body: Any) -> tuple[dict[str, Any], Any]:
    req = CreateJobRequest.model_validate({"model": "m", "training_file": FILE, **body})
    out = map_request(req, "m", None)
    return out.fields, out.batch_size


def test_openai_fields_and_ftune_extras_become_one_spec() -> None:
    fields, batch = mapped(
        validation_file="b" * 32,
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8}}},
        adapter="qlora",
        lora_r=4,
    )
    spec = build_spec(fields)
    assert (spec.base_model, spec.dataset_id, spec.validation_dataset_id) == ("m", FILE, "b" * 32)
    assert (spec.seed, spec.epochs, spec.method, spec.lora_r) == (3, 2, "qlora", 4)
    assert batch == 8
    assert spec.learning_rate == JobSpec.model_fields["learning_rate"].default  # multiplier auto = 1


def test_learning_rate_multiplier_multiplies_the_default() -> None:
    fields, _ = mapped(hyperparameters={"learning_rate_multiplier": 0.5})
    assert build_spec(fields).learning_rate == pytest.approx(1e-4)
    with pytest.raises(ValidationError):  # 0.1 is the highest learning rate JobSpec takes
        mapped(hyperparameters={"learning_rate_multiplier": 501})


def test_resolved_has_no_auto() -> None:
    spec = JobSpec(base_model="m", dataset_id=FILE, micro_batch_size=2, gradient_accumulation_steps=3)
    shown = resolved(spec, "supervised")
    assert shown["hyperparameters"] == {"n_epochs": 1, "batch_size": 6, "learning_rate_multiplier": 1.0}
    assert shown["method"] == {
        "type": "supervised",
        "supervised": {"hyperparameters": shown["hyperparameters"]},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"hyperparameters": {"n_epochs": 2}, "epochs": 3}, "epochs"),
        ({"hyperparameters": {"learning_rate_multiplier": 2}, "learning_rate": 1e-4}, "learning_rate"),
        ({"hyperparameters": {"batch_size": 8}, "micro_batch_size": 2}, "micro_batch_size"),
        ({"hyperparameters": {"batch_size": 8}, "examples_per_step": 8}, "examples_per_step"),
        ({"base_model": "x"}, "base_model"),
        ({"dataset_id": FILE}, "dataset_id"),
        ({"seed": 1, "extra": 1}, None),  # not a duplicate: `seed` is OpenAI's own field here
    ],
)
def test_a_setting_given_twice_is_refused_by_name(body: dict[str, Any], param: str | None) -> None:
    if param is None:
        with pytest.raises(InvalidInput) as e:
            build_spec(mapped(**body)[0])
        assert e.value.param == "extra"  # the unknown extra field, by name
        return
    with pytest.raises(InvalidInput) as e:
        mapped(**body)
    assert (e.value.code, e.value.param) == ("duplicate_parameter", param)


def test_hyperparameters_in_method_and_top_level_is_refused() -> None:
    with pytest.raises(InvalidInput) as e:
        mapped(method={"type": "supervised"}, hyperparameters={"n_epochs": 1})
    assert e.value.param == "hyperparameters"


def test_what_ftune_cannot_honour_is_refused_by_name() -> None:
    with pytest.raises(Unsupported) as e:
        mapped(integrations=[{"type": "wandb"}])
    assert e.value.param == "integrations"
    assert mapped(integrations=[])[0]["base_model"] == "m"


def test_dpo_maps_onto_the_spec_when_ftune_has_it() -> None:
    body = {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.3}}}}
    if "objective" not in JobSpec.model_fields:
        with pytest.raises(Unsupported) as e:
            mapped(**body)
        assert e.value.param == "method.type"
        return
    fields, _ = mapped(**body)
    assert (fields["objective"], fields["beta"]) == ("dpo", 0.3)


def test_batch_size_splits_over_gpus() -> None:
    assert per_gpu_batch("auto", 2) == 4
    assert per_gpu_batch(8, 2) == 4
    with pytest.raises(InvalidInput) as e:
        per_gpu_batch(7, 2)
    assert e.value.param == "batch_size"
    _, batch = mapped(micro_batch_size=2, gradient_accumulation_steps=4)
    assert batch is None  # set by the extra fields: nothing left to choose


@pytest.mark.parametrize(
    ("examples", "batch"),
    [(0, 1), (1, 1), (160, 1), (749, 1), (750, 2), (1000, 2), (10_000, 20), (127_749, 255), (10**7, 256)],
)
def test_auto_batch_size_is_openais_share_of_the_training_examples(examples: int, batch: int) -> None:
    """~0.2% of the examples (1 in 500, rounded half up), at least 1, at most 256."""
    assert auto_batch_size(examples) == batch


def test_batch_size_counts_examples_per_step() -> None:
    assert per_gpu_batch("auto", 1, num_examples=160) == 1
    assert per_gpu_batch("auto", 2, num_examples=160) == 1  # 1 rounded up to a multiple of 2 GPUs: 2
    assert per_gpu_batch("auto", 2, num_examples=5000) == 5
    assert per_gpu_batch(8, 1, num_examples=160) == 8  # given: as given
    # the job object shows examples per step, not micro x accumulation (here 2 packed rows x 2: 4 rows)
    split = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}
    spec = JobSpec.model_validate({"base_model": "m", "dataset_id": FILE, "examples_per_step": 8, **split})
    assert resolved(spec, "supervised")["hyperparameters"]["batch_size"] == 8
    # as an extra field it is the batch to split (micro-batch and accumulation still to choose)
    fields, batch = mapped(examples_per_step=6)
    assert batch == 6 and fields["examples_per_step"] == 6


def test_reinforcement_maps_onto_grpo() -> None:
    grader = {"type": "string_check", "name": "s", "operation": "eq", "input": "{{sample.output_text}}"}
    grader["reference"] = "{{item.answer}}"
    hp = {"eval_interval": 5, "eval_samples": 9, "compute_multiplier": 2, "reasoning_effort": "high"}
    fields, _ = mapped(
        method={"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hp}}
    )
    assert fields["objective"] == "grpo" and fields["grader"] == grader
    assert (fields["eval_every_steps"], fields["eval_samples"], fields["num_generations"]) == (5, 9, 8)
    assert fields["checkpoint_every_steps"] == 5  # a checkpoint at each evaluation, as OpenAI's
