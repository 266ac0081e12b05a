"""Grammar-constrained rows in the one decoding engine: every sampled row of a random model writes JSON of
its schema and stops once it is whole; its log-probs stay the model's own (a rollout's policy terms must
not see the mask); a row without a grammar in the same batch is untouched."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from training.decoding.constraint import Grammar, GrammarError
from training.decoding.engine import Row, decode
from training.decoding.sampling import Sampling
from training.decoding.text import TextStream

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).double().eval()


def test_every_sampled_row_keeps_to_its_schema_and_its_logprobs_are_the_models(model, tokenizer) -> None:
    grammar = Grammar.json_schema(tokenizer, SCHEMA)
    eos = {tokenizer.eos_token_id}
    prompt = tokenizer("Answer in JSON:")["input_ids"]
    rows = [
        Row(
            sampling=Sampling(max_tokens=48, temperature=1.0),
            stops=eos,
            text=TextStream(tokenizer, (), eos, lambda _: None),
            constraint=grammar.constraint(),
            logprobs=[],
        )
        for _ in range(8)
    ]
    torch.manual_seed(0)
    with torch.no_grad():
        decode(model, [prompt] * len(rows), rows)
    for row in rows:
        assert row.finish_reason == "stop" and row.text is not None
        jsonschema.validate(json.loads(row.text.text), SCHEMA)
    row = rows[0]
    whole = torch.tensor([prompt + row.tokens])
    with torch.no_grad():
        logits = model(whole).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(row.tokens)].float()
    own = logits.log_softmax(-1).gather(1, torch.tensor(row.tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(row.logprobs), own, rtol=1e-5, atol=1e-5)


def test_a_row_without_a_grammar_beside_one_decodes_as_alone(model, tokenizer) -> None:
    prompt = tokenizer("Hello")["input_ids"]
    greedy = Sampling(max_tokens=12, temperature=0)
    alone = Row(sampling=greedy)
    with torch.no_grad():
        decode(model, [prompt], [alone])
    free, bound = (
        Row(sampling=greedy),
        Row(sampling=greedy, constraint=Grammar.json_schema(tokenizer, None).constraint()),
    )
    with torch.no_grad():
        decode(model, [prompt, prompt], [free, bound])
    assert free.tokens == alone.tokens
    assert tokenizer.decode(bound.tokens).startswith("{")


def test_a_schema_llguidance_cannot_compile_says_why(tokenizer) -> None:
    with pytest.raises(GrammarError):
        Grammar.json_schema(tokenizer, {"type": "object", "minProperties": "two"})


def test_rollouts_under_a_response_format_are_its_json_and_end_with_an_end_token(model, tokenizer) -> None:
    """A reinforcement job's rollouts (training.rollouts.sample, as the grpo objective calls it): each
    completion is the schema's JSON, and its tokens end with an end token (the policy learns to stop)."""
    from training.rollouts import sample, stop_ids

    prompts = [tokenizer("Answer in JSON:")["input_ids"], tokenizer("Again:")["input_ids"]]
    done = sample(
        model,
        tokenizer,
        prompts,
        n=3,
        temperature=1.0,
        max_new_tokens=48,
        seed=(7, 0),
        device=torch.device("cpu"),
        grammar=Grammar.json_schema(tokenizer, SCHEMA),
    )
    stops = stop_ids(tokenizer, model)
    for group in done:
        for completion in group:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
            assert not completion.truncated and completion.ids[-1] in stops
