"""Image parts of a chat row (`{"type": "image_url", "image_url": {"url": ...}}`), checked at upload.

An upload is checked without knowing the base it will train: every image must decode and stay within the
limits here, whatever the base; whether the base reads images is job admission's question
(models.admission.check_image_base). An image travels in the row as a data: URL (base64 of a PNG, JPEG,
GIF or WebP file).

An http(s) URL is refused (image_url_not_fetched; a literal private address is named as such, the refusal
webhooks give it: core.net.refusal) unless the operator enables fetching (FTUNE_IMAGE_FETCH_ENABLED) and
the caller passes a `fetch` (core.image_fetch: the webhooks' address guard, a deadline, the byte cap).
A fetched image is checked exactly as a data: URL's and then inlined: the part's URL is replaced, in the
caller's parsed row, by the data: URL of the bytes fetched. The stored dataset thus holds the image itself
(training and serving never fetch; a later change at the URL changes nothing, and the file is the whole
dataset), and a chat request reaches the engine with its images inlined.

Images are decoded with Pillow, header first: its size is checked before its pixels are read, so a small
file that claims 50,000 x 50,000 pixels costs nothing. Nothing here unpickles or runs anything of the
file's.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from core.data.problems import LineProblem, json_type, show
from core.net import refusal

IMAGE_KINDS = ("image_url", "input_image")  # OpenAI's chat part, and its Responses API's
MAX_IMAGES_PER_EXAMPLE = 10  # OpenAI's own bound on a vision fine-tuning example: its files move as they are
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height, before the processor's own resizing
MAX_IMAGE_BYTES = 10 * 2**20  # a decoded image file
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
# An http(s) URL and its field path -> the bytes of the file there; a LineProblem when they cannot be had.
Fetch = Callable[[str, str], bytes]


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int


def image_url(part: dict[str, Any], at: str) -> tuple[str, str]:
    """(the part's URL, its field path): OpenAI's {"image_url": {"url"}} or the Responses API's
    {"image_url": "..."}."""
    kind = part["type"]
    value = part.get(kind) if kind == "image_url" else part.get("image_url")
    if type(value) is dict:
        value, at = value.get("url"), f"{at}.{kind}.url"
    else:
        at = f"{at}.{'image_url' if kind == 'input_image' else kind}"
    if value is None:
        raise LineProblem("missing_field", "is required", at)
    if type(value) is not str:
        raise LineProblem("wrong_type", f"must be a string (a data: URL); got {json_type(value)}", at)
    return value, at


def check_image_part(part: dict[str, Any], at: str, fetch: Fetch | None = None) -> ImageSize:
    """The size of a part's image; a LineProblem for one ftune cannot train on (see the module doc).
    `fetch`: an http(s) URL is fetched with it, checked, and replaced in `part` by its data: URL."""
    url, at = image_url(part, at)
    if url.startswith("data:"):
        return decode(data_url_bytes(url, at), at)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if fetch is None:
            raise _remote(url, at)
        data = fetch(url, at)
        size, fmt = _open(data, at)
        inlined = f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
        if type(part["image_url"]) is dict:  # where image_url() read the URL
            part["image_url"]["url"] = inlined
        else:
            part["image_url"] = inlined
        return size
    raise LineProblem(
        "image_url_invalid", f"must be a data: URL (data:image/png;base64,...); got {show(url)}", at
    )


def _remote(url: str, at: str) -> LineProblem:
    host = (urlsplit(url).hostname or "").strip("[]")
    try:
        why = refusal(ipaddress.ip_address(host))
    except ValueError:  # a name: not resolved here, since nothing is fetched
        why = "loopback" if host == "localhost" or host.endswith(".localhost") else None
    if why is not None:
        return LineProblem(
            "image_url_private",
            f"points at a {why} address ({show(host)}); ftune never connects to private addresses for a "
            "dataset: send the image inline as a data: URL",
            at,
        )
    return LineProblem(
        "image_url_not_fetched",
        "is an http(s) URL; ftune does not fetch images from URLs: send the image inline as a data: URL "
        "(data:image/png;base64,...); fetching them is off on this server",
        at,
    )


def data_url_bytes(url: str, at: str) -> bytes:
    """The bytes of a base64 data: URL of an image type."""
    head, sep, payload = url.partition(",")
    mime = head[5:].split(";", 1)[0].lower()
    if not sep or not head.endswith(";base64") or not mime.startswith("image/"):
        raise LineProblem(
            "image_url_invalid",
            f"must be a base64 data: URL of an image (data:image/png;base64,...); got {show(head + sep)}",
            at,
        )
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise LineProblem("image_too_large", f"holds more than {MAX_IMAGE_BYTES:,} bytes of image", at)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise LineProblem("image_undecodable", "is not valid base64", at) from None


def decode(data: bytes, at: str) -> ImageSize:
    """Open and fully decode an image file, its size checked before its pixels are read."""
    return _open(data, at)[0]


def _open(data: bytes, at: str) -> tuple[ImageSize, str]:
    """decode()'s size, and the file's format (one of FORMATS)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            width, height, fmt = *img.size, str(img.format)
            if width * height > MAX_IMAGE_PIXELS:
                raise LineProblem(
                    "image_too_large",
                    f"is {width} x {height} pixels, over the limit of {MAX_IMAGE_PIXELS:,} pixels",
                    at,
                )
            img.load()
    except LineProblem:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        kind = (
            "is not an image Pillow reads (PNG, JPEG, GIF, WebP)"
            if isinstance(e, UnidentifiedImageError)
            else f"does not decode: {type(e).__name__}"
        )
        raise LineProblem("image_undecodable", kind, at) from None
    if not width or not height:
        raise LineProblem("image_undecodable", "has no pixels", at)
    return ImageSize(width, height), fmt


def count_images(messages: list[dict[str, Any]], where: str = "messages") -> int:
    """Image parts of a row's messages (checked before their parts are decoded); a LineProblem past
    MAX_IMAGES_PER_EXAMPLE or for an image outside a user message."""
    if type(messages) is not list:
        return 0  # check_messages names the problem
    n = 0
    for i, m in enumerate(messages):
        parts = m.get("content") if type(m) is dict else None
        k = sum(type(p) is dict and p.get("type") in IMAGE_KINDS for p in parts) if type(parts) is list else 0
        if k and m.get("role") != "user":
            raise LineProblem(
                "image_not_in_user_message", "holds an image; only user messages may", f"{where}[{i}].content"
            )
        n += k
    if n > MAX_IMAGES_PER_EXAMPLE:
        raise LineProblem(
            "too_many_images",
            f"holds {n} images; an example may hold at most {MAX_IMAGES_PER_EXAMPLE}",
            where,
        )
    return n
