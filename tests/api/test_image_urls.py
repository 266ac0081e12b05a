"""http(s) image URLs in uploaded chat rows (core.image_fetch, core.data.images), through the app with a real
database and a real image server on loopback: off (the default), refused as always; on, fetched through the
webhooks' address guard and stored inlined as a data: URL, or refused with a line code, line and field."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.data.images import MAX_IMAGE_BYTES
from core.settings import Settings
from tests.image_server import STREAMED_BYTES, ImageServer, noise_png

FIELD = "messages[0].content[1].image_url.url"


@pytest.fixture
def images() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


def operator(app: FastAPI, **settings: Any) -> Settings:
    services = app.state.services
    services.settings = services.settings.model_copy(update={"max_upload_bytes": 4 * 2**20, **settings})
    return services.settings


def fetching(app: FastAPI, allow_private: bool = True) -> Settings:
    """Fetching on; loopback allowed (the image server is on 127.0.0.1) unless `allow_private` is False."""
    return operator(
        app, image_fetch_enabled=True, image_fetch_allow_private=allow_private, image_fetch_timeout_seconds=5
    )


def row(url: str, text: str = "What colour?") -> dict[str, Any]:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "red"}]}


def upload(client: TestClient, *rows: dict[str, Any]) -> tuple[bytes, Any]:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return body, client.post("/datasets", files={"file": ("images.jsonl", body)})


def stored_lines(settings: Settings, dataset_id: str) -> list[dict[str, Any]]:
    path = settings.data_dir / "datasets" / f"{dataset_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def refused(settings: Settings, response: Any, body: bytes) -> list[tuple[int, str, str | None]]:
    """The problems of a refused upload; it is kept as sent (status invalid), nothing inlined."""
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_dataset"
    dataset = error["details"]
    assert dataset["status"] == "invalid"
    assert (settings.data_dir / "datasets" / f"{dataset['id']}.jsonl").read_bytes() == body
    problems = dataset["report"]["problems"]  # after too_few_examples (line 0) where no row is valid
    return [(p["line"], p["code"], p["field"]) for p in problems if p["code"] != "too_few_examples"]


def first_message(response: Any) -> str:
    """The message of the first line's problem."""
    return str(
        next(p["message"] for p in response.json()["error"]["details"]["report"]["problems"] if p["line"])
    )


def test_off_by_default_an_image_url_is_refused_and_nothing_is_fetched(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    settings = operator(app)
    assert settings.image_fetch_enabled is False
    body, r = upload(client, row(images.url("/cat.png", host="example.com")), row(images.url("/cat.png")))
    assert refused(settings, r, body) == [
        (1, "image_url_not_fetched", FIELD),
        (2, "image_url_private", FIELD),
    ]
    assert images.requests == []


def test_on_the_image_is_fetched_and_stored_inline(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    settings = fetching(app)
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    body, r = upload(client, row(images.url("/cat.png")), plain, row(images.url("/cat.png"), "Again?"))
    assert r.status_code == 201, r.text
    dataset = r.json()
    assert images.requests == ["/cat.png"]  # one image named twice is fetched once
    inline = "data:image/png;base64," + base64.b64encode(images.cat).decode()
    assert stored_lines(settings, dataset["id"]) == [row(inline), plain, row(inline, "Again?")]
    stored = (settings.data_dir / "datasets" / f"{dataset['id']}.jsonl").read_bytes()
    assert stored.splitlines()[1] == body.splitlines()[1]  # a row without a URL keeps its bytes
    # the dataset is the stored file: its size (what the quota counts) and sha256 are the inlined file's
    assert dataset["size_bytes"] == len(stored) > len(body)
    assert client.get(f"/datasets/{dataset['id']}").json()["sha256"] == dataset["sha256"]
    assert dataset["sha256"] == hashlib.sha256(stored).hexdigest()
    assert dataset["report"]["stats"]["images_fetched"] == 2
    assert dataset["report"]["stats"]["with_images"] == 2


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_private_address_is_refused_by_default_even_by_name(
    client: TestClient, app: FastAPI, images: ImageServer, host: str
) -> None:
    settings = fetching(app, allow_private=False)
    body, r = upload(client, row(images.url("/cat.png", host=host)))
    assert refused(settings, r, body) == [(1, "image_url_private", FIELD)]
    message = first_message(r)
    assert "a loopback address, is not allowed" in message
    assert images.requests == []


CASES = [
    ("/not-an-image.png", "image_undecodable", "is not an image Pillow reads"),
    ("/wide.png", "image_too_large", "4097 x 4096 pixels"),
    ("/declared-huge.png", "image_too_large", f"52,428,800 bytes, over the limit of {MAX_IMAGE_BYTES:,}"),
    ("/missing.png", "image_fetch_failed", "answered 404 Not Found"),
    ("/moved.png", "image_fetch_failed", "answered 302 Found; redirects are not followed"),
]


@pytest.mark.parametrize(("path", "code", "says"), CASES, ids=[c[0] for c in CASES])
def test_an_image_that_cannot_be_had_is_a_line_code(
    client: TestClient, app: FastAPI, images: ImageServer, path: str, code: str, says: str
) -> None:
    settings = fetching(app)
    body, r = upload(client, row(images.url("/cat.png")), row(images.url(path)))
    assert refused(settings, r, body) == [(2, code, FIELD)]
    message = first_message(r)
    assert message.startswith(f'line 2: field "{FIELD}" ') and says in message, message
    assert images.requests[-1] == path  # the redirect was not followed


def test_a_body_past_the_byte_cap_is_cut_off_not_read_to_its_end(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    settings = fetching(app)
    body, r = upload(client, row(images.url("/endless.png")))
    assert refused(settings, r, body) == [(1, "image_too_large", FIELD)]
    deadline = time.monotonic() + 10
    while images.streamed is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # what the server got to send: the cap and the sockets' buffers, not the 128 MiB it had
    assert MAX_IMAGE_BYTES < images.streamed < MAX_IMAGE_BYTES + 24 * 2**20 < STREAMED_BYTES


def test_a_row_held_to_the_line_limit_with_its_image_inlined(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    """A row is stored as if it had been sent with the image inline, and is held to the same line limit."""
    settings = fetching(app)
    images.files["/noise.png"] = noise_png(600)  # ~1.1 MB: within the image cap, over 1 MiB as base64
    body, r = upload(client, row(images.url("/noise.png")))
    assert refused(settings, r, body) == [(1, "line_too_long", None)]
    assert "with its fetched image(s) inlined" in first_message(r)


def test_a_host_that_does_not_resolve_and_the_upload_cap_on_fetches(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    settings = operator(
        app, image_fetch_enabled=True, image_fetch_allow_private=True, image_fetch_max_per_upload=2
    )
    images.files["/dog.png"] = images.cat
    rows = [row("http://no-such-host.invalid/cat.png")] + [
        row(images.url(p)) for p in ("/cat.png", "/dog.png")
    ]
    body, r = upload(client, *rows)
    problems = refused(settings, r, body)
    assert problems == [(1, "image_fetch_failed", FIELD), (3, "too_many_images", FIELD)]
    assert images.requests == ["/cat.png"]  # the third URL was not fetched


def test_an_upload_validated_twice_fetches_once(
    client: TestClient, app: FastAPI, images: ImageServer
) -> None:
    """A column mapping sent as a form field is read after the file: the upload is validated again from
    disk, and the second pass answers the first one's URLs from memory."""
    settings = fetching(app)
    body = (json.dumps(row(images.url("/cat.png"))) + "\n").encode()
    form = {"column_mapping": json.dumps({"messages": "messages"})}
    r = client.post("/datasets", files={"file": ("images.jsonl", body)}, data=form)
    assert r.status_code == 201, r.text
    assert images.requests == ["/cat.png"]
    assert r.json()["report"]["stats"]["images_fetched"] == 1
    assert stored_lines(settings, r.json()["id"])[0]["messages"][0]["content"][1]["image_url"][
        "url"
    ].startswith("data:image/png;base64,")
