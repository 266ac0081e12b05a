"""The official openai SDK's `client.fine_tuning.jobs` against `ftune up` (API, embedded broker, a training
worker and a CPU worker, all real processes; SQLite): the job lifecycle, on the package's one stack
(tests/openai/conftest.py), tiny demo jobs. Errors: test_job_errors.py; webhooks: test_webhooks_sdk.py."""

from __future__ import annotations

import csv
import io
import json
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from core import ft_names
from core.spec import JobSpec
from tests.openai.conftest import EXAMPLES, STEPS, SUPERVISED, TINY_RUN, Stack, jsonl, wait_for

pytestmark = pytest.mark.slow


def test_create_with_suffix_metadata_and_ftune_settings_until_succeeded(
    stack: Stack,
    org: tuple[openai.OpenAI, httpx.Client, str],
    finished: Any,
    training_file: str,
    tmp_path: Path,
) -> None:
    sdk, native, _ = org
    job = finished
    assert job.object == "fine_tuning.job" and job.status == "succeeded"
    assert job.fine_tuned_model == f"ft:ftune-demo:{job.organization_id}:demo-run:{job.id}"
    assert ft_names.parse(job.fine_tuned_model) == ft_names.FineTunedName(job_id=job.id)
    assert job.model == "ftune-demo" and job.training_file == training_file and job.validation_file is None
    assert job.metadata == {"team": "search", "run": "baseline"} and job.seed == 7
    assert job.user_provided_suffix == "demo run"
    # No "auto" left: batch_size 1 example per step (~0.2% of the file's 200, at least 1), ftune's lr x 5.
    assert job.hyperparameters.model_dump() == {
        "n_epochs": 1,
        "batch_size": 1,
        "learning_rate_multiplier": 5.0,
    }
    assert job.method is not None and job.method.type == "supervised"
    assert job.finished_at is not None and job.finished_at >= job.created_at
    assert job.estimated_finish is None and job.error is None
    # The same job natively, with the settings that rode along.
    spec = native.get(f"/jobs/{job.id}").json()["spec"]
    assert {k: spec[k] for k in TINY_RUN} == TINY_RUN
    assert spec["learning_rate"] == pytest.approx(5 * 2e-4) and spec["seed"] == 7
    steps = native.get(f"/jobs/{job.id}/metrics").json()["data"]
    assert len(steps) == STEPS
    assert job.trained_tokens == sum(s["tokens"] for s in steps) > 0

    # Events: newest first, a metrics event per step with the training loss the run logged.
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=7))  # the SDK walks every page
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == list(range(STEPS, 0, -1))  # type: ignore[index]
    assert [e.data["train_loss"] for e in metrics][::-1] == [s["loss"] for s in steps]  # type: ignore[index]
    accuracy = [e.data["train_mean_token_accuracy"] for e in metrics][::-1]  # type: ignore[index]
    assert accuracy == [s["token_accuracy"] for s in steps] and all(0 <= a <= 1 for a in accuracy)
    assert all(e.object == "fine_tuning.job.event" and e.level in ("info", "warn") for e in events)
    assert any(e.type == "message" and "queued" in e.message for e in events)
    assert len(sdk.fine_tuning.jobs.list_events(job.id).data) == 20  # OpenAI's default page

    # Checkpoints in step order, with their step's metrics, each named as a model.
    checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job.id))
    native_events = native.get(f"/jobs/{job.id}/events?limit=500").json()["data"]
    saved = sorted({e["data"]["step"] for e in native_events if e["kind"] == "checkpoint_saved"})
    assert {10, 20, 30} <= set(saved)
    assert [c.step_number for c in checkpoints] == saved[-2:]  # keep_checkpoints 2 (nothing evaluated)
    by_step = {s["step"]: s["loss"] for s in steps}
    for c in checkpoints:
        assert c.fine_tuning_job_id == job.id
        assert c.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-{c.step_number}"
        assert c.metrics.train_loss == by_step[c.step_number]

    # Each listed checkpoint downloads natively: the whole state as training saved it, safetensors only.
    last = checkpoints[-1].step_number
    r = native.get(f"/jobs/{job.id}/checkpoints/{last}")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"} == names
        state = json.loads(tar.extractfile(f"ftune-checkpoint-{job.id}-step-{last}/state.json").read())  # type: ignore[union-attr]
        assert state["position"]["step"] == last
    gone = [s for s in saved if s not in {c.step_number for c in checkpoints}]
    r = native.get(f"/jobs/{job.id}/checkpoints/{gone[0]}")  # pruned by keep_checkpoints
    assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found"

    # The result file: a CSV of the metrics per step.
    [result_id] = job.result_files
    meta = sdk.files.retrieve(result_id)
    assert meta.purpose == "fine-tune-results" and meta.status == "processed"
    rows = list(csv.DictReader(io.StringIO(sdk.files.content(result_id).text)))
    assert list(rows[0]) == [
        "step",
        "train_loss",
        "train_accuracy",
        "valid_loss",
        "valid_mean_token_accuracy",
    ]
    assert [(int(r["step"]), float(r["train_loss"])) for r in rows] == [(s["step"], s["loss"]) for s in steps]
    assert [float(r["train_accuracy"]) for r in rows] == [s["token_accuracy"] for s in steps]
    assert meta.bytes == len(sdk.files.content(result_id).content)

    # The adapter downloads natively and loads with peft.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = download_adapter_native(native, job.id, tmp_path)
    assert adapter and all(torch.isfinite(t).all() for t in adapter.values())
    base = AutoModelForCausalLM.from_pretrained(stack.models_dir / "ftune-demo", dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, tmp_path / job.id)
    assert tuned.peft_config["default"].r == 8


def test_list_walks_every_page_and_filters_by_metadata(stack: Stack, training_file: str) -> None:
    sdk, native, _ = stack.tenant()
    with sdk, native, (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
        ids = []
        for i in range(5):
            created = sdk.fine_tuning.jobs.create(
                model="ftune-demo", training_file=file_id, metadata={"i": str(i)}, extra_body=TINY_RUN
            )
            ids.append(created.id)
            # Cancelled at once (queued) or after its current step (running): listing needs no training.
            cancelled = sdk.fine_tuning.jobs.cancel(created.id)
            assert cancelled.id == created.id
        for job_id in ids:
            assert wait_for(sdk, job_id, {"cancelled"}).status == "cancelled"
        first = sdk.fine_tuning.jobs.list(limit=2)
        assert [j.id for j in first.data] == ids[::-1][:2] and first.has_more
        assert [j.id for j in sdk.fine_tuning.jobs.list(limit=2)] == ids[::-1]  # auto-pagination
        only = sdk.fine_tuning.jobs.list(metadata={"i": "3"})
        assert [j.id for j in only.data] == [ids[3]]
        assert only.data[0].metadata == {"i": "3"}
        # A cancelled job cannot be cancelled again: a 400 the SDK does not retry.
        with pytest.raises(openai.BadRequestError) as e:
            sdk.fine_tuning.jobs.cancel(ids[0])
        assert e.value.code == "job_finished"
        # Visible natively too, as cancelled.
        assert native.get(f"/jobs/{ids[0]}").json()["status"] == "cancelled"


def test_pause_then_resume_ends_succeeded_with_the_same_adapter_as_its_twin(
    stack: Stack,
    org: tuple[openai.OpenAI, httpx.Client, str],
    finished: Any,
    training_file: str,
    tmp_path: Path,
) -> None:
    sdk, native, _ = org
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=training_file, seed=7, method=SUPERVISED, extra_body=TINY_RUN
    )
    deadline = time.monotonic() + 300
    while native.get(f"/jobs/{job.id}").json()["progress"]["step"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sdk.fine_tuning.jobs.pause(job.id).status in ("running", "paused")
    paused = wait_for(sdk, job.id, {"paused", "succeeded"})
    assert paused.status == "paused", "the pause landed after the last step: make the run longer"
    assert native.get(f"/jobs/{job.id}").json()["progress"]["step"] < STEPS
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.pause(job.id)
    assert e.value.code == "job_not_pausable"
    assert sdk.fine_tuning.jobs.resume(job.id).status in ("queued", "validating_files", "running")
    done = wait_for(sdk, job.id, {"succeeded"})
    assert done.fine_tuned_model is not None
    twin = download_adapter_native(native, finished.id, tmp_path)
    resumed = download_adapter_native(native, job.id, tmp_path)
    assert twin.keys() == resumed.keys()
    for k in twin:
        assert torch.allclose(twin[k], resumed[k], atol=1e-5, rtol=0), k


@pytest.mark.skipif("init_from" not in JobSpec.model_fields, reason="JobSpec has no init_from yet")
def test_continue_from_a_fine_tuned_model(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], finished: Any, training_file: str
) -> None:
    sdk, native, _ = org
    job = sdk.fine_tuning.jobs.create(
        model=finished.fine_tuned_model,
        training_file=training_file,
        seed=7,
        method=SUPERVISED,
        extra_body={**TINY_RUN, "max_steps": 4},  # its first step is the claim
    )
    assert job.model == finished.fine_tuned_model
    spec = native.get(f"/jobs/{job.id}").json()["spec"]
    assert (spec["init_from"], spec["base_model"]) == (finished.id, "ftune-demo")
    done = wait_for(sdk, job.id, {"succeeded"})
    assert done.fine_tuned_model != finished.fine_tuned_model
    # It starts from the trained adapter: its first step (the same examples, seed 7) has a lower loss.
    first = native.get(f"/jobs/{finished.id}/metrics").json()["data"][0]["loss"]
    again = native.get(f"/jobs/{job.id}/metrics").json()["data"][0]["loss"]
    assert again < first - 0.1, (again, first)

    other, other_native, _ = stack.tenant()
    with other, other_native, pytest.raises(openai.BadRequestError) as e:  # another tenant's model
        other.fine_tuning.jobs.create(model=finished.fine_tuned_model, training_file=training_file)
    assert (e.value.code, e.value.param) == ("model_not_found", "model")


def download_adapter_native(native: httpx.Client, job_id: str, tmp: Path) -> dict[str, torch.Tensor]:

    r = native.get(f"/jobs/{job_id}/adapter")
    assert r.status_code == 200, r.text
    (tmp / f"{job_id}.tar.gz").write_bytes(r.content)
    with tarfile.open(tmp / f"{job_id}.tar.gz") as tar:
        tar.extractall(tmp / job_id, filter="data")
    return load_file(tmp / job_id / "adapter_model.safetensors")


# One micro-batch of 4: every step of a job on it trains on the same examples.
FOUR = jsonl(*({"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(4)))


def test_continue_from_a_checkpoint_starts_from_its_adapter(stack: Stack) -> None:
    """A checkpoint's model (`...:ckpt-step-N`) continues from that checkpoint's adapter, not the final one.
    On a file that is one micro-batch, every step sees the same examples, so the new job's first loss
    (its forward pass before any update) equals the loss the earlier job logged at step N + 1, whose
    forward pass ran with the adapter saved at step N. A checkpoint not kept is a 400 checkpoint_not_found."""
    sdk, native, _ = stack.tenant()
    with sdk, native:
        file_id = sdk.files.create(file=("four.jsonl", FOUR), purpose="fine-tune").id
        sdk.files.wait_for_processing(file_id, poll_interval=0.2)
        settings = {**TINY_RUN, "max_steps": 3, "checkpoint_every_steps": 1, "keep_checkpoints": 2}
        settings |= {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "packing": False}
        body: Any = {"training_file": file_id, "seed": 7, "method": SUPERVISED}
        first = sdk.fine_tuning.jobs.create(model="ftune-demo", **body, extra_body=settings)
        first = wait_for(sdk, first.id, {"succeeded"})
        losses = [s["loss"] for s in native.get(f"/jobs/{first.id}/metrics").json()["data"]]
        assert len(losses) == 3 and losses[2] < losses[1] < losses[0], losses  # each step's adapter differs
        kept = {c.step_number: c for c in sdk.fine_tuning.jobs.checkpoints.list(first.id)}
        assert set(kept) == {2, 3}  # step 1's was pruned (keep_checkpoints 2)

        model = kept[2].fine_tuned_model_checkpoint
        job = sdk.fine_tuning.jobs.create(model=model, **body, extra_body={**settings, "max_steps": 1})
        assert job.model == model
        spec = native.get(f"/jobs/{job.id}").json()["spec"]
        assert (spec["init_from"], spec["init_from_step"], spec["base_model"]) == (first.id, 2, "ftune-demo")
        assert wait_for(sdk, job.id, {"succeeded"}).fine_tuned_model is not None
        [again] = [s["loss"] for s in native.get(f"/jobs/{job.id}/metrics").json()["data"]]
        assert again == pytest.approx(losses[2], rel=1e-5), (again, losses)

        for step in (1, 9):  # pruned, never saved
            with pytest.raises(openai.BadRequestError) as e:
                sdk.fine_tuning.jobs.create(
                    model=f"{first.fine_tuned_model}:ckpt-step-{step}", **body, extra_body=settings
                )
            assert (e.value.code, e.value.param) == ("checkpoint_not_found", "model")
        # Natively: init_from_step names the checkpoint, and needs init_from.
        native_spec = {"base_model": "ftune-demo", "dataset_id": file_id, **settings}
        r = native.post("/jobs", json={**native_spec, "init_from": first.id, "init_from_step": 9})
        assert r.status_code == 422 and r.json()["error"]["code"] == "checkpoint_not_found", r.text
        assert r.json()["error"]["param"] == "init_from_step"
        r = native.post("/jobs", json={**native_spec, "init_from_step": 2})
        assert r.status_code == 422 and "init_from_step needs init_from" in r.text, r.text


def test_idempotent_create(org: tuple[openai.OpenAI, httpx.Client, str], training_file: str) -> None:
    """The SDK sends no Idempotency-Key of its own, so a retry without one makes a second job; with
    `extra_headers={"Idempotency-Key": ...}` a retry of the same create gets the first job back."""
    sdk, _, _ = org
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body: dict[str, Any] = {"model": "ftune-demo", "training_file": training_file, "extra_body": TINY_RUN}
    first = sdk.fine_tuning.jobs.with_raw_response.create(**body, extra_headers=key)
    again = sdk.fine_tuning.jobs.with_raw_response.create(**body, extra_headers=key)
    assert again.parse().id == first.parse().id
    assert again.headers.get("Idempotent-Replayed") == "true"
    other = sdk.fine_tuning.jobs.create(**body, extra_headers={"Idempotency-Key": uuid.uuid4().hex})
    assert other.id != first.parse().id
    with pytest.raises(openai.BadRequestError) as e:  # the same key with a different body
        sdk.fine_tuning.jobs.create(**{**body, "seed": 1}, extra_headers=key)
    assert e.value.code == "idempotency_key_reused"
    for job_id in (first.parse().id, other.id):
        sdk.fine_tuning.jobs.cancel(job_id)


def test_native_delete_of_datasets_and_finished_jobs(stack: Stack) -> None:
    """Files in use by an unfinished job stay; a finished job's files go, its record stays (deleted)."""
    sdk, native, _ = stack.tenant()
    with sdk, native, (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
        job = sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=file_id, extra_body=TINY_RUN)
        r = native.delete(f"/datasets/{file_id}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use", r.text
        assert r.json()["error"]["details"]["jobs"] == [job.id]
        r = native.delete(f"/jobs/{job.id}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_finished", r.text

        sdk.fine_tuning.jobs.cancel(job.id)
        wait_for(sdk, job.id, {"cancelled"})
        r = native.delete(f"/jobs/{job.id}")
        assert r.status_code == 200 and r.json()["deleted_at"] is not None, r.text
        assert native.get(f"/jobs/{job.id}").json()["status"] == "cancelled"  # the record stays
        assert native.get(f"/jobs/{job.id}/artifacts").json() == []
        assert native.get(f"/jobs/{job.id}/adapter").json()["error"]["code"] == "adapter_deleted"
        assert "deleted" in [e["kind"] for e in native.get(f"/jobs/{job.id}/events?limit=500").json()["data"]]

        assert native.delete(f"/datasets/{file_id}").status_code == 204
        assert file_id not in [d["id"] for d in native.get("/datasets").json()["data"]]
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(file_id)
        assert native.delete(f"/datasets/{file_id}").status_code == 404
        # Its record stays (the cancelled job names it), and a new job is told it was deleted.
        assert native.get(f"/datasets/{file_id}").json()["status"] == "deleted"
        with pytest.raises(openai.BadRequestError) as e:
            sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=file_id, extra_body=TINY_RUN)
        assert (e.value.code, e.value.param) == ("dataset_deleted", "training_file")
        assert "deleted" in e.value.message
