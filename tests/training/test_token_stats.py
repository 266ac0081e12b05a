"""`python -m training.token_stats` gives the numbers training itself computes for the same spec."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.spec import JobSpec
from tests.training.util import qa_rows, write_jsonl
from training import batches, data, evaluate
from training.memory import batch_shape
from training.token_stats import main

REPO = Path(__file__).resolve().parents[2]
BASE = {"base_model": "tiny", "dataset_id": "testdata01", "micro_batch_size": 2, "max_seq_len": 40}


def _args(model: Path, dataset: Path, spec: dict[str, Any]) -> list[str]:
    return ["--model-dir", str(model), "--dataset", str(dataset), "--spec", json.dumps({**BASE, **spec})]


def _expected(tokenizer, dataset: Path, spec: JobSpec) -> dict[str, Any]:
    """What training computes (training.recipe.load_splits, training.batches), step by step."""
    whole = data.tokenize_file(dataset, tokenizer, None, spec.train_on_inputs)
    stats = data.token_stats([len(t.input_ids) for t in whole], spec.max_seq_len, spec.over_length)
    items, dropped = data.fit_to_length(whole, spec.max_seq_len, spec.over_length)
    train, _ = evaluate.split_validation(items, spec.validation_fraction, spec.seed)
    lengths = [len(t.input_ids) for t in train]
    steps = batches.epoch_steps(spec, lengths, 0)
    micro = [m for step in steps for m in batches.split_step(spec, lengths, step)]
    return {
        **stats,
        "dropped": dropped,
        "micro_batches_per_epoch": len(micro),
        "steps_per_epoch": len(steps),
        "examples_per_micro_batch": round(len(train) / len(micro), 2),
        "run_epochs": round(spec.max_steps / len(steps), 2) if spec.max_steps else spec.epochs,
        "train_examples": len(train),
        # the planner's re-plan input (checked against the collated micro-batches in test_batch_shape.py)
        **batch_shape(spec, train).token_stats(),  # type: ignore[union-attr]
    }


def test_the_command_prints_trainings_numbers(tmp_path: Path, tiny_model: Path, tokenizer) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", qa_rows(40))  # all four formats
    spec = {"gradient_accumulation_steps": 2, "micro_batch_size": 4}
    # The command runs at nice 10 (below the API's requests): beside the suite's other processes on 2 cores
    # it gets a few percent of a core, and importing torch then takes minutes (CI, 2026-11-29: past 120 s).
    out = subprocess.run(
        [sys.executable, "-m", "training.token_stats", *_args(tiny_model, dataset, spec)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()  # stdout is the one JSON answer, nothing else
    got = json.loads(line)
    want = _expected(tokenizer, dataset, JobSpec(**{**BASE, **spec}))
    assert got == {k: v for k, v in want.items() if k != "train_examples"} | {
        "max_seq_len": 40,
        "packing": True,
    }
    assert got["over_max_seq_len"] > 0 and got["over_length"] == "truncate"  # the file has long ones
    # Packed into up to 4 * 40 tokens: at least 4 examples of <= 40 tokens each, often more.
    assert got["micro_batches_per_epoch"] <= 40 / 4 and got["examples_per_micro_batch"] >= 4
    # Truncation happens after counting: p50/max are whole lengths, as training's start record has them.
    assert got["max"] == max(len(data.tokenize_example(e, tokenizer, None).input_ids) for e in _read(dataset))


def _read(path: Path):  # type: ignore[no-untyped-def]
    from core.data.examples import read_examples

    return list(read_examples(path, None))


@pytest.mark.parametrize(
    "spec",
    [
        {"packing": False, "over_length": "drop", "micro_batch_size": 3},
        {"validation_fraction": 0.2, "num_gpus": 2, "max_seq_len": 512},
    ],
)
def test_padded_dropped_and_split(
    tmp_path: Path, tiny_model: Path, tokenizer, spec: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", qa_rows(30))
    assert main(_args(tiny_model, dataset, spec)) == 0
    got = json.loads(capsys.readouterr().out)
    want = _expected(tokenizer, dataset, JobSpec(**{**BASE, **spec}))
    assert {k: got[k] for k in want if k != "train_examples"} == {
        k: v for k, v in want.items() if k != "train_examples"
    }
    if spec.get("over_length") == "drop":
        assert got["dropped"] == got["over_max_seq_len"] > 0
        assert got["micro_batches_per_epoch"] == math.ceil(want["train_examples"] / 3)  # padded batches
    else:
        assert got["over_max_seq_len"] == 0 and want["train_examples"] == 24  # 6 of 30 held out


def test_nothing_to_train_on_is_a_clear_error(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": "a long question " * 8, "completion": "an answer"}] * 3  # truncated away at 8
    assert main(_args(tiny_model, write_jsonl(tmp_path / "d.jsonl", rows), {"max_seq_len": 8})) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "invalid_dataset" and "no example has tokens to train on" in err["message"]


def test_a_missing_tokenizer_names_no_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    dataset = write_jsonl(tmp_path / "d.jsonl", qa_rows(2))
    assert main(_args(tmp_path / "empty", dataset, {})) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "tokenizer_error" and str(tmp_path) not in err["message"]
