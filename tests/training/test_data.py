"""Examples -> ids + labels: exact label masks for every format; padded collation."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from core.data.examples import to_example
from tests.training.util import qa_rows, write_jsonl
from training.chat_template import DEFAULT_CHAT_TEMPLATE
from training.data import (
    IGNORE,
    PAD_MULTIPLE,
    DatasetError,
    collate,
    load_dataset,
    token_stats,
    tokenize_example,
)


def trained_text(tok, ids: list[int], labels: list[int]) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def masked_text(tok, ids: list[int], labels: list[int]) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE])


def test_chat_trains_on_assistant_turns_with_weight_1_only(tokenizer) -> None:
    ex = to_example(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "Five.", "weight": 0},
                {"role": "user", "content": "Try again."},
                {"role": "assistant", "content": "Four."},
            ]
        },
        "chat",
    )
    t = tokenize_example(ex, tokenizer, max_seq_len=512)
    full = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in ex.messages], tokenize=False
    )
    # The pieces concatenate to exactly the tokenization of the whole rendering.
    assert t.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert trained_text(tokenizer, t.input_ids, t.labels) == "Four.<|im_end|>\n"
    assert masked_text(tokenizer, t.input_ids, t.labels) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFive.<|im_end|>\n<|im_start|>user\nTry again.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Trained labels equal their ids (the shift to next-token targets happens in the loss).
    assert all(lab in (IGNORE, i) for i, lab in zip(t.input_ids, t.labels, strict=True))


def test_chat_with_two_trained_turns_keeps_both(tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    t = tokenize_example(to_example({"messages": msgs}, "chat"), tokenizer, 512)
    assert trained_text(tokenizer, t.input_ids, t.labels) == "Hello!<|im_end|>\nGoodbye!<|im_end|>\n"


def test_instruction_masks_the_prompt(tokenizer) -> None:
    ex = to_example(
        {"instruction": "Name a color.", "input": "Warm ones only.", "output": "Red."}, "instruction"
    )
    t = tokenize_example(ex, tokenizer, 512)
    assert trained_text(tokenizer, t.input_ids, t.labels) == "Red.<|im_end|>\n"
    assert masked_text(tokenizer, t.input_ids, t.labels) == (
        "<s><|im_start|>user\nName a color.\n\nWarm ones only.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_completion_trains_completion_and_eos(tokenizer) -> None:
    ex = to_example({"prompt": "The sky is", "completion": " blue."}, "prompt_completion")
    t = tokenize_example(ex, tokenizer, 512)
    assert t.input_ids[0] == tokenizer.bos_token_id and t.input_ids[-1] == tokenizer.eos_token_id
    assert masked_text(tokenizer, t.input_ids, t.labels) == "<s>The sky is"
    assert trained_text(tokenizer, t.input_ids, t.labels) == " blue.</s>"


def test_text_trains_everything_and_eos(tokenizer) -> None:
    t = tokenize_example(to_example({"text": "Plants need light."}, "text"), tokenizer, 512)
    assert masked_text(tokenizer, t.input_ids, t.labels) == "<s>"  # BOS is never a target anyway
    assert trained_text(tokenizer, t.input_ids, t.labels) == "Plants need light.</s>"
    assert t.num_targets == len(t.input_ids) - 1


def test_train_on_inputs_trains_the_prompt_but_never_a_weight_0_turn(tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Five.", "weight": 0},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Four."},
    ]
    t = tokenize_example(to_example({"messages": msgs}, "chat"), tokenizer, 512, train_on_inputs=True)
    assert masked_text(tokenizer, t.input_ids, t.labels) == "Five.<|im_end|>\n"
    ex = to_example({"prompt": "The sky is", "completion": " blue."}, "prompt_completion")
    t = tokenize_example(ex, tokenizer, 512, train_on_inputs=True)
    assert trained_text(tokenizer, t.input_ids, t.labels) == "<s>The sky is blue.</s>"


def test_a_tokenizer_without_chat_template_gets_the_default_chatml(tokenizer) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    t = tokenize_example(to_example({"messages": msgs}, "chat"), plain, 512)
    assert (
        masked_text(plain, t.input_ids, t.labels)
        == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # the reply ends with the end-of-turn marker and EOS, so generation learns to stop
    assert trained_text(plain, t.input_ids, t.labels) == "Hello!<|im_end|></s>\n"
    full = plain.apply_chat_template(msgs, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False)
    assert t.input_ids == plain(full, add_special_tokens=False)["input_ids"]


def test_truncation_and_examples_with_nothing_to_train_are_dropped(tokenizer, tmp_path: Path) -> None:
    long_prompt = {"prompt": "word " * 100, "completion": "end"}
    path = write_jsonl(tmp_path / "d.jsonl", [long_prompt, {"text": "short text"}])
    items, dropped = load_dataset(path, tokenizer, max_seq_len=16)
    assert dropped == 1 and len(items) == 1
    assert all(len(t.input_ids) <= 16 for t in items)
    with pytest.raises(DatasetError):
        load_dataset(write_jsonl(tmp_path / "e.jsonl", [long_prompt]), tokenizer, max_seq_len=16)


def test_collate_right_pads_with_ignored_labels(tokenizer, tmp_path: Path) -> None:
    items, _ = load_dataset(write_jsonl(tmp_path / "c.jsonl", qa_rows(3)), tokenizer, 64)
    batch = collate(items, pad_id=tokenizer.pad_token_id)
    lens = [len(t.input_ids) for t in items]
    width = -(-max(lens) // PAD_MULTIPLE) * PAD_MULTIPLE  # the longest, rounded up
    assert batch["input_ids"].shape == (3, width)
    for row, (t, n) in enumerate(zip(items, lens, strict=True)):
        assert batch["input_ids"][row, :n].tolist() == t.input_ids
        assert (batch["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, n:] == IGNORE).all()
    assert collate(items, 0, limit=max(lens))["input_ids"].shape == (3, max(lens))  # never past the limit


def test_over_length_truncate_or_drop(tokenizer, tmp_path: Path) -> None:
    rows = [{"text": "word " * 40}, {"text": "short text"}, {"prompt": "word " * 100, "completion": "end"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kept, dropped = load_dataset(path, tokenizer, max_seq_len=16, over_length="truncate")
    assert len(kept) == 2 and dropped == 1  # the long prompt leaves nothing to train on
    assert max(len(t.input_ids) for t in kept) == 16
    kept, dropped = load_dataset(path, tokenizer, max_seq_len=16, over_length="drop")
    assert len(kept) == 1 and dropped == 2
    assert trained_text(tokenizer, kept[0].input_ids, kept[0].labels) == "short text</s>"


def test_load_dataset_applies_the_column_mapping(tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"q": "The sky is", "a": " blue."}])
    with pytest.raises(DatasetError):
        load_dataset(path, tokenizer, 64)
    (t,), _ = load_dataset(path, tokenizer, 64, column_mapping={"q": "prompt", "a": "completion"})
    assert trained_text(tokenizer, t.input_ids, t.labels) == " blue.</s>"


def test_token_stats_count_what_exceeds_max_seq_len() -> None:
    stats = token_stats([5, 1, 9, 3, 7, 20, 12, 2, 8, 4], max_seq_len=8, over_length="drop")
    assert stats == {
        "count": 10, "p50": 7, "p95": 20, "max": 20, "over_max_seq_len": 3, "over_length": "drop"
    }  # fmt: skip
    assert token_stats([], 8, "truncate") == {"count": 0}
