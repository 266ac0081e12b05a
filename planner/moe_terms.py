"""The mixture-of-experts terms of a plan's forward/backward phase (formulas: planner.moe)."""

from __future__ import annotations

from planner.context import Context
from planner.moe import stack_copy_bytes
from planner.types import Term


def moe_terms(c: Context) -> list[Term]:
    """Forward/backward terms of a MoE model alive through the step: the LoRA'd stacks every layer keeps
    (without checkpointing; with it, the recomputed layer holds one layer's: recomputed_stack_bytes) and
    the load-balancing loss's router tensors."""
    x, arch, tokens = c.arch.experts, c.arch, c.tokens
    if x is None:
        return []
    terms = []
    stacks = stack_copy_bytes(arch, c.lora, c.store_b)
    if stacks and not c.spec.gradient_checkpointing:
        terms.append(
            Term(
                name="LoRA'd expert stacks",
                bytes=arch.num_layers * stacks,
                note=(
                    f"every layer's wrapped expert stacks with their update folded in ({c.store}), made by "
                    "peft's forward and kept by the grouped matmul for backward"
                ),
            )
        )
    if x.aux_loss_coef and c.spec.objective == "sft":
        per_token = arch.num_layers * x.num_experts * (c.act_b + 4)
        terms.append(
            Term(
                name="router logits for the load-balancing loss",
                bytes=tokens * per_token,
                note=(
                    f"{arch.num_layers} layers x {x.num_experts} experts x {tokens} tokens: the logits "
                    f"({c.act_b} B) kept until the loss and their fp32 softmax kept for its backward "
                    f"(router_aux_loss_coef {x.router_aux_loss_coef:g})"
                ),
            )
        )
    return terms


def recomputed_stack_bytes(c: Context) -> int:
    """A checkpointed layer's LoRA'd stacks, made again in its recomputation and kept until its backward."""
    if not c.spec.gradient_checkpointing:
        return 0
    return stack_copy_bytes(c.arch, c.lora, c.store_b)
