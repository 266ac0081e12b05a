"""Peak memory of the training steps, comparable with the planner's estimate.

CUDA: `torch.cuda.max_memory_allocated()` (bytes held by tensors through the caching allocator; the
plan's allocated_bytes) and `torch.cuda.max_memory_reserved()` (the allocator's segments: those bytes plus
its cached free blocks, what the device must have; the plan's reserved_bytes).

CPU: there is no allocator statistic, so a step is measured with torch's profiler in memory mode,
which reports every allocation and free made through the c10 CPU allocator, i.e. every tensor
storage, including temporaries inside kernels and autograd's buffers. The peak of a measured step is

    bytes live when the step starts: parameters + buffers (incl. 4-bit quantisation states)
                                     + gradients + optimizer states (deduplicated by storage)
  + the highest running sum of allocations minus frees during the step: activations, temporaries,
    gradients, optimizer states created on the first step, logits and loss.

Not counted: memory outside torch's allocator (Python objects, numpy, the CUDA/MKL runtimes, the
file cache) and allocator fragmentation, which a process's RSS would include. A CPU has no reserved
peak (None): its allocator caches nothing the planner counts. Profiling costs a
little per op, so only the first MEASURED_STEPS steps of a process are measured; later steps report
the highest value seen (the peak is reached by step 2, once the optimizer states exist).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from core.spec import JobSpec
from planner import FTUNE, BatchShape, Runtime
from training import batches

MEASURED_STEPS = 3
log = logging.getLogger("ftune.training")


class PeakMemory:
    def __init__(self, device: torch.device, measured_steps: int = MEASURED_STEPS) -> None:
        self.device = device
        self.measured_steps = measured_steps
        self.steps_measured = 0
        self.peak_bytes = 0
        self.reserved_bytes: int | None = None  # CUDA only: max_memory_reserved

    @contextmanager
    def step(self, live_tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """Measure one optimizer step (if still measuring); `live_tensors` are the ones that
        exist before the step starts and stay (weights, grads, optimizer states)."""
        if self.device.type == "cuda":
            yield
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
            reserved = torch.cuda.max_memory_reserved(self.device)
            self.reserved_bytes = max(self.reserved_bytes or 0, reserved)
            return
        if self.steps_measured >= self.measured_steps:
            yield
            return
        base = storage_bytes(live_tensors)
        with _profile_allocations() as deltas:
            yield
        peak = running_peak(deltas)
        self.steps_measured += 1
        self.peak_bytes = max(self.peak_bytes, base + peak)


def reset_cuda_peaks(device: torch.device) -> None:
    """CUDA's peak statistics from now on, also in a process that ran something before. Before CUDA's
    first use in the process there is nothing to reset, and torch raises 'Invalid device argument' (every
    job failed so on an H200, torch 2.11, 2026-11-27): no reset then."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors (views and shared weights count once)."""
    seen: dict[int, int] = {}
    from torch.distributed.tensor import DTensor

    for t in tensors:
        if isinstance(t, DTensor):  # FSDP: this rank holds its shard only
            t = t.to_local()
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def running_peak(deltas: Iterable[int]) -> int:
    total = peak = 0
    for d in deltas:
        total += d
        peak = max(peak, total)
    return peak


def model_state_tensors(model, optimizer) -> Iterator[torch.Tensor]:
    """Everything that lives across steps: parameters, buffers, grads, quant states, optimizer states."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            yield from _tensors_in(vars(qs))
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from _tensors_in(state)


def _tensors_in(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    if depth > 3:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("bitsandbytes"):
        yield from _tensors_in(vars(obj), depth + 1)


@contextmanager
def _profile_allocations() -> Iterator[list[int]]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    deltas: list[int] = []
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with warnings.catch_warnings():
        # Frees of blocks allocated before profiling are skipped (they are in `base`); torch says so.
        warnings.filterwarnings("ignore", message=".*allocated before the profiling started.*")
        with _quiet_stderr():
            prof.start()
        try:
            yield deltas
        finally:
            with _quiet_stderr():
                prof.stop()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None  # stopped above
    events = [
        n
        for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"
    ]
    events.sort(key=lambda n: n.start_time_ns)
    deltas.extend(n.extra_fields.alloc_size for n in events)


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints start/stop banners straight to fd 2; keep them out of the training log."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def batch_shape(spec: JobSpec, items: Sequence[Any], val_items: Sequence[Any] = ()) -> BatchShape | None:
    """The largest micro-batch this run forms from its training examples (or preference pairs, or grpo's
    prompts, each with its completions at max_completion_tokens: they are sampled during the step). A
    grpo sequence is bounded by the longest prompt of either split (evaluation samples too) plus
    max_completion_tokens: the rollouts' cache is counted at that width."""
    if not items:
        return None
    lengths = [x.length for x in items]
    if spec.rl.enabled:
        n, completion = spec.num_generations, spec.max_completion_tokens
        widths = [length + completion for length in lengths]
        tokens, _, scored = batches.largest_micro_batch(
            spec, lengths, widths, [n * completion] * len(items), sampled=[n * w for w in widths]
        )
        widest = max(x.length for x in [*items, *val_items]) + completion
        return BatchShape(tokens=tokens, seq_len=widest, targets=scored)
    widths = [max(x.chosen.length, x.rejected.length) if hasattr(x, "chosen") else x.length for x in items]
    targets = [x.num_targets for x in items]
    tokens, widest, scored = batches.largest_micro_batch(spec, lengths, widths, targets)
    return BatchShape(tokens=tokens, seq_len=widest, targets=scored)


def engine_runtime() -> Runtime:
    """The planner's Runtime for this engine on the torch it runs on: FTUNE, with whether torch's varlen
    attention takes grouped k and v (training.packing repeats them for one that does not)."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
    except ImportError:  # no varlen: packed rows take one SDPA call per example, grouped k and v as they are
        gqa = True
    return replace(FTUNE, varlen_gqa=gqa)


@dataclass(frozen=True)
class Predicted:
    """The plan's prediction for this run, stored next to what the tracker measures."""

    allocated: int | None = None  # max_memory_allocated on CUDA, live tensor bytes on a CPU
    reserved: int | None = None  # max_memory_reserved on CUDA (the plan's total less its context)


def predicted_peaks(
    spec: JobSpec, model_dir: Path, device: torch.device, shape: BatchShape | None = None
) -> Predicted:
    """The planner's allocated and reserved bytes for this spec on the device this run uses, for the run's
    largest micro-batch: what the tracker measures, stored next to it."""
    from core.arch import load_architecture
    from planner.feasibility import device_gpu, plan_on

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev = {"kind": "cuda", "name": props.name, "memory_bytes": props.total_memory}
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        dev = {"kind": "cpu", "name": "cpu", "memory_bytes": ram}
    try:
        plan = plan_on(
            spec, load_architecture(model_dir), device_gpu(dev), shape=shape, runtime=engine_runtime()
        )
    except Exception:  # a model the planner does not know must not stop training
        log.warning("no memory prediction for this run", exc_info=True)
        return Predicted()
    return Predicted(plan.allocated_bytes, plan.reserved_bytes if device.type == "cuda" else None)
