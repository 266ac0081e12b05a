"""One completion: transformers' `generate` on the model as it is set (adapter on or off), token by token.

`generate` itself decodes (greedy for temperature 0, else sampling with temperature and top_p, no top-k),
so the engine's tokens are those of a plain `generate` call. A stopping criterion sees each new token
(transformers calls it before a streamer, so a streamer would learn of a stop string one token late);
text is released as soon as it cannot be the start of a stop string, and a stop string, a cancelled
request or a deadline (wall clock) ends generation at that token. A completion cut by the deadline ends
like one cut by max_tokens, with finish_reason "length". The batched path (inference.batcher) uses the
same TextStream, so both give the same tokens and the same pieces of text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's sampling extension: generate exactly max_tokens (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # every generated token, the end token included
    finish_reason: str = "length"

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class TextStream:
    """Generated ids -> text released so far, holding back what might still become a stop string."""

    tokenizer: object
    stop: tuple[str, ...]
    eos: set[int]
    on_text: Callable[[str], None]
    ids: list[int] = field(default_factory=list)
    released: int = 0
    stopped: bool = False
    text: str = ""

    def add(self, token: int) -> None:
        if self.stopped:
            return
        if token in self.eos:
            self.stopped = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            return
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text, self.stopped = text[:at], True
        self.text = text
        hold = 0 if self.stopped else _held_back(text, self.stop)
        self._release(len(text) - hold)

    def finish(self) -> None:
        self._release(len(self.text))

    def _release(self, upto: int) -> None:
        if upto > self.released:
            self.on_text(self.text[self.released : upto])
            self.released = upto


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def generate(
    model,
    tokenizer,
    prompt: list[int],
    sampling: Sampling,
    on_text: Callable[[str], None],
    cancelled: threading.Event | None = None,
    deadline: float | None = None,
) -> Completion:
    """Generate one completion of `prompt` with `model` as it is set; `on_text` gets each released piece.
    Generation stops at the next token once `cancelled` is set or time.monotonic() passes `deadline`."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    eos = eos_ids(model, tokenizer)
    decoder = TextStream(tokenizer, sampling.stop, set() if sampling.ignore_eos else eos, on_text)
    generated: list[int] = []

    class Stop(StoppingCriteria):
        """Called once per new token (the last of `input_ids`), the first one included."""

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            token = int(input_ids[0, -1])
            generated.append(token)
            decoder.add(token)
            done = (
                decoder.stopped
                or (cancelled is not None and cancelled.is_set())
                or (deadline is not None and time.monotonic() >= deadline)
            )
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    config = GenerationConfig(
        max_new_tokens=sampling.max_tokens,
        do_sample=not sampling.greedy,
        temperature=None if sampling.greedy else sampling.temperature,
        top_p=None if sampling.greedy else sampling.top_p,
        top_k=None if sampling.greedy else 0,
        eos_token_id=[] if sampling.ignore_eos else sorted(eos),  # [] (not None: None takes the model's)
        pad_token_id=_pad_id(tokenizer, eos),
        bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        use_cache=True,
    )
    ids = torch.tensor([prompt], dtype=torch.long, device=device_of(model))
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([Stop()]),
        )
    decoder.finish()
    reason = "stop" if decoder.stopped else "length"
    return Completion(text=decoder.text, token_ids=generated, finish_reason=reason)


def eos_ids(model, tokenizer) -> set[int]:
    """The model's end tokens: its generation config's (e.g. the demo's </s> and <|im_end|>), else the
    tokenizer's EOS."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list | tuple) else {int(eos)}


def _pad_id(tokenizer, eos: set[int]) -> int | None:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return min(eos) if eos else None


def device_of(model) -> torch.device:
    return next(model.parameters()).device
