"""Evaluation on a held-out split, early stopping, and the merged export."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.storage import ADAPTER_DIR, MERGED_DIR, METRICS_FILE
from tests.training.util import qa_rows, read_metrics, write_jsonl
from training.data import DatasetError, Tokenized, collate, load_dataset
from training.evaluate import split_validation
from training.model import load_model
from training.objectives.sft.evaluate import evaluate
from training.run import EXIT_OK, run


def _items(n: int) -> list[Tokenized]:
    return [Tokenized([1] * (i + 2), [1] * (i + 2)) for i in range(n)]


def test_split_is_seeded_disjoint_and_complete() -> None:
    items = _items(20)
    train, val = split_validation(items, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert sorted(len(x.input_ids) for x in train + val) == [i + 2 for i in range(20)]
    assert split_validation(items, 0.25, seed=3) == (train, val)
    assert split_validation(items, 0.25, seed=4)[1] != val
    assert split_validation(items, 0.0, seed=3) == (items, [])
    assert len(split_validation(_items(3), 0.01, seed=0)[1]) == 1  # at least one when asked for
    with pytest.raises(DatasetError):
        split_validation(_items(1), 0.5, seed=0)


def test_evaluate_is_the_mean_token_loss_and_accuracy(make_config, tokenizer, tmp_path: Path) -> None:
    config = make_config(qa_rows(5), lora_dropout=0.3)
    items, _ = load_dataset(Path(config.dataset_path), tokenizer, 64)
    torch.manual_seed(0)
    model = load_model(config.spec, Path(config.model_dir), torch.device("cpu"))
    model.train()
    result = evaluate(model, items, 2, 0, torch.device("cpu"), nullcontext)
    assert model.training  # restored

    model.eval()
    batch = collate(items, 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]  # right-padded: no mask needed
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    expected_loss = torch.nn.functional.cross_entropy(logits[mask], labels[mask]).item()
    expected_acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
    assert result.target_tokens == int(mask.sum()) == sum(x.num_targets for x in items)
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    assert result.token_accuracy == pytest.approx(expected_acc)


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(out / METRICS_FILE) if r["type"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_evaluation_on_a_second_dataset_does_not_change_training(
    make_config, tmp_path: Path, method: str
) -> None:
    val_file = write_jsonl(tmp_path / "val.jsonl", qa_rows(4, start=40))
    kw = {"epochs": 2, "lora_dropout": 0.1, "method": method}
    plain = make_config(qa_rows(8), name="plain", **kw)
    evald = make_config(qa_rows(8), name="evald", validation_dataset_id="valdata01", eval_every_steps=1, **kw)
    evald = evald.model_copy(update={"validation_path": str(val_file)})
    assert run(plain) == EXIT_OK and run(evald) == EXIT_OK

    evals = _records(Path(evald.output_dir), "eval")
    assert [e["step"] for e in evals] == [1, 2, 3, 4]
    assert all(e["eval_tokens"] > 0 and 0 <= e["eval_token_accuracy"] <= 1 for e in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # the adapter learns what generalises
    a = load_file(Path(plain.output_dir) / ADAPTER_DIR / "adapter_model.safetensors")
    b = load_file(Path(evald.output_dir) / ADAPTER_DIR / "adapter_model.safetensors")
    for name in a:  # dropout draws the same random numbers: eval mode draws none
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_exports(make_config) -> None:
    # min_delta is huge: no evaluation after the first counts as better, so patience 2 stops at the third.
    config = make_config(
        qa_rows(12),
        epochs=10,
        validation_fraction=0.25,
        eval_every_steps=1,
        early_stopping_patience=2,
        early_stopping_min_delta=100.0,
    )
    assert run(config) == EXIT_OK
    out = Path(config.output_dir)
    assert [e["step"] for e in _records(out, "eval")] == [1, 2, 3]
    done = _records(out, "done")[0]
    assert done["step"] == 3 and done["stopped_early"] is True
    assert (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    # 9 training examples, micro 2 x accumulation 2: 3 steps an epoch, 30 planned
    assert _records(out, "start")[0]["total_steps"] == 30
    assert run(config) == EXIT_OK  # a rerun resumes from the early stop's checkpoint and stays stopped
    assert _records(out, "done")[-1]["step"] == 3


@pytest.mark.slow
def test_merged_export_equals_base_plus_adapter(make_config) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config(qa_rows(8), max_steps=3, export="merged", learning_rate=2e-2)
    assert run(config) == EXIT_OK
    out = Path(config.output_dir)
    merged_dir = out / MERGED_DIR
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not list(merged_dir.glob("*.bin"))  # safetensors only

    ids = torch.tensor([[1, 5, 9, 200, 300, 7]])
    base = AutoModelForCausalLM.from_pretrained(config.model_dir, local_files_only=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()(input_ids=ids).logits
        folded = merged(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(folded, tuned, atol=1e-4, rtol=1e-4)
