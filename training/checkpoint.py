"""Atomic checkpoints holding the whole training state, and resume from the newest complete one.

checkpoints/step-00000040/
  adapter.safetensors     the whole trainable (LoRA) weights, by parameter name: what serving a kept
                          checkpoint (core.checkpoint_adapter), init_from and a download read
  optimizer.safetensors   every tensor of the optimizer state (torch AdamW or bitsandbytes 8-bit);
                          one process only: under FSDP, shards/ holds it instead
  shards/                 FSDP only: each rank's slices of the weights and of AdamW's state, one
                          safetensors file per rank (training.checkpoint_shards, torch.distributed.checkpoint)
  rng.safetensors         torch CPU (and CUDA) generator states (uint8 tensors)
  state.json              position (step, epoch, step in epoch), losses so far, optimizer scalars and
                          param groups, LR schedule, grad scaler, python/numpy RNG, the spec, and
                          `shards`: how many ranks wrote shards/ (0: none, optimizer.safetensors instead)
Nothing is pickled. A checkpoint is written into a hidden temp dir next to its final place (`.tmp-step-*`,
one name every rank knows), fsynced and renamed in one `os.replace`, so a `step-*` directory is
always complete. Under FSDP every rank, on every node, writes its own shard into that temp dir on the
job's shared directory; after all have written (DCP's save ends in a collective), rank 0 writes the
whole adapter (small: all-gathered), RNG and state.json and renames. So the optimizer state is never
gathered, and a node killed at any moment leaves the previous checkpoint as it was.

A checkpoint resumes on any number of processes: a sharded one through DCP, which reshards on loading
(one process reads every rank's slices); a one-process one under FSDP by every rank reading the files
and keeping its own slice. One process keeps the one-file layout because it also holds what FSDP refuses
(bitsandbytes' 8-bit optimizer states, an fp16 grad scaler), and needs no coordination to write it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core.spec import JobSpec
from core.storage import CHECKPOINT_ADAPTERS_DIR, fsync_path
from training import checkpoint_shards, distributed
from training.checkpoint_codec import (
    flatten_optimizer_state,
    jsonable,
    numpy_state,
    set_torch_rng_state,
    torch_rng_state,
    tuples,
    unflatten_optimizer_state,
)
from training.checkpoint_shards import SHARDS_DIR
from training.step import Parts, Position

KEEP = 3
FORMAT = 2  # 2: the position counts steps within an epoch (1 counted micro-batches)
STEP_DIR = re.compile(r"^step-(\d{8})$")
FILES = ("adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
ADAPTER, OPTIMIZER, RNG, STATE = FILES


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(root: Path, parts: Parts, pos: Position, total_steps: int) -> Path:
    """Write the state after `pos.step` steps to root/step-<step>; keep the newest spec.keep_checkpoints
    and the best by eval loss.

    Collective under FSDP: every rank calls it and writes its shard; rank 0 writes the rest."""
    target = root / checkpoint_name(pos.step)
    if distributed.any_rank(distributed.is_main() and _complete(target)):
        return target  # already saved at this step: the state is a function of the step
    tmp = root / f".tmp-{target.name}"
    if distributed.is_main():
        shutil.rmtree(target, ignore_errors=True)  # damaged (e.g. a file lost); latest_checkpoint skipped it
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-write
        tmp.mkdir(parents=True)
    distributed.barrier()  # the temp dir is there, empty, before any rank writes into it
    weights = {n: distributed.full_tensor(p) for n, p in named_trainable(parts)}  # collective; small
    try:
        if distributed.active():
            opt_tensors, opt_json = flatten_optimizer_state(checkpoint_shards.save(tmp / SHARDS_DIR, parts))
        else:
            opt_tensors, opt_json = flatten_optimizer_state(
                distributed.full_tree(parts.optimizer.state_dict())
            )
        if distributed.is_main():
            state = _state(parts, pos, total_steps, opt_json)
            _write(tmp, target, weights, opt_tensors, state)
            prune(root, parts.spec.keep_checkpoints)
    except BaseException:
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.barrier()  # no rank moves on (or exits) before the checkpoint is complete
    return target


def _state(parts: Parts, pos: Position, total_steps: int, opt_json: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "shards": distributed.world_size() if distributed.active() else 0,
        "position": vars(pos),
        "optimizer": opt_json,
        "scheduler": {
            "name": parts.spec.optim.lr_scheduler,
            "warmup_steps": parts.spec.optim.warmup_steps_for(total_steps),
            "total_steps": total_steps,
            "step": pos.step,
        },
        "grad_scaler": parts.scaler.state_dict() if parts.scaler else None,
        "python_rng": jsonable(random.getstate()),
        "numpy_rng": jsonable(np.random.get_state(legacy=True)),
        "spec": parts.spec.model_dump(mode="json"),
    }


def _write(
    tmp: Path,
    target: Path,
    weights: dict[str, torch.Tensor],
    opt_tensors: dict[str, torch.Tensor],
    state: dict,
) -> None:
    """Rank 0: the files besides the shards into `tmp`, all fsynced, then `tmp` renamed to `target`."""
    save_file(weights, tmp / ADAPTER)
    if not state["shards"]:
        save_file(opt_tensors, tmp / OPTIMIZER)
    save_file(torch_rng_state(), tmp / RNG)
    (tmp / STATE).write_text(json.dumps(state))
    missing = [str(f) for f in _files(tmp, state["shards"]) if not f.is_file()]
    if missing:  # a shard's name not the one DCP's writer gave it, or a node's write lost
        raise RuntimeError(f"checkpoint files missing after every rank wrote its own: {missing}")
    # Each rank fsynced its own shard before DCP's save returned; rank 0 what it wrote, and the entries.
    written = [ADAPTER, RNG, STATE, SHARDS_DIR] if state["shards"] else list(FILES)
    for name in written:
        fsync_path(tmp / name)
    os.replace(tmp, target)
    fsync_path(target.parent)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, or None. Incomplete temp dirs are ignored."""
    for path in sorted(list_checkpoints(root), reverse=True):
        if _complete(path):
            return path
    return None


def _complete(path: Path) -> bool:
    try:
        shards = json.loads((path / STATE).read_text()).get("shards", 0)
    except (OSError, ValueError, AttributeError):
        return False
    return all(f.is_file() for f in _files(path, shards))


def _files(path: Path, shards: int) -> list[Path]:
    """A checkpoint's files: with `shards` ranks' shards (0: the optimizer state in one file)."""
    if not shards:
        return [path / f for f in FILES]
    return [path / f for f in (ADAPTER, RNG, STATE)] + [
        path / SHARDS_DIR / f for f in checkpoint_shards.shard_files(shards)
    ]


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
            loss = json.loads((path / STATE).read_text())["position"].get("best_eval_loss")
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
    """Restore weights, optimizer, grad scaler and RNGs into `parts`; return the saved position.

    Collective under FSDP when the checkpoint is sharded (DCP's load)."""
    state = json.loads((path / STATE).read_text())
    if state.get("format") != FORMAT:
        # e.g. format 1, whose data position meant another batch order: resuming it would not be exact
        raise ValueError(f"checkpoint {path} has format {state.get('format')}, this trainer reads {FORMAT}")
    if _as_today(state["spec"]) != parts.spec.model_dump(mode="json"):
        raise ValueError(f"checkpoint {path} was written for a different job spec")
    with safe_open(path / ADAPTER, framework="pt") as f:
        names = set(f.keys())
    params = dict(named_trainable(parts))
    if names != params.keys():
        raise ValueError(f"checkpoint {path} does not match the model's trainable parameters")
    if state.get("shards"):  # its optimizer state in state.json holds no tensor: they are in the shards
        checkpoint_shards.load(path / SHARDS_DIR, parts, unflatten_optimizer_state({}, state["optimizer"]))
    else:
        _load_whole(path, parts, params, state["optimizer"])
    if parts.scaler and state["grad_scaler"]:
        parts.scaler.load_state_dict(state["grad_scaler"])
    set_torch_rng_state(load_file(path / RNG))
    random.setstate(tuples(state["python_rng"]))
    np.random.set_state(numpy_state(state["numpy_rng"]))
    return Position(**state["position"])


def _load_whole(path: Path, parts: Parts, params: dict[str, torch.nn.Parameter], opt_tree: Any) -> None:
    """A one-process checkpoint's weights and optimizer state; under FSDP every rank keeps its slices."""
    weights = load_file(path / ADAPTER)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(distributed.shard_like(weights[name], p))
    opt_state = unflatten_optimizer_state(load_file(path / OPTIMIZER), opt_tree)
    parts.optimizer.load_state_dict(shard_optimizer_state(opt_state, parts.optimizer))


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
