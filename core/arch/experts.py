"""A mixture-of-experts block's routed experts and router, as transformers 5 builds them.

transformers 5 keeps each block's experts as stacked 3-D parameters of one module (Qwen3MoeExperts,
MixtralExperts: `gate_up_proj` [experts, 2 x intermediate, hidden] and `down_proj` [experts, hidden,
intermediate]), not as an nn.Linear per expert; checkpoints saved per expert (transformers 4's layout, the
one on the Hub) are fused when they load. The router is a module of its own (`mlp.gate`, a plain
[experts, hidden] weight that is not an nn.Linear). Every expert's weights are resident; a token runs
through top_k of them.

What this means for the rest of ftune:
- bitsandbytes' 4-bit loading replaces nn.Linear modules only: under QLoRA the experts and the router stay
  in the compute dtype (measured: a Qwen3-MoE loaded with BitsAndBytesConfig(load_in_4bit) has Params4bit
  attention projections and float expert stacks).
- peft wraps an expert stack through `target_parameters` (lora.ParamWrapper: lora_A [r x experts, in],
  lora_B [out, r x experts], so r x experts x (in + out) parameters), without LoRA dropout; each forward
  adds the update to the whole stack (a new tensor of the stack's size), which the grouped matmul keeps
  for backward.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from core.arch.linears import InputGroup, LinearModule


class ExpertWeight(BaseModel):
    """One stacked parameter of a block's experts, named relative to the block, sized per expert."""

    model_config = ConfigDict(frozen=True)

    name: str  # "mlp.experts.gate_up_proj"
    in_features: int
    out_features: int
    bias: bool  # a stacked bias [experts, out] beside it
    group: InputGroup  # mlp_in: reads the normed hidden state; mlp_mid: the experts' activation

    @property
    def params_per_expert(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


class Experts(BaseModel):
    """The routed experts of every sparse block (all layers of the supported families are sparse)."""

    model_config = ConfigDict(frozen=True)

    num_experts: int
    top_k: int  # experts each token runs through
    expert_intermediate: int  # one expert's MLP width
    weights: tuple[ExpertWeight, ...]
    module: str  # the experts module, relative to the block: "mlp.experts"
    router: str  # the router module: "mlp.gate"
    router_in: int  # the router reads the normed hidden state: [experts, hidden] (+ a bias)
    router_bias: bool
    # transformers' load-balancing loss: added as router_aux_loss_coef x aux when output_router_logits
    output_router_logits: bool
    router_aux_loss_coef: float

    @property
    def params(self) -> int:
        """Parameters of one block's experts (all of them) and router."""
        experts = self.num_experts * sum(w.params_per_expert for w in self.weights)
        return experts + self.num_experts * self.router_in + (self.num_experts if self.router_bias else 0)

    @property
    def inactive_params(self) -> int:
        """One block's expert parameters a token does not use (num_experts - top_k of them)."""
        return (self.num_experts - self.top_k) * sum(w.params_per_expert for w in self.weights)

    @property
    def matmul_params(self) -> int:
        """Weights one token multiplies with in a block: its top_k experts' and the router's."""
        per_expert = sum(w.in_features * w.out_features for w in self.weights)
        return self.top_k * per_expert + self.num_experts * self.router_in

    @property
    def stack_numel(self) -> int:
        """Values of one block's expert stacks (all experts, biases left out)."""
        return self.num_experts * sum(w.in_features * w.out_features for w in self.weights)

    @property
    def aux_loss_coef(self) -> float:
        """The load-balancing loss's weight in training: 0 unless the config asks for the loss."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def lora_module(self, w: ExpertWeight) -> LinearModule:
        """peft's LoRA of a stacked weight counted as one linear of experts x (in, out): r x experts x
        (in + out) parameters, its lora_A and lora_B the sizes of that linear's."""
        return LinearModule(
            name=w.name,
            in_features=self.num_experts * w.in_features,
            out_features=self.num_experts * w.out_features,
            bias=False,
            group=w.group,
        )
