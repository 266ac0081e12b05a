"""FSDP checkpoints in shards: every rank writes its own part with torch.distributed.checkpoint (DCP).

step-00000040/shards/
  shard-00001-model-00001-of-00001.safetensors   what rank 0 holds
  shard-00002-model-00001-of-00001.safetensors   what rank 1 holds, and so on for every rank of every node
Each file holds its rank's slice of every trainable weight ("weights.<parameter name>") and of AdamW's
moments ("optimizer.<parameter name>.exp_avg", ".exp_avg_sq"), the replicated scalars (each parameter's
`step`) that DCP dealt to it, and where each slice sits in its whole tensor (DCP_SHARDING_INFO in the
safetensors header). torch's HuggingFaceStorageWriter/Reader write and read them: the reader rebuilds
the checkpoint's metadata from those headers. DCP's default FileSystemWriter/Reader are not used: they
pickle a `.metadata` file, and nothing here is ever unpickled. What is not a tensor (AdamW's param groups,
naming their parameters) is returned to the caller for state.json.

Loading reshards: any number of ranks, or one process without a process group, reads the slices it needs
from whichever files hold them (tests/training/test_fsdp.py resumes a 2-rank checkpoint on one process).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from core.storage import CHECKPOINT_SHARDS_DIR
from training.model import trainable_parameters
from training.step import Parts

SHARDS_DIR = CHECKPOINT_SHARDS_DIR


def shard_files(world_size: int) -> list[str]:
    """The files `world_size` ranks write: HuggingFaceStorageWriter names them by rank, from 1."""
    return [f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors" for rank in range(world_size)]


def save(directory: Path, parts: Parts) -> dict[str, Any]:
    """Collective: every rank writes its slices into `directory` (on storage every node reaches; each
    file fsynced by its writer). Returns the optimizer state that is not tensors (its param groups, by
    parameter name), the same on every rank."""
    sd: dict[str, Any] = get_optimizer_state_dict(parts.model, parts.optimizer)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    dcp.save(_tensors(parts, sd), storage_writer=writer)
    return {"state": _scalars(sd), "param_groups": sd["param_groups"]}


def load(directory: Path, parts: Parts, saved: dict[str, Any]) -> None:
    """Collective under FSDP: this rank's slices of the weights (copied into the parameters) and of the
    optimizer state, whatever number of ranks wrote them. `saved`: what `save` returned."""
    # AdamW's state, made (zeros) to be filled: DCP reads into tensors laid out as this run shards them.
    sd: dict[str, Any] = get_optimizer_state_dict(parts.model, parts.optimizer)
    tensors = _tensors(parts, sd)
    with warnings.catch_warnings():  # one process, no process group: DCP says so, as intended here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)))
    state = {
        name: {k: tensors[_key(name, k)] if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        | saved["state"].get(name, {})
        for name, s in sd["state"].items()
    }
    set_optimizer_state_dict(
        parts.model, parts.optimizer, {"state": state, "param_groups": saved["param_groups"]}
    )


def _tensors(parts: Parts, sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What DCP writes or reads in place: the trainable weights and the optimizer's tensors, by name (a
    DTensor under FSDP: each rank's slice)."""
    out = {f"weights.{name}": p.detach() for name, p in trainable_parameters(parts.model)}
    for name, state in sd["state"].items():
        out |= {_key(name, k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def _scalars(sd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {k: v for k, v in s.items() if not isinstance(v, torch.Tensor)}
        for name, s in sd["state"].items()
    }


def _key(name: str, state_key: str) -> str:
    return f"optimizer.{name}.{state_key}"
