"""Write examples/vision_colors.jsonl: chat rows whose user turn shows a small PNG (a data: URL) and asks
its colour and shape; the assistant answers. For a vision-language base (Qwen2.5-VL); deterministic.

.venv/bin/python examples/vision_examples.py
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLORS = [
    ("red", (220, 30, 30)),
    ("green", (30, 180, 60)),
    ("blue", (40, 60, 220)),
    ("yellow", (240, 220, 40)),
]
SHAPES = [("square", 40, 40), ("wide rectangle", 64, 28), ("tall rectangle", 28, 64)]


def png_data_url(width: int, height: int, rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def rows() -> list[dict]:
    out = []
    for color, rgb in COLORS:
        for shape, w, h in SHAPES:
            question = [
                {"type": "image_url", "image_url": {"url": png_data_url(w, h, rgb)}},
                {"type": "text", "text": "What colour and shape is this?"},
            ]
            out.append({"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"A {color} {shape}."},
            ]})  # fmt: skip
    return out


if __name__ == "__main__":
    path = HERE / "vision_colors.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {path}")
