"""A model's architecture (what the planner counts with) and its exact parameter counts.

core.arch.families knows the decoder block of each supported family as transformers 5 builds it:
every linear module of a block with its (in, out, bias), the norms, embeddings and whether the
lm_head is tied. From that, total parameters and LoRA trainable parameters (peft's rules) are
counted exactly.
Missing config keys take the defaults of the transformers config class of that family.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from core.errors import InvalidInput

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


class Architecture(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    config_dtype: str | None  # "float32" | "bfloat16" | "float16" | None (config.json says nothing)
    block_linears: tuple[LinearModule, ...]
    norms_per_layer: int  # norms over the hidden size applied inside one block
    norm_params_per_layer: int  # all norm weights (+ biases) of one block, q/k norms included
    qk_norm: bool
    final_norm_params: int
    position_embeddings: int  # learned absolute positions (GPT-2's wpe), 0 for rotary models
    gated_mlp: bool
    hidden_act: str
    # module paths, as transformers names them, for peft target matching
    layers_prefix: str
    embed_names: tuple[str, ...]  # vocab embedding first, then positions (if any)
    final_norm_name: str
    block_norm_names: tuple[str, ...]

    # -- parameter counts -------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        """Input token embeddings plus learned position embeddings."""
        return self.vocab_size * self.hidden_size + self.position_embeddings * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the input embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def linear_params_per_layer(self) -> int:
        return sum(m.params for m in self.block_linears)

    @property
    def layer_params(self) -> int:
        return self.linear_params_per_layer + self.norm_params_per_layer

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.num_layers * self.layer_params
            + self.final_norm_params
            + self.lm_head_params
        )

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (block linears + the lm_head, tied or not)."""
        return self.num_layers * sum(m.weight_numel for m in self.block_linears) + (
            self.vocab_size * self.hidden_size
        )

    @property
    def largest_linear_numel(self) -> int:
        return max(m.weight_numel for m in self.block_linears)

    # -- LoRA (peft) ------------------------------------------------------------------------------
    def lora_targets(self, targets: list[str] | str) -> list[tuple[LinearModule, int]]:
        """Linear modules peft would wrap, each with how many layers it is wrapped in.

        peft matches a list entry t against a full module name k when k == t or k ends with "." + t;
        "all-linear" means every nn.Linear/Conv1D but the output embedding. The lm_head and the
        embeddings are returned as pseudo block modules (group "attn_in") with a count of 1.
        Raises InvalidInput when nothing matches or a non-linear module (a norm) would be targeted.
        """
        return list(self._lora_targets(tuple(targets) if isinstance(targets, list) else targets))

    def lora_params(self, targets: list[str] | str, r: int) -> int:
        """LoRA A (r x in) + B (out x r) for each wrapped module; embeddings: r x (num + dim)."""
        return sum(r * (m.in_features + m.out_features) * n for m, n in self.lora_targets(targets))

    @property
    def _lm_head(self) -> LinearModule:
        return LinearModule(
            name="lm_head",
            in_features=self.hidden_size,
            out_features=self.vocab_size,
            bias=False,
            group="attn_in",
        )

    def _lora_targets(self, targets: tuple[str, ...] | str) -> tuple[tuple[LinearModule, int], ...]:
        if targets == "all-linear":
            return tuple((m, self.num_layers) for m in self.block_linears)
        if isinstance(targets, str):
            raise InvalidInput(
                "lora_target_modules must be a list or 'all-linear'", param="lora_target_modules"
            )

        def hit(key: str) -> bool:
            return any(key == t or key.endswith("." + t) for t in targets)

        found: list[tuple[LinearModule, int]] = []
        for m in self.block_linears:
            n = sum(hit(f"{self.layers_prefix}.{i}.{m.name}") for i in range(self.num_layers))
            if n:
                found.append((m, n))
        if hit("lm_head"):
            found.append((self._lm_head, 1))
        sizes = [self.vocab_size, self.position_embeddings]
        for name, rows in zip(self.embed_names, sizes, strict=False):
            if hit(name):
                emb = LinearModule(
                    name=name, in_features=rows, out_features=self.hidden_size, bias=False, group="attn_in"
                )
                found.append((emb, 1))
        norms = [f"{self.layers_prefix}.0.{n}" for n in self.block_norm_names] + [self.final_norm_name]
        bad = [n for n in norms if hit(n)]
        if bad:
            raise InvalidInput(
                f"LoRA cannot wrap norm modules: {bad}", param="lora_target_modules", details={"modules": bad}
            )
        if not found:
            raise InvalidInput(
                f"none of {list(targets)} matches a linear module of this {self.model_type} model; "
                f"its block linears are {[m.name.rsplit('.', 1)[-1] for m in self.block_linears]}",
                param="lora_target_modules",
            )
        return tuple(found)
