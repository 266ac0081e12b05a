"""http(s) image URLs in chat requests (api/openai/chat_images.py): real APIs (uvicorn) in front of the engine
double (tests/openai/engine_double.py) and a real image server on loopback. Fetching on, the API fetches the
image through the webhooks' address guard and the engine gets it inlined as a data: URL; a URL that fails is
a 400 with its code and field, and nothing reaches the engine. Fetching off (the default), the request goes
on as sent and ftune's engine refuses it (image_url_not_fetched), as it always has. Nothing is fetched for a
text-only base, whose engine refuses any image part (unsupported_content)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from inference.errors import EngineError
from inference.schemas import ChatRequest
from tests.e2e.stack import REPO, TEST_ADMIN_KEY
from tests.image_server import ImageServer, noise_png
from tests.openai.engine_double import EngineDouble, serve, start_api

pytestmark = pytest.mark.slow
FIELD = "messages[0].content[1].image_url.url"
VL_CONFIG = REPO / "tests" / "configs" / "Qwen2.5-VL-7B-Instruct.json"  # the catalog reads config.json only


def ask(url: str) -> list[Any]:
    parts = [{"type": "text", "text": "What colour?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[EngineDouble, ImageServer, dict[str, openai.OpenAI]]]:
    """The engine double, the image server, and an SDK per operator setting: fetching "on" (loopback allowed,
    where the image server is), "guarded" (on, private addresses refused: the default) and "off"."""
    engine, images = EngineDouble(), ImageServer()
    server = serve(engine)
    env = {"FTUNE_INFERENCE_URL": f"http://127.0.0.1:{server.server_port}"}
    on = {"FTUNE_IMAGE_FETCH_ENABLED": "true"}
    settings = {"on": on | {"FTUNE_IMAGE_FETCH_ALLOW_PRIVATE": "true"}, "guarded": on, "off": {}}
    apis, sdks = [], {}
    try:
        for name, extra in settings.items():
            vl = tmp_path / name / "models" / "vl"
            vl.mkdir(parents=True)
            (vl / "config.json").write_bytes(VL_CONFIG.read_bytes())
            api, base, _ = start_api(tmp_path / name, **env, **extra)
            apis.append(api)
            sdks[name] = openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{base}/v1", max_retries=0)
        yield engine, images, sdks
    finally:
        for api in apis:
            api.stop()
        server.shutdown()
        images.close()


def refused(sdk: openai.OpenAI, url: str) -> tuple[Any, Any, str]:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="vl", messages=ask(url))
    return e.value.code, e.value.param, e.value.message


def test_image_urls_follow_the_operators_setting(stack: Any) -> None:
    engine, images, sdks = stack
    cat = images.url("/cat.png")

    sdks["on"].chat.completions.create(model="vl", messages=ask(cat))
    inline = "data:image/png;base64," + base64.b64encode(images.cat).decode()
    assert engine.chats[-1]["messages"] == ask(inline)  # the engine never sees the URL
    assert images.requests == ["/cat.png"]

    sent = len(engine.chats)
    code, param, message = refused(sdks["on"], images.url("/missing.png"))
    assert (code, param) == ("image_fetch_failed", FIELD) and "answered 404" in message
    code, param, message = refused(sdks["on"], images.url("/not-an-image.png"))
    assert (code, param) == ("image_undecodable", FIELD)
    # a request's image may hold no more than a request body could carry inline (1 MiB)
    images.files["/noise.png"] = noise_png(600)
    code, param, message = refused(sdks["on"], images.url("/noise.png"))
    assert (code, param) == ("image_too_large", FIELD) and "over the limit of 1,048,576" in message

    fetched = list(images.requests)
    for host in ("127.0.0.1", "localhost"):
        code, param, message = refused(sdks["guarded"], images.url("/cat.png", host=host))
        assert (code, param) == ("image_url_private", FIELD) and "loopback" in message
    assert images.requests == fetched  # never asked
    assert len(engine.chats) == sent  # nothing refused reached the engine

    sdks["off"].chat.completions.create(model="vl", messages=ask(cat))
    assert engine.chats[-1]["messages"] == ask(cat) and images.requests == fetched
    # a text-only base's engine refuses any image part: nothing is fetched for it, fetching on or not
    sdks["on"].chat.completions.create(model="tiny", messages=ask(cat))
    assert engine.chats[-1]["messages"] == ask(cat) and images.requests == fetched
    # ... where ftune's engine refuses it, as before (the double above only echoes)
    for url, code in ((cat, "image_url_private"), ("https://example.com/cat.png", "image_url_not_fetched")):
        with pytest.raises(EngineError) as e:
            ChatRequest(model="tiny", messages=ask(url)).image_messages()
        assert (e.value.code, e.value.param) == (code, FIELD)
