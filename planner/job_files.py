"""The bytes a job's files take on the shared volume, counted in its tenant's storage quota.

A job's directory (core.storage) holds its checkpoints (the adapter's weights and the optimizer state, under
FSDP the weights again in the ranks' shards: keep_checkpoints of them, the best by eval loss besides, and
the next while it is written), the final adapter and its download archive, a merged model and its archive
(export: merged), a kept checkpoint's adapter laid out for serving, and its metrics, samples and training
log.

- `project`: what those files may reach, from the spec, the base model's architecture and the data's
  size. Admission reserves it in the tenant's quota and refuses a job it does not fit (413
  storage_quota_exceeded, models.job_files); it is the job's allowance (RunConfig.files_allowance_bytes).
- `check_room`: training asks before it writes a checkpoint, and before the final adapter and merged
  export, whether the job's directory stays within its allowance; if not, the run fails with
  storage_quota_exceeded (StorageQuotaExceeded) and what is on disk stays as it was.
- `stored_bytes`: what a finished job's directory holds, which counts in the quota instead of the
  allowance once the job has ended, until it is deleted.
Pure Python: the API, the worker and training all import it.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

from core.arch import Architecture
from core.spec import JobSpec
from core.storage import ADAPTER_DIR, CHECKPOINT_ADAPTERS_DIR, CHECKPOINTS_DIR
from planner.context import storage_dtype
from planner.memory import DTYPE_BYTES, adam8bit_state_bytes

CODE = "storage_quota_exceeded"
ADAPTER_B = 4  # peft keeps, and saves, adapters in fp32 (a checkpoint's weights too)
CHECKPOINT_SLACK = 1 << 20  # a checkpoint's RNG states, state.json (spec, RNG), safetensors headers
LOSS_B = 32  # state.json keeps every step's loss
# A sharded (FSDP) checkpoint's header bytes per LoRA tensor in each rank's file: the keys of its weight,
# moments and step, each twice (the safetensors header, DCP's sharding info) at names of ~100 characters,
# and its name in state.json's param groups; about 1.2 KiB measured (tests/training/test_fsdp.py).
SHARD_HEADER_B = 2048
ADAPTER_SLACK = 64 << 10  # adapter_config.json and the model card
MERGED_SLACK = 64 << 20  # config and tokenizer files beside the merged weights
LOG_B_PER_STEP = 4096  # a step's metrics record and log lines
LOG_SLACK = 16 << 20  # run.json, the plans, warnings and a traceback or two in train.log
SAMPLE_B = 32 << 10  # one before/after sample (a prompt, two completions), in metrics and samples.json


class StorageQuotaExceeded(Exception):
    """A write that would take the job's files past its allowance: the run fails with CODE."""


@dataclass(frozen=True)
class Projection:
    """The most a job's files take at once, by kind, and what it is counted from."""

    trainable: int  # LoRA parameters
    steps: int  # at most
    checkpoint_bytes: int  # one checkpoint
    checkpoints: int  # on disk at once, at most
    adapter_bytes: int  # the final adapter, its archive, the kept checkpoints' serving layouts
    merged_bytes: int  # the merged model and its archive (export: merged)
    log_bytes: int  # metrics, samples, the training log

    @property
    def total(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        return {
            "checkpoints": self.checkpoints * self.checkpoint_bytes,
            "adapter": self.adapter_bytes,
            "merged": self.merged_bytes,
            "logs": self.log_bytes,
        }


def project(spec: JobSpec, arch: Architecture, num_examples: int) -> Projection:
    """The job's files at their largest (a bound, not a guess): see the module docstring."""
    trainable = arch.lora_params(spec.lora_target_modules, spec.lora_r)
    steps = max_steps(spec, num_examples)
    ckpt = trainable * ADAPTER_B + optimizer_bytes(spec, trainable) + checkpoint_slack(steps)
    placement = spec.placement
    if placement.sharded:  # the weights again, in the ranks' shards (training.checkpoint_shards)
        tensors = 2 * sum(n for _, n in arch.lora_targets(spec.lora_target_modules))  # A and B
        ckpt += trainable * ADAPTER_B + shard_headers_bytes(tensors, placement.world_size)
    every = spec.checkpoint_every_steps
    saves = (steps // every if every else 0) + spec.epochs + 2  # + each epoch's end, the end, an early stop
    best = 1 if spec.has_validation else 0
    kept = min(spec.keep_checkpoints + best + 1, saves)  # + the one being written before the oldest goes
    adapter = trainable * ADAPTER_B + ADAPTER_SLACK
    return Projection(
        trainable=trainable,
        steps=steps,
        checkpoint_bytes=ckpt,
        checkpoints=kept,
        adapter_bytes=2 * adapter + kept * trainable * ADAPTER_B,
        merged_bytes=2 * merged_model_bytes(spec, arch) if spec.export == "merged" else 0,
        log_bytes=LOG_SLACK + steps * LOG_B_PER_STEP + _samples_bytes(spec, steps),
    )


def max_steps(spec: JobSpec, num_examples: int) -> int:
    """Optimizer steps of the run at most (training.batches.total_steps; a packed epoch has no more)."""
    if spec.max_steps is not None:
        return spec.max_steps
    return spec.epochs * (math.ceil(max(num_examples, 1) / spec.batch.step_size) + 1)


def optimizer_bytes(spec: JobSpec, trainable: int) -> int:
    """The optimizer's state: AdamW's m and v in fp32, or bitsandbytes' 8-bit states with their absmax."""
    if spec.optimizer == "adamw":
        return 2 * 4 * trainable
    return adam8bit_state_bytes(trainable)


def checkpoint_slack(step: int) -> int:
    """A checkpoint's bytes besides its tensors, after `step` steps."""
    return CHECKPOINT_SLACK + LOSS_B * step


def shard_headers_bytes(tensors: int, ranks: int) -> int:
    """The headers of a sharded checkpoint's files: each of the `ranks` files names every one of the
    `tensors` trainable tensors' weight and optimizer state (its slice may be empty)."""
    return SHARD_HEADER_B * tensors * ranks


def merged_model_bytes(spec: JobSpec, arch: Architecture) -> int:
    """The base with the adapter merged in, in its own dtype (a QLoRA base unquantized), with its files."""
    return arch.total_params * DTYPE_BYTES[storage_dtype(spec, arch)] + MERGED_SLACK


def _samples_bytes(spec: JobSpec, steps: int) -> int:
    samples = spec.samples
    if not samples.enabled:
        return 0
    prompts = len(samples.prompts) if isinstance(samples.prompts, list) else samples.prompts
    sets = 1  # the end's
    if samples.at_eval:  # + each evaluation's (training.evaluate.is_eval_step)
        every = spec.eval_every_steps
        sets += (steps // every if every else spec.epochs) + 1
    # each set: a record in metrics.jsonl, and in samples.json, rewritten whole with every set so far
    return prompts * SAMPLE_B * sets * 2


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is missing); a file removed meanwhile counts 0."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def check_room(job_dir: Path, allowance: int | None, adding: int, what: str) -> None:
    """Raise StorageQuotaExceeded when writing `adding` bytes more (`what`) would take the job's files past
    `allowance` (None: no bound). Nothing is written or removed here."""
    if allowance is None:
        return
    used = dir_bytes(job_dir)
    if used + adding > allowance:
        raise StorageQuotaExceeded(
            f"{what} would take {adding:,} bytes, but the job's files already take {used:,} of the "
            f"{allowance:,} bytes reserved for them in the tenant's storage quota; what is saved stays "
            "(earlier checkpoints too). Lower keep_checkpoints or raise checkpoint_every_steps, or export "
            "the adapter only, and submit again"
        )


def stored_bytes(job_dir: Path) -> int:
    """What a finished job's files take: its directory, and a serving layout (an adapter's size) for each
    kept checkpoint that has none yet (made when a chat first asks for it, core.checkpoint_adapter)."""
    served = job_dir / CHECKPOINT_ADAPTERS_DIR
    checkpoints = job_dir / CHECKPOINTS_DIR
    unserved = 0
    if checkpoints.is_dir():
        kept = [p for p in checkpoints.iterdir() if p.name.startswith("step-") and p.is_dir()]
        unserved = sum(1 for p in kept if not (served / p.name).exists())
    adapter = job_dir / ADAPTER_DIR / "adapter_model.safetensors"
    size = adapter.stat().st_size if adapter.is_file() else 0
    return dir_bytes(job_dir) + unserved * size
