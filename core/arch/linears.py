"""One linear module of a decoder block (what peft's LoRA wraps), and which input it reads."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# Which linear inputs are the same tensor (q/k/v read one normed hidden state; gate/up another).
InputGroup = Literal["attn_in", "attn_out", "mlp_in", "mlp_mid"]


class LinearModule(BaseModel):
    """One linear (nn.Linear or GPT-2's Conv1D) of a decoder block, named relative to the block."""

    model_config = ConfigDict(frozen=True)

    name: str
    in_features: int
    out_features: int
    bias: bool
    group: InputGroup

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features
