"""The phases of a step added up into one Plan (see the package docstring for the model of the peak)."""

from __future__ import annotations

from core.arch import Architecture
from core.planner.allocator import cached_bytes, overhead_terms
from core.planner.context import plan_context
from core.planner.forward_backward import forward_backward_terms
from core.planner.gpus import Gpu
from core.planner.speed import epoch_seconds
from core.planner.state import persistent_terms
from core.planner.step import step_terms
from core.planner.types import Plan, Runtime, idle
from core.spec import JobSpec


def peak_plan(
    spec: JobSpec, arch: Architecture, gpu: Gpu, tokens_per_epoch: int | None, runtime: Runtime
) -> Plan:
    c = plan_context(spec, arch, gpu, runtime)
    persistent = persistent_terms(c)
    fwd = forward_backward_terms(c)
    step = step_terms(c)
    fwd_total, step_total = sum(t.bytes for t in fwd), sum(t.bytes for t in step)
    if fwd_total >= step_total:
        step = idle(step, "the step phase is smaller")
    else:
        fwd = idle(fwd, "the forward/backward phase is smaller")
    used = sum(t.bytes for t in persistent) + max(fwd_total, step_total)
    breakdown = persistent + fwd + step + overhead_terms(c, used)
    total = sum(t.bytes for t in breakdown)
    loss_segments, varlen_cache = cached_bytes(c, gpu, total)
    usable = gpu.usable_bytes
    seconds, speed_note = epoch_seconds(spec, arch, gpu, c.trainable, tokens_per_epoch)
    return Plan(
        gpu=gpu.name,
        num_gpus=spec.num_gpus,
        method=spec.method,
        total_params=arch.total_params,
        trainable_params=c.trainable,
        breakdown=breakdown,
        allocated_bytes=used,
        total_bytes=total,
        loss_segments_bytes=loss_segments,
        varlen_cache_bytes=varlen_cache,
        usable_bytes=usable,
        fits=total <= usable,
        headroom_bytes=usable - total,
        est_seconds_per_epoch=seconds,
        speed_note=speed_note,
    )
