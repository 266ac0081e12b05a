"""The planner on mixture-of-experts bases, from their released config.json files alone (tests/configs):
every expert resident, active parameters for FLOPs, bitsandbytes leaving the experts unquantized, the
expert stacks' LoRA, the router's load-balancing loss; and the 24 GB verdict on Qwen3-30B-A3B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.arch import Architecture, from_config
from core.errors import InvalidInput
from core.spec import JobSpec
from planner import estimate
from planner.gpus import resolve_gpu
from planner.moe import stack_copy_bytes
from tests.planner.planner_util import spec, term

CONFIGS = Path(__file__).parents[1] / "configs"


def arch(name: str, **override: object) -> Architecture:
    return from_config({**json.loads((CONFIGS / f"{name}.json").read_text()), **override})


QWEN = "Qwen3-30B-A3B"
MIXTRAL = "Mixtral-8x7B-v0.1"


def test_a_24gb_gpu_refuses_a_bf16_lora_of_qwen3_30b_a3b_and_each_suggestion_fits() -> None:
    job = spec(method="lora")
    plan = estimate(job, arch(QWEN), resolve_gpu("24GB"))
    assert not plan.fits
    assert (plan.total_params, plan.active_params) == (30_532_122_624, 3_353_032_704)
    assert term(plan, "base weights") == 30_532_122_624 * 2  # bf16, every expert resident
    assert plan.suggestions
    for s in plan.suggestions:
        again = estimate(job.model_copy(update=s.change), arch(QWEN), resolve_gpu("24GB"), suggest=False)
        assert s.fits and again.fits and again.total_bytes == s.plan_total_bytes, s.description
    # QLoRA alone cannot fit: bitsandbytes quantizes the attention's linears, not the expert stacks
    assert not any(s.change == {"method": "qlora"} for s in plan.suggestions)
    qlora = estimate(spec(method="qlora"), arch(QWEN), resolve_gpu("24GB"), suggest=False)
    experts = term(qlora, "expert weights (not quantized)")
    assert experts == 48 * (128 * 3 * 2048 * 768 + 128 * 2048) * 2
    assert term(qlora, "base weights (NF4)") < experts // 50


def test_flops_count_the_active_parameters() -> None:
    """Time per epoch scales with what a token multiplies with (top_k experts), not with every expert."""
    gpu = resolve_gpu("H100")
    moe = estimate(spec(method="lora"), arch(MIXTRAL), gpu, tokens_per_epoch=10**6, suggest=False)
    dense_like = arch(MIXTRAL, num_experts_per_tok=8)  # every expert on every token
    dense = estimate(spec(method="lora"), dense_like, gpu, tokens_per_epoch=10**6, suggest=False)
    assert moe.est_seconds_per_epoch and dense.est_seconds_per_epoch
    assert 2.5 < dense.est_seconds_per_epoch / moe.est_seconds_per_epoch < 4.0
    assert moe.total_params == dense.total_params and moe.active_params < dense.active_params


def test_expert_lora_keeps_each_layers_folded_stacks_and_needs_no_dropout() -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
    with pytest.raises(InvalidInput) as refused:
        estimate(spec(lora_target_modules=targets), arch(MIXTRAL), resolve_gpu("H200"))
    assert refused.value.param == "lora_dropout"
    a = arch(MIXTRAL)
    job = spec(lora_target_modules=targets, lora_dropout=0.0, gradient_checkpointing=False)
    plan = estimate(job, a, resolve_gpu("H200"), suggest=False)
    stacks = stack_copy_bytes(a, tuple(a.lora_targets(targets)), 2)
    assert stacks == 8 * 3 * 4096 * 14336 * 2  # one layer's gate_up and down stacks, bf16
    assert term(plan, "LoRA'd expert stacks") == 32 * stacks
    assert plan.trainable_params == a.lora_params(targets, 16)
    ckpt = estimate(job.model_copy(update={"gradient_checkpointing": True}), a, resolve_gpu("H200"))
    assert "LoRA'd expert stacks" not in {t.name for t in ckpt.breakdown}  # one layer's, recomputed


def test_the_load_balancing_loss_is_planned_when_the_config_asks_for_it() -> None:
    on = arch(QWEN, output_router_logits=True)
    job: JobSpec = spec(method="qlora", gradient_checkpointing=True, max_seq_len=1024)
    plan = estimate(job, on, resolve_gpu("H200"), suggest=False)
    tokens = job.micro_batch_size * 1024
    assert term(plan, "router logits for the load-balancing loss") == tokens * 48 * 128 * (2 + 4)
    off = estimate(job, arch(QWEN), resolve_gpu("H200"), suggest=False)
    assert "router logits for the load-balancing loss" not in {t.name for t in off.breakdown}
