"""Chat completions end to end on real processes: `ftune up` (API, broker, training and CPU workers, and
ftune's inference engine) trains a short job on the demo model with one example repeated, then the official
openai SDK chats with `job.fine_tuned_model`, streaming and not, through the API's forwarding to the engine.

Greedy decoding (temperature 0): the streamed chunks join to the non-streamed answer; the tuned model's
answer on the training prompt differs from the base model's and shares more tokens with the training target.
The checkpoints the job keeps are models too (`...:ckpt-step-<n>`): the last one, saved at the final step with
the final adapter's weights, answers as the final model does; a pruned one is 404 model_not_found.
The training worker declares its memory less the engine's bound (cli/inference.py), as `ftune up` plans it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

from cli.inference import engine_bound
from core import ft_names
from core.catalog import Catalog
from tests.e2e.stack import TEST_ADMIN_KEY, Up, api, upload, wait_finished

pytestmark = pytest.mark.slow
BASE = "ftune-demo"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TARGET = "The capital of France is Paris."
SPEC = {"base_model": BASE, "method": "lora", "max_seq_len": 64, "micro_batch_size": 1, "lora_r": 16}
# one example repeated: a batch of it learns what one copy does, at a quarter of the compute
SPEC |= {"lora_alpha": 32, "lora_dropout": 0.0, "max_steps": 30, "learning_rate": 1e-2, "warmup_steps": 2}
# saved at steps 10, 20, 30 and at each epoch's end; the newest two are kept, step 10's pruned
SPEC |= {"checkpoint_every_steps": 10, "keep_checkpoints": 2}
GREEDY: Any = {"messages": PROMPT, "max_tokens": 16, "temperature": 0}


def overlap(tokenizer: object, answer: str) -> float:
    """Share of the target's tokens (as a multiset) that the answer has."""
    target = Counter(tokenizer(TARGET)["input_ids"])  # type: ignore[operator]
    got = Counter(tokenizer(answer)["input_ids"])  # type: ignore[operator]
    return sum((target & got).values()) / sum(target.values())


@pytest.fixture(scope="module")
def trained(up: Up, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    """The module's one job, trained to success: (its id, seconds it took)."""
    data = tmp_path_factory.mktemp("chat") / "one.jsonl"
    row = {"messages": [*PROMPT, {"role": "assistant", "content": TARGET}]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(16)))
    dataset = upload(up.base, data)
    r = api.post(f"{up.base}/jobs", json={**SPEC, "dataset_id": dataset["id"]})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    started = time.monotonic()
    assert wait_finished(up.base, [job_id], timeout=300)[job_id][-1]["status"] == "succeeded"
    return job_id, time.monotonic() - started


def test_a_fine_tuned_model_answers_through_chat_completions(
    up: Up, models_dir: Path, trained: tuple[str, float]
) -> None:
    job_id, trained_s = trained
    with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{up.base}/v1", max_retries=0, timeout=120) as sdk:
        model = sdk.fine_tuning.jobs.retrieve(job_id).fine_tuned_model
        assert model is not None and model in {m.id for m in sdk.models.list()}

        started = time.monotonic()
        tuned = sdk.chat.completions.create(model=model, **GREEDY)  # type: ignore[call-overload]
        first_s = time.monotonic() - started  # registers the adapter and loads the base
        answer = tuned.choices[0].message.content or ""
        assert tuned.model == model and tuned.usage is not None and tuned.usage.completion_tokens > 0

        stream = sdk.chat.completions.create(model=model, stream=True, **GREEDY)  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer

        base = sdk.chat.completions.create(model=BASE, **GREEDY)  # type: ignore[call-overload]
        base_answer = base.choices[0].message.content or ""

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models_dir / BASE, local_files_only=True)
    print(f"trained in {trained_s:.1f} s; first answer in {first_s:.1f} s")
    print(f"tuned: {answer!r} (overlap {overlap(tokenizer, answer):.2f})")
    print(f"base:  {base_answer!r} (overlap {overlap(tokenizer, base_answer):.2f})")
    assert answer != base_answer
    assert overlap(tokenizer, answer) > overlap(tokenizer, base_answer)


def test_a_kept_checkpoint_answers_through_chat_completions(up: Up, trained: tuple[str, float]) -> None:
    job_id, _ = trained
    with openai.OpenAI(api_key=TEST_ADMIN_KEY, base_url=f"{up.base}/v1", max_retries=0, timeout=120) as sdk:
        final = sdk.fine_tuning.jobs.retrieve(job_id).fine_tuned_model
        assert final is not None
        kept = {
            c.step_number: c.fine_tuned_model_checkpoint
            for c in sdk.fine_tuning.jobs.checkpoints.list(job_id)
        }
        assert len(kept) == 2 and max(kept) == 30 and 10 not in kept
        assert kept == {step: ft_names.checkpoint_model(final, step) for step in kept}
        listed = [m.id for m in sdk.models.list()]
        assert set(kept.values()) <= set(listed) and ft_names.checkpoint_model(final, 10) not in listed

        tuned = sdk.chat.completions.create(model=final, **GREEDY)
        last = sdk.chat.completions.create(model=kept[30], **GREEDY)
        assert last.model == kept[30]
        assert last.choices[0].message.content == tuned.choices[0].message.content  # the same weights
        middle = sdk.chat.completions.create(model=kept[min(kept)], **GREEDY)
        assert middle.usage is not None and middle.usage.completion_tokens > 0
        answers = {min(kept): middle.choices[0].message.content, 30: last.choices[0].message.content}
        print(f"checkpoints' answers: {answers}")

        with pytest.raises(openai.NotFoundError) as e:  # pruned by keep_checkpoints
            sdk.chat.completions.create(model=ft_names.checkpoint_model(final, 10), **GREEDY)
        assert e.value.code == "model_not_found" and e.value.param == "model"


def test_the_training_worker_declares_its_memory_less_the_engines_bound(
    up: Up, models_dir: Path, tmp_path: Path
) -> None:
    bound = engine_bound(Catalog(models_dir, tmp_path / "no-hf-cache"))  # as the stack sees it
    assert bound > 0
    deadline = time.monotonic() + 30
    while not (trainers := [w for w in api.get(f"{up.base}/workers").json() if w["id"].endswith("-up")]):
        assert time.monotonic() < deadline, "the training worker never registered"
        time.sleep(0.3)
    trainer = trainers[0]
    declared = trainer["devices"][0]
    ram = _ram_bytes()
    assert declared["kind"] == "cpu"
    assert ram - bound - 2**20 < declared["memory_bytes"] <= ram - bound  # rounded down to MiB
    assert f"bound {bound / 2**30:.2f} GiB" in up.log.read_text()


def _ram_bytes() -> int:
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
