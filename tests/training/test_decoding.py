"""The decoding engine itself (training.decoding): log-probabilities, what a fixed batch refuses, and that
it is the product's one token-by-token loop. Its exactness against transformers' generate() is tested
where it is used: test_rollouts (seeded rollouts), test_samples (samples), tests/inference (chat)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from training.decoding.engine import Decoder, Row, decode
from training.decoding.sampling import Sampling

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ["core", "training", "inference", "models", "api", "worker", "cli"]


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").double().eval()


def test_logprobs_are_the_models_own_for_each_chosen_token(model, tokenizer) -> None:
    """A row that asks gets each chosen token's log-probability under the model (before the sampling's
    warpers): those of one plain forward over the prompt and its completion; a row that does not, none."""
    prompts = [tokenizer("Say something")["input_ids"], tokenizer("Count to three please now")["input_ids"]]
    spec = Sampling(max_tokens=8, temperature=0.7)
    rows = [Row(sampling=spec, logprobs=[]), Row(sampling=spec)]
    torch.manual_seed(0)
    with torch.no_grad():
        decode(model, prompts, rows)
    assert rows[1].logprobs is None and len(rows[0].tokens) == 8
    whole = torch.tensor([prompts[0] + rows[0].tokens])
    with torch.no_grad():
        logits = model(whole).logits[0, len(prompts[0]) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(rows[0].tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(rows[0].logprobs), expected, rtol=1e-5, atol=1e-5)


def test_a_fixed_batch_ends_rows_at_their_end_tokens_and_limits(model, tokenizer) -> None:
    prompt = tokenizer("Hi")["input_ids"]
    free = Row(sampling=Sampling(max_tokens=6, temperature=0))
    with torch.no_grad():
        decode(model, [prompt], [free])
    assert free.finish_reason == "length" and len(free.tokens) == 6
    ended: list[Row] = []
    rows = [
        Row(sampling=Sampling(max_tokens=6, temperature=0), stops={free.tokens[2]}, on_finish=ended.append),
        Row(sampling=Sampling(max_tokens=3, temperature=0), on_finish=ended.append),
        Row(sampling=Sampling(max_tokens=6, temperature=0), on_finish=ended.append),
    ]
    with torch.no_grad():
        decode(model, [prompt] * 3, rows)
    assert [r.tokens for r in rows] == [free.tokens[:3], free.tokens[:3], free.tokens]
    assert [r.finish_reason for r in rows] == ["stop", "length", "length"]
    assert ended == rows[:2] + rows[2:] and len(ended) == 3


def test_what_a_batch_draw_and_a_static_cache_need(model) -> None:
    with pytest.raises(ValueError, match="fixed batch"):
        Decoder(model, draws="batch")
    with pytest.raises(ValueError, match="fixed batch"):
        Decoder(model, static_cache=True)
    mixed = [Row(sampling=Sampling(max_tokens=2, temperature=t)) for t in (1.0, 0.5)]
    with pytest.raises(ValueError, match="same sampling"):
        decode(model, [[1, 2], [3, 4]], mixed)
    with pytest.raises(ValueError, match="max_tokens"):
        decode(model, [[1, 2]], [Row(sampling=Sampling(max_tokens=None))])


def test_one_token_by_token_loop_in_the_product() -> None:
    """Nothing in the product packages calls transformers' generate() (its own loop): every decoding step
    is training.decoding.engine's."""
    calls = re.compile(r"(?<!engine)(?<!self)\.generate\(")  # not the inference engine's own method
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for package in PRODUCT
        for path in (REPO / package).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if calls.search(line)
    ]
    assert found == []
