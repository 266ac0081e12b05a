"""POST /plan and GET /models for mixture-of-experts bases from their released config.json alone (no
weights): Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 (tests/configs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings

CONFIGS = Path(__file__).parents[1] / "configs"
BASES = {
    "Qwen/Qwen3-30B-A3B": ("Qwen3-30B-A3B.json", "Qwen3-MoE", 30_532_122_624, 3_353_032_704),
    "mistralai/Mixtral-8x7B-v0.1": ("Mixtral-8x7B-v0.1.json", "Mixtral", 46_702_792_704, 12_879_925_248),
}


@pytest.fixture
def moe_bases(settings: Settings) -> list[str]:
    for name, (config, *_) in BASES.items():
        (settings.models_dir / name).mkdir(parents=True)
        shutil.copy(CONFIGS / config, settings.models_dir / name / "config.json")
    return list(BASES)


@pytest.mark.parametrize("name", list(BASES))
def test_plan_itemises_a_moe_base_with_active_and_total_params(
    client: TestClient, dataset_id: str, moe_bases: list[str], name: str
) -> None:
    _, _, total, active = BASES[name]
    r = client.post("/plan", json={"base_model": name, "dataset_id": dataset_id, "gpu": "H200"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert (plan["total_params"], plan["active_params"]) == (total, active)
    assert sum(t["bytes"] for t in plan["breakdown"]) == plan["total_bytes"]
    base = next(t for t in plan["breakdown"] if t["name"] == "base weights")
    assert base["bytes"] == total * 2 and "experts" in base["note"] and "active" in base["note"]
    qlora = client.post(
        "/plan", json={"base_model": name, "dataset_id": dataset_id, "gpu": "H200", "method": "qlora"}
    ).json()
    names = {t["name"] for t in qlora["breakdown"]}
    assert {"base weights (NF4)", "expert weights (not quantized)"} <= names


def test_a_24gb_gpu_refuses_a_bf16_lora_of_qwen3_30b_a3b_with_suggestions_that_fit(
    client: TestClient, dataset_id: str, moe_bases: list[str]
) -> None:
    job = {"base_model": "Qwen/Qwen3-30B-A3B", "dataset_id": dataset_id, "method": "lora"}
    r = client.post("/plan", json={**job, "gpu": "24GB"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert not plan["fits"] and plan["suggestions"]
    for s in plan["suggestions"]:
        assert s["fits"] and s["plan_total_bytes"] <= plan["usable_bytes"], s
        again = client.post("/plan", json={**job, **s["change"], "gpu": "24GB"}).json()
        assert again["fits"] and again["total_bytes"] == s["plan_total_bytes"], s["description"]


def test_expert_lora_with_dropout_is_a_422_naming_lora_dropout(
    client: TestClient, dataset_id: str, moe_bases: list[str]
) -> None:
    job = {"base_model": "mistralai/Mixtral-8x7B-v0.1", "dataset_id": dataset_id, "gpu": "H200"}
    targets = ["q_proj", "v_proj", "experts"]
    r = client.post("/plan", json={**job, "lora_target_modules": targets})
    assert r.status_code == 422 and r.json()["error"]["param"] == "lora_dropout"
    r = client.post("/plan", json={**job, "lora_target_modules": targets, "lora_dropout": 0})
    assert r.status_code == 200 and r.json()["trainable_params"] > 0
    r = client.post("/plan", json={**job, "lora_target_modules": ["gate"]})  # the router
    assert r.status_code == 422 and r.json()["error"]["param"] == "lora_target_modules"


def test_models_list_shows_family_sizes_and_modality(client: TestClient, moe_bases: list[str]) -> None:
    listed = {m["name"]: m for m in client.get("/models").json()}
    for name, (_, family, total, active) in BASES.items():
        m = listed[name]
        assert (m["family"], m["total_params"], m["active_params"], m["modality"]) == (
            family, total, active, "text"
        )  # fmt: skip
    tiny = listed["tiny"]  # a dense Llama: active = total
    assert tiny["family"] == "Llama" and tiny["active_params"] == tiny["total_params"]
