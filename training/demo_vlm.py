"""A small Qwen2.5-VL built locally (random weights), so vision-language bases train and are tested offline.

transformers' own Qwen2_5_VLForConditionalGeneration at a tiny size (its vision tower and projector
included), random weights from a fixed seed. The tokenizer is the demo model's (training.demo) with
Qwen2.5-VL's vision tokens added, and a ChatML template that renders an image part as Qwen2.5-VL's does
(<|vision_start|><|image_pad|><|vision_end|>). The image processor is transformers' Qwen2VLImageProcessor
(its Pillow backend) built from its constructor, with pixel bounds small enough for a CPU. Saved as
transformers saves them (config.json, weights, tokenizer, preprocessor_config.json), atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.demo import BOS, EOS, IM_END, PAD, save_built

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VlmSize:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 1088  # the demo tokenizer's 1024 + the vision tokens, rounded up
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_intermediate: int = 64
    vision_heads: int = 2
    min_pixels: int = 28 * 28  # one merged token at least
    max_pixels: int = 28 * 28 * 16  # at most 16 tokens per image


TINY_VLM = VlmSize()


class _Built:
    """The model and its image processor, saved together into the built directory."""

    def __init__(self, model: Any, images: Any, tokenizer: Any) -> None:
        self.model, self.images, self.tokenizer = model, images, tokenizer

    def save_pretrained(self, path: Path) -> None:
        self.tokenizer.save_pretrained(path)  # with the vision tokens and the VLM template
        self.images.save_pretrained(path)
        self.model.save_pretrained(path)


def build_vlm_model(
    models_dir: Path, name: str = "ftune-demo-vlm", size: VlmSize = TINY_VLM, *, force: bool = False,
    seed: int = 1234,
) -> Path:  # fmt: skip
    """Build (or return the already built) tiny Qwen2.5-VL at models_dir/name."""
    return save_built(Path(models_dir) / name, 1024, lambda tok: _build(size, tok, seed), force)


def _build(size: VlmSize, tokenizer: Any, seed: int) -> _Built:
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.add_tokens([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD], special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    assert len(tokenizer) <= size.vocab_size, "tokenizer larger than the embedding table"
    ids = tokenizer.convert_tokens_to_ids
    head_dim = size.hidden_size // size.num_heads
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen2.5-VL's 16/24/24 of 128
    text = dict(
        vocab_size=size.vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        bos_token_id=ids(BOS), eos_token_id=ids(EOS), pad_token_id=ids(PAD),
    )  # fmt: skip
    tower = dict(
        depth=size.vision_depth, hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
        num_heads=size.vision_heads, out_hidden_size=size.hidden_size, window_size=56,
        fullatt_block_indexes=[size.vision_depth - 1],
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=tower,
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids(BOS), eos_token_id=[ids(EOS), ids(IM_END)], pad_token_id=ids(PAD)
    )
    images = Qwen2VLImageProcessorPil(min_pixels=size.min_pixels, max_pixels=size.max_pixels)
    return _Built(model, images, tokenizer)
