"""Persistent terms, held through every phase of a step: the frozen base weights and the trainable state
(LoRA adapters, gradients, master weights, optimizer states)."""

from __future__ import annotations

from planner.context import Context
from planner.memory import adam8bit_state_bytes, nf4_bytes
from planner.moe import expert_weight_bytes
from planner.types import Term


def persistent_terms(c: Context) -> list[Term]:
    return _base_weight_terms(c) + _trainable_state_terms(c)


def optimizer_states(c: Context) -> tuple[int, str]:
    """Bytes of the optimizer's states over all GPUs, and what they are."""
    if c.spec.optimizer == "adamw":
        return c.trainable * 2 * c.state_b, f"AdamW m and v in {'fp32' if c.state_b == 4 else c.store}"
    return (
        adam8bit_state_bytes(c.trainable),
        "bitsandbytes 8-bit AdamW: uint8 m and v + fp32 absmax per 256 values (~2.03 B/param)",
    )


def _base_weight_terms(c: Context) -> list[Term]:
    """The frozen base: NF4 block linears + the layers bitsandbytes leaves unquantized, or all in `store`."""
    spec, arch, store, shard = c.spec, c.arch, c.store, c.shard
    n, sb, total_params = spec.num_gpus, c.store_b, arch.total_params
    terms: list[Term] = []
    if spec.method == "qlora":
        q_bytes = arch.num_layers * sum(nf4_bytes(m.weight_numel) for m in arch.block_linears)
        q_params = arch.num_layers * sum(m.weight_numel for m in arch.block_linears)
        expert_params, expert_bytes = expert_weight_bytes(arch, sb)
        rest = total_params - q_params - expert_params
        terms.append(
            Term(
                name="base weights (NF4)",
                bytes=q_bytes // n,
                note=(
                    f"{q_params:,} block linear weights in 4-bit NF4: 0.5 B/param + uint8 absmax "
                    "per 64 values, fp32 scale per 256 absmaxes (double quant) = "
                    f"{q_bytes / q_params:.4f} B/param{shard}"
                ),
            )
        )
        up = c.fp32_upcast
        qb = 4 if up else sb
        how = "cast to fp32 by prepare_model_for_kbit_training" if up else f"in {store}"
        terms.append(
            Term(
                name="unquantized weights",
                bytes=rest * qb // n,
                note=(
                    f"{rest:,} params {how}: embeddings, lm_head, norms, biases (bitsandbytes quantizes "
                    f"only the decoder-block linears){shard}"
                ),
            )
        )
        if expert_params:
            terms.append(
                Term(
                    name="expert weights (not quantized)",
                    bytes=expert_bytes // n,
                    note=(
                        f"{expert_params:,} params of every layer's experts and router in {store}: "
                        "bitsandbytes' 4-bit loading replaces nn.Linear modules only, and transformers "
                        f"keeps the experts as stacked parameters{shard}"
                    ),
                )
            )
    else:
        terms.append(
            Term(
                name="base weights",
                bytes=total_params * sb // n,
                note=(f"{total_params:,} params in {store} ({sb} B/param){_experts_note(c)}{shard}"),
            )
        )
    return terms


def _experts_note(c: Context) -> str:
    x = c.arch.experts
    if x is None:
        return ""
    return (
        f", of which {expert_weight_bytes(c.arch, 1)[0]:,} in {x.num_experts} experts and a router per "
        f"layer, all resident ({c.arch.active_params:,} active per token: top {x.top_k} experts)"
    )


def _trainable_state_terms(c: Context) -> list[Term]:
    spec, trainable, shard = c.spec, c.trainable, c.shard
    n = spec.num_gpus
    terms: list[Term] = []
    if not c.full:
        terms.append(
            Term(
                name="LoRA adapters",
                bytes=trainable * c.trainable_b // n,
                note=(
                    f"{trainable:,} params (r={spec.lora_r}, {len(c.lora)} module kinds) in "
                    + (
                        f"{c.store} (the framework casts the whole model)"
                        if c.half_model
                        else "fp32 (peft keeps adapters in fp32)"
                    )
                    + shard
                ),
            )
        )
    terms.append(
        Term(
            name="gradients",
            bytes=trainable * c.trainable_b // n,
            note=(f"{trainable:,} x {c.trainable_b} B, kept whole through accumulation{shard}"),
        )
    )
    if c.full or c.master_b:
        terms.append(
            Term(
                name="master weights",
                bytes=trainable * c.master_b // n,
                note=(
                    f"fp32 copies, 4 B/param{shard}"
                    if c.master_b
                    else "none: "
                    + (
                        "weights are already fp32"
                        if c.store_b == 4
                        else "master_weights is off (pure low-precision)"
                    )
                ),
            )
        )
    if spec.optimizer != "paged_adamw_8bit":  # paged states count in the step phase (planner_step)
        opt_bytes, opt_note = optimizer_states(c)
        terms.append(Term(name="optimizer states", bytes=opt_bytes // n, note=f"{opt_note}{shard}"))
    return terms
