"""training.rollouts.sample: a chunk of prompts of different lengths (left-padded into one batch) answers
each prompt as it would alone, as transformers' own generate() of the base model does, with the growing
KV cache and with a static one (bench/rollouts_decode.py's other row); seeded samples repeat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from training.model import load_model
from training.packing import ATTN_NAME
from training.rollouts import sample, static_cache_keeps_dtypes

CPU = torch.device("cpu")
# before transformers 5.24 a static cache holds values in the keys' dtype: sample() refuses it (test below)
needs_static = pytest.mark.skipif(
    not static_cache_keeps_dtypes(), reason="a static cache needs transformers >= 5.24"
)


@pytest.fixture(scope="module")
def policy(tiny_model: Path):
    """A fresh adapter (lora_B zero: the base model's answers), in float64: a random model's logits are
    near ties, which rounding would decide."""
    torch.manual_seed(0)
    model = load_model(JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0), tiny_model, CPU)
    assert model.get_base_model().config._attn_implementation == ATTN_NAME  # training's, without masks
    return model.double()


@pytest.fixture
def static_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the writes into a static KV cache: cache="static" is really taken."""
    from transformers.cache_utils import StaticCache

    calls: list[int] = []
    update = StaticCache.update
    monkeypatch.setattr(
        StaticCache, "update", lambda self, *a, **kw: calls.append(1) or update(self, *a, **kw)
    )
    return calls


def answers(model, tokenizer, prompts, cache: str, temperature: float = 0.0, n: int = 1) -> list[list[int]]:
    groups = sample(
        model, tokenizer, prompts, n=n, temperature=temperature, max_new_tokens=12, seed=(1, 2), device=CPU,
        chunk=len(prompts), cache=cache,
    )  # fmt: skip
    return [c.ids for group in groups for c in group]


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=needs_static)])
def test_a_padded_chunk_answers_each_prompt_as_alone(
    policy, tokenizer, tiny_model: Path, cache: str, static_updates: list[int]
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer("Say something")["input_ids"], tokenizer("Count to three please now")["input_ids"]]
    assert len(prompts[0]) < len(prompts[1])
    together = answers(policy, tokenizer, prompts, cache)
    assert bool(static_updates) == (cache == "static")
    assert together == [answers(policy, tokenizer, [p], cache)[0] for p in prompts]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").double()
    assert together == [answers(base, tokenizer, [p], "dynamic")[0] for p in prompts]
    assert all(len(ids) > 2 for ids in together)  # not ended at once
    assert policy.get_base_model().config._attn_implementation == ATTN_NAME  # training's again


@needs_static
def test_seeded_samples_with_a_static_cache_repeat(policy, tokenizer, static_updates: list[int]) -> None:
    prompts = [tokenizer("Say something")["input_ids"], tokenizer("Count to three please now")["input_ids"]]
    sampled = answers(policy, tokenizer, prompts, "static", temperature=1.0, n=3)
    assert static_updates
    assert answers(policy, tokenizer, prompts, "static", temperature=1.0, n=3) == sampled
    assert all(1 <= len(ids) <= 12 for ids in sampled)
    assert len({tuple(ids) for ids in sampled}) > 1


def test_a_static_cache_is_refused_before_transformers_5_24(
    policy, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H200 with transformers 5.17 the static cache failed inside generate() (index_copy_: Float
    keys' cache, BFloat16 values): the engine says so before it starts."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ValueError, match=r"transformers >= 5\.24"):
        answers(policy, tokenizer, [tokenizer("Say something")["input_ids"]], "static")
    assert answers(policy, tokenizer, [tokenizer("Say something")["input_ids"]], "dynamic")
