"""The oracle of the decoding engine's exactness tests: transformers' own generate(), called as ftune called
it before training.decoding (the sequential engine's inference.generation, training.rollouts._generate),
so "equal to the oracle" means "what ftune gave before the engine, token for token"."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from training.decoding.sampling import Sampling
from training.decoding.text import TextStream


def generate_alone(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    sampling: Sampling,
    eos: Collection[int],
    on_text: Callable[[str], None] = lambda _: None,
) -> tuple[list[int], str, str]:
    """One completion by generate() on the model as it is set, a stopping criterion seeing each new token
    (stop strings through a TextStream): (token ids, text, finish reason). Sampling draws from torch's
    generator."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    stream = TextStream(tokenizer, sampling.stop, eos, on_text)
    generated: list[int] = []

    class Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            token = int(input_ids[0, -1])
            generated.append(token)
            stream.add(token)
            return torch.full(
                (input_ids.shape[0],), stream.stopped, dtype=torch.bool, device=input_ids.device
            )

    greedy = sampling.greedy
    config = GenerationConfig(
        max_new_tokens=sampling.max_tokens,
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=None if greedy else 0,
        eos_token_id=sorted(eos),  # [] (not None: None takes the model's)
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        use_cache=True,
    )
    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([Stop()]),
        )
    stream.finish()
    return generated, stream.text, "stop" if stream.stopped else "length"


def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    stops: Collection[int],
    pad: int,
    cache: str = "dynamic",
) -> list[list[int]]:
    """n samples of each prompt by one generate() call of the left-padded prompts (num_return_sequences),
    each cut after its first end token: prompt-major. Draws from torch's generator."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    device = next(model.parameters()).device
    with torch.no_grad():
        result = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=sorted(stops),
            pad_token_id=pad,
            use_cache=True,
            cache_implementation=None if cache == "dynamic" else cache,
            **sampling,
        )
    rows = result[:, width:].tolist()
    ends = [next((j for j, t in enumerate(row) if t in stops), None) for row in rows]
    return [row if end is None else row[: end + 1] for row, end in zip(rows, ends, strict=True)]
