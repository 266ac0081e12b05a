"""Training a vision-language base (Qwen2.5-VL): its rows' images turned into the model's inputs.

A chat row's image parts (data: URLs, checked at upload: core.data.images) are decoded with Pillow and
handed to the model's own image processor (its preprocessor_config.json: resizing, patches,
pixel_values, image_grid_thw). The row is rendered as any chat row (training.data.render_chat_pieces),
each image a part the model's chat template renders as <|vision_start|><|image_pad|><|vision_end|>; each
<|image_pad|> is then widened to the image's tokens, grid t x h x w / merge^2, as the model's processor
(Qwen2_5_VLProcessor.replace_image_token) does. Image tokens are inputs (never targets).

An example carries its pixel values, grid and its 3-D rotary positions (`mrope_positions`: the model's
get_rope_index for one sequence), so a packed row of several examples keeps each one's positions and
whole images: examples are packed whole, and one longer than max_seq_len is truncated only where no image
token is cut off, else dropped. The vision tower is frozen and runs with SDPA on its own image
boundaries: the packed row's bounds (training.packing) are the language model's, not the tower's.

transformers' Qwen2_5_VLProcessor itself needs torchvision for its video processor; ftune reads images
only, so it loads the image processor and the tokenizer (whose chat template is the model's) alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from core.data.examples import _lines
from core.data.images import IMAGE_KINDS, data_url_bytes, image_url
from core.data.messages import row_tools, to_messages
from training.data import (
    DatasetError,
    Tokenized,
    render_chat_pieces,
    token_stats,
)
from training.decoding.engine import Media


@dataclass(frozen=True)
class Processor:
    """What builds a vision-language base's inputs: its tokenizer (and chat template), its image processor
    and its image placeholder token."""

    tokenizer: Any
    images: Any  # transformers' image processor of the base (Qwen2VLImageProcessor)
    image_token_id: int
    vision_start_id: int
    merge_size: int


def load_processor(model_dir: Path) -> Processor:
    from transformers import AutoImageProcessor

    from training.model import load_tokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    images = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    return Processor(
        load_tokenizer(model_dir),
        images,
        int(config["image_token_id"]),
        int(config["vision_start_token_id"]),
        int(images.merge_size),
    )


@dataclass(frozen=True)
class VisionTokenized(Tokenized):
    """A tokenized example with its images: pixel_values [patches, values], image_grid_thw [images, 3],
    mrope_positions [3, tokens]."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    mrope_positions: torch.Tensor

    @staticmethod
    def batch_inputs(items: Sequence[Tokenized], width: int | None) -> dict[str, torch.Tensor]:
        """A micro-batch's images and 3-D positions (training.data.extra_inputs asks for them)."""
        return batch_inputs(items, width)

    def cut(self, n: int, image_id: int) -> VisionTokenized | None:
        """The first n tokens, or None when that would cut an image's tokens off."""
        if image_id in self.input_ids[n:]:
            return None
        kept = self.mrope_positions[:, :n]
        return replace(self, input_ids=self.input_ids[:n], labels=self.labels[:n], mrope_positions=kept)


def row_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The PIL images of a row's image parts, in order."""
    import io

    from PIL import Image

    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") in IMAGE_KINDS:
                url, at = image_url(part, f"messages[{i}].content[{j}]")
                out.append(Image.open(io.BytesIO(data_url_bytes(url, at))).convert("RGB"))
    return out


def _template_messages(messages: list[dict[str, Any]]) -> list[Any]:
    """Messages as training.data renders them, a content with images as the template's parts."""
    out = list(to_messages(messages, trained=True))
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") in IMAGE_KINDS for p in content):
            parts = [
                {"type": "image"} if p.get("type") in IMAGE_KINDS else {"type": "text", "text": p["text"]}
                for p in content
            ]
            out[i] = replace(out[i], content=parts)  # type: ignore[arg-type]  # the template reads parts
    return out


def tokenize_row(row: dict[str, Any], proc: Processor, train_on_inputs: bool = False) -> VisionTokenized:
    """One chat row's ids, labels, pixel values, grids and 3-D positions (see the module doc)."""
    from training.data import INPUT, TARGET

    pixels, grid = _pixels(row_images(row["messages"]), proc)
    trained = {TARGET} | ({INPUT} if train_on_inputs else set())
    pieces = render_chat_pieces(_template_messages(row["messages"]), proc.tokenizer, row_tools(row))
    ids, labels = _widened(pieces, grid, proc, trained)
    positions = mrope_positions(ids, grid, proc.image_token_id, proc.merge_size)
    return VisionTokenized(ids, labels, pixels, grid, positions)


def prompt_inputs(
    messages: list[dict[str, Any]], proc: Processor, tools: Sequence[dict[str, Any]] = ()
) -> tuple[list[int], Media]:
    """A chat request's prompt on a vision-language base, built as training builds a row (tokenize_row):
    the ids of its messages and the generation prompt (inference.prompt's rule: the conversation with an
    empty reply, whose piece is dropped), its images' pixels and grids, its 3-D positions."""
    from training.data import TARGET

    pixels, grid = _pixels(row_images(messages), proc)
    reply = [*messages, {"role": "assistant", "content": ""}]
    pieces = render_chat_pieces(_template_messages(reply), proc.tokenizer, list(tools) or None)
    if pieces and pieces[-1][1] == TARGET:
        pieces = pieces[:-1]
    ids, _ = _widened(pieces, grid, proc, set())
    return ids, Media(pixels, grid, mrope_positions(ids, grid, proc.image_token_id, proc.merge_size))


def _pixels(images: list[Any], proc: Processor) -> tuple[torch.Tensor, torch.Tensor]:
    if not images:
        return torch.zeros((0, 0)), torch.zeros((0, 3), dtype=torch.long)
    inputs = proc.images(images=images, return_tensors="pt")
    return inputs["pixel_values"], inputs["image_grid_thw"].long()


def _widened(
    pieces: list[tuple[list[int], str]], grid: torch.Tensor, proc: Processor, trained: set[str]
) -> tuple[list[int], list[int]]:
    """The pieces' ids with each <|image_pad|> widened to its image's tokens, and their labels."""
    widths = iter((grid.prod(-1) // proc.merge_size**2).tolist())
    ids: list[int] = []
    labels: list[int] = []
    for piece, kind in pieces:
        for t in piece:
            run = [t] * next(widths) if t == proc.image_token_id else [t]
            ids += run
            labels += run if kind in trained and t != proc.image_token_id else [-100] * len(run)
    if next(widths, None) is not None:
        raise DatasetError("the model's chat template dropped an image part (no <|image_pad|> for it)")
    return ids, labels


def mrope_positions(ids: list[int], grid: torch.Tensor, image_id: int, merge: int) -> torch.Tensor:
    """Qwen2.5-VL's 3-D rotary positions of one sequence (its get_rope_index for images): text tokens count
    on in all three rows; an image's tokens take (start, start + row, start + column), and the text after
    it starts at start + max(rows, columns)."""
    rows: list[torch.Tensor] = []
    pos, i, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_id:
            j = i
            while j < len(ids) and ids[j] != image_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        t, h, w = (int(x) for x in grid[k])
        h, w = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos, i, k = pos + max(h, w), i + t * h * w, k + 1
    return torch.cat(rows, dim=1) if rows else torch.zeros((3, 0), dtype=torch.long)


def load_for_training(
    path: Path, tokenizer: Any, spec: Any, column_mapping: dict[str, str] | None
) -> tuple[list[Any], int, dict[str, Any]]:
    """A chat file as training reads it for a vision-language base (training.data.load_for_training's
    twin): the trainable examples, how many were dropped, token statistics of the whole examples.
    `tokenizer`: the base's Processor (load_processor), in the place where the text objectives take theirs."""
    proc: Processor = tokenizer
    if spec.objective != "sft":
        raise DatasetError(
            f"objective {spec.objective!r} is not supported on a vision-language base; use sft"
        )
    try:
        whole = [tokenize_row(obj, proc, spec.train_on_inputs) for obj, _ in _lines(path, column_mapping)]
    except (ValueError, KeyError, TypeError, OSError) as e:
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"cannot read dataset: {e}") from e
    stats = token_stats([t.length for t in whole], spec.max_seq_len, spec.over_length)
    fitting = [t if t.length <= spec.max_seq_len else _fit(t, spec, proc) for t in whole]
    kept = [t for t in fitting if t is not None and t.num_targets > 0]
    if not kept:
        raise DatasetError(
            f"no example has tokens to train on within max_seq_len {spec.max_seq_len} (an image's tokens "
            "are never cut: is max_seq_len too short for the images?)"
        )
    return kept, len(whole) - len(kept), stats


def _fit(t: VisionTokenized, spec: Any, proc: Processor) -> VisionTokenized | None:
    return t.cut(spec.max_seq_len, proc.image_token_id) if spec.over_length == "truncate" else None


def batch_inputs(items: Sequence[Tokenized], width: int | None) -> dict[str, torch.Tensor]:
    """The model inputs of a micro-batch's images: pixel values and grids in example order, and the 3-D
    positions, one row per example right-padded to `width` (None: one packed row of all the examples)."""
    vis = [t for t in items if isinstance(t, VisionTokenized)]
    if not vis:
        return {}
    out: dict[str, torch.Tensor] = {}
    with_images = [t for t in vis if t.image_grid_thw.numel()]
    if with_images:
        out["pixel_values"] = torch.cat([t.pixel_values for t in with_images])
        out["image_grid_thw"] = torch.cat([t.image_grid_thw for t in with_images])
    if width is None:
        out["position_ids"] = torch.cat([t.mrope_positions for t in vis], dim=1)[:, None, :]
        return out
    rows = []
    for t in vis:
        p = t.mrope_positions
        start = int(p.max()) + 1 if p.numel() else 0
        rows.append(torch.cat([p, torch.arange(start, start + width - p.shape[1]).expand(3, -1)], dim=1))
    out["position_ids"] = torch.stack(rows, dim=1)
    return out
