"""Image parts at upload (core.data.images): accepted when they decode within the limits, else a line code;
the report counts the rows with images for admission; serving's reading of a content still refuses them."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from core.data import images
from core.data.parts import content_text
from core.data.problems import LineProblem
from core.data.validate import DatasetValidator, validate_file
from core.image_fetch import ImageFetcher
from tests.image_server import ImageServer

PIL = pytest.importorskip("PIL")
LIMITS = dict(max_line_bytes=10**7, min_examples=1, max_problems=50)


def png(width: int = 16, height: int = 12, fmt: str = "PNG") -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def row(*parts: Any, role: str = "user") -> dict[str, Any]:
    first = {"role": role, "content": list(parts)}
    if role == "user":
        return {"messages": [first, {"role": "assistant", "content": "red"}]}
    return {"messages": [{"role": "user", "content": "hi"}, first]}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def check(tmp_path: Path, *rows: dict[str, Any]):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return validate_file(path, **LIMITS)


def test_rows_with_images_are_valid_and_counted(tmp_path: Path) -> None:
    report = check(
        tmp_path,
        row(image(png()), {"type": "text", "text": "colour?"}),
        row(image(png(fmt="JPEG"))),  # an image alone is a user turn's content
        row(image(png()), image(png(8, 8)), {"type": "input_image", "image_url": png()}),
        {"messages": [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "ok"}]},
        row(*[image(png())] * 10),  # OpenAI's bound on an example, as its vision fine-tuning files have it
    )
    assert report.valid, report.problems
    assert report.stats["with_images"] == 4 and report.stats["images"] == 15


URL = "messages[0].content[0].image_url.url"
BIG = 4097  # over MAX_IMAGE_PIXELS = 4096 x 4096 with a height of 4096
CASES = [
    (row(image("data:image/png;base64,aGVsbG8=")), "image_undecodable", URL),
    (row(image("data:image/png;base64,@@@")), "image_undecodable", URL),
    (row(image("data:text/plain;base64,aGVsbG8=")), "image_url_invalid", URL),
    (row(image("http://10.1.2.3/cat.png")), "image_url_private", URL),
    (row(image("http://[::1]:8080/cat.png")), "image_url_private", URL),
    (row(image("http://localhost/cat.png")), "image_url_private", URL),
    (row(image("https://example.com/cat.png")), "image_url_not_fetched", URL),
    (row(image(png(BIG, 4096))), "image_too_large", URL),
    (row(*[image(png())] * 11), "too_many_images", "messages"),
    (row(image(png()), role="assistant"), "image_not_in_user_message", "messages[1].content"),
    (row({"type": "image_url"}), "missing_field", "messages[0].content[0].image_url"),
    (row({"type": "input_audio", "input_audio": {}}), "unsupported_content", "messages[0].content[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "code", "field"), CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_bad_images_get_a_line_code(tmp_path: Path, bad: dict[str, Any], code: str, field: str) -> None:
    report = check(tmp_path, row(image(png())), bad)
    assert [(p.line, p.code, p.field) for p in report.problems] == [(2, code, field)]


def test_the_pixel_limit_is_read_from_the_header_before_decoding(monkeypatch) -> None:
    """A small file that claims many pixels is refused without its pixels being read."""
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(LineProblem) as e:
        images.check_image_part(image(png(11, 10)), "x")
    assert e.value.code == "image_too_large"
    assert images.check_image_part(image(png(10, 10)), "x") == images.ImageSize(10, 10)


def test_serving_still_refuses_image_parts() -> None:
    """Chat completions read text only (inference.schemas): an image is refused there, not dropped."""
    with pytest.raises(LineProblem) as e:
        content_text([image(png()), {"type": "text", "text": "hi"}], "messages[0].content", False)
    assert e.value.code == "unsupported_content"


def test_fetched_images_are_inlined_into_the_rows_as_sent(tmp_path: Path) -> None:
    """A fetched image goes into the row under the user's own keys (a column_mapping renames only for the
    checks), and the stored file differs from the received one only in the rows that held a URL."""
    server = ImageServer()
    try:
        fetch = ImageFetcher(owner="t", allow_private=True, timeout=5)
        validator = DatasetValidator(**LIMITS, column_mapping={"turns": "messages"}, fetch_image=fetch)
        rows = [row(image(server.url("/cat.png"))), row(image(png()))]
        received = b"".join(
            json.dumps({"turns": r["messages"], "id": i}).encode() + b"\r\n" for i, r in enumerate(rows)
        )
        path = tmp_path / "d.jsonl"
        path.write_bytes(received)
        validator.feed_file(path)
        assert validator.finish().sha256 == hashlib.sha256(received).hexdigest()
        report = validator.stored(path)
    finally:
        server.close()
    assert report.valid and report.stats["images_fetched"] == 1
    stored = path.read_bytes()
    assert (report.size_bytes, report.sha256) == (len(stored), hashlib.sha256(stored).hexdigest())
    first, second = stored.split(b"\n", 1)
    inline = "data:image/png;base64," + base64.b64encode(server.cat).decode()
    assert json.loads(first) == {"turns": row(image(inline))["messages"], "id": 0}
    assert second == received.split(b"\n", 1)[1]  # as received, its \r kept
