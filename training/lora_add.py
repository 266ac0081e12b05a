"""A LoRA layer's update added inside its matmul: result += scaling x lora_B(lora_A(dropout(x))) as one GEMM.

peft's plain LoRA Linear computes `result + lora_B(lora_A(dropout(x))) * scaling`: lora_B's output, its
scaled copy and the sum are three tensors of the layer's output size ([tokens, out_features]), made by two
elementwise kernels in forward and one more (the scaling's gradient) in backward. `addmm_` with alpha =
scaling adds the product into the base output in the GEMM itself (accumulated in fp32, rounded once): no
tensor of the output's size beyond the output, and the gradients of the same expression. Installed on
every plain peft LoRA Linear as an instance forward; a call it does not cover (merged or disabled
adapters, several active adapters, a LoRA variant such as DoRA, peft's adapter_names, a lora_B bias, an
update in another dtype than the base output, a hook on one of its linears) takes peft's own forward.

The linears are called as functions, not modules, and peft's state is read directly: decoding a few rows
on a GPU waits on the host's work per module, and this forward runs 154 times a decoding step in a
22-layer model (on a CPU at width 128: bench/lora_layer.py, a call 51-52 -> 40-41 us, peft's 50-53;
bench/rollouts_decode.py, a decoding step 28-30 -> 25 ms).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module


def install(model: torch.nn.Module) -> int:
    """The fused forward on every plain peft lora.Linear of `model` (bitsandbytes' 4-bit LoRA layers keep
    peft's); returns how many."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for module in model.modules():
        if type(module) is Linear:
            module.forward = MethodType(_forward, module)  # type: ignore[method-assign]  # torch calls self.forward
            n += 1
    return n


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    lora_A = self.lora_A._modules.get(name)
    if (
        args
        or kwargs
        or lora_A is None  # several active adapters, or none of this name here
        or self._disable_adapters
        or self.merged_adapters
        or name in self.lora_variant
        or self.lora_bias.get(name)
        # without autocast the update is in the adapter's dtype: peft adds it to the base output in the
        # wider of the two
        or not (torch.is_autocast_enabled(x.device.type) or lora_A.weight.dtype == x.dtype)
    ):
        return type(self).forward(self, x, *args, **kwargs)
    base, lora_B, dropout = self.base_layer, self.lora_B[name], self.lora_dropout[name]
    if _hooked(base, lora_A, lora_B):  # their hooks run where peft calls them
        return type(self).forward(self, x, *args, **kwargs)
    # the base linear on the flattened input: its output is then no view, and the in-place add records
    # one AddmmBackward, no copy of the output for a view's history
    flat = x.reshape(-1, x.shape[-1])
    result = F.linear(flat, base.weight, base.bias) if type(base) is torch.nn.Linear else base(flat)
    h = self._cast_input_dtype(x, lora_A.weight.dtype)
    if type(dropout) is not torch.nn.Identity:
        h = dropout(h)  # on the input's shape: training.dropout's masks are laid out by its rows
    update = F.linear(h.reshape(-1, h.shape[-1]), lora_A.weight)  # lora_A: a Linear without bias (peft's)
    b = lora_B.weight
    if b.dtype != result.dtype:
        b = b.to(result.dtype)  # as autocast casts it
    result.addmm_(update, b.t(), alpha=self.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


def _hooked(*modules: torch.nn.Module) -> bool:
    """Whether a module call of any of `modules` would run a hook: their own or a global one."""
    if (
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    ):
        return True
    for m in modules:  # a loop, not any(): a generator's setup is host time on every call
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return False
