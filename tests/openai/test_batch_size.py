"""`batch_size` as OpenAI users mean it, through the official SDK against `ftune up`: examples per optimizer
step, not packed rows, and "auto" ~0.2% of the training examples (at least 1, at most 256). 40 short
examples for 2 epochs: auto is 1, so 80 steps; batch_size 8, 10 steps; the same file natively with
JobSpec's defaults (a step of 4 packed rows of up to 512 tokens, ~50 short examples each) trains a step
an epoch. The job object and an event say the batch chosen."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.openai.conftest import EXAMPLES, Stack, wait_for

pytestmark = pytest.mark.slow

RUN = {"lora_r": 8, "lora_dropout": 0.0, "checkpoint_every_steps": 0}  # max_seq_len: JobSpec's 512


def hyperparameters(n_epochs: int, batch_size: int | str) -> Any:
    hp = {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate_multiplier": 1}
    return {"type": "supervised", "supervised": {"hyperparameters": hp}}


def steps_trained(native: httpx.Client, job_id: str) -> int:
    return len(native.get(f"/jobs/{job_id}/metrics").json()["data"])


def test_batch_size_counts_examples_and_auto_follows_the_file(stack: Stack) -> None:
    sdk, native, _ = stack.tenant()
    with sdk, native:
        rows = (EXAMPLES / "alpaca_small.jsonl").read_bytes().splitlines(keepends=True)[:40]
        file_id = sdk.files.create(file=("short.jsonl", b"".join(rows)), purpose="fine-tune").id
        sdk.files.wait_for_processing(file_id, poll_interval=0.2)
        body: Any = {"model": "ftune-demo", "training_file": file_id, "extra_body": RUN}
        auto = sdk.fine_tuning.jobs.create(**body, method=hyperparameters(2, "auto"))
        eight = sdk.fine_tuning.jobs.create(**body, method=hyperparameters(2, 8))
        r = native.post("/jobs", json={"base_model": "ftune-demo", "dataset_id": file_id, "epochs": 2, **RUN})
        assert r.status_code == 202, r.text
        native_id = r.json()["id"]

        assert auto.hyperparameters.batch_size == 1  # 0.2% of 40 is 0.08: at least 1
        assert eight.hyperparameters.batch_size == 8
        spec = native.get(f"/jobs/{auto.id}").json()["spec"]
        assert (spec["examples_per_step"], spec["packing"]) == (1, True)
        assert native.get(f"/jobs/{native_id}").json()["spec"]["examples_per_step"] is None
        [said] = [e for e in sdk.fine_tuning.jobs.list_events(auto.id) if "Hyperparameters" in e.message]
        assert "batch_size 1 (examples per optimizer step; auto: ~0.2% of 40 training examples" in (
            said.message
        )
        data: Any = said.data
        assert data["hyperparameters"]["batch_size"] == 1 and data["training_examples"] == 40
        [said] = [e for e in sdk.fine_tuning.jobs.list_events(eight.id) if "Hyperparameters" in e.message]
        assert "batch_size 8 (examples per optimizer step)" in said.message

        for job_id, steps in ((auto.id, 80), (eight.id, 10)):
            job = wait_for(sdk, job_id, {"succeeded"}, timeout=600)
            assert job.hyperparameters.batch_size in (1, 8)
            assert steps_trained(native, job_id) == steps
        stats = native.get(f"/jobs/{auto.id}").json()["token_stats"]
        assert stats["steps_per_epoch"] == 40
        wait_for(sdk, native_id, {"succeeded"}, timeout=600)
        native_steps = steps_trained(native, native_id)
        assert native_steps == 2, native_steps  # packed rows per step, as before: not 80
        print(f"\n40 examples x 2 epochs: auto 80, batch_size 8: 10, native default: {native_steps} steps")


def test_batch_size_auto_with_no_training_file_left_to_count(stack: Stack) -> None:
    """A file that is not the caller's is refused as before (404), auto or not."""
    sdk, native, _ = stack.tenant()
    with sdk, native, pytest.raises(openai.NotFoundError):
        sdk.fine_tuning.jobs.create(
            model="ftune-demo", training_file="f" * 32, method=hyperparameters(1, "auto")
        )
