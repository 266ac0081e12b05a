"""A mixture-of-experts base through the whole service: `ftune models build-demo --family qwen3_moe` builds a
tiny random-weight Qwen3-MoE (transformers' own Qwen3MoeForCausalLM) into the running `ftune up`'s models
directory; GET /models lists it with its family, total and active parameters; a packed LoRA job on it is
planned, queued, trained by the CPU worker and succeeds; its adapter, downloaded from the API, changes the
model's output, and the tuned model answers differently from the base through chat completions. Three
jobs that split the same global batch differently (micro 4 x accumulation 1, micro 1 x 4, and num_gpus 2
x micro 2, which the CPU worker runs as two gloo processes under torchrun), padded, train the same adapter
(tests/training/test_moe_split_invariance.py proves it packed and padded, with the router's loss)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.stack import REPO, TEST_ADMIN_KEY, Up, api, build_demo, download_adapter, upload, wait_finished

pytestmark = pytest.mark.slow
BASE = "ftune-demo-qwen3-moe"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TARGET = "The capital of France is Paris."
SPEC: dict[str, Any] = {
    "base_model": BASE, "method": "lora", "max_seq_len": 64, "micro_batch_size": 2, "max_steps": 12,
    "learning_rate": 2e-2, "lora_dropout": 0.0, "warmup_steps": 1, "checkpoint_every_steps": 0,
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_base(up: Up, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-MoE, built by the real CLI into the running stack's models directory."""
    build_demo("qwen3_moe", models_dir, tmp_path_factory.mktemp("moe"))
    return BASE


def test_a_tiny_qwen3_moe_job_trains_an_adapter_that_changes_the_output(
    up: Up, models_dir: Path, moe_base: str, tmp_path: Path
) -> None:
    listed = {m["name"]: m for m in api.get(f"{up.base}/models").json()}
    moe = listed[BASE]
    assert (moe["family"], moe["modality"], moe["model_type"]) == ("Qwen3-MoE", "text", "qwen3_moe")
    assert 0 < moe["active_params"] < moe["total_params"]

    data = tmp_path / "one.jsonl"
    row = {"messages": [*PROMPT, {"role": "assistant", "content": TARGET}]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(16)))
    dataset = upload(up.base, data)
    try:
        r = api.post(f"{up.base}/jobs", json={**SPEC, "dataset_id": dataset["id"]})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        final = wait_finished(up.base, [job_id], timeout=600)[job_id][-1]
        assert final["status"] == "succeeded", final
        losses = [s["loss"] for s in api.get(f"{up.base}/jobs/{job_id}/metrics").json()["data"]]
        assert len(losses) == SPEC["max_steps"] and losses[-1] < losses[0], losses

        adapter = download_adapter(up.base, job_id, tmp_path)
        _assert_adapter_changes_outputs(models_dir / BASE, adapter)
        _assert_chat_differs(up, job_id)
    except BaseException:
        print(up.tail())
        raise


def _assert_adapter_changes_outputs(base_dir: Path, adapter_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(base_dir)(PROMPT[0]["content"], return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert type(base).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, adapter_dir)(ids).logits
    assert (after - before).abs().max().item() > 1e-3


def _assert_chat_differs(up: Up, job_id: str) -> None:
    greedy: Any = {"messages": PROMPT, "max_tokens": 12, "temperature": 0}
    with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{up.base}/v1", max_retries=0, timeout=120) as sdk:
        model = sdk.fine_tuning.jobs.retrieve(job_id).fine_tuned_model
        assert model is not None
        tuned = sdk.chat.completions.create(model=model, **greedy).choices[0].message.content
        base = sdk.chat.completions.create(model=BASE, **greedy).choices[0].message.content
    assert tuned and tuned != base, (tuned, base)


SPLITS = {
    "micro 4 x accum 1": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    "micro 1 x accum 4": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
    "2 ranks x micro 2": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
}


def test_moe_jobs_that_split_the_same_global_batch_train_the_same_adapter(
    up: Up, moe_base: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from tests.training.util import relative_difference

    spec = {**SPEC, "max_steps": 6, "learning_rate": 2e-3, "lora_dropout": 0.1, "packing": False}
    dataset = upload(up.base, REPO / "examples" / "alpaca_small.jsonl")
    try:
        jobs = {}
        for name, split in SPLITS.items():
            r = api.post(f"{up.base}/jobs", json={**spec, **split, "dataset_id": dataset["id"]})
            assert r.status_code == 202, r.text
            jobs[name] = r.json()["id"]
        done = wait_finished(up.base, list(jobs.values()), timeout=900)
        assert all(done[j][-1]["status"] == "succeeded" for j in jobs.values()), done
        adapters = {
            name: load_file(download_adapter(up.base, j, tmp_path) / "adapter_model.safetensors")
            for name, j in jobs.items()
        }
        losses = {
            name: [s["loss"] for s in api.get(f"{up.base}/jobs/{j}/metrics").json()["data"]]
            for name, j in jobs.items()
        }
    except BaseException:
        print(up.tail())
        raise
    ref = "micro 4 x accum 1"
    for name in SPLITS:
        assert losses[name] == pytest.approx(losses[ref], rel=1e-4), name
        assert relative_difference(adapters[ref], adapters[name]) <= 1e-4, name
