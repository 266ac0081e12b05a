"""Memory-feasibility planner: estimate(spec, arch, gpu) -> Plan (per-GPU breakdown, verdict, suggestions).

Model of the peak (per GPU), each piece a named Term with its assumption in `note`:
  persistent   base weights (+ NF4 constants), LoRA adapters, gradients, optimizer states, master weights
  fwd/bwd      activations saved for backward, autocast copies, FSDP all-gathered units, and the larger of
                 loss      logits + loss buffers at backward start (+ a cast lm_head copy)
                 layer     one block's backward: recomputed layer (checkpointing), gradients in flight,
                           QLoRA's dequantized weight
  step         paged optimizer states (paged in), AdamW temporaries, grad-norm buffers
  peak = persistent + max(fwd/bwd, step) + CUDA context + fragmentation margin
allocated_bytes (the peak without the last two) is what a run measures: max_memory_allocated on CUDA,
live tensor bytes on a CPU (tests/training/test_planner_vs_measured.py holds it within 15% there).
A phase that is not the peak is listed with 0 bytes and its size in the note, so terms sum to total.
What a training framework keeps beyond the JobSpec (ftune's engine by default) is a Runtime.
Cached blocks the allocator keeps reserved but would free (and retry) before an OOM are reported beside
the total, not in it, for comparing with nvidia-smi or max_memory_reserved: loss_segments_bytes (the
half-precision logits' segments an fp32 loss's gradients cannot reuse) and varlen_cache_bytes (an earlier,
shorter batch's loss buffers on data of varying lengths).

This module adds the phases up; each has a module of its own:
  planner_types             Term, Plan, Suggestion, Runtime: what goes in and comes out
  planner_context           the dtypes, trainable parameters and tokens every section counts with
  planner_state             persistent: base weights and trainable state
  planner_forward_backward  fwd/bwd transients
  planner_step              optimizer-step transients
  planner_allocator         CUDA context, fragmentation margin, cached blocks beside the total
  planner_speed             time per epoch
  suggest                   changes that fit, for a job that does not
"""

from __future__ import annotations

from core.arch import Architecture
from core.gpus import Gpu
from core.planner_allocator import cached_bytes, overhead_terms
from core.planner_context import compute_dtype, plan_context, storage_dtype
from core.planner_forward_backward import forward_backward_terms
from core.planner_speed import epoch_seconds
from core.planner_state import persistent_terms
from core.planner_step import step_terms
from core.planner_types import FTUNE, Plan, Runtime, Suggestion, Term, idle
from core.spec import JobSpec

__all__ = ["FTUNE", "Plan", "Runtime", "Suggestion", "Term", "compute_dtype", "estimate", "storage_dtype"]


def estimate(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens_per_epoch: int | None = None,
    *,
    suggest: bool = True,
    runtime: Runtime = FTUNE,
) -> Plan:
    plan = _estimate(spec, arch, gpu, tokens_per_epoch, runtime)
    if suggest and not plan.fits:
        from core.suggest import suggestions  # it plans its alternatives with estimate

        plan = plan.model_copy(update={"suggestions": suggestions(spec, arch, gpu, runtime)})
    return plan


def _estimate(
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
