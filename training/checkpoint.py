"""Atomic checkpoints holding the whole training state, and resume from the newest complete one.

checkpoints/step-00000040/
  adapter.safetensors     trainable (LoRA) weights, by parameter name
  optimizer.safetensors   every tensor of the optimizer state (torch AdamW or bitsandbytes 8-bit)
  rng.safetensors         torch CPU (and CUDA) generator states (uint8 tensors)
  state.json              position (step, epoch, step in epoch), losses so far, optimizer scalars and
                          param groups, LR schedule, grad scaler, python/numpy RNG, the spec
Nothing is pickled. A checkpoint is written into a hidden temp dir next to its final place, fsynced
and renamed in one `os.replace`, so a `step-*` directory is always complete.

Under FSDP every rank takes part in gathering the whole adapter and optimizer state, and rank 0 alone
writes it, in the same format: a checkpoint resumes on any number of processes. On loading, every rank
reads the files and keeps its own slice.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from core.spec import JobSpec
from core.storage import CHECKPOINT_ADAPTERS_DIR, fsync_path
from training import distributed
from training.step import Parts, Position

KEEP = 3
FORMAT = 2  # 2: the position counts steps within an epoch (1 counted micro-batches)
STEP_DIR = re.compile(r"^step-(\d{8})$")
FILES = ("adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(root: Path, parts: Parts, pos: Position, total_steps: int) -> Path:
    """Write the state after `pos.step` steps to root/step-<step>; keep the newest spec.keep_checkpoints
    and the best by eval loss.

    Collective under FSDP: every rank calls it; rank 0 writes."""
    target = root / checkpoint_name(pos.step)
    weights, opt_state = gather_state(parts)
    if distributed.is_main():
        _save(root, target, parts, pos, total_steps, weights, opt_state)
    distributed.barrier()  # no rank moves on (or exits) before the checkpoint is complete
    return target


def gather_state(parts: Parts) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Collective: the whole trainable weights (by name) and optimizer state, on the CPU."""
    weights = {n: distributed.full_tensor(p) for n, p in named_trainable(parts)}
    return weights, distributed.full_tree(parts.optimizer.state_dict())


def _save(
    root: Path,
    target: Path,
    parts: Parts,
    pos: Position,
    total_steps: int,
    weights: dict[str, torch.Tensor],
    opt_state: Any,
) -> None:
    if _complete(target):  # already saved at this step: the state is a function of the step
        return
    shutil.rmtree(target, ignore_errors=True)  # damaged (e.g. a file lost); latest_checkpoint skipped it
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{target.name}-"))
    try:
        _write_state(tmp, parts, pos, total_steps, weights, opt_state)
        for name in FILES:
            fsync_path(tmp / name)
        os.replace(tmp, target)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, parts.spec.keep_checkpoints)


def _write_state(
    d: Path,
    parts: Parts,
    pos: Position,
    total_steps: int,
    weights: dict[str, torch.Tensor],
    opt_state: dict[str, Any],
) -> None:
    save_file(weights, d / FILES[0])
    opt_tensors, opt_json = flatten_optimizer_state(opt_state)
    save_file(opt_tensors, d / FILES[1])
    save_file(torch_rng_state(), d / FILES[2])
    state = {
        "format": FORMAT,
        "position": vars(pos),
        "optimizer": opt_json,
        "scheduler": {
            "name": parts.spec.optim.lr_scheduler,
            "warmup_steps": parts.spec.optim.warmup_steps_for(total_steps),
            "total_steps": total_steps,
            "step": pos.step,
        },
        "grad_scaler": parts.scaler.state_dict() if parts.scaler else None,
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": _jsonable(np.random.get_state(legacy=True)),
        "spec": parts.spec.model_dump(mode="json"),
    }
    (d / FILES[3]).write_text(json.dumps(state))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, or None. Incomplete temp dirs are ignored."""
    for path in sorted(list_checkpoints(root), reverse=True):
        if _complete(path):
            return path
    return None


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints and the best by eval loss (see best_checkpoint), with
    the serving layout of each removed one's adapter, if one was made (core.checkpoint_adapter)."""
    done = list_checkpoints(root)
    best = best_checkpoint(done)
    for old in done[:-keep]:
        if old != best:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(root.parent / CHECKPOINT_ADAPTERS_DIR / old.name, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)


def best_checkpoint(paths: list[Path]) -> Path | None:
    """The first checkpoint (in step order) that holds the lowest best-eval-loss seen: the one saved at, or
    first after, the best evaluation. None when nothing was evaluated."""
    best: tuple[float, Path] | None = None
    for path in paths:
        try:
            loss = json.loads((path / FILES[3]).read_text())["position"].get("best_eval_loss")
        except (OSError, ValueError, KeyError):
            continue  # incomplete: never the one to keep
        if loss is not None and (best is None or loss < best[0]):
            best = (loss, path)
    return best[1] if best else None


def _as_today(spec: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's spec as this version writes it: a field added since (e.g. rollout_batch_size) takes
    its default, so a job paused before an upgrade resumes after it. None where it is no JobSpec now."""
    try:
        return JobSpec.model_validate(spec).model_dump(mode="json")
    except ValueError:  # pydantic's ValidationError: a field since removed, or a value now refused
        return None


def load_checkpoint(path: Path, parts: Parts) -> Position:
    """Restore weights, optimizer, grad scaler and RNGs into `parts`; return the saved position."""
    state = json.loads((path / FILES[3]).read_text())
    if state.get("format") != FORMAT:
        # e.g. format 1, whose data position meant another batch order: resuming it would not be exact
        raise ValueError(f"checkpoint {path} has format {state.get('format')}, this trainer reads {FORMAT}")
    if _as_today(state["spec"]) != parts.spec.model_dump(mode="json"):
        raise ValueError(f"checkpoint {path} was written for a different job spec")
    weights = load_file(path / FILES[0])
    params = dict(named_trainable(parts))
    if weights.keys() != params.keys():
        raise ValueError(f"checkpoint {path} does not match the model's trainable parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(distributed.shard_like(weights[name], p))
    opt_state = unflatten_optimizer_state(load_file(path / FILES[1]), state["optimizer"])
    parts.optimizer.load_state_dict(shard_optimizer_state(opt_state, parts.optimizer))
    if parts.scaler and state["grad_scaler"]:
        parts.scaler.load_state_dict(state["grad_scaler"])
    set_torch_rng_state(load_file(path / FILES[2]))
    random.setstate(_tuples(state["python_rng"]))
    np.random.set_state(_numpy_state(state["numpy_rng"]))
    return Position(**state["position"])


def shard_optimizer_state(sd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A whole optimizer state cut to this rank's slices: a state tensor shaped like its parameter
    (AdamW's moments) is laid out like it; scalars such as `step` stay as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        i: {k: distributed.shard_like(v, params[i]) if _like(v, params[i]) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {**sd, "state": state}


def _like(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0


def named_trainable(parts: Parts) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in parts.model.named_parameters() if p.requires_grad]


# Optimizer state: nested dicts of tensors and scalars -> {path: tensor} + JSON, and back.
def flatten_optimizer_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj.detach().cpu().contiguous()
            return {"__tensor__": path}
        if isinstance(obj, dict):
            return {"__dict__": [[k, walk(v, f"{path}/{k}")] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot checkpoint optimizer state value of type {type(obj).__name__} at {path}")

    return tensors, walk(sd, "")


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, list):
        return [unflatten_optimizer_state(tensors, v) for v in tree]
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__tuple__" in tree:
            return tuple(unflatten_optimizer_state(tensors, v) for v in tree["__tuple__"])
        # keys keep their type (param ids are ints in torch's state_dict)
        return {k: unflatten_optimizer_state(tensors, v) for k, v in tree["__dict__"]}
    return tree


def torch_rng_state() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda:{i}"] = s
    return states


def set_torch_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        cuda = [states[f"cuda:{i}"] for i in range(torch.cuda.device_count()) if f"cuda:{i}" in states]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (tuple, list)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(v) for v in obj) if isinstance(obj, list) else obj


def _numpy_state(obj: list[Any]) -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = obj
    return (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
