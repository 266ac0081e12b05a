"""Mixture-of-experts architectures (core.arch.moe_families) against transformers' own models and peft.

Counts are checked against Qwen3MoeForCausalLM and MixtralForCausalLM built from tiny configs, and against
the published sizes of the released checkpoints, whose config.json files are copied in tests/configs
(Qwen/Qwen3-30B-A3B: "30.5B parameters in total, 3.3B activated"; mistralai/Mixtral-8x7B-v0.1: 46.7B in
total, 12.9B active per token)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from core.arch import from_config, load_architecture
from core.arch.lora import expert_lora, peft_targets
from core.errors import InvalidInput, Unsupported

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CONFIGS = Path(__file__).parents[1] / "configs"
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {**SMALL, "head_dim": 24, "moe_intermediate_size": 24, "num_experts": 6,
                                     "num_experts_per_tok": 2}),
    "qwen3_moe_bias_tied": ("Qwen3MoeConfig", {**SMALL, "moe_intermediate_size": 20, "num_experts": 4,
                                               "num_experts_per_tok": 3, "attention_bias": True,
                                               "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {**SMALL, "intermediate_size": 40, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
}  # fmt: skip


def _build(case: str):
    cls, kwargs = CASES[case]
    config = getattr(transformers, cls)(**kwargs, **IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return config, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_total_and_active_params_match_real_models(case: str) -> None:
    config, model = _build(case)
    for as_json in (config.to_dict(), config.to_diff_dict()):  # full dict, and only non-default keys
        arch = from_config(json.loads(json.dumps(as_json)))
        assert arch.total_params == sum(p.numel() for p in model.parameters()), case
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        per_expert = sum(p[0].numel() for e in experts[:1] for p in e.parameters())  # one expert's slice
        inactive = len(experts) * (config.num_experts - config.num_experts_per_tok) * per_expert
        assert arch.active_params == arch.total_params - inactive
        assert arch.experts is not None and arch.experts.num_experts == config.num_experts
        assert arch.intermediate_size == config.num_experts_per_tok * arch.experts.expert_intermediate


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "targets",
    [
        "all-linear",
        ["q_proj", "v_proj"],
        ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
        ["o_proj", "down_proj"],  # down_proj: the expert stack (the block has no dense MLP)
        ["layers.1.mlp.experts.gate_up_proj", "lm_head"],
    ],
)
def test_lora_counts_match_what_peft_wraps(case: str, targets) -> None:
    config, model = _build(case)
    arch = from_config(config.to_dict())
    modules, parameters = peft_targets(arch, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # peft's unmatched rank_pattern warning: none
        lora = peft.get_peft_model(
            model,
            peft.LoraConfig(r=4, target_modules=modules, target_parameters=parameters or None,
                            lora_dropout=0.0),
        )  # fmt: skip
    trainable = {n: p.numel() for n, p in lora.named_parameters() if p.requires_grad}
    assert arch.lora_params(targets, 4) == sum(trainable.values())
    assert not any(".mlp.gate." in n for n in trainable)  # never the router
    wrapped = expert_lora(arch, tuple(arch.lora_targets(targets)))
    assert bool(wrapped) == any(".mlp.experts." in n for n in trainable)


def test_all_linear_is_the_attention_not_the_experts_or_the_router() -> None:
    """peft's own "all-linear" on a transformers 5 MoE model also wraps the experts and the router (its
    v4-name conversion); ftune's default hands peft the attention's linears alone."""
    config, _ = _build("qwen3_moe")
    arch = from_config(config.to_dict())
    modules, parameters = peft_targets(arch, "all-linear")
    assert modules == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert parameters == []
    assert peft_targets(arch, ["experts"]).parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_router_dense_layers_and_bad_configs_are_refused() -> None:
    config, _ = _build("mixtral")
    arch = from_config(config.to_dict())
    for router in (["gate"], ["mlp.gate", "q_proj"]):
        with pytest.raises(InvalidInput, match="router"):
            arch.lora_targets(router)
    with pytest.raises(InvalidInput):
        arch.lora_params(["input_layernorm"], 8)
    qwen = {"model_type": "qwen3_moe", **SMALL, "num_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(Unsupported):
        from_config({**qwen, "mlp_only_layers": [1]})
    with pytest.raises(Unsupported):
        from_config({**qwen, "decoder_sparse_step": 2})
    with pytest.raises(InvalidInput):
        from_config({**qwen, "num_experts_per_tok": 5})


def test_published_sizes_of_the_released_checkpoints() -> None:
    qwen = load_architecture_json(CONFIGS / "Qwen3-30B-A3B.json")
    assert (qwen.total_params, qwen.active_params) == (30_532_122_624, 3_353_032_704)
    assert qwen.experts is not None and (qwen.experts.num_experts, qwen.experts.top_k) == (128, 8)
    assert qwen.config_dtype == "bfloat16" and qwen.experts.aux_loss_coef == 0.0  # output_router_logits off
    mixtral = load_architecture_json(CONFIGS / "Mixtral-8x7B-v0.1.json")
    assert (mixtral.total_params, mixtral.active_params) == (46_702_792_704, 12_879_925_248)
    # FLOPs count the weights a token multiplies with: its top_k experts, the router, attention, lm_head
    assert mixtral.matmul_params < mixtral.active_params < mixtral.total_params


def test_load_architecture_reads_a_moe_config_json(tmp_path: Path) -> None:
    config, model = _build("qwen3_moe")
    config.save_pretrained(tmp_path)
    assert load_architecture(tmp_path).total_params == sum(p.numel() for p in model.parameters())


def load_architecture_json(path: Path):
    return from_config(json.loads(path.read_text()))
