"""Data-parallel training across torchrun processes with FSDP2 (`fully_shard`).

One process per device; torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address.
Without them (a plain `python -m training.run`) every helper here is the single-process identity, so
the loop and the checkpoint code call them unconditionally. CUDA devices talk over NCCL; on a CPU
machine the processes use gloo, which is how FSDP is tested here.

Every function marked "collective" must be called by all ranks in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from core.spec import JobSpec


def launched() -> bool:
    """True in a process started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_shardable(spec: JobSpec) -> None:
    """What FSDP here does not support, refused before any work (admission refuses it too)."""
    from planner.sharding import fsdp_problem

    problem = fsdp_problem(spec.model_copy(update={"num_gpus": 2}))  # also a 1-GPU spec under torchrun
    if problem:
        raise ValueError(problem[1])


def init(device: torch.device) -> torch.device:
    """Join the process group torchrun describes; returns this rank's device."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    """Collective."""
    if active():
        dist.barrier()


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (its `_no_split_modules` classes), in order."""
    base = getattr(model, "get_base_model", lambda: model)()  # under peft's wrapper
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(base).__name__} to shard")
    return layers


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, lm_head).

    Every rank must hold the same full weights (same files, same LoRA seed) before this call: each
    keeps its own slice, with no broadcast. Gradients are summed over ranks, not averaged, because the
    loss is already divided by the step's target tokens over all ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Reduce-scatter gradients in this backward (the last micro-batch of a step) or keep them local."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def sum_list_over_ranks(values: list[float]) -> list[float]:
    """Collective: elementwise sums over ranks, in one all-reduce."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def sum_tensor_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Collective: the elementwise sum over ranks, left on the device (no host sync)."""
    if not active():
        return t
    t = t.to(_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool) -> bool:
    """Collective: True on every rank if it is True on any (e.g. one rank got SIGTERM)."""
    if not active():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def whole(t: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded tensor: the whole tensor, where it is (a plain tensor is itself)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded tensor: the whole tensor on every rank, detached, on the CPU."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().contiguous()


def full_tree(obj: Any) -> Any:
    """Collective: `obj` (nested dicts/lists/tuples) with every tensor made whole and moved to the CPU."""
    return _map_tensors(obj, full_tensor)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole tensor, laid out like `param` (itself when `param` is not sharded).

    Every rank read the same file, so each cuts its own slice: no communication.
    """
    if not isinstance(param, DTensor):
        return full
    full = full.to(param.device)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
