"""Preference tuning end to end on real processes (`ftune up`: API, embedded broker, training worker, CPU
worker): upload a chat file and a preference file, train SFT on the chat data, then DPO continuing from
the SFT adapter (init_from) on the preference pairs; the reward accuracy on the training pairs rises
above 0.5 and the adapter loads with peft. Admission refuses an SFT job on preference pairs and the
reverse, and init_from naming a job that is missing, unfinished or of another adapter shape."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.stack import REPO, Up, api, download_adapter, upload, wait_finished

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
COMMON = {"base_model": "ftune-demo", "method": "lora", "max_seq_len": 128, "micro_batch_size": 4,
          "lora_dropout": 0.0, "checkpoint_every_steps": 10}  # fmt: skip
SFT = {**COMMON, "max_steps": 20, "learning_rate": 2e-3}
DPO = {**COMMON, "objective": "dpo", "beta": 0.1, "max_steps": 30, "learning_rate": 1e-3}


def post_job(base: str, spec: dict[str, Any]) -> Any:
    return api.post(f"{base}/jobs", json=spec)


def refused(base: str, spec: dict[str, Any], code: str) -> dict[str, Any]:
    r = post_job(base, spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return dict(err)


def test_sft_then_dpo_from_its_adapter_through_the_api(up: Up, models_dir: Path, tmp_path: Path) -> None:
    base = up.base
    try:
        chat = upload(base, EXAMPLES / "chat_small.jsonl")
        pairs = upload(base, EXAMPLES / "preference_small.jsonl")
        assert (chat["format"], chat["report"]["kind"]) == ("chat", "sft")
        assert (pairs["format"], pairs["report"]["kind"], pairs["num_examples"]) == (
            "preference",
            "preference",
            102,
        )

        err = refused(base, {**SFT, "dataset_id": pairs["id"]}, "dataset_is_preference")
        assert err["param"] == "dataset_id" and "objective 'dpo'" in err["message"]
        refused(base, {**DPO, "dataset_id": chat["id"]}, "dataset_not_preference")
        refused(base, {**DPO, "dataset_id": pairs["id"], "init_from": "0" * 32}, "init_from_not_found")

        sft = post_job(base, {**SFT, "dataset_id": chat["id"]})
        assert sft.status_code == 202, sft.text
        sft_id = sft.json()["id"]
        err = refused(
            base, {**DPO, "dataset_id": pairs["id"], "init_from": sft_id}, "init_from_not_succeeded"
        )
        assert err["details"]["status"] in ("queued", "running")
        assert wait_finished(base, [sft_id], timeout=600)[sft_id][-1]["status"] == "succeeded"
        refused(
            base,
            {**DPO, "dataset_id": pairs["id"], "init_from": sft_id, "lora_r": 8},
            "init_from_lora_mismatch",
        )

        dpo = post_job(base, {**DPO, "dataset_id": pairs["id"], "init_from": sft_id})
        assert dpo.status_code == 202, dpo.text
        dpo_id = dpo.json()["id"]
        assert dpo.json()["spec"]["init_from"] == sft_id
        final = wait_finished(base, [dpo_id], timeout=900)[dpo_id][-1]
        assert final["status"] == "succeeded", final

        stats = api.get(f"{base}/jobs/{dpo_id}").json()["token_stats"]
        assert stats["status"] == "ready" and stats["kind"] == "preference" and stats["count"] == 102
        assert stats["prompt_max"] > 0 and stats["completion_max"] > 0

        steps = api.get(f"{base}/jobs/{dpo_id}/metrics").json()["data"]
        assert len(steps) == DPO["max_steps"]
        # the SFT adapter is the reference: the first step's policy is the reference
        assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
        assert steps[0]["rewards_margin"] == pytest.approx(0.0, abs=1e-5)
        last = steps[-5:]
        accuracy = sum(s["rewards_accuracy"] for s in last) / len(last)
        margin = sum(s["rewards_margin"] for s in last) / len(last)
        print(f"\nDPO from the SFT adapter: reward accuracy on the training pairs {accuracy:.2f}, "
              f"margin {margin:.3f}, loss {steps[0]['loss']:.4f} -> {last[-1]['loss']:.4f}")  # fmt: skip
        assert accuracy > 0.5 and margin > 0
        assert sum(s["loss"] for s in last) / len(last) < steps[0]["loss"]

        # The same metrics in the OpenAI surface's events (a native job is a /v1 job too).
        v1 = api.get(f"{base}/v1/fine_tuning/jobs/{dpo_id}/events", params={"limit": 100}).json()["data"]
        metric = [e["data"] for e in v1 if e["type"] == "metrics"]
        assert len(metric) == DPO["max_steps"], v1
        assert {d["step"]: d["train_rewards_accuracy"] for d in metric} == {
            s["step"]: s["rewards_accuracy"] for s in steps
        }

        events = api.get(f"{base}/jobs/{dpo_id}/events").json()["data"]
        assert [e["kind"] for e in events][-1] == "succeeded"
        started = next(e for e in events if e["kind"] == "training_started")
        assert started["data"]["token_stats"]["kind"] == "preference"

        adapter = download_adapter(base, dpo_id, tmp_path)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
        assert not (adapter / "ref").exists()
        check_loads_with_peft(models_dir / "ftune-demo", adapter, download_adapter(base, sft_id, tmp_path))
    except BaseException:
        print(up.tail())
        raise


def check_loads_with_peft(base_dir: Path, dpo_adapter: Path, sft_adapter: Path) -> None:
    """The DPO adapter loads with peft and differs from the SFT adapter it started from."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"]  # fmt: skip
    outs = []
    for adapter in (sft_adapter, dpo_adapter):
        net = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter
        )
        assert list(net.peft_config) == ["default"]
        with torch.no_grad():
            outs.append(net(input_ids=ids).logits)
    assert (outs[0] - outs[1]).abs().max().item() > 1e-4
    time.sleep(0)
