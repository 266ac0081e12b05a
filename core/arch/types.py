"""A model's architecture (what the planner counts with) and its exact parameter counts.

core.arch.families knows the decoder block of each supported family as transformers 5 builds it:
every linear module of a block with its (in, out, bias), the norms, embeddings and whether the
lm_head is tied. From that, total parameters and LoRA trainable parameters (peft's rules) are
counted exactly. core.arch.moe_families adds the mixture-of-experts families, whose blocks also hold
routed experts (core.arch.experts): their parameters are all resident, a token uses top_k of them.
Missing config keys take the defaults of the transformers config class of that family.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from core.arch.experts import Experts
from core.arch.linears import InputGroup, LinearModule
from core.arch.vision import VisionTower, projector_targets
from core.errors import InvalidInput

__all__ = ["Architecture", "InputGroup", "LinearModule"]

Wrapped = tuple[
    tuple[LinearModule, int], ...
]  # what LoRA wraps (a module, an expert stack), in how many layers


class Architecture(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # the gated MLP's width per token: a dense MLP's intermediate_size; a MoE block's top_k x an expert's
    # (every token runs through top_k experts: that many gate/up/act rows are made and saved per token)
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
    # a mixture-of-experts block's routed experts and router (every layer's), None for a dense model;
    # block_linears then lists the block's nn.Linear modules alone (attention, shared or dense MLPs)
    experts: Experts | None = None
    modality: str = "text"  # what the model reads: "text", or "text+image" for a vision-language base
    vision: VisionTower | None = None  # a vision-language base's (frozen) tower and projector

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
        experts = self.experts.params if self.experts else 0
        return self.linear_params_per_layer + self.norm_params_per_layer + experts

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.num_layers * self.layer_params
            + self.final_norm_params
            + self.lm_head_params
            + (self.vision.params if self.vision else 0)
        )

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to (= total_params if dense)."""
        return self.total_params - self.num_layers * (self.experts.inactive_params if self.experts else 0)

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (block linears, a MoE block's router and top_k
        experts, the lm_head, tied or not): the N of FLOPs per token."""
        per_layer = sum(m.weight_numel for m in self.block_linears)
        per_layer += self.experts.matmul_params if self.experts else 0
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size

    @property
    def largest_linear_numel(self) -> int:
        return max(m.weight_numel for m in self.block_linears)

    # -- LoRA (peft) ------------------------------------------------------------------------------
    def lora_targets(self, targets: list[str] | str) -> list[tuple[LinearModule, int]]:
        """Linear modules peft would wrap, each with how many layers it is wrapped in (core.arch.lora).

        peft matches a list entry t against a full module name k when k == t or k ends with "." + t;
        "all-linear" means every nn.Linear/Conv1D of the blocks. The lm_head and the embeddings are
        returned as pseudo block modules (group "attn_in") with a count of 1; a MoE block's expert stacks
        as linears of experts x (in, out) (core.arch.experts.Experts.lora_module).
        Raises InvalidInput when nothing matches or a norm or a router would be targeted.
        """
        return list(lora_targets(self, tuple(targets) if isinstance(targets, list) else targets))

    def lora_params(self, targets: list[str] | str, r: int) -> int:
        """LoRA A (r x in) + B (out x r) for each wrapped module; embeddings: r x (num + dim)."""
        return sum(r * (m.in_features + m.out_features) * n for m, n in self.lora_targets(targets))


def target_error(message: str, **details: object) -> InvalidInput:
    return InvalidInput(message, param="lora_target_modules", details=details or None)


def lora_targets(arch: Architecture, targets: tuple[str, ...] | str) -> Wrapped:
    """What peft wraps: each block linear (expert stack: core.arch.experts.Experts.lora_module) with the
    number of layers it is wrapped in; the lm_head and embeddings as pseudo modules counted once."""
    if targets == "all-linear":
        return tuple((m, arch.num_layers) for m in arch.block_linears)
    if isinstance(targets, str):
        raise target_error("lora_target_modules must be a list or 'all-linear'")
    hit = target_matcher(targets)
    found: list[tuple[LinearModule, int]] = []
    for m in arch.block_linears:
        n = sum(hit(f"{arch.layers_prefix}.{i}.{m.name}") for i in range(arch.num_layers))
        if n:
            found.append((m, n))
    found += _expert_targets(arch, targets)
    found += projector_targets(arch.vision, targets)
    if hit("lm_head"):
        head = LinearModule(
            name="lm_head",
            in_features=arch.hidden_size,
            out_features=arch.vocab_size,
            bias=False,
            group="attn_in",
        )
        found.append((head, 1))
    sizes = [arch.vocab_size, arch.position_embeddings]
    for name, rows in zip(arch.embed_names, sizes, strict=False):
        if hit(name):
            emb = LinearModule(name=name, in_features=rows, out_features=arch.hidden_size, bias=False,
                               group="attn_in")  # fmt: skip
            found.append((emb, 1))
    norms = [f"{arch.layers_prefix}.0.{n}" for n in arch.block_norm_names] + [arch.final_norm_name]
    bad = [n for n in norms if hit(n)]
    if bad:
        raise target_error(f"LoRA cannot wrap norm modules: {bad}", modules=bad)
    if not found:
        names = [m.name.rsplit(".", 1)[-1] for m in arch.block_linears]
        if arch.experts:
            names += [w.name for w in arch.experts.weights]
        raise target_error(
            f"none of {list(targets)} matches a linear module of this {arch.model_type} model; "
            f"its block linears are {names}"
        )
    return tuple(found)


def target_matcher(targets: tuple[str, ...]):  # -> Callable[[str], bool]
    return lambda key: any(key == t or key.endswith("." + t) for t in targets)


def _expert_targets(arch: Architecture, targets: tuple[str, ...]) -> list[tuple[LinearModule, int]]:
    """The expert stacks a target names, per layer; a target naming the router is refused."""
    experts = arch.experts
    if experts is None:
        return []
    hit = target_matcher(targets)
    prefix, layers = arch.layers_prefix, range(arch.num_layers)
    routers = [f"{prefix}.{i}.{experts.router}" for i in layers if hit(f"{prefix}.{i}.{experts.router}")]
    if routers:
        raise target_error(
            f"LoRA on the router ({experts.router}) is not supported: it decides which experts a token "
            "uses; target the attention ('all-linear') and, if wanted, the experts ('experts')",
            modules=routers[:3],
        )
    found = []
    for w in experts.weights:
        n = sum(hit(f"{prefix}.{i}.{w.name}") or hit(f"{prefix}.{i}.{experts.module}") for i in layers)
        if n:
            found.append((experts.lora_module(w), n))
    return found
