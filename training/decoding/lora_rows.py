"""One forward in which each row uses its own LoRA adapter, at little more than a plain forward's cost.

peft can mix adapters in one batch (`model(..., adapter_names=[one per row])`) and run the base alone
(`with model.disable_adapter()`), but each call walks the whole module tree, and its mixed batch gathers
and scatters every adapter's rows in every layer: on a small model on a CPU that is more time than the
step's matmuls. Here peft's LoRA layers are switched off once (they return their base layer's output) and
each one's forward is wrapped for good (an instance attribute, not a module hook: hooks put every call of
the layer on torch's slower path, several percent of a lone request's time) to add the LoRA delta of every
row:
  - rows that all use one adapter: `lora_B(lora_A(x)) * scaling`, peft's own operations in its order, so
    a request alone computes exactly what peft computes for it
  - rows that mix adapters: one matmul with every resident adapter's A stacked, a per-row mask that keeps
    the row's own rank columns (times its scaling), one matmul with the B's side by side; the other
    adapters' columns add exact zeros, so a row differs from its lone value only by float rounding
  - base rows: nothing
Layers with a LoRA variant (DoRA) or not linear fall back to peft's mixed batch with its walk.
A serving model's (the inference engine's): the wrapped layers stay wrapped, so never a model in training.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

BASE_ROWS = "__base__"  # peft's name, in a mixed batch, for rows that use no adapter
_WRAPPED = "_ftune_adapter_rows"  # set on a LoRA layer once its forward is wrapped
_STACKED = (
    "_ftune_stacked"  # (its adapter slots, A stacked, B side by side, owner and scaling of each column)
)
_step = threading.local()  # the forward running on this thread: .slots (per row, or None), .one, .rows


class AdapterRows:
    def __init__(self) -> None:
        self._seen: tuple[int, tuple[str, ...]] | None = None  # (model, its adapters) when layers were found
        self._layers: list[Any] = []
        self._own = True  # the wrapper computes the deltas (False: peft's mixed batch)

    def forward(self, model, slots: Sequence[str], inputs: dict):
        """model(**inputs) with row i using adapter slot `slots[i]` (BASE_ROWS: none)."""
        if not (hasattr(model, "peft_config") and hasattr(model, "base_model")):
            return model(**inputs)  # never had an adapter
        if not model.peft_config:  # every adapter evicted: the inner model is the plain base
            return model.base_model.model(**inputs)
        self._find_layers(model)
        if not self._own:
            return self._peft_forward(model, slots, inputs)
        self._switch(model, on=False)
        distinct = set(slots)
        if distinct == {BASE_ROWS}:
            return model(**inputs)
        _step.one = next(iter(distinct)) if len(distinct) == 1 else None
        _step.slots = list(slots)
        _step.rows = {}  # a layer's adapter order -> the rows' places in it (one per step)
        try:
            return model(**inputs)
        finally:
            _step.slots = None

    def _find_layers(self, model) -> None:
        seen = (id(model), tuple(model.peft_config))
        if seen == self._seen:
            return
        from peft.tuners.lora import Linear, LoraLayer

        self._layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        self._own = all(type(m) is Linear and not m.lora_variant for m in self._layers)
        for layer in self._layers:
            if not getattr(layer, _WRAPPED, False):
                layer.forward = _rows_forward.__get__(layer)  # torch calls self.forward: this one
                setattr(layer, _WRAPPED, True)
        self._seen = seen

    def _peft_forward(self, model, slots: Sequence[str], inputs: dict):
        distinct = set(slots)
        if distinct == {BASE_ROWS}:
            with model.disable_adapter():
                return model(**inputs)
        self._switch(model, on=True)
        _step.names = list(slots)
        try:
            return model(**inputs)
        finally:
            _step.names = None

    def _switch(self, model, on: bool) -> None:
        """peft's adapter layers on or off, touching them only on a change."""
        if self._layers and self._layers[0].disable_adapters == on:
            if on:
                model.base_model.enable_adapter_layers()
            else:
                model.base_model.disable_adapter_layers()


def _rows_forward(module, x, *args, **kwargs):
    """peft's own forward (with the rows' adapter names in its mixed batch), plus each row's delta."""
    names = getattr(_step, "names", None)
    if names is not None:
        kwargs["adapter_names"] = names
    result = type(module).forward(module, x, *args, **kwargs)
    slots = getattr(_step, "slots", None)
    return result if slots is None else _add_deltas(module, x, slots, result)


def _add_deltas(module, x, slots, result):
    slot = _step.one
    if slot is not None:  # peft's forward for one active adapter, step for step
        if slot not in module.lora_A:
            return result
        lora_A, lora_B = module.lora_A[slot], module.lora_B[slot]
        x = module._cast_input_dtype(x, lora_A.weight.dtype)
        return (result + lora_B(lora_A(module.lora_dropout[slot](x))) * module.scaling[slot]).to(result.dtype)
    slots_here, stacked_a, stacked_b, owner, scale, order = _stacked(module)
    rows = _step.rows.get(slots_here)
    if rows is None:
        rows = _step.rows[slots_here] = torch.tensor([order.get(s, -1) for s in slots], device=x.device)
    keep = (rows[:, None] == owner[None, :]).to(stacked_a.dtype) * scale  # [rows, sum of ranks]
    down = torch.nn.functional.linear(x.to(stacked_a.dtype), stacked_a)  # [rows, tokens, sum of ranks]
    shape = (keep.shape[0],) + (1,) * (down.dim() - 2) + (keep.shape[1],)
    delta = torch.nn.functional.linear(down * keep.view(shape), stacked_b)
    return result + delta.to(result.dtype)


def _stacked(module):
    """The layer's adapters side by side, rebuilt when its set of adapters changes."""
    slots = tuple(module.lora_A.keys())
    cached = getattr(module, _STACKED, None)
    if cached is not None and cached[0] == slots:
        return cached
    a = [module.lora_A[s].weight for s in slots]
    b = [module.lora_B[s].weight for s in slots]
    owner = torch.cat([torch.full((w.shape[0],), i) for i, w in enumerate(a)]).to(a[0].device)
    scale = torch.cat(
        [torch.full((w.shape[0],), float(module.scaling[s])) for s, w in zip(slots, a, strict=True)]
    )
    order = {s: i for i, s in enumerate(slots)}
    built = (slots, torch.cat(a), torch.cat(b, dim=1), owner, scale.to(a[0].device, a[0].dtype), order)
    setattr(module, _STACKED, built)
    return built
