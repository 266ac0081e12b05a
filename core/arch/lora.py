"""Which modules and parameters peft's LoRA wraps for a job's lora_target_modules, counted per layer.

peft matches a target t against a full name k when k == t or k ends with "." + t. "all-linear" means
every nn.Linear/Conv1D of the blocks (not the lm_head). A mixture-of-experts block adds stacked expert
weights (core.arch.experts), which peft wraps through `target_parameters`; a target names them as it names
modules: "down_proj", "experts.gate_up_proj", or "experts" for all of a block's expert weights. The router
is never a target, and "all-linear" leaves the experts out: it is the attention and any dense or shared
MLP linears, the default of peft and of the families' own fine-tuning guides.

On a MoE model ftune hands peft the exact modules and parameters (peft_targets), not the job's names:
peft (>= 0.18, under transformers 5) reads transformers 4's names of Mixtral- and Qwen2-MoE-style
experts and routers (gate, gate_proj, up_proj, down_proj, w1, w2, w3) as the fused expert stacks and the
router, and its "all-linear" as all of them; the planner must count what is trained.
"""

from __future__ import annotations

from typing import NamedTuple

from core.arch.types import Architecture, Wrapped, target_error, target_matcher


class PeftTargets(NamedTuple):
    """A LoraConfig's target_modules and target_parameters."""

    modules: list[str] | str
    parameters: list[str]


def expert_lora(arch: Architecture, wrapped: Wrapped) -> list[str]:
    """The expert stacks (block-relative names) among what LoRA wraps."""
    names = {w.name for w in arch.experts.weights} if arch.experts else set()
    return [m.name for m, _ in wrapped if m.name in names]


def peft_targets(arch: Architecture, targets: list[str] | str) -> PeftTargets:
    """The LoraConfig that wraps exactly lora_targets(targets). A dense model: the job's names as they
    are. A MoE model: the job's names that match linears, as target_modules (all-linear: the block
    linears' names), and the expert stacks' parameter names, as target_parameters (see the module doc)."""
    if arch.vision is not None:
        return PeftTargets(vision_base_modules(arch, targets), [])
    if arch.experts is None:
        return PeftTargets(targets, [])
    experts = arch.experts
    if targets == "all-linear":
        return PeftTargets(sorted({m.name for m in arch.block_linears}), [])
    as_tuple = tuple(targets)
    arch.lora_targets(list(as_tuple))  # refuses what cannot be wrapped
    prefix, layers = arch.layers_prefix, range(arch.num_layers)
    modules, parameters = [], []
    for t in as_tuple:
        hit = target_matcher((t,))
        linear = any(hit(f"{prefix}.{i}.{m.name}") for i in layers for m in arch.block_linears)
        linear = linear or hit("lm_head") or any(hit(e) for e in arch.embed_names)
        stacks = [
            (i, w.name)
            for w in experts.weights
            for i in layers
            if hit(f"{prefix}.{i}.{w.name}") or hit(f"{prefix}.{i}.{experts.module}")
        ]
        if linear and stacks:
            raise target_error(f"{t!r} names both linear modules and expert weights: name them apart, e.g. "
                          f"'{stacks[0][1]}' for the experts")  # fmt: skip
        if linear:
            modules.append(t)
        for name in sorted({w for _, w in stacks}):
            hits = [i for i, w in stacks if w == name]
            whole = len(hits) == arch.num_layers
            parameters += [name] if whole else [f"{prefix}.{i}.{name}" for i in hits]
    return PeftTargets(modules, sorted(set(parameters)))


def vision_base_modules(arch: Architecture, targets: list[str] | str) -> list[str]:
    """A vision-language base's LoRA modules by their full names: the language model's linears the job's
    targets name (all-linear: all of them) and the projector's if named. By full name, since peft's
    all-linear and a short name like "down_proj" would also wrap the tower's linears, which stay frozen."""
    wrapped = arch.lora_targets(targets)  # refuses what cannot be wrapped
    hit = (lambda key: True) if targets == "all-linear" else target_matcher(tuple(targets))
    prefix = arch.layers_prefix
    names = [
        f"{prefix}.{i}.{m.name}"
        for m, _ in wrapped
        if m in arch.block_linears
        for i in range(arch.num_layers)
        if hit(f"{prefix}.{i}.{m.name}")
    ]
    return names + [m.name for m, _ in wrapped if m not in arch.block_linears]
