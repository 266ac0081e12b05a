"""A vision-language base's images in the plan: how many tokens an image becomes, and its tower's memory.

Image tokens follow the image processor's resizing rules (Qwen2VLImageProcessor's smart_resize): both
sides rounded to a multiple of patch x merge, the area brought within [min_pixels, max_pixels] keeping the
aspect ratio; the image is then (h / patch) x (w / patch) patches, merge^2 of which make one token of the
language model. Those tokens sit in the sequence like text, so max_seq_len (and the data's token
statistics, made with the processor: training.vision) already count them in every language-model term.

What the tower adds: its weights (in Architecture.total_params, so in "base weights") and, frozen and fed
no gradient, only transient activations during its forward. This term bounds them by the worst case of a
micro-batch whose every token is an image token (merge^2 patches each), one block's widest tensors at a
time; they are freed before the language model's activations build up, so the plan counts them only
where they exceed those (planner.forward_backward). When LoRA wraps the projector, its input is
kept for backward as well. bench/planner_self.py's vision configs measure the sum against a random
Qwen2.5-VL at the demo width; a real tower's own peak is not measured (a GPU check would).
"""

from __future__ import annotations

import math

from planner.context import Context
from planner.types import Term

# Qwen2VLImageProcessor's defaults (transformers 5.24), which a preprocessor_config.json may override.
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 14, 2, 56 * 56, 28 * 28 * 1280


def resized(
    height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """The (height, width) the image processor resizes an image to (smart_resize)."""
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_tokens(
    height: int,
    width: int,
    *,
    patch: int = PATCH,
    merge: int = MERGE,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> int:
    """Language-model tokens of one image of height x width pixels."""
    h, w = resized(height, width, patch * merge, min_pixels, max_pixels)
    return (h // patch) * (w // patch) // merge**2


def vision_terms(c: Context) -> tuple[list[Term], list[Term]]:
    """(the tower's forward, transient; what is kept for backward: the LoRA'd projector's inputs)."""
    tower = c.arch.vision
    if tower is None:
        return [], []
    patches = c.tokens * tower.merge_size**2
    widest = 4 * tower.hidden_size + 3 * tower.intermediate_size  # qkv + attention out; gate, up, act
    forward = [
        Term(
            name="vision tower forward",
            bytes=patches * (tower.patch_values + widest) * c.act_b,
            note=(
                f"at most {patches:,} patches ({c.tokens:,} tokens, all image tokens, x "
                f"{tower.merge_size}^2): "
                f"pixel values and one block's widest tensors in {c.compute}; the tower is frozen and keeps "
                "nothing for backward"
            ),
        )
    ]
    kept = []
    names = {m.name for m, _ in c.lora}
    if any(m.name in names for m in tower.projector):
        wide = tower.hidden_size * tower.merge_size**2
        kept.append(
            Term(
                name="projector inputs (LoRA)",
                bytes=c.tokens * 2 * wide * c.act_b,
                note="the LoRA'd projector's two linears keep their inputs for the adapter's gradient",
            )
        )
    return forward, kept
