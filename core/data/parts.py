"""A message's content: a string, or (everywhere OpenAI accepts one) an array of content parts.

Text parts (`{"type": "text", "text": ...}`) are joined back to back, with nothing between them: that is
how OpenAI concatenates a message's text parts, and how ftune's chat completions read them
(inference.schemas), so an adapter trains on the text that serving will show it. Image parts are accepted
where the caller reads them (`images`: a dataset upload, whose images core.data.images checks; only a
vision-language base trains on them, which job admission checks) and add no text. Elsewhere (serving,
which reads text only), and for audio and file parts always, such a part is refused (unsupported_content),
never dropped, since a model shown the words around a missing image answers a question it never saw.
"""

from __future__ import annotations

from typing import Any

from core.data.images import IMAGE_KINDS, Fetch, check_image_part
from core.data.problems import LineProblem, checked_string, json_type, show

# The non-text parts OpenAI accepts, and what each one holds.
UNSUPPORTED = {"image_url": "image", "input_image": "image", "input_audio": "audio", "file": "file"}
NEEDS = {
    "image": "a vision base model",
    "audio": "an audio base model",
    "file": "a base model that reads files",
}


def content_text(
    value: Any,
    field: str,
    strict: bool,
    *,
    required: bool = True,
    images: bool = False,
    fetch: Fetch | None = None,
) -> str:
    """The text of a checked content (a string or an array of parts); raise a LineProblem for a missing,
    blank (when required), non-text or malformed one. An absent content is "" when not required.
    `images`: image parts are checked (core.data.images; an http(s) one fetched with `fetch` and inlined,
    if given) and allowed, else refused."""
    if type(value) is not list:
        return checked_string(value, field, strict, required=required)
    texts = [_part_text(part, f"{field}[{j}]", strict, images, fetch) for j, part in enumerate(value)]
    text = "".join(texts)
    pictured = images and any(part.get("type") in IMAGE_KINDS for part in value)  # an image is a content
    if required and (not text or text.isspace()) and not pictured:
        raise LineProblem("empty_content", "must not be empty", field)
    return text


def _part_text(part: Any, at: str, strict: bool, images: bool, fetch: Fetch | None) -> str:
    if type(part) is not dict:
        raise LineProblem("wrong_type", f"must be a content part (an object); got {json_type(part)}", at)
    kind = part.get("type")
    if kind == "text":
        if part.get("text") is None:
            raise LineProblem("missing_field", "is required", f"{at}.text")
        return checked_string(part["text"], f"{at}.text", strict, required=False)
    if images and kind in IMAGE_KINDS:
        check_image_part(part, at, fetch)
        return ""
    what = UNSUPPORTED.get(kind) if type(kind) is str else None
    if what is not None:
        article = "an" if what[0] in "aeiou" else "a"
        raise LineProblem(
            "unsupported_content",
            f"is {article} {what} part ({show(kind)}): {what} parts need {NEEDS[what]}, and this "
            "model reads text; put what it shows into a text part, or leave the row out",
            at,
        )
    if kind is None:
        raise LineProblem("missing_field", "is required", f"{at}.type")
    raise LineProblem("wrong_type", f'must be "text" (a text part); got {show(kind)}', f"{at}.type")


def text_of(content: Any) -> str:
    """The text of a content that passed content_text (absent: "")."""
    if content is None:
        return ""
    if type(content) is str:
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")
