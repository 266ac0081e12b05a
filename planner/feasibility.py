"""Admission against the fleet: plan a job for every kind of worker and pick where it fits best.

A worker reports its devices (see worker/devices.py). A job with num_gpus N can run on a worker with
at least N devices; it is planned against that worker's smallest device. On a CPU worker the "device"
is the machine's RAM and mixed precision "auto" means none, as the engine does on a CPU; it runs any
num_gpus as that many gloo processes, which share the RAM, so each is planned against RAM / N.
"""

from __future__ import annotations

import math
from typing import Any

from core.arch import Architecture
from core.errors import Infeasible, InvalidInput
from core.spec import JobSpec
from planner.estimate import estimate
from planner.gpus import Gpu, resolve_gpu
from planner.types import FTUNE, BatchShape, Plan, Runtime

# Rough characters per token of English BPE text, for an epoch-time estimate before tokenizing.
CHARS_PER_TOKEN = 4.0


def device_gpu(device: dict[str, Any]) -> Gpu:
    """The planner's Gpu for a device a worker reported."""
    if device.get("kind") == "cpu":
        return Gpu(
            name="cpu",
            memory_bytes=int(device["memory_bytes"]),
            bf16_flops=None,
            bf16_supported=False,
            kind="cpu",
        )
    try:
        return resolve_gpu(str(device["name"]))
    except InvalidInput:
        if device.get("memory_bytes"):
            return Gpu(name=str(device["name"]), memory_bytes=int(device["memory_bytes"]))
        raise


def for_device(spec: JobSpec, gpu: Gpu) -> JobSpec:
    if gpu.name == "cpu" and spec.mixed_precision == "auto":
        return spec.model_copy(update={"mixed_precision": "no"})
    return spec


def tokens_per_epoch(report: dict[str, Any], max_seq_len: int) -> int | None:
    """Estimated tokens in one epoch from the upload report's character statistics."""
    chars = (report.get("stats") or {}).get("chars_per_example") or {}
    if not report.get("num_examples") or not chars.get("mean"):
        return None
    per_example = min(max_seq_len, math.ceil(chars["mean"] / CHARS_PER_TOKEN))
    return int(report["num_examples"] * per_example)


def plan_on(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens: int | None = None,
    *,
    shape: BatchShape | None = None,
    runtime: Runtime = FTUNE,
) -> Plan:
    return estimate(for_device(spec, gpu), arch, gpu, tokens, shape=shape, runtime=runtime)


def plan_for_fleet(
    spec: JobSpec,
    arch: Architecture,
    fleet: list[list[dict[str, Any]]],
    tokens: int | None = None,
    *,
    shape: BatchShape | None = None,
) -> Plan:
    """The best plan over the fleet's workers (each a list of devices): the roomiest one that fits,
    else the one with the most usable memory (not fitting, with suggestions)."""
    eligible = [g for devices in fleet if (g := worker_device(devices, spec.num_gpus)) is not None]
    if not eligible:
        most = max((len(d) for d in fleet), default=0)
        raise Infeasible(
            f"the job needs {spec.num_gpus} devices on one worker; the largest worker has {most}",
            param="num_gpus",
        )
    if len(eligible) < spec.num_nodes:  # a multi-node job is gang-placed on that many workers at once
        raise Infeasible(
            f"the job needs {spec.num_nodes} workers with {spec.num_gpus} devices each; the fleet has "
            f"{len(eligible)}",
            param="num_nodes",
        )
    kinds = {(g.name, g.memory_bytes): g for g in eligible}  # one plan per kind (CPU workers: per RAM)
    plans = [plan_on(spec, arch, gpu, tokens, shape=shape) for gpu in kinds.values()]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return max(fitting, key=lambda p: p.headroom_bytes)
    return max(plans, key=lambda p: p.usable_bytes)


def worker_device(devices: list[dict[str, Any]], num_gpus: int) -> Gpu | None:
    """The device one rank of a num_gpus job is planned against on this worker; None: it cannot run there."""
    if len(devices) == 1 and devices[0].get("kind") == "cpu":
        ram = device_gpu(devices[0])
        return ram.model_copy(update={"memory_bytes": ram.memory_bytes // num_gpus})
    if not devices or len(devices) < num_gpus:
        return None
    return min((device_gpu(d) for d in devices), key=lambda g: g.memory_bytes)


def require_fits(plan: Plan, why: str = "") -> Plan:
    """The plan if it fits, else Infeasible with its breakdown; `why` is added to the message."""
    if plan.fits:
        return plan
    counted = (
        f"planned from {plan.batch_shape.describe()}"
        if plan.batch_shape
        else "planned for micro-batches of micro_batch_size x max_seq_len tokens"
    )
    raise Infeasible(
        f"the job needs {plan.total_bytes / 2**30:.2f} GiB per device but the largest device it may run on "
        f"({plan.gpu}) has {plan.usable_bytes / 2**30:.2f} GiB usable ({counted}{why}); details has the "
        f"breakdown and {len(plan.suggestions)} suggested changes that fit",
        details=plan.model_dump(mode="json"),
    )
