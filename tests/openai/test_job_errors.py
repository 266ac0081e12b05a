"""Each error class of `client.fine_tuning.jobs.create` and of another tenant's view, through the official
openai SDK against the package's `ftune up` (tests/openai/conftest.py): bad file, unknown model,
unsupported method or integration, a setting given twice, infeasible (with the planner's breakdown),
another tenant's file or job (404), a bad key (401)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.openai.conftest import TINY_RUN, Stack

pytestmark = pytest.mark.slow


def test_error_classes(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], training_file: str
) -> None:
    sdk, _, key = org
    jobs = sdk.fine_tuning.jobs

    def refused(exc: type[openai.APIStatusError], **body: Any) -> openai.APIStatusError:
        with pytest.raises(exc) as e:
            jobs.create(
                **{"model": "ftune-demo", "training_file": training_file, "extra_body": TINY_RUN, **body}
            )
        return e.value

    bad = sdk.files.create(file=("bad.jsonl", b'{"instruction": "no output"}\n'), purpose="fine-tune")
    e = refused(openai.BadRequestError, training_file=bad.id)
    assert (e.code, e.param) == ("dataset_invalid", "training_file")
    e = refused(openai.NotFoundError, training_file="0" * 32)
    assert (e.code, e.param) == ("file_not_found", "training_file")
    e = refused(openai.BadRequestError, model="no-such-model")
    assert (e.code, e.param) == ("model_not_found", "model")
    e = refused(openai.BadRequestError, model=f"ft:ftune-demo:x::{'1' * 32}")
    assert (e.code, e.param) == ("model_not_found", "model")
    e = refused(openai.BadRequestError, method={"type": "reinforcement", "reinforcement": {}})
    assert e.param == "method.reinforcement.grader"  # reinforcement needs its grader
    e = refused(openai.BadRequestError, integrations=[{"type": "wandb", "wandb": {"project": "p"}}])
    assert e.param == "integrations"
    e = refused(openai.BadRequestError, hyperparameters={"n_epochs": 2}, extra_body={**TINY_RUN, "epochs": 3})
    assert (e.code, e.param) == ("duplicate_parameter", "epochs")
    e = refused(openai.BadRequestError, extra_body={**TINY_RUN, "base_model": "ftune-demo"})
    assert e.param == "base_model"
    e = refused(openai.BadRequestError, extra_body={**TINY_RUN, "no_such_setting": 1})
    assert e.param == "no_such_setting"
    e = refused(openai.BadRequestError, suffix="x" * 65)
    assert e.param == "suffix"
    e = refused(openai.BadRequestError, metadata={f"k{i}": "v" for i in range(17)})
    assert e.param == "metadata"
    # Infeasible: the planner's breakdown and suggestions ride along in the error body. A max_seq_len far
    # above the data's lengths costs nothing (admission measures them), so the data is long: 520 examples
    # of ~700 tokens in padded micro-batches of 512 need far more than the worker's RAM.
    words = " ".join(f"w{i % 97}" for i in range(600))
    long = sdk.files.create(
        file=("long.jsonl", f'{{"text": "{words}"}}\n'.encode() * 520), purpose="fine-tune"
    )
    heavy = {**TINY_RUN, "max_seq_len": 131072, "micro_batch_size": 512, "packing": False}
    e = refused(openai.BadRequestError, training_file=long.id, extra_body=heavy)
    assert e.code == "infeasible" and "planned from the data's largest micro-batch" in e.message
    details = e.body["details"]  # type: ignore[index]
    assert details["fits"] is False and details["breakdown"] and "suggestions" in details
    assert details["batch_shape"]["tokens"] < 512 * 131072

    # Another tenant's file and job are 404, exactly like missing ones.
    other, other_native, _ = stack.tenant()
    with other, other_native:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(training_file)
        with pytest.raises(openai.NotFoundError) as theirs_file:
            other.fine_tuning.jobs.create(
                model="ftune-demo", training_file=training_file, extra_body=TINY_RUN
            )
        assert theirs_file.value.param == "training_file"
        mine = jobs.create(model="ftune-demo", training_file=training_file, extra_body=TINY_RUN).id
        jobs.cancel(mine)
        theirs = other.fine_tuning.jobs
        for call in (theirs.retrieve, theirs.cancel, theirs.pause, theirs.resume, theirs.list_events):
            with pytest.raises(openai.NotFoundError):
                call(mine)  # type: ignore[operator]
        assert mine not in [j.id for j in other.fine_tuning.jobs.list()]
    bad_key = openai.OpenAI(api_key=key[:-4] + "zzzz", base_url=str(sdk.base_url), max_retries=0)
    with bad_key, pytest.raises(openai.AuthenticationError):
        bad_key.fine_tuning.jobs.list()
