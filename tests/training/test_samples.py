"""Before/after samples (training.samples): the texts are what a plain generate() gives, the prompts
come from the validation split, completions are bounded, and sampling does not change training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.run_protocol import SamplesRecord, read_records
from tests.training.util import pair_rows, qa_rows, read_metrics, write_jsonl
from training import samples
from training.data import IGNORE
from training.model import load_model, load_tokenizer
from training.objectives.dpo import Dpo
from training.recipe import load_splits
from training.run import run

CPU = torch.device("cpu")
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}]


def plain_generate(model, ids: list[int], max_new: int, tokenizer) -> str:
    """The oracle: transformers' own greedy generate on the prompt, decoded without special tokens."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_samples_equal_plain_generate_of_the_base_and_of_the_saved_adapter(
    make_config, tiny_model: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = qa_rows(12)
    first_q = rows[0]["messages"][0]["content"]  # the first row is a chat example: prompts render as chat
    config = make_config(
        rows, sample_prompts=[first_q, CHAT], sample_max_tokens=12, max_steps=6, learning_rate=2e-2
    )
    assert run(config) == 0
    records = [
        r for r in read_records(Path(config.output_dir) / "metrics.jsonl") if isinstance(r, SamplesRecord)
    ]
    assert [(r.step, r.at) for r in records] == [(6, "end")]
    items = records[0].items
    assert [i.prompt for i in items] == [first_q, CHAT]

    tok = load_tokenizer(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    # Prompts as the chat template renders them for generation (the tokenizer's own apply_chat_template).
    prompts = [[{"role": "user", "content": first_q}], CHAT]
    ids = [
        list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in prompts
    ]
    assert [plain_generate(base, x, 12, tok) for x in ids] == [i.base for i in items]
    tuned = PeftModel.from_pretrained(base, Path(config.output_dir) / "adapter").eval()
    assert [plain_generate(tuned, x, 12, tok) for x in ids] == [i.tuned for i in items]
    with tuned.disable_adapter():
        assert [plain_generate(tuned, x, 12, tok) for x in ids] == [i.base for i in items]
    assert any(i.base != i.tuned for i in items)  # the adapter changed something


def test_n_prompts_come_from_the_validation_split_as_training_tokenizes_them(make_config, tokenizer) -> None:
    config = make_config(qa_rows(16), sample_prompts=3, validation_fraction=0.5)
    _, val, _, _ = load_splits(config, tokenizer)
    prompts = samples.prompts_for(config, tokenizer, val)
    assert len(prompts) == 3
    for p in prompts:
        # Each prompt is the inputs of a held-out example, up to where its trained reply starts.
        (owner,) = [v for v in val if v.input_ids[: len(p.ids)] == p.ids]
        assert all(label == IGNORE for label in owner.labels[: len(p.ids)])
        assert owner.labels[len(p.ids)] != IGNORE
    asked = {r["messages"][0]["content"] if "messages" in r else r.get("instruction") for r in qa_rows(16)}
    chat_prompts = [p.shown for p in prompts if isinstance(p.shown, list)]
    assert chat_prompts and all(p[-1]["content"] in asked for p in chat_prompts)


def test_n_prompts_from_a_validation_file_and_without_validation(
    make_config, tokenizer, tmp_path: Path
) -> None:
    val_rows = qa_rows(8, start=40)
    val_path = write_jsonl(tmp_path / "val.jsonl", val_rows)
    config = make_config(qa_rows(12), sample_prompts=4, validation_dataset_id="valdata01")
    config = config.model_copy(update={"validation_path": str(val_path)})
    shown = [p.shown for p in samples.prompts_for(config, tokenizer)]
    # Rows cycle chat, instruction, prompt_completion, text: a text example has no prompt and is passed over.
    assert shown == [
        [{"role": "user", "content": val_rows[0]["messages"][0]["content"]}],
        [{"role": "user", "content": val_rows[1]["instruction"]}],
        val_rows[2]["prompt"],
        [{"role": "user", "content": val_rows[4]["messages"][0]["content"]}],
    ]
    # No validation split: the training file's first examples.
    first = samples.prompts_for(make_config(qa_rows(12), sample_prompts=1), tokenizer)
    assert first[0].shown == [{"role": "user", "content": qa_rows(1)[0]["messages"][0]["content"]}]


def test_a_string_prompt_renders_as_the_training_data_does(make_config, tokenizer) -> None:
    raw_rows = [{"prompt": f"q{i}\n", "completion": f"a{i}"} for i in range(4)]
    (p,) = samples.prompts_for(make_config(raw_rows, sample_prompts=["Tell me"]), tokenizer)
    assert p.ids == [tokenizer.bos_token_id, *tokenizer("Tell me", add_special_tokens=False)["input_ids"]]
    (c,) = samples.prompts_for(make_config(qa_rows(4), sample_prompts=["Tell me"]), tokenizer)
    chat = [{"role": "user", "content": "Tell me"}]
    assert c.ids == list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def test_dpo_prompts_are_the_validation_pairs_prompts(make_config, tokenizer) -> None:
    config = make_config(pair_rows(12), objective="dpo", sample_prompts=2, validation_fraction=0.25)
    _, val, _, _ = load_splits(config, tokenizer)
    prompts = samples.prompts_for(config, tokenizer, val, Dpo.sample_prompts)
    assert [p.ids for p in prompts] == [list(v.chosen.input_ids[: v.prompt_len]) for v in val[:2]]


def test_qlora_samples_and_the_model_goes_back_to_training(make_config, tiny_model: Path, tokenizer) -> None:
    config = make_config(qa_rows(4), method="qlora", sample_prompts=["Hello there"])
    net = load_model(config.spec, tiny_model, CPU)  # 4-bit base, gradient checkpointing on
    net.train()
    prompts = samples.prompts_for(config, tokenizer)
    (item,) = samples.generate_samples(net, tokenizer, prompts, 6, CPU)
    assert net.training
    net.eval()
    assert item.tuned == plain_generate(net, prompts[0].ids, 6, tokenizer)
    with net.disable_adapter():
        assert item.base == plain_generate(net, prompts[0].ids, 6, tokenizer)


def test_completions_are_bounded_by_sample_max_tokens(tiny_model: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = samples.raw_prompt_ids("The", tokenizer)
    for limit in (1, 5):
        new = samples.greedy_ids(model, ids, limit, tokenizer)
        assert 1 <= len(new) <= limit


class StopAfter:
    """A stop flag that goes up once `steps` step records are in the metrics file (SIGTERM in that step)."""

    def __init__(self, out: Path, steps: int) -> None:
        self.metrics, self.steps = out / "metrics.jsonl", steps

    def is_set(self) -> bool:
        return sum(r["type"] == "step" for r in read_metrics(self.metrics)) >= self.steps


@pytest.mark.slow
def test_sampling_at_each_evaluation_does_not_change_training_nor_repeats_after_a_resume(make_config) -> None:
    common = {"max_steps": 4, "validation_fraction": 0.25, "eval_every_steps": 2, "lora_dropout": 0.1}
    plain = make_config(qa_rows(16), name="plain", **common)
    sampled = make_config(
        qa_rows(16), name="sampled", sample_prompts=2, sample_at_eval=True, sample_max_tokens=4, **common
    )
    out = Path(sampled.output_dir)
    assert run(plain) == 0
    assert run(sampled, StopAfter(out, 2)) == 3  # stopped after step 2 (and its evaluation), checkpointed
    assert run(sampled) == 0  # resumed from step 2
    a, b = read_metrics(Path(plain.output_dir) / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["loss"] for r in a if r["type"] == "step"] == [r["loss"] for r in b if r["type"] == "step"]
    assert [r["resumed_from_step"] for r in b if r["type"] == "start"] == [0, 2]
    sets = [(r["step"], r["at"], len(r["items"])) for r in b if r["type"] == "samples"]
    assert sets == [(2, "eval", 2), (4, "eval", 2), (4, "end", 2)]


def test_a_failed_sampling_never_fails_the_run(make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for the KV cache")

    monkeypatch.setattr(samples, "generate_samples", out_of_memory)
    config = make_config(qa_rows(8), sample_prompts=["Hi"], max_steps=1)
    assert run(config) == 0
    types = [r["type"] for r in read_metrics(Path(config.output_dir) / "metrics.jsonl")]
    assert "samples" not in types and types[-1] == "done"
