"""Small mixture-of-experts models built locally (random weights), so MoE bases train and are tested offline.

The demo model's tokenizer and chat template (training.demo) on transformers' own Qwen3MoeForCausalLM or
MixtralForCausalLM, random weights from a fixed seed, saved as transformers saves them (per-expert weights,
the Hub's layout, which transformers 5 fuses into expert stacks when it loads them). Built into a temp
dir next to the target and renamed into place, as the demo model is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from training.demo import BOS, EOS, IM_END, PAD, save_built

Family = Literal["qwen3_moe", "mixtral"]
FAMILIES: tuple[Family, ...] = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoeSize:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    expert_intermediate: int = 32
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 512


TINY_MOE = MoeSize()


def build_moe_model(
    models_dir: Path,
    name: str = "ftune-demo-moe",
    family: Family = "qwen3_moe",
    size: MoeSize = TINY_MOE,
    *,
    aux_loss_coef: float | None = None,
    force: bool = False,
    seed: int = 1234,
) -> Path:
    """Build (or return the already built) MoE model at models_dir/name. `aux_loss_coef`: the config asks
    for the router's load-balancing loss with that weight (output_router_logits); None: it does not, as
    the released checkpoints' configs do not."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    return save_built(
        Path(models_dir) / name,
        size.vocab_size,
        lambda tokenizer: _build(family, size, tokenizer, seed, aux_loss_coef),
        force,
    )


def moe_config(family: Family, size: MoeSize, ids: dict[str, int], aux_loss_coef: float | None) -> Any:
    """transformers' config of `family` at `size` (router and experts as the released models have them)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_position_embeddings,
        num_experts_per_tok=size.top_k,
        output_router_logits=aux_loss_coef is not None,
        router_aux_loss_coef=aux_loss_coef if aux_loss_coef is not None else 0.001,
        tie_word_embeddings=False,
        dtype="float32",
        **ids,
    )
    if family == "qwen3_moe":
        qwen: dict[str, Any] = {
            "head_dim": size.hidden_size // size.num_heads,  # read by the attention, as config.json has it
            "intermediate_size": 4 * size.expert_intermediate,  # a dense layer's: none (mlp_only_layers [])
            "moe_intermediate_size": size.expert_intermediate,
            "num_experts": size.num_experts,
            "norm_topk_prob": True,  # as Qwen3-30B-A3B's config.json
        }
        return Qwen3MoeConfig(**common, **qwen)
    return MixtralConfig(
        **common, intermediate_size=size.expert_intermediate, num_local_experts=size.num_experts
    )


def _build(family: Family, size: MoeSize, tokenizer: Any, seed: int, aux_loss_coef: float | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    ids = tokenizer.convert_tokens_to_ids
    config = moe_config(
        family, size, {"bos_token_id": ids(BOS), "eos_token_id": ids(EOS), "pad_token_id": ids(PAD)},
        aux_loss_coef,
    )  # fmt: skip
    assert len(tokenizer) <= size.vocab_size, "tokenizer larger than the embedding table"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids(BOS), eos_token_id=[ids(EOS), ids(IM_END)], pad_token_id=ids(PAD)
    )
    return model
