"""A vision-language base through the whole service: a tiny Qwen2.5-VL (`ftune models build-demo --family
qwen2_5_vl`: training.demo_vlm, transformers' own Qwen2_5_VLForConditionalGeneration) in the running
`ftune up`'s models directory trains on
examples/vision_colors.jsonl (images as data: URLs) to an adapter that changes the model's output;
POST /plan reads the released Qwen2.5-VL-7B's config.json alone (no weights); bad images are line codes at
upload, and an image dataset on a text-only base is refused (422, the service's InvalidInput) with nothing
queued."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.stack import REPO, TEST_ADMIN_KEY, Up, api, build_demo, download_adapter, upload, wait_finished

pytestmark = pytest.mark.slow
BASE = "ftune-demo-vlm"
EXAMPLES = REPO / "examples" / "vision_colors.jsonl"
SPEC: dict[str, Any] = {
    "base_model": BASE, "method": "lora", "max_seq_len": 64, "micro_batch_size": 2, "max_steps": 10,
    "learning_rate": 2e-2, "lora_dropout": 0.0, "warmup_steps": 1, "checkpoint_every_steps": 0,
    "packing": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def vlm_base(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM (built by the real CLI), and the 7B's config.json alone, in the running stack's models
    directory."""
    seven = models_dir / "Qwen2.5-VL-7B-Instruct"
    seven.mkdir(exist_ok=True)
    shutil.copy(REPO / "tests" / "configs" / "Qwen2.5-VL-7B-Instruct.json", seven / "config.json")
    build_demo("qwen2_5_vl", models_dir, tmp_path_factory.mktemp("vlm"))
    return models_dir / BASE


def test_a_tiny_vlm_job_trains_an_adapter_that_changes_the_output(
    up: Up, vlm_base: Path, tmp_path: Path
) -> None:
    listed = {m["name"]: m for m in api.get(f"{up.base}/models").json()}
    assert (listed[BASE]["family"], listed[BASE]["modality"]) == ("Qwen2.5-VL", "text+image")
    dataset = upload(up.base, EXAMPLES)
    assert dataset["report"]["stats"]["with_images"] == 12, dataset
    try:
        r = api.post(f"{up.base}/jobs", json={**SPEC, "dataset_id": dataset["id"]})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        final = wait_finished(up.base, [job_id], timeout=600)[job_id][-1]
        assert final["status"] == "succeeded", final
        losses = [s["loss"] for s in api.get(f"{up.base}/jobs/{job_id}/metrics").json()["data"]]
        assert losses[-1] < losses[0], losses
        _assert_adapter_changes_outputs(vlm_base, download_adapter(up.base, job_id, tmp_path))
        _assert_the_tuned_model_answers_an_image_through_v1(up, job_id)
    except BaseException:
        print(up.tail())
        raise


def _assert_adapter_changes_outputs(base_dir: Path, adapter_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from training import vision
    from training.data import collate

    row = json.loads(EXAMPLES.read_text().splitlines()[0])
    batch = collate([vision.tokenize_row(row, vision.load_processor(base_dir))], 0)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "position_ids")}
    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(**inputs).logits
        after = PeftModel.from_pretrained(base, adapter_dir)(**inputs).logits
    assert (after - before).abs().max() > 1e-2


def _assert_the_tuned_model_answers_an_image_through_v1(up: Up, job_id: str) -> None:
    """The `ft:` model answers a chat with an image part through the API's /v1 and ftune's engine (the
    official SDK), streamed the same; a text-only base refuses the image part by name. (That the adapter
    changes the model's output is checked on its logits: _assert_adapter_changes_outputs.)"""
    row = json.loads(EXAMPLES.read_text().splitlines()[0])
    ask = {"messages": row["messages"][:1], "max_tokens": 8, "temperature": 0}
    with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{up.base}/v1", max_retries=0, timeout=120) as sdk:
        model = sdk.fine_tuning.jobs.retrieve(job_id).fine_tuned_model
        assert model is not None
        tuned = sdk.chat.completions.create(model=model, **ask)
        answer = tuned.choices[0].message.content or ""
        assert tuned.usage is not None and tuned.usage.completion_tokens > 0 and answer
        stream = sdk.chat.completions.create(model=model, stream=True, **ask)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model="ftune-demo", **ask)
        assert e.value.body["code"] == "unsupported_content"  # type: ignore[index]


def test_plan_reads_the_7b_config_alone(up: Up, vlm_base: Path) -> None:
    dataset = upload(up.base, EXAMPLES)
    spec = {"base_model": "Qwen2.5-VL-7B-Instruct", "dataset_id": dataset["id"], "max_seq_len": 2048}
    r = api.post(f"{up.base}/plan", json={**spec, "gpu": "H100-80GB"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["total_params"] == 8_292_166_656
    names = [t["name"] for t in plan["breakdown"]]
    assert "base weights" in names and "vision tower forward" in names


def test_bad_images_and_a_text_only_base_queue_nothing(up: Up, vlm_base: Path, tmp_path: Path) -> None:
    good = json.loads(EXAMPLES.read_text().splitlines()[0])
    bad = tmp_path / "bad.jsonl"
    undecodable = json.loads(json.dumps(good))
    undecodable["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,aGVsbG8="
    private = json.loads(json.dumps(good))
    private["messages"][0]["content"][0]["image_url"]["url"] = "http://192.168.1.10/cat.png"
    bad.write_text("".join(json.dumps(r) + "\n" for r in (good, undecodable, private)))
    with bad.open("rb") as f:
        r = api.post(f"{up.base}/datasets", files={"file": (bad.name, f)})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_dataset", r.text
    problems = r.json()["error"]["details"]["report"]["problems"]
    assert [(p["line"], p["code"]) for p in problems] == [(2, "image_undecodable"), (3, "image_url_private")]

    before = len(api.get(f"{up.base}/jobs").json()["data"])
    dataset = upload(up.base, EXAMPLES)
    r = api.post(f"{up.base}/jobs", json={**SPEC, "base_model": "ftune-demo", "dataset_id": dataset["id"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "base_reads_no_images", r.text
    assert r.json()["error"]["param"] == "base_model"
    assert len(api.get(f"{up.base}/jobs").json()["data"]) == before
