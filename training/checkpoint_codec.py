"""A checkpoint's state as safetensors + JSON, and back: nothing pickled (training.checkpoint).

The optimizer's state (nested dicts, lists and tuples of tensors and scalars) becomes {path: tensor} for a
safetensors file and a JSON tree that keeps tuples and the keys' types; torch's generator states are
uint8 tensors; python's and numpy's RNG states are JSON lists, turned back into what their setters take.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


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


def jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (tuple, list)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def tuples(obj: Any) -> Any:
    return tuple(tuples(v) for v in obj) if isinstance(obj, list) else obj


def numpy_state(obj: list[Any]) -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = obj
    return (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
