"""Decoder layers torch.compile'd for the training step, on CUDA.

On an H200 (bench/gpu_vs_trl.py, 2026-11-28: a 1.1B Llama, LoRA r16 on all linear layers, bf16 weights,
micro-batch 8 x 1024 packed, no checkpointing) the layers compiled trained 76,451 real tokens/s against
50,786 eager (45.7% against 30.4% MFU), at the same peak allocated memory (13.49 against 13.55 GiB) and
less reserved (13.63 against 14.23 GiB): inductor fuses the LoRA adds, the residual adds, the norms and
the gate, which eager runs as a kernel each. torch.compile made 2 graphs, with no recompile and no graph
break in 30 steps of varying packed lengths (dynamic shapes); compiling took ~15 s of the first step.

Only the training step runs the compiled code: a call without autograd (evaluation, a DPO reference pass,
GRPO's sampling with its KV cache) runs the layer's own, since it would compile other graphs for what it
is called with. And only where that was measured: CUDA, objective sft, packed rows, LoRA on unquantized
weights, gradient checkpointing off, one process. Padded batches (another attention path), DPO and GRPO
(other calls of the layers in a step), QLoRA (bitsandbytes' kernels), checkpointing (the layer recomputed
in the backward pass) and FSDP (its hooks around each layer) are not timed compiled on a GPU yet; there
the layers run eagerly. The worker's FTUNE_COMPILE_LAYERS=false turns it off (RunConfig.compile_layers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from core.spec import JobSpec
from training import distributed

log = logging.getLogger(__name__)


def why_not_compiled(spec: JobSpec, device: torch.device, sharded: bool, wanted: bool = True) -> str | None:
    """Why this run's layers stay eager, or None where they are compiled."""
    if not wanted:
        return "turned off (RunConfig.compile_layers: the worker's FTUNE_COMPILE_LAYERS)"
    if device.type != "cuda":
        return "not CUDA"
    if spec.method != "lora":
        return f"{spec.method}: its quantized layers are not timed compiled"
    if spec.objective != "sft":
        return f"objective {spec.objective}: not timed compiled"
    if not spec.packing:
        return "padded batches: not timed compiled"
    if spec.gradient_checkpointing:
        return "gradient checkpointing: not timed compiled"
    if sharded:
        return "FSDP: not timed compiled"
    return None


def compile_layers(
    model: torch.nn.Module, spec: JobSpec, device: torch.device, sharded: bool, wanted: bool = True
) -> str:
    """Compile each decoder layer's training step where it pays (see the module's docstring) and is
    `wanted`; returns what it did, for the log."""
    why = why_not_compiled(spec, device, sharded, wanted)
    if why:
        return f"none ({why})"
    from training import moe

    if moe.is_moe(model):  # grouped expert matmuls and the router hooks (training.moe): not timed compiled
        return "none (mixture of experts: not timed compiled)"
    layers = distributed.decoder_layers(model)
    for layer in layers:
        compile_for_training(layer)
    return f"{len(layers)} decoder layers, for the training step"


def compile_for_training(layer: torch.nn.Module, backend: str | Callable[..., Any] = "inductor") -> None:
    """Make `layer` run compiled code while autograd records, and its own code otherwise. The first
    compiled call that fails (a torch.compile error, before any kernel runs) turns the layer back to its
    own code, with the error logged; the step goes on eagerly."""
    eager: Callable[..., Any] = layer.forward
    compiled = torch.compile(eager, dynamic=True, backend=backend)
    mode = "first"  # -> "compiled" once a compiled call returned, or "eager" if it failed

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal mode
        if mode == "eager" or not torch.is_grad_enabled():
            return eager(*args, **kwargs)
        if mode == "compiled":
            return compiled(*args, **kwargs)
        try:
            out = compiled(*args, **kwargs)
        except Exception:  # torch.compile's errors have no common base
            log.exception("torch.compile failed on %s: it runs eagerly", type(layer).__name__)
            mode = "eager"
            return eager(*args, **kwargs)
        mode = "compiled"
        return out

    layer.forward = forward
