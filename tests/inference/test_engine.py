"""The engine in-process (no HTTP): ten adapters on one copy of the base, LRU eviction, and answers equal to
plain transformers / peft generate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from core.catalog import Catalog
from core.data.examples import Message
from inference.engine import Engine, Target
from inference.errors import EngineError
from tests.inference.conftest import BASE
from tests.training.reference_decoding import generate_alone
from training.decoding.engine import eos_ids
from training.decoding.sampling import Sampling

MESSAGES = [Message(role="system", content="Be brief."), Message(role="user", content="What is a tree?")]
GREEDY = Sampling(max_tokens=12, temperature=0)


def base_storages(model) -> dict[int, int]:
    """data_ptr -> bytes of the storages behind the base model's own weights (not LoRA's)."""
    return {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for n, p in model.named_parameters()
        if ".lora_" not in n
    }


def param_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def plain_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' generate, greedy, on a model built without the engine."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def load_plain(model_dir: Path, adapter: Path | None = None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    model.eval()
    return PeftModel.from_pretrained(model, adapter).eval() if adapter else model


def test_ten_adapters_on_one_base_then_the_eleventh_evicts_the_least_recently_used(
    catalog: Catalog, tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    engine = Engine(catalog, max_adapters=10)
    dirs = [make_adapter(seed) for seed in range(11)]
    for i, d in enumerate(dirs):
        engine.register(f"ft:tiny:a{i}", str(d))  # base from adapter_config.json's name, via the catalog

    base_answer = engine.complete(engine.resolve(BASE), MESSAGES, GREEDY)[1]
    plain_base = engine.loaded_model(BASE)
    weights_alone = param_bytes(plain_base)
    storages_alone = base_storages(plain_base)

    answers, sizes = [], []
    for i in range(10):
        _, done = engine.complete(engine.resolve(f"ft:tiny:a{i}"), MESSAGES, GREEDY)
        answers.append(done.token_ids)
        model = engine.loaded_model(BASE)
        # one copy of the base: the same storages, however many adapters sit on it
        assert base_storages(model) == storages_alone
        sizes.append(param_bytes(model))
    one_adapter = sizes[0] - weights_alone
    assert one_adapter > 0
    assert sizes == [weights_alone + k * one_adapter for k in range(1, 11)]  # only adapter bytes are added
    assert len({tuple(a) for a in answers}) == 10, "every adapter answers differently"
    assert all(a != base_answer.token_ids for a in answers)
    assert engine.resident_adapters(BASE) == [f"ft:tiny:a{i}" for i in range(10)]
    assert engine.evictions == []

    # a0 used again: a1 is now the least recently used, and the eleventh evicts it
    engine.complete(engine.resolve("ft:tiny:a0"), MESSAGES, GREEDY)
    _, eleventh = engine.complete(engine.resolve("ft:tiny:a10"), MESSAGES, GREEDY)
    assert engine.evictions == ["ft:tiny:a1"]
    assert "ft:tiny:a1" not in engine.resident_adapters(BASE)
    assert len(engine.resident_adapters(BASE)) == 10
    assert param_bytes(engine.loaded_model(BASE)) == weights_alone + 10 * one_adapter
    assert base_storages(engine.loaded_model(BASE)) == storages_alone

    # the evicted one reloads from its path and answers as before (evicting the next least recent, a2)
    _, again = engine.complete(engine.resolve("ft:tiny:a1"), MESSAGES, GREEDY)
    assert again.token_ids == answers[1]
    assert engine.evictions == ["ft:tiny:a1", "ft:tiny:a2"]

    # exactness: each adapter's greedy answer is plain peft generate's on a separately loaded model
    prompt = engine.start(engine.resolve("ft:tiny:a3"), MESSAGES, GREEDY).prompt
    for i in (3, 10):
        oracle = plain_generate(load_plain(tiny_model, dirs[i]), prompt, GREEDY.max_tokens or 0)
        expected = eleventh.token_ids if i == 10 else answers[i]
        assert expected == oracle, f"adapter {i}"
    # the base with adapters attached (disabled) answers as the plain base model
    _, base_later = engine.complete(engine.resolve(BASE), MESSAGES, GREEDY)
    assert (
        base_later.token_ids
        == base_answer.token_ids
        == plain_generate(load_plain(tiny_model), prompt, GREEDY.max_tokens or 0)
    )


def test_prompt_is_the_chat_template_with_generation_prompt(catalog: Catalog, tiny_model: Path) -> None:
    from training.model import load_tokenizer

    engine = Engine(catalog)
    prepared = engine.start(engine.resolve(BASE), MESSAGES, GREEDY)
    tokenizer = load_tokenizer(tiny_model)
    dicts = [{"role": m.role, "content": m.content} for m in MESSAGES]
    text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prepared.prompt) == text
    assert text.endswith("<|im_start|>assistant\n")


def test_stop_strings_sampling_seed_and_length(catalog: Catalog, make_adapter: Callable[..., Path]) -> None:
    engine = Engine(catalog)
    engine.register("ad", str(make_adapter(0)))
    target = engine.resolve("ad")
    _, full = engine.complete(target, MESSAGES, Sampling(max_tokens=20, temperature=0, ignore_eos=True))
    assert full.tokens == 20 and full.finish_reason == "length"
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    pieces: list[str] = []
    prepared = engine.start(target, MESSAGES, Sampling(max_tokens=20, temperature=0, stop=(stop,)))
    cut = engine.generate(prepared, pieces.append)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)] == "".join(pieces)
    assert cut.tokens < 20

    # a client that went away (scheduler.withdraw sets the event): generation stops at the next token
    gone = threading.Event()
    prepared = engine.start(target, MESSAGES, Sampling(max_tokens=20, temperature=0, ignore_eos=True))
    assert engine.generate(prepared, lambda _: gone.set(), gone).tokens < 5

    # a deadline (wall clock) ends a long generation like max_tokens does: finish_reason "length"
    prepared = engine.start(target, MESSAGES, Sampling(max_tokens=400, temperature=0, ignore_eos=True))
    started = time.monotonic()
    slow = lambda _: time.sleep(0.005)  # noqa: E731  (400 pieces: at least 2 s without the deadline)
    timed = engine.generate(prepared, slow, deadline=started + 0.3)
    assert timed.finish_reason == "length" and 0 < timed.tokens < 400
    assert time.monotonic() - started < 1.5

    sampled = Sampling(max_tokens=10, temperature=1.0, top_p=0.9)
    one = engine.complete(target, MESSAGES, sampled, seed=7)[1].token_ids
    assert engine.complete(target, MESSAGES, sampled, seed=7)[1].token_ids == one
    # exact: transformers' generate() with torch's generator seeded alike (the engine before the decoding one)
    for s in (sampled, Sampling(max_tokens=10, temperature=0.7)):
        p = engine.start(target, MESSAGES, s)
        torch.manual_seed(7)
        oracle, _, _ = generate_alone(
            p.model, p.tokenizer, p.prompt, p.sampling, eos_ids(p.model, p.tokenizer)
        )
        assert engine.complete(target, MESSAGES, s, seed=7)[1].token_ids == oracle
    with pytest.raises(EngineError) as e:
        engine.start(target, MESSAGES, Sampling(max_tokens=10_000))
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "max_tokens")


def test_registration_errors(catalog: Catalog, make_adapter: Callable[..., Path], tmp_path: Path) -> None:
    engine = Engine(catalog)
    good = make_adapter(0)
    engine.register("x", str(good))
    engine.register("x", str(good))  # idempotent
    assert engine.resolve("x") == Target(BASE, engine.adapters()[0])

    def refused(name: str, path: str, base: str | None = None) -> tuple[int, str, str | None]:
        with pytest.raises(EngineError) as e:
            engine.register(name, path, base)
        return e.value.status, e.value.code, e.value.param

    assert refused("x", str(make_adapter(1))) == (400, "lora_already_loaded", "lora_name")
    assert refused("y", str(tmp_path)) == (400, "invalid_adapter", "lora_path")
    assert refused("y", "relative/dir") == (400, "invalid_value", "lora_path")
    assert refused("y", str(good), "no-such-model") == (400, "unknown_base", "base_model")
    assert refused(BASE, str(good)) == (400, "lora_name_taken", "lora_name")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (pickled / "adapter_model.safetensors").write_bytes(b"\x80\x04not safetensors")
    assert refused("y", str(pickled)) == (400, "invalid_adapter", "lora_path")

    engine.unregister("x")
    with pytest.raises(EngineError) as e:
        engine.unregister("x")
    assert (e.value.status, e.value.code) == (404, "lora_not_found")
    with pytest.raises(EngineError) as e:
        engine.resolve("x")
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")


def test_memory_bytes_bounds_resident_adapters(catalog: Catalog, make_adapter: Callable[..., Path]) -> None:
    probe = Engine(catalog)
    probe.register("p", str(make_adapter(0)))
    probe.complete(probe.resolve("p"), MESSAGES, GREEDY)
    loaded = probe._bases[BASE]
    one = loaded.resident["p"][2]
    engine = Engine(catalog, max_adapters=10, memory_bytes=loaded.fixed_bytes + 2 * one + one // 2)
    for i in range(4):
        engine.register(f"m{i}", str(make_adapter(i)))
        engine.complete(engine.resolve(f"m{i}"), MESSAGES, GREEDY)
    assert engine.resident_adapters(BASE) == ["m2", "m3"]
    assert engine.evictions == ["m0", "m1"]


def test_unloaded_adapter_leaves_memory_at_next_request(
    catalog: Catalog, make_adapter: Callable[..., Path]
) -> None:
    engine = Engine(catalog)
    engine.register("gone", str(make_adapter(5)))
    engine.complete(engine.resolve("gone"), MESSAGES, GREEDY)
    engine.unregister("gone")
    engine.complete(engine.resolve(BASE), MESSAGES, GREEDY)
    assert engine.resident_adapters(BASE) == []


def test_one_base_at_a_time_with_its_adapters(
    catalog: Catalog, tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    """A request for another base drops the loaded one and its resident adapters; they come back on use."""
    import shutil

    other = tiny_model.parent / "tiny-copy"
    if not other.exists():
        shutil.copytree(tiny_model, other)
    engine = Engine(catalog)
    engine.register("on-tiny", str(make_adapter(3)))
    _, first = engine.complete(engine.resolve("on-tiny"), MESSAGES, GREEDY)
    assert list(engine._bases) == [BASE] and engine.resident_adapters(BASE) == ["on-tiny"]

    _, copy_answer = engine.complete(engine.resolve("tiny-copy"), MESSAGES, GREEDY)
    assert list(engine._bases) == ["tiny-copy"] and engine.resident_adapters(BASE) == []

    _, again = engine.complete(engine.resolve("on-tiny"), MESSAGES, GREEDY)
    assert list(engine._bases) == [BASE] and again.token_ids == first.token_ids
    _, base_answer = engine.complete(engine.resolve(BASE), MESSAGES, GREEDY)
    assert copy_answer.token_ids == base_answer.token_ids  # the same weights under another name
