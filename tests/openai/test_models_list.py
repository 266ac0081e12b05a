"""The official openai SDK's `client.models` against a real API: the catalog's base models and the caller's
own fine-tuned models (succeeded, not deleted) with the checkpoints their jobs still keep, never another
organization's."""

from __future__ import annotations

import shutil

import openai
import pytest

from core import ft_names
from core.storage import Storage
from tests.openai.engine_double import ChatStack, chat_stack  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_list_and_retrieve_show_only_the_callers_models(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, tenant_id = chat_stack.tenant()
    other_sdk, other = chat_stack.tenant()
    mine = ft_names.fine_tuned_model("tiny", tenant_id, "demo", chat_stack.finished_job(tenant_id))
    running = ft_names.fine_tuned_model(
        "tiny", tenant_id, "demo", chat_stack.finished_job(tenant_id, "running")
    )
    theirs = ft_names.fine_tuned_model("tiny", other, "demo", chat_stack.finished_job(other))
    with sdk, other_sdk:
        listed = {m.id: m for m in sdk.models.list()}
        assert set(listed) == {"tiny", mine}
        assert listed["tiny"].owned_by == "ftune" and listed["tiny"].object == "model"
        assert listed[mine].owned_by == tenant_id and listed[mine].created > 0
        assert {m.id for m in other_sdk.models.list()} == {"tiny", theirs}

        got = sdk.models.retrieve(mine)
        assert (got.id, got.owned_by, got.object) == (mine, tenant_id, "model")
        assert sdk.models.retrieve("tiny").owned_by == "ftune"
        for model in (theirs, running, "no-such-base", f"{mine}:ckpt-step-1"):
            with pytest.raises(openai.NotFoundError) as e:
                sdk.models.retrieve(model)
            assert e.value.code == "model_not_found", model


def test_kept_checkpoints_are_models_until_pruned(chat_stack: ChatStack) -> None:  # noqa: F811
    sdk, tenant_id = chat_stack.tenant()
    other_sdk, _ = chat_stack.tenant()
    job_id = chat_stack.finished_job(tenant_id)
    final = ft_names.fine_tuned_model("tiny", tenant_id, "demo", job_id)
    pruned = chat_stack.checkpoint(job_id, 10)
    for step in (20, 30):
        chat_stack.checkpoint(job_id, step)
    shutil.rmtree(pruned)  # keep_checkpoints pruned the oldest; its Artifact row stays
    ckpt = {step: ft_names.checkpoint_model(final, step) for step in (10, 20, 30)}
    with sdk, other_sdk:
        listed = [m.id for m in sdk.models.list()]
        assert listed == ["tiny", final, ckpt[30], ckpt[20]]  # the job's final model, then newest first
        got = sdk.models.retrieve(ckpt[20])
        assert (got.id, got.owned_by, got.object) == (ckpt[20], tenant_id, "model") and got.created > 0
        # the /v1 checkpoints list names the same models
        names = [c.fine_tuned_model_checkpoint for c in sdk.fine_tuning.jobs.checkpoints.list(job_id)]
        assert sorted(names) == sorted([ckpt[20], ckpt[30]])
        for model in (ckpt[10], ckpt[20].replace(":demo:", ":other:")):
            with pytest.raises(openai.NotFoundError) as e:
                sdk.models.retrieve(model)
            assert e.value.code == "model_not_found", model
        with pytest.raises(openai.NotFoundError):
            other_sdk.models.retrieve(ckpt[20])
        assert [m.id for m in other_sdk.models.list()] == ["tiny"]


def test_models_need_a_key(chat_stack: ChatStack) -> None:  # noqa: F811
    with openai.OpenAI(api_key="ftk_nope", base_url=f"{chat_stack.base}/v1", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            sdk.models.list()
        with pytest.raises(openai.AuthenticationError):
            sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])


def test_a_fine_tuned_model_and_a_checkpoints_model_can_be_deleted(chat_stack: ChatStack) -> None:  # noqa: F811
    """`client.models.delete`: a checkpoint's model takes its files alone (and the adapter laid out from it
    for serving); the final model takes its job's files, so its checkpoints' models too, and the job stays
    (deleted, its name kept). Another organization's model is 404 and left as it is; a base model 403."""
    sdk, tenant_id = chat_stack.tenant()
    other_sdk, _ = chat_stack.tenant()
    job_id = chat_stack.finished_job(tenant_id)
    checkpoints = {step: chat_stack.checkpoint(job_id, step) for step in (20, 30)}
    final = ft_names.fine_tuned_model("tiny", tenant_id, "demo", job_id)
    ckpt = {step: ft_names.checkpoint_model(final, step) for step in checkpoints}
    storage = Storage(chat_stack.data_dir)
    hi = [{"role": "user", "content": "hi"}]
    with sdk, other_sdk:
        assert sdk.chat.completions.create(model=ckpt[20], messages=hi).choices  # lays out its adapter
        served_view = storage.checkpoint_adapter_dir(job_id, 20)
        assert served_view.exists()
        with pytest.raises(openai.NotFoundError) as e:
            other_sdk.models.delete(final)
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.PermissionDeniedError):
            sdk.models.delete("tiny")
        assert [m.id for m in sdk.models.list()] == ["tiny", final, ckpt[30], ckpt[20]]  # nothing went

        gone = sdk.models.delete(ckpt[20])
        assert (gone.id, gone.deleted, gone.object) == (ckpt[20], True, "model")
        assert not checkpoints[20].exists() and not served_view.exists() and checkpoints[30].exists()
        assert [m.id for m in sdk.models.list()] == ["tiny", final, ckpt[30]]
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model=ckpt[20], messages=hi)

        assert sdk.models.delete(final).deleted
        assert [m.id for m in sdk.models.list()] == ["tiny"]
        assert not storage.job_dir(job_id).exists()
        job = sdk.fine_tuning.jobs.retrieve(job_id)  # the job's record stays, naming what it made
        assert job.status == "succeeded" and job.fine_tuned_model == final
        for model in (final, ckpt[30]):
            with pytest.raises(openai.NotFoundError):
                sdk.chat.completions.create(model=model, messages=hi)
            with pytest.raises(openai.NotFoundError):
                sdk.models.delete(model)
