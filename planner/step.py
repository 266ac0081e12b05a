"""Optimizer-step transients: paged optimizer states (paged in), the step's temporaries, grad-norm buffers."""

from __future__ import annotations

from planner.context import Context
from planner.gpus import MiB
from planner.state import optimizer_states
from planner.types import Term


def step_terms(c: Context) -> list[Term]:
    spec, n, shard = c.spec, c.spec.num_gpus, c.shard
    step: list[Term] = []
    if spec.optimizer == "paged_adamw_8bit":
        opt_bytes, opt_note = optimizer_states(c)
        step.append(
            Term(
                name="optimizer states (paged)",
                bytes=opt_bytes // n,
                note=(
                    f"{opt_note}; in CUDA unified memory: evicted to CPU under pressure during "
                    "forward/backward, "
                    f"paged back for the optimizer step, so counted in the step phase only{shard}"
                ),
            )
        )
    if c.half_model:
        grad_b = c.trainable_b
        step.append(
            Term(
                name="fp32 gradient copy for the step",
                bytes=c.trainable * (grad_b + 4) // n,
                note=(
                    "the engine flattens the half-precision gradient partition and casts it to fp32 for "
                    f"its fused Adam (no further temporaries): {grad_b} + 4 B/param{shard}"
                ),
            )
        )
    elif spec.optimizer == "adamw":
        largest = max((spec.lora_r * max(m.in_features, m.out_features) for m, _ in c.lora), default=0)
        step.append(
            Term(
                name="optimizer step temporaries",
                bytes=(largest if c.cpu and not c.full else c.trainable) * c.state_b // n,
                note=(
                    "torch AdamW on a CPU runs tensor by tensor: sqrt(v) of the largest one"
                    if c.cpu
                    else "torch foreach AdamW allocates sqrt(v) for all params at once (a state-sized buffer)"
                ),
            )
        )
    arch = c.arch
    n_tensors = (
        (arch.num_layers * (len(arch.block_linears) * 2 + 4) + 4) if c.full else 2 * sum(k for _, k in c.lora)
    )
    step.append(
        Term(
            name="gradient-norm buffers",
            bytes=n_tensors * 4 + (0 if c.cpu else 4 * MiB),
            note="clip_grad_norm_: one fp32 norm per trainable tensor"
            + ("" if c.cpu else " + a 4 MiB CUDA reduction workspace"),
        )
    )
    return step
