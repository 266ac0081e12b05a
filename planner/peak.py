"""The phases of a step added up into one Plan (see the package docstring for the model of the peak)."""

from __future__ import annotations

from core.arch import Architecture
from core.spec import JobSpec
from planner.allocator import loss_segments_bytes, overhead_terms, workspace_terms
from planner.context import plan_context
from planner.forward_backward import forward_backward_terms, reference_terms
from planner.gpus import Gpu
from planner.rollouts import rollout_terms
from planner.sharding import ranks_spec
from planner.speed import epoch_seconds
from planner.state import persistent_terms
from planner.step import step_terms
from planner.types import BatchShape, Plan, Runtime, idle


def peak_plan(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens_per_epoch: int | None,
    runtime: Runtime,
    shape: BatchShape | None = None,
) -> Plan:
    spec = ranks_spec(spec)  # per node: today's plan at world size num_nodes x num_gpus
    c = plan_context(spec, arch, gpu, runtime, shape)
    persistent = persistent_terms(c) + workspace_terms(c, gpu.name)
    # The phases of a step, one at a time; the largest makes the peak, the others are listed at 0.
    reference = spec.preference.uses_reference  # dpo's (grpo's with beta > 0) forward, before the policy's
    phases = {
        "rollouts": rollout_terms(c) if spec.rl.enabled else [],  # grpo samples before it trains
        "reference forward": reference_terms(c) if reference else [],
        "forward/backward": forward_backward_terms(c),
        "step": step_terms(c),
    }
    totals = {name: sum(t.bytes for t in terms) for name, terms in phases.items()}
    peak = max(totals, key=lambda name: totals[name])
    for name in phases:
        if name != peak:
            phases[name] = idle(phases[name], f"the {name} phase is smaller than the {peak} phase")
    held = sum(t.bytes for t in persistent)
    used = held + totals[peak]
    overhead = overhead_terms(c, used, held)
    breakdown = persistent + [t for terms in phases.values() for t in terms] + overhead
    total = sum(t.bytes for t in breakdown)
    context = sum(t.bytes for t in overhead if t.name == "CUDA context")
    usable = gpu.usable_bytes
    seconds, speed_note = epoch_seconds(spec, arch, gpu, c.trainable, tokens_per_epoch)
    return Plan(
        gpu=gpu.name,
        num_gpus=spec.num_gpus,
        method=spec.method,
        total_params=arch.total_params,
        active_params=arch.active_params,
        trainable_params=c.trainable,
        breakdown=breakdown,
        allocated_bytes=used,
        reserved_bytes=total - context,
        total_bytes=total,
        loss_segments_bytes=loss_segments_bytes(c, gpu.memory_bytes, total),
        usable_bytes=usable,
        fits=total <= usable,
        headroom_bytes=usable - total,
        batch_shape=shape,
        planned_tokens=c.tokens,
        est_seconds_per_epoch=seconds,
        speed_note=speed_note,
    )
