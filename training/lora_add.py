"""A LoRA layer's update added inside its matmul: result += scaling x lora_B(lora_A(dropout(x))) as one GEMM.

peft's plain LoRA Linear computes `result + lora_B(lora_A(dropout(x))) * scaling`: lora_B's output, its
scaled copy and the sum are three tensors of the layer's output size ([tokens, out_features]), made by two
elementwise kernels in forward and one more (the scaling's gradient) in backward. `addmm_` with alpha =
scaling adds the product into the base output in the GEMM itself (accumulated in fp32, rounded once): no
tensor of the output's size beyond the output, and the gradients of the same expression. Installed on
every plain peft LoRA Linear as an instance forward; a call it does not cover (merged or disabled
adapters, several active adapters, a LoRA variant such as DoRA, peft's adapter_names, a lora_B bias, an
update in another dtype than the base output) takes peft's own forward.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch


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
    if (
        args
        or kwargs
        or name is None
        or self.disable_adapters
        or self.merged
        or name not in self.lora_A
        or name in self.lora_variant
        or self.lora_B[name].bias is not None
        # without autocast the update is in the adapter's dtype: peft adds it to the base output in the
        # wider of the two
        or not (torch.is_autocast_enabled(x.device.type) or self.lora_A[name].weight.dtype == x.dtype)
    ):
        return type(self).forward(self, x, *args, **kwargs)
    lora_A, lora_B = self.lora_A[name], self.lora_B[name]
    update = lora_A(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.weight.dtype)))
    # the base linear on the flattened input: its output is then no view, and the in-place add records
    # one AddmmBackward, no copy of the output for a view's history
    result = self.base_layer(x.reshape(-1, x.shape[-1]))
    weight = lora_B.weight.to(result.dtype)  # what autocast would cast it to
    result.addmm_(update.reshape(-1, update.shape[-1]), weight.t(), alpha=self.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])
