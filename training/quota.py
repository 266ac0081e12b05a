"""The run's files within the job's allowance in its tenant's storage quota (planner.job_files).

Before a checkpoint, and before the final adapter (and merged export), the bytes it will write are added
to what the job's directory holds; past RunConfig.files_allowance_bytes the run fails with
storage_quota_exceeded (planner.job_files.StorageQuotaExceeded, training.run's classify_error) before
anything is written or pruned, so every earlier checkpoint stays. Collective under FSDP: rank 0, the
writer, measures, and every rank raises alike. No allowance (None): nothing is checked. What an earlier
attempt left half-written (a killed process) is removed at setup (discard_partial), so it is not counted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from core.arch import load_architecture
from core.run_protocol import RunConfig
from core.storage import CHECKPOINTS_DIR
from planner import job_files
from planner.job_files import StorageQuotaExceeded
from training import distributed
from training.step import Parts


def discard_partial(out: Path) -> None:
    """Remove the temporary directories of writes an earlier attempt did not finish: a checkpoint's, the
    adapter's or the merged model's (core.storage.atomic_dir). This attempt is the job's only writer."""
    for partial in [*out.glob(".tmp-*"), *(out / CHECKPOINTS_DIR).glob(".tmp-step-*")]:
        shutil.rmtree(partial, ignore_errors=True)


def check_checkpoint(config: RunConfig, parts: Parts, step: int) -> None:
    """Room for the checkpoint after `step` steps: the trainable weights and the optimizer state, and under
    FSDP the weights again in the ranks' shards, with each shard's header (training.checkpoint_shards)."""
    if config.files_allowance_bytes is None:
        return
    needed = weights_bytes(parts) + optimizer_bytes(parts.optimizer) + job_files.checkpoint_slack(step)
    if distributed.active():
        ranks = distributed.world_size()
        needed += weights_bytes(parts) + job_files.shard_headers_bytes(len(parts.params), ranks)
    _check(config, needed, f"the checkpoint at step {step}")


def check_final(config: RunConfig, parts: Parts) -> None:
    """Room for the final adapter and its download archive, and the merged model and its archive."""
    if config.files_allowance_bytes is None:
        return
    needed = 2 * (weights_bytes(parts) + job_files.ADAPTER_SLACK)
    what = "the final adapter"
    if config.spec.export == "merged":
        arch = load_architecture(Path(config.model_dir))
        needed += 2 * job_files.merged_model_bytes(config.spec, arch)
        what = "the final adapter and the merged model"
    _check(config, needed, what)


def weights_bytes(parts: Parts) -> int:
    """The whole trainable weights (a sharded parameter's numel is its whole tensor's)."""
    return sum(p.numel() * p.element_size() for p in parts.params)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor of the optimizer's state, as a checkpoint writes it."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def _check(config: RunConfig, needed: int, what: str) -> None:
    problem: StorageQuotaExceeded | None = None
    if distributed.is_main():
        try:
            job_files.check_room(Path(config.output_dir), config.files_allowance_bytes, needed, what)
        except StorageQuotaExceeded as e:
            problem = e
    if distributed.any_rank(problem is not None):
        raise problem or StorageQuotaExceeded(f"{what} would pass the job's storage allowance (rank 0)")
