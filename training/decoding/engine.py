"""The decoding loop: rows prefilled together, then one forward per step giving every running row a token.

A `Row` is one sequence: a request's choice, a prompt's sample. It carries its sampling, its end tokens,
optionally its text (stop strings, pieces streamed as they become text: training.decoding.text), its
generator, its LoRA adapter, an end from outside (a deadline, a client gone), and, when asked, each chosen
token's log-probability. A row ends at an end token (kept as its last token) or a stop string ("stop"), at
max_tokens or when told from outside ("length").

A `Decoder` holds the running rows and their KV cache (training.decoding.kv) on one model. `prefill` adds
the rows of some prompts in one forward (left-padded; a prompt's rows take their first token from its
logits); `step` gives every running row its next token in one forward. Two ways to run it:
  - continuous batching (inference.batcher): rows join between steps and leave as soon as they end; each
    row draws from its own generator and may use its own adapter (lora_rows);
  - a fixed batch (`decode`: rollouts, samples, the one-request engine): prefilled once, every row fed
    its padding once it has ended, until all have ended, with one draw for the batch from torch's
    generator: transformers' generate(), step for step (the inputs it gives the model, its sampling, its
    RNG draws), so a seeded rollout samples what generate() sampled; a StaticCache optionally, with which
    the decoding step is compiled on a GPU as generate(cache_implementation="static") compiles it.
The caller picks the grad mode (no_grad in training: a tensor made under inference_mode could not be
saved for backward later; inference_mode serving), the model's mode, its attention and the RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from training.decoding import sampling
from training.decoding.constraint import Constraint
from training.decoding.kv import BatchCache, new_cache
from training.decoding.lora_rows import BASE_ROWS, AdapterRows
from training.decoding.sampling import Sampling
from training.decoding.text import TextStream


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # every generated token, the end token included
    finish_reason: str = "length"

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Media:
    """A prompt's images as a vision-language model reads them (Qwen2.5-VL): its image processor's pixel
    values and grids, and the prompt's 3-D rotary positions [3, prompt tokens] (training.vision)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: torch.Tensor

    @property
    def delta(self) -> int:
        """The position of a token after the prompt less its index (images take fewer positions)."""
        return int(self.positions.max()) + 1 - self.positions.shape[1] if self.positions.numel() else 0


@dataclass(kw_only=True, eq=False)
class Row:
    """One sequence the engine decodes (a caller may subclass it to carry its own fields)."""

    sampling: Sampling  # its max_tokens set
    stops: Collection[int] = ()  # end tokens
    text: TextStream | None = None  # its text, stop strings and streamed pieces (None: ids only)
    generator: torch.Generator | None = None  # its draws when each row draws its own (None: torch's)
    adapter: str = BASE_ROWS  # its LoRA adapter's slot, with per-row adapters
    ended: Callable[[], bool] | None = None  # True: it ends now, at the tokens it has ("length")
    on_finish: Callable[[Row], None] | None = None  # called once it has ended
    logprobs: list[float] | None = None  # [] to ask: each chosen token's log-probability (no warper)
    constraint: Constraint | None = None  # a grammar its text keeps to (training.decoding.constraint)
    position_delta: int | None = None  # set: 3-D rotary positions (a vision-language model), this offset
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once it has ended

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> Completion:
        return Completion(self.text.text if self.text else "", self.tokens, self.finish_reason or "length")


class Decoder:
    """Rows decoded together on one model: `prefill` adds rows, `step` gives each running one a token."""

    def __init__(
        self,
        model: Any,
        *,
        fixed: bool = False,
        draws: Literal["rows", "batch"] = "rows",
        per_row_adapters: bool = False,
        static_cache: bool = False,
        pad: int = 0,
    ) -> None:
        """`model`: a transformers model or a peft one (the caller may swap it between steps for one
        holding the same weights: peft wraps a base when its first adapter is attached). `fixed`: one
        prefill, and rows stay until all have ended (needed by `draws="batch"` and `static_cache`).
        `per_row_adapters`: rows use their own adapter slots (a serving model's peft adapters), else the
        model as it is set. `pad`: the token prompts are padded with, and ended rows are fed."""
        if (draws == "batch" or static_cache) and not fixed:
            raise ValueError("one draw for the batch and a static cache need a fixed batch")
        self.model = model
        self.fixed, self.draws, self.pad = fixed, draws, pad
        self._adapters = AdapterRows() if per_row_adapters else None
        self._static = static_cache
        self._compiled: Callable[..., Any] | None = None
        self._cache = BatchCache()
        self.rows: list[Row] = []
        self.steps = 0  # decoding steps run (not counting prefills)

    @property
    def running(self) -> bool:
        return any(not row.done for row in self.rows)

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        rows: Sequence[Sequence[Row]],
        media: Sequence[Media | None] | None = None,
    ) -> None:
        """One forward over `prompts` (left-padded to the longest): the rows of each (rows[i] continue
        prompts[i]) take their first token from its logits; those still going join the batch (a fixed
        batch's rows all join). With one draw for the batch a prompt has one row: repeat it for more.
        `media`: each prompt's images (a vision-language model: every prompt of its batches has an entry,
        None for one without images)."""
        flat = [row for group in rows for row in group]
        if self.fixed and self.rows:
            raise ValueError("a fixed batch is prefilled once")
        if self.draws == "batch" and (
            any(len(group) != 1 for group in rows) or len({_warpers(r.sampling) for r in flat}) > 1
        ):
            raise ValueError("one draw for the batch: one row per prompt, all with the same sampling")
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        device = device_of(self.model)
        ids = [[self.pad] * (width - len(p)) + list(p) for p in prompts]
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
        longest = max(_max_tokens(row) for row in flat)
        cache = new_cache(hf_model(self.model), width + longest - 1 if self._static else None)
        inputs: dict[str, Any] = {"position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
        if media is not None:
            inputs = self._media_inputs(media, lengths, rows, device)
        logits = self._forward(
            [group[0].adapter for group in rows],
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            attention_mask=mask if min(lengths) < width else None,  # none without padding, as generate()
            cache=cache,
            **inputs,
        )
        sources = [i for i, group in enumerate(rows) for _ in group]
        if sources != list(range(len(prompts))):
            logits = logits.index_select(0, torch.tensor(sources, device=logits.device))
        tokens = self._choose(logits, flat)
        going = [
            k for k, (row, token) in enumerate(zip(flat, tokens, strict=True)) if not self._add(row, token)
        ]
        if self.fixed:
            going = list(range(len(flat)))
        if going:
            self._cache.join(cache, mask, [sources[k] for k in going], [lengths[sources[k]] for k in going])
            self.rows += [flat[k] for k in going]
        if self._static and self._compiled is None:
            self._compiled = compiled_step(hf_model(self.model))

    def _media_inputs(
        self, media: Sequence[Media | None], lengths: list[int], rows: Sequence[Sequence[Row]], device: Any
    ) -> dict[str, torch.Tensor]:
        """A vision-language prefill's inputs: the images' pixels and grids, and 3-D positions [3, rows,
        width] (each prompt's, left-padded); each row keeps its prompt's position delta for its steps."""
        width, out = max(lengths), {}
        positions = []
        for m, n, group in zip(media, lengths, rows, strict=True):
            own = m.positions if m is not None else torch.arange(n).expand(3, n)
            positions.append(F.pad(own, (width - n, 0)))
            for row in group:
                row.position_delta = m.delta if m is not None else 0
        pictured = [m for m in media if m is not None and m.image_grid_thw.numel()]
        if pictured:
            dtype = next(self.model.parameters()).dtype
            out["pixel_values"] = torch.cat([m.pixel_values for m in pictured]).to(device, dtype)
            out["image_grid_thw"] = torch.cat([m.image_grid_thw for m in pictured]).to(device)
        out["position_ids"] = torch.stack(positions, dim=1).to(device)
        return out

    def step(self) -> None:
        """One token for every running row. Rows ended from outside since their last token finish first,
        as they stand; rows that end leave the batch (a fixed batch's stay, fed padding, until all end)."""
        for row in self.rows:
            if not row.done and row.ended is not None and row.ended():
                self._finish(row, "length")
        self._leave()
        if not self.running:
            return
        rows, cache = self.rows, self._cache
        mask, positions = cache.step_inputs()
        if any(row.position_delta is not None for row in rows):  # 3-D rotary positions, text's
            deltas = torch.tensor([row.position_delta or 0 for row in rows], device=positions.device)
            positions = (positions + deltas[:, None]).unsqueeze(0).expand(3, -1, -1)
        ids = [[self.pad if row.done else row.tokens[-1]] for row in rows]
        logits = self._forward(
            [row.adapter for row in rows],
            step=True,
            input_ids=torch.tensor(ids, dtype=torch.long, device=mask.device),
            attention_mask=mask if cache.padded else None,
            position_ids=positions,
            cache=cache.cache,
        )
        cache.advanced(mask)
        self.steps += 1
        for row, token in zip(rows, self._choose(logits, rows), strict=True):
            if not row.done:
                self._add(row, token)
        self._leave()

    def _add(self, row: Row, token: int) -> bool:
        """Record a row's new token (streamed as text); True when the row has ended."""
        row.tokens.append(token)
        if row.text is not None:
            row.text.add(token)
        if row.constraint is not None and token not in row.stops:
            row.constraint.accept(token)
        if token in row.stops or (row.text is not None and row.text.stopped):
            self._finish(row, "stop")
        elif len(row.tokens) >= _max_tokens(row) or (row.ended is not None and row.ended()):
            self._finish(row, "length")
        return row.done

    def _finish(self, row: Row, reason: str) -> None:
        row.finish_reason = reason
        if row.text is not None:
            row.text.finish()
        if row.on_finish is not None:
            row.on_finish(row)

    def _leave(self) -> None:
        """Rows that have ended leave the batch (not a fixed one's); the others keep their cache."""
        if self.fixed:
            return
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self._cache.keep(keep)

    def _choose(self, logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
        """Each row's next token (and its log-probability under the model, for rows that asked); a row
        with a grammar chooses among the tokens it allows."""
        asked = [i for i, row in enumerate(rows) if row.logprobs is not None and not row.done]
        own = logits.log_softmax(dim=-1) if asked else None  # before any grammar masks the logits
        for i, row in enumerate(rows):
            if row.constraint is not None and not row.done:
                row.constraint.restrict(logits[i], row.stops)
        if self.draws == "batch":
            chosen: torch.Tensor | None = sampling.batch(logits, rows[0].sampling)
            tokens = chosen.tolist()  # type: ignore[union-attr]
        else:
            chosen = None
            tokens = sampling.per_row(logits, [r.sampling for r in rows], [r.generator for r in rows])
        if own is not None:
            index = chosen if chosen is not None else torch.tensor(tokens, device=logits.device)
            values = own.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
            for i in asked:
                rows[i].logprobs.append(values[i])  # type: ignore[union-attr]
        return tokens

    def _forward(self, slots: Sequence[str], *, step: bool = False, **inputs: Any) -> torch.Tensor:
        """The model's last-position logits (float32) for these rows, as generate() calls the model."""
        inputs |= {"use_cache": True, "logits_to_keep": 1}
        if self._adapters is not None:
            return self._adapters.forward(self.model, slots, inputs).logits[:, -1].to(dtype=torch.float32)
        model = call = hf_model(self.model)
        if self._static:  # generate()'s inputs for a compilable cache: a 4-D mask of the cache's width
            inputs = model.prepare_inputs_for_generation(is_first_iteration=not step, **inputs)
            if step and self._compiled is not None:
                call = self._compiled
        logits = call(**inputs).logits[:, -1]
        # a compiled step's output lives in a buffer its next call overwrites: a copy, as generate() makes
        return logits.to(dtype=torch.float32, copy=call is not model)


def decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[Row],
    *,
    pad: int = 0,
    static_cache: bool = False,
    media: Sequence[Media | None] | None = None,
) -> None:
    """A fixed batch decoded to its end: rows[i] continues prompts[i] (a prompt repeated for several rows),
    every row with the same sampling, one draw for the batch from torch's generator on the model's device:
    transformers' generate() of the left-padded prompts, step for step. The rows hold the results.
    `media`: the prompts' images, for a vision-language model (Decoder.prefill)."""
    decoder = Decoder(model, fixed=True, draws="batch", static_cache=static_cache, pad=pad)
    decoder.prefill(prompts, [[row] for row in rows], media)
    while decoder.running:
        decoder.step()


def hf_model(model: Any) -> Any:
    """The transformers model under a peft one (what generate() calls: peft hands generate() to it)."""
    from peft import PeftModel

    # PeftModel.get_base_model() reads the active adapter's config: gone once that adapter is deleted
    return model.base_model.model if isinstance(model, PeftModel) else model


def compiled_step(model: Any) -> Callable[..., Any] | None:
    """generate()'s choice for a static cache: the model's call compiled (its generation config's
    compile_config) on a GPU, or on any device when that config says so; none when its generation config
    disables compiling or its quantizer cannot compile."""
    config = model.generation_config
    compile_config = getattr(config, "compile_config", None)
    everywhere = bool(getattr(compile_config, "_compile_all_devices", False))
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(config, "disable_compile", False) or (quantizer is not None and not quantizer.is_compileable):
        return None
    if device_of(model).type not in ("cuda", "xpu") and not everywhere:
        return None
    return model.get_compiled_call(compile_config)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The model's end tokens: its generation config's (e.g. the demo's </s> and <|im_end|>), else the
    tokenizer's EOS."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}


def device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def _max_tokens(row: Row) -> int:
    if row.sampling.max_tokens is None:
        raise ValueError("a row decodes at most sampling.max_tokens tokens: set it")
    return row.sampling.max_tokens


def _warpers(s: Sampling) -> tuple[float, float]:
    return (0.0, 1.0) if s.greedy else (s.temperature, s.top_p)
