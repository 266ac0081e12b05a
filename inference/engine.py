"""The engine: base models from the catalog, registered adapters, and which of them are in memory.

Registration (`register`, `unregister`, `resolve`) is cheap bookkeeping, safe from any thread. Everything
that touches torch (`complete`) runs on the one generation thread (inference.scheduler):
  - one base loaded at a time on a CPU (`max_bases`); a request for another base drops the least
    recently used one, with its resident adapters (they reload from their paths on next use)
  - per base at most `max_adapters` adapters resident, fewer when `memory_bytes` says so (the planner's
    planner.serving bound: base + buffers, the rest for adapters); the least recently used adapter
    is deleted from the peft model before another is loaded
  - a base model request runs with the adapters disabled; an adapter request sets its adapter
The batched path (inference.batcher) renders a request with `render` and holds its adapter with `pin`
while its rows decode: a pinned adapter is never evicted nor dropped (unregistered, it goes once
unpinned), and one that cannot be made resident beside the pinned ones raises `Busy` (the request waits).
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from math import inf
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

from core.catalog import BaseModelInfo, Catalog
from core.data.examples import Message
from inference import adapters
from inference.adapters import Adapter
from inference.errors import Busy, EngineError, invalid, model_not_found
from inference.structured import Shape
from inference.tool_calls import ToolFormat
from training.decoding.constraint import Grammar
from training.decoding.engine import Completion, Media, Row, decode, eos_ids
from training.decoding.lora_rows import BASE_ROWS
from training.decoding.sampling import Sampling
from training.decoding.text import TextStream

if TYPE_CHECKING:
    from training.vision import Processor


@dataclass
class LoadedBase:
    info: BaseModelInfo
    model: object  # the transformers model, a peft PeftModel once an adapter is attached
    tokenizer: object
    context: int  # max positions
    fixed_bytes: int  # the planner's bound without adapters (base + generation buffers)
    processor: Processor | None = None  # a vision-language base's (its images): training.vision
    resident: OrderedDict[str, tuple[str, Adapter, int]] = field(default_factory=OrderedDict)
    # lora_name -> (peft slot, the registration it was loaded from, resident bytes); oldest use first


@dataclass(frozen=True)
class Prepared:
    """A request ready to generate: the model set for it, its prompt ids, its sampling and what its
    answer must be (inference.structured: the grammar it keeps to, the format its tool calls are read in)."""

    model: object
    tokenizer: object
    prompt: list[int]
    sampling: Sampling
    base_only: bool
    grammar: Grammar | None = None
    tool_format: ToolFormat | None = None
    media: Media | None = None  # its images, on a vision-language base


class Rendered(NamedTuple):
    loaded: LoadedBase
    prompt: list[int]
    sampling: Sampling  # max_tokens filled in
    media: Media | None  # the prompt's images, on a vision-language base


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a base (adapter None) or a registered adapter on its base."""

    base: str
    adapter: Adapter | None


class Engine:
    def __init__(
        self,
        catalog: Catalog,
        *,
        max_adapters: int = 8,
        max_bases: int = 1,
        memory_bytes: int | None = None,
        adapter_root: Path | None = None,
        max_batch_tokens: int = 2048,
        max_running: int = 32,
    ) -> None:
        if max_adapters < 1 or max_bases < 1:
            raise ValueError("max_adapters and max_bases must be at least 1")
        self.catalog = catalog
        self.max_adapters = max_adapters
        self.max_bases = max_bases
        self.memory_bytes = memory_bytes
        self.adapter_root = adapter_root
        self.max_batch_tokens = max_batch_tokens  # the batcher's bounds, which the memory bound counts
        self.max_running = max_running
        self._lock = threading.Lock()  # guards the registry (written by the server, read by generation)
        self._registry: dict[str, Adapter] = {}
        self._bases: OrderedDict[str, LoadedBase] = OrderedDict()  # oldest use first
        self._slots = itertools.count()
        self.evictions: list[str] = []  # lora names evicted, in order (for tests and logs)
        self._pinned: Counter[str] = Counter()  # lora name -> rows decoding with it (generation thread)

    # -- registry (any thread) --------------------------------------------------------------------------
    def register(self, name: str, path: str, base_model: str | None = None) -> Adapter:
        adapter = adapters.check_adapter(name, path, base_model, self.catalog, self.adapter_root)
        if self._is_base(name):
            raise invalid(f"{name!r} is a base model's name", "lora_name", code="lora_name_taken")
        with self._lock:
            known = self._registry.get(name)
            if known is not None and (known.path, known.base) != (adapter.path, adapter.base):
                raise invalid(
                    # vLLM's words, which clients (api/inference_client.py) recognise
                    f"The lora adapter {name!r} has already been loaded (from {known.path}); unload it first",
                    "lora_name",
                    code="lora_already_loaded",
                )
            self._registry[name] = known or adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter; the generation thread deletes its resident copy before its next request."""
        with self._lock:
            if self._registry.pop(name, None) is None:
                raise EngineError(404, "lora_not_found", f"no LoRA adapter named {name!r}", param="lora_name")

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return list(self._registry.values())

    def base_models(self) -> list[BaseModelInfo]:
        return self.catalog.list()

    def resolve(self, model: str) -> Target:
        """The base or adapter a request names; 404 model_not_found otherwise."""
        with self._lock:
            adapter = self._registry.get(model)
        if adapter is not None:
            return Target(adapter.base, adapter)
        if self._is_base(model):
            return Target(self.catalog.get(model).name, None)
        raise model_not_found(model)

    def _is_base(self, name: str) -> bool:
        try:
            self.catalog.get(name)
            return True
        except Exception:
            return False

    # -- generation thread ------------------------------------------------------------------------------
    def start(
        self,
        target: Target,
        messages: Sequence[Message] | Sequence[dict[str, Any]],
        sampling: Sampling,
        shape: Shape = Shape(),
    ) -> Prepared:
        """Load what the target needs and render its prompt; a prompt that does not fit, or an answer
        shape it cannot keep to, is a 400 here, before any token is generated (and before a stream has
        sent its headers)."""
        loaded, ids, sampling, media = self.render(target, messages, sampling, shape.tools)
        grammar, fmt = self.shaped(target, loaded, shape)
        _, model = self.prepare(target)
        return Prepared(model, loaded.tokenizer, ids, sampling, target.adapter is None, grammar, fmt, media)

    def shaped(
        self, target: Target, loaded: LoadedBase, shape: Shape
    ) -> tuple[Grammar | None, ToolFormat | None]:
        """The grammar a request's answers keep to and the format its calls are read in, on its base."""
        name = target.adapter.name if target.adapter else target.base
        fmt = shape.tool_format(loaded.tokenizer, name)
        return shape.grammar(loaded.tokenizer, fmt), fmt

    def reads_images(self, target: Target) -> bool:
        """The target's base is a vision-language one (its requests' messages keep their image parts)."""
        from training.vision_model import is_vision_base

        return is_vision_base(self.catalog.get(target.base).path)

    def render(
        self,
        target: Target,
        messages: Sequence[Message] | Sequence[dict[str, Any]],
        sampling: Sampling,
        tools: Sequence[dict[str, Any]] = (),
    ) -> Rendered:
        """The target's base loaded, the prompt's ids (with the tools offered), the sampling with
        max_tokens filled in (up to the context) and, on a vision-language base, the prompt's images
        (`messages` are then the request's checked dicts, image parts kept); 400 context_length_exceeded
        when they do not fit."""
        from inference.prompt import prompt_ids
        from training.vision import prompt_inputs

        loaded = self._base(target.base)
        self._drop_unregistered(loaded)
        media = None
        if loaded.processor is not None:
            ids, media = prompt_inputs(list(messages), loaded.processor, tools)  # type: ignore[arg-type]
        else:
            ids = prompt_ids(messages, loaded.tokenizer, tools)  # type: ignore[arg-type]
        room = loaded.context - len(ids)
        if room < 1 or (sampling.max_tokens or 0) > room:
            raise invalid(
                f"the prompt is {len(ids)} tokens and max_tokens {sampling.max_tokens}; this model's "
                f"context is {loaded.context} tokens",
                "max_tokens" if room >= 1 else "messages",
                code="context_length_exceeded",
            )
        return Rendered(loaded, ids, replace(sampling, max_tokens=sampling.max_tokens or room), media)

    def pin(self, target: Target) -> str:
        """Make the target's adapter resident (its base is loaded: `render` came first) and hold it until
        `unpin`: its peft slot, or "__base__" for a base model. Busy when only a pinned adapter could
        make room for it."""
        if target.adapter is None:
            return BASE_ROWS
        loaded = self._bases[target.base]
        name = target.adapter.name
        entry = loaded.resident.get(name)
        if entry is not None and entry[1] != target.adapter:  # registered again from elsewhere
            if name in self._pinned:
                raise Busy(f"adapter {name!r} waits for its previous registration's rows to finish")
            self._evict(loaded, name)
            entry = None
        if entry is None:
            entry = self._load_adapter(loaded, target.adapter)
        loaded.resident.move_to_end(name)
        self._pinned[name] += 1
        return entry[0]

    def unpin(self, target: Target) -> None:
        if target.adapter is not None:
            self._pinned[target.adapter.name] -= 1
            if self._pinned[target.adapter.name] <= 0:
                del self._pinned[target.adapter.name]

    def generate(
        self,
        prepared: Prepared,
        on_text: Callable[[str], None] = lambda _: None,
        cancelled: threading.Event | None = None,
        deadline: float | None = None,
    ) -> Completion:
        """One completion of a started request (call right after start: the model is set for it), decoded
        alone as transformers' generate() would (training.decoding: a batch of one, drawing from torch's
        generator); `on_text` gets each piece of text as it is released. It ends at the next token once
        `cancelled` is set or time.monotonic() passes `deadline` (finish "length")."""
        p = prepared
        model = p.model
        if p.base_only and _is_peft(model):
            if not model.peft_config:  # type: ignore[attr-defined]
                # every adapter evicted: the wrapped layers hold none, the inner model is the plain base
                return _generate(model.base_model.model, p, on_text, cancelled, deadline)  # type: ignore[attr-defined]
            with model.disable_adapter():  # type: ignore[attr-defined]
                return _generate(model, p, on_text, cancelled, deadline)
        if _is_peft(model):  # the batched path (training.decoding.lora_rows) may have left them off
            model.base_model.enable_adapter_layers()  # type: ignore[attr-defined]
        return _generate(model, p, on_text, cancelled, deadline)

    def complete(
        self,
        target: Target,
        messages: Sequence[Message],
        sampling: Sampling,
        seed: int | None = None,
        shape: Shape = Shape(),
    ) -> tuple[int, Completion]:
        """start + generate: (prompt tokens, the completion)."""
        prepared = self.start(target, messages, sampling, shape)
        if seed is not None:
            seed_everything(seed)
        return len(prepared.prompt), self.generate(prepared)

    def prepare(self, target: Target) -> tuple[LoadedBase, object]:
        """Load the target's base (dropping another) and make its adapter resident and active."""
        loaded = self._base(target.base)
        self._drop_unregistered(loaded)
        if target.adapter is None:
            return loaded, loaded.model
        name = target.adapter.name
        entry = loaded.resident.get(name)
        if entry is None:
            entry = self._load_adapter(loaded, target.adapter)
        loaded.resident.move_to_end(name)
        loaded.model.set_adapter(entry[0])  # type: ignore[attr-defined]
        return loaded, loaded.model

    def resident_adapters(self, base: str) -> list[str]:
        """Lora names in memory on `base`, least recently used first."""
        loaded = self._bases.get(base)
        return list(loaded.resident) if loaded else []

    def loaded_model(self, base: str):
        return self._bases[base].model

    def _base(self, name: str) -> LoadedBase:
        loaded = self._bases.get(name)
        if loaded is not None:
            self._bases.move_to_end(name)
            return loaded
        while len(self._bases) >= self.max_bases:
            self._bases.popitem(last=False)
            gc.collect()  # free the dropped weights before loading the next base
        loaded = load_base(self.catalog.get(name), self.max_batch_tokens, self.max_running)
        self._bases[name] = loaded
        return loaded

    def _drop_unregistered(self, loaded: LoadedBase) -> None:
        with self._lock:
            registry = dict(self._registry)
        for name, (_slot, adapter, _) in list(loaded.resident.items()):
            if registry.get(name) != adapter and name not in self._pinned:
                self._evict(loaded, name)

    def _load_adapter(self, loaded: LoadedBase, adapter: Adapter) -> tuple[str, Adapter, int]:
        # fp32 once resident; its file may hold a half-precision copy (conservative: count 4 B/value)
        want = adapter.nbytes * 4 // _min_element_size(adapter)
        while len(loaded.resident) >= self.max_adapters or not self._fits(loaded, want):
            unpinned = [name for name in loaded.resident if name not in self._pinned]  # oldest use first
            if not unpinned:
                break
            self._evict(loaded, unpinned[0])
        if loaded.resident.keys() & self._pinned.keys() and (
            len(loaded.resident) >= self.max_adapters or not self._fits(loaded, want)
        ):
            raise Busy(f"adapter {adapter.name!r} waits for a pinned adapter to be released")
        if not self._fits(loaded, want):
            raise EngineError(
                400,
                "adapter_too_large",
                f"adapter {adapter.name!r} ({want:,} B) does not fit in --memory-bytes beside its base",
                param="model",
            )
        slot = f"slot{next(self._slots)}"
        loaded.model = adapters.attach(loaded.model, slot, adapter)
        if loaded.model.active_adapter not in loaded.model.peft_config:  # type: ignore[attr-defined]
            loaded.model.set_adapter(slot)  # type: ignore[attr-defined]  # the last active one was evicted
        entry = (slot, adapter, adapters.resident_bytes(loaded.model, slot))
        loaded.resident[adapter.name] = entry
        return entry

    def _fits(self, loaded: LoadedBase, want: int) -> bool:
        if self.memory_bytes is None:
            return True
        used = sum(b for _, _, b in loaded.resident.values())
        return loaded.fixed_bytes + used + want <= self.memory_bytes

    def _evict(self, loaded: LoadedBase, name: str) -> None:
        slot, _, _ = loaded.resident.pop(name)
        loaded.model.delete_adapter(slot)  # type: ignore[attr-defined]
        self.evictions.append(name)
        gc.collect()


def _generate(
    model, p: Prepared, on_text, cancelled: threading.Event | None, deadline: float | None
) -> Completion:
    """A batch of one on the model as it is set (training.decoding.engine.decode)."""
    import time

    import torch

    eos = set() if p.sampling.ignore_eos else eos_ids(model, p.tokenizer)
    gone, until = cancelled or threading.Event(), inf if deadline is None else deadline
    text = TextStream(p.tokenizer, p.sampling.stop, eos, on_text, keep_special=p.tool_format is not None)
    constraint = p.grammar.constraint() if p.grammar is not None else None
    row = Row(sampling=p.sampling, stops=eos, text=text, constraint=constraint)
    row.ended = lambda: gone.is_set() or time.monotonic() >= until
    with torch.inference_mode():
        decode(model, [p.prompt], [row], media=[p.media] if p.media is not None else None)
    return row.completion()


def seed_everything(seed: int) -> None:
    """Sampling draws from torch's global generator; only the generation thread uses it."""
    import torch

    torch.manual_seed(seed)


def _min_element_size(adapter: Adapter) -> int:
    """Bytes per value in the adapter's file (its header says; ftune writes fp32)."""
    import json
    import struct

    with (adapter.path / adapters.WEIGHTS).open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
    found = [sizes.get(v["dtype"], 4) for k, v in header.items() if k != "__metadata__"]
    return min(found) if found else 4


def _is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def load_base(
    info: BaseModelInfo, max_batch_tokens: int = 2048, max_running: int = 32, max_seq_len: int = 2048
) -> LoadedBase:
    """A catalog model as training loads it (training.model: the checkpoint's dtype, local files only,
    never remote code, safetensors weights), in eval mode with the KV cache on; its memory bound counts
    the batcher's bounds (max_batch_tokens, max_running rows)."""
    from core.arch import load_architecture
    from planner.serving import serving_bytes
    from training import vision, vision_model
    from training.model import base_dtype, load_tokenizer, pick_device

    dtype = base_dtype(SimpleNamespace(torch_dtype="auto"), info.path)  # type: ignore[arg-type]
    model = vision_model.auto_model_class(info.path).from_pretrained(
        info.path, dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
    )
    processor = vision.load_processor(info.path) if vision_model.is_vision_base(info.path) else None
    if processor is not None:
        vision_model.prepare_model(model)
    model.to(pick_device())
    model.eval()
    model.config.use_cache = True
    for p in model.parameters():
        p.requires_grad_(False)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    try:
        fixed = serving_bytes(
            load_architecture(info.path),
            max_adapters=0,
            max_seq_len=min(context, max_seq_len),
            max_batch=max_running,
            max_batch_tokens=max_batch_tokens,
            dtype=str(dtype).removeprefix("torch."),
        )
    except Exception:  # an architecture the planner does not know: weights only
        fixed = sum(p.numel() * p.element_size() for p in model.parameters())
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(info.path)
    return LoadedBase(info, model, tokenizer, context, fixed, processor)
