"""A vision-language base served by the engine: a chat request with an image part decodes on the one
decoding engine exactly as transformers' generate() decodes the same inputs (its own 3-D rotary positions
and rope deltas), alone and batched beside other requests (another image, no image); image parts are
checked as uploads are, and a text-only base still refuses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.catalog import Catalog
from inference.batcher import Batcher, Chat
from inference.engine import Engine
from inference.errors import EngineError
from inference.schemas import ChatRequest
from tests.inference.test_batcher import Now, Recorded
from training.decoding.engine import Row, decode
from training.decoding.sampling import Sampling
from training.demo_vlm import build_vlm_model
from training.vision import prompt_inputs

REPO = Path(__file__).resolve().parents[2]
VLM = "ftune-demo-vlm"
ROWS = [json.loads(line) for line in (REPO / "examples" / "vision_colors.jsonl").read_text().splitlines()]


def ask(row: int, text: str = "What colour and shape is this?") -> list[dict[str, Any]]:
    image = next(p for p in ROWS[row]["messages"][0]["content"] if p["type"] == "image_url")
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def picture(size: tuple[int, int], seed: int) -> dict[str, Any]:
    """A noisy PNG part big enough for a grid of several merged patches a side: its 3-D positions span
    fewer places than its tokens (a non-zero rope delta for the text after it)."""
    import base64
    import io

    from PIL import Image

    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    out = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def big(seed: int, size: tuple[int, int] = (112, 84)) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [picture(size, seed), {"type": "text", "text": "Describe it."}]}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Engine:
    models = tmp_path_factory.mktemp("vlm-models")
    build_vlm_model(models)
    (models / "tiny").symlink_to(tiny_model)  # a text-only base beside it
    return Engine(Catalog(models, hf_cache=tmp_path_factory.mktemp("no-hf")))


def request(messages: list[dict[str, Any]], max_tokens: int = 12) -> ChatRequest:
    return ChatRequest(model=VLM, messages=messages, max_tokens=max_tokens, temperature=0)


def reference(engine: Engine, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
    """transformers' generate() on the prompt as the model's processor hands it over: ids, pixels, grids,
    and which tokens are an image's (from which the model works out its 3-D positions itself)."""
    loaded = engine._base(VLM)
    ids, media = prompt_inputs(messages, loaded.processor)  # type: ignore[arg-type]
    model: Any = engine.loaded_model(VLM)
    with torch.inference_mode():
        out = model.generate(**own_inputs(engine, ids, media), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def own_inputs(engine: Engine, ids: list[int], media: Any) -> dict[str, Any]:
    image = engine._base(VLM).processor.image_token_id  # type: ignore[union-attr]
    x = torch.tensor([ids])
    inputs = {"input_ids": x, "attention_mask": torch.ones_like(x), "mm_token_type_ids": (x == image).int()}
    if media.image_grid_thw.numel():
        inputs |= {"pixel_values": media.pixel_values, "image_grid_thw": media.image_grid_thw}
    return inputs


def test_an_image_prompt_decodes_as_the_model_reads_it(engine: Engine) -> None:
    """The engine's greedy tokens are generate()'s, and each token's log-probability is the model's own in
    one forward over the prompt and the answer, where the model places every token itself: the positions
    after a big picture are its rope-delta-shifted ones (with plain positions they drift)."""
    target = engine.resolve(VLM)
    assert engine.reads_images(target)
    loaded = engine._base(VLM)
    for messages in (ask(0), big(1)):
        body = request(messages)
        _, done = engine.complete(target, body.image_messages(), body.sampling())
        assert done.token_ids == reference(engine, messages, 12)
        ids, media = prompt_inputs(body.image_messages(), loaded.processor)  # type: ignore[arg-type]
        row = Row(sampling=Sampling(max_tokens=12, temperature=0), logprobs=[])
        with torch.inference_mode():
            decode(engine.loaded_model(VLM), [ids], [row], media=[media])
            whole = engine.loaded_model(VLM)(**own_inputs(engine, ids + row.tokens, media)).logits[0].float()
        answer = torch.tensor(row.tokens)
        own = whole[len(ids) - 1 : -1].log_softmax(-1).gather(1, answer[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(row.logprobs), own, rtol=1e-4, atol=1e-4)
    assert media.delta < 0  # the big picture's tokens take fewer positions than their count


def run_batched(engine: Engine, chats: list[list[dict[str, Any]]]) -> list[list[int]]:
    batcher = Batcher(engine)
    tickets = []
    for messages in chats:
        work = Chat(engine.resolve(VLM), messages, Sampling(max_tokens=12, temperature=0))
        ticket = Recorded(work=work, loop=Now())  # type: ignore[arg-type]
        assert batcher.admit(ticket)
        tickets.append(ticket)
    while batcher.busy:
        batcher.step()
    return [t.finished()[0].token_ids for t in tickets]


def test_image_prompts_batched_together_answer_as_alone(engine: Engine) -> None:
    chats = [
        big(2),
        ask(5, "And this one?"),
        [{"role": "user", "content": "No picture here."}],
        big(3, (56, 140)),
    ]
    alone = [run_batched(engine, [c])[0] for c in chats]
    assert run_batched(engine, chats) == alone
    assert alone[0] != alone[1]  # the image is read: two images, two answers


def test_image_parts_are_checked_and_a_text_only_base_refuses_them(engine: Engine) -> None:
    broken = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    with pytest.raises(EngineError) as e:
        request(broken).image_messages()
    assert e.value.param == "messages[0].content[0].image_url.url"
    assert not engine.reads_images(engine.resolve("tiny"))
    with pytest.raises(EngineError) as e:
        ChatRequest(model="tiny", messages=ask(0)).chat_messages()
    assert (e.value.code, e.value.param) == ("unsupported_content", "messages[0].content[0]")
