"""A chat request's http(s) image URLs, fetched by the API where the operator enables it
(FTUNE_IMAGE_FETCH_ENABLED) and inlined as data: URLs before the request goes to the engine.

The API fetches, not the engine: it knows the tenant (whose lookups core.net bounds) and the operator's
settings, and the engine stays a process that reads what it is sent and connects nowhere. The fetch is
guarded as an upload's (core.image_fetch: the webhooks' address guard, one deadline, no redirects) and the
image checked as a data: URL's (core.data.images); the engine then checks the inlined images as it checks
any (decode, pixels, and whether the model reads images at all). Fetching off, the URL goes on as sent and
the engine refuses it (400 image_url_not_fetched), as it always has.

A request with its images inlined stays within the bound on a JSON body (api.bodylimit): a fetched image
may hold no more than that body could have carried as a data: URL, so fetching saves a client a step, never
lifts a limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from api.bodylimit import MAX_JSON_BODY_BYTES
from core.data.images import MAX_IMAGE_BYTES, check_image_part, count_images
from core.data.problems import LineProblem
from core.errors import InvalidInput
from core.image_fetch import ImageFetcher
from core.settings import Settings


class ChatBody(Protocol):
    """What this module reads of a chat request (api.openai.chat.ChatCompletionRequest)."""

    @property
    def messages(self) -> Sequence[Any]: ...

    def forwarded(self) -> bytes: ...


def remote_parts(body: ChatBody) -> list[tuple[dict[str, Any], str]]:
    """The request's image parts with an http(s) URL, as {"type", "image_url"} dicts (their image_url is the
    part's own, so inlining changes the request), each with its field path."""
    found = []
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            url = part.image_url.get("url") if part.type == "image_url" and part.image_url else None
            if isinstance(url, str) and urlsplit(url).scheme.lower() in ("http", "https"):
                found.append(
                    ({"type": part.type, "image_url": part.image_url}, f"messages[{i}].content[{j}]")
                )
    return found


def inline_images(
    body: ChatBody, remote: list[tuple[dict[str, Any], str]], settings: Settings, tenant_id: str
) -> None:
    """Fetch the request's http(s) image URLs (`remote`: remote_parts(body)) and put their data: URLs in
    their place (blocking: run it in a thread); nothing where fetching is off. 400 with the image's code and
    field for one that fails."""
    fetch = ImageFetcher.from_settings(
        settings, tenant_id, max_bytes=min(MAX_IMAGE_BYTES, MAX_JSON_BODY_BYTES)
    )
    if not remote or fetch is None:
        return
    try:
        count_images([m.model_dump(exclude_none=True) for m in body.messages])  # before anything is fetched
        for part, at in remote:
            check_image_part(part, at, fetch)
    except LineProblem as p:
        raise InvalidInput(p.message, code=p.code, param=p.field) from None
    size = len(body.forwarded())
    if size > MAX_JSON_BODY_BYTES:
        raise InvalidInput(
            f"with its images inlined as data: URLs the request is {size} bytes, over the limit of "
            f"{MAX_JSON_BODY_BYTES} bytes of a request body",
            code="image_too_large",
            param="messages",
        )
