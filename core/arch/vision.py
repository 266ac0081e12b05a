"""A vision-language base's vision tower and projector, as transformers 5 builds Qwen2.5-VL's.

The tower (`model.visual`) reads an image as patches of patch x patch pixels over temporal_patch_size
frames (an image is its one frame repeated): a Conv3d patch embedding without bias, `depth` blocks of
RMSNorm, attention (one fused qkv linear and an output proj, both with bias) and a gated SiLU MLP with
biases. The projector (`model.visual.merger`) folds each merge x merge group of patches into one token of
the language model: an RMSNorm over the tower's width, then Linear(width x merge^2, width x merge^2), GELU,
Linear(width x merge^2, the language model's hidden size), both with bias.

ftune freezes the tower; LoRA wraps the language model's layers, and the projector's two linears when a
job's lora_target_modules names them (PROJECTOR_TARGETS, or a linear's own name).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from core.arch.linears import LinearModule

# What a job names to put LoRA on the projector as well (the tower itself is never a target).
PROJECTOR_TARGETS = ("merger", "projector")
TOWER_PREFIX = "model.visual"  # where transformers puts the tower and its projector


class VisionTower(BaseModel):
    model_config = ConfigDict(frozen=True)

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # spatial_merge_size: merge x merge patches make one language-model token
    out_hidden_size: int  # the projector's output: the language model's hidden size
    prefix: str = TOWER_PREFIX

    @property
    def patch_embed_params(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2 * self.hidden_size

    @property
    def block_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attention = h * 3 * h + 3 * h + h * h + h
        mlp = 2 * (h * i + i) + i * h + h
        return 2 * h + attention + mlp

    @property
    def projector(self) -> tuple[LinearModule, ...]:
        """The merger's two linears, named as peft sees them (relative to the model)."""
        wide = self.hidden_size * self.merge_size**2
        return (
            LinearModule(name=f"{self.prefix}.merger.mlp.0", in_features=wide, out_features=wide, bias=True,
                         group="mlp_in"),
            LinearModule(name=f"{self.prefix}.merger.mlp.2", in_features=wide,
                         out_features=self.out_hidden_size, bias=True, group="mlp_mid"),
        )  # fmt: skip

    @property
    def projector_params(self) -> int:
        return self.hidden_size + sum(m.params for m in self.projector)  # ln_q + the two linears

    @property
    def params(self) -> int:
        return self.patch_embed_params + self.depth * self.block_params + self.projector_params

    @property
    def patch_values(self) -> int:
        """Values of one patch as the image processor flattens it (pixel_values' second dimension)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def projector_targets(
    tower: VisionTower | None, targets: tuple[str, ...] | str
) -> list[tuple[LinearModule, int]]:
    """The projector's linears a job's targets name (each wrapped once), none for "all-linear": that
    means the language model's linears, as peft's own all-linear leaves a VLM's tower alone."""
    if tower is None or isinstance(targets, str):
        return []
    named = any(t in PROJECTOR_TARGETS for t in targets)
    hit = [
        m for m in tower.projector if named or any(m.name == t or m.name.endswith("." + t) for t in targets)
    ]
    return [(m, 1) for m in hit]
