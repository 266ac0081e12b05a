"""training.rollouts.sample: a chunk of prompts of different lengths (left-padded into one batch) answers
each prompt as it would alone, as transformers' own generate() of the base model does, with the growing
KV cache and with a static one (bench/rollouts_decode.py's other row); seeded samples repeat, and are
generate()'s own under the same seed (what rollouts were before the decoding engine), token for token."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from tests.training.reference_decoding import generate_batch
from training import rollouts
from training.decoding.kv import static_cache_keeps_dtypes
from training.model import load_model
from training.packing import ATTN_NAME, masked_attention
from training.rollouts import sample

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


@pytest.fixture(scope="module")
def tuned(tiny_model: Path):
    """An adapter with random weights (float32): the LoRA layers change the answers."""
    torch.manual_seed(0)
    model = load_model(JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0), tiny_model, CPU)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def generated(model, tokenizer, prompts, n: int, temperature: float, cache: str, autocast=None) -> list:
    """The oracle: rollouts as they were, one generate() call of the chunk, seeded as sample() seeds it."""
    stops = rollouts.stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    model.eval()
    with masked_attention(model), torch.random.fork_rng(), autocast or nullcontext():
        torch.manual_seed(rollouts._seed((5, 7), 0))
        out = generate_batch(
            model, prompts, n=n, temperature=temperature, max_new_tokens=16, stops=stops, pad=pad, cache=cache
        )
    model.train()
    return out


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=needs_static)])
def test_seeded_rollouts_are_generate_token_for_token(
    tuned, tokenizer, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of four lengths, n samples each at temperature 1 and 0.7, and greedy; then with more end
    tokens, so that rows end at different steps (an ended row is fed padding while the others go on)."""
    texts = ["Say something", "Count to three please now", "Hi", "What is the colour of the sea at night?"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]

    def ours(n: int, temperature: float, autocast=None) -> list:
        groups = sample(
            tuned, tokenizer, prompts, n=n, temperature=temperature, max_new_tokens=16, seed=(5, 7),
            device=CPU, chunk=len(prompts), cache=cache, autocast=autocast or nullcontext,
        )  # fmt: skip
        return [c.ids for group in groups for c in group]

    free = generated(tuned, tokenizer, prompts, 3, 1.0, cache)
    assert ours(3, 1.0) == free
    # end tokens taken from those answers: rows end after 3 or 5 tokens, others run to max_new_tokens
    ends = sorted({row[2] for row in free[::3]} | {row[4] for row in free[1::3]})
    eos = [tokenizer.eos_token_id, *ends]
    monkeypatch.setattr(tuned.generation_config, "eos_token_id", eos)
    for n, temperature in ((3, 1.0), (3, 0.7), (1, 0.0)):
        expected = generated(tuned, tokenizer, prompts, n, temperature, cache)
        assert ours(n, temperature) == expected, (n, temperature)
        assert tuned.training
    lengths = {len(ids) for ids in generated(tuned, tokenizer, prompts, 3, 1.0, cache)}
    assert {3, 5, 16} <= lengths  # ended at different steps
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert ours(2, 1.0, bf16) == generated(tuned, tokenizer, prompts, 2, 1.0, cache, bf16())
