"""A step or eval record carries its own objective's metrics (core.run_protocol.OBJECTIVE_FIELDS): sft's
token accuracy, dpo's preference metrics, grpo's rl; the line leaves the other objectives' out, readers
get them as None, and a line written before (every objective's fields, null where not its own) reads
the same."""

from __future__ import annotations

import json

import pytest

from core.run_protocol import (
    OBJECTIVE_FIELDS,
    EvalRecord,
    PreferenceMetrics,
    RLMetrics,
    StepRecord,
    encode,
    parse_record,
)

COMMON = {"step": 3, "total_steps": 6, "epoch": 0.5, "loss": 0.7, "lr": 1e-4, "tokens": 40, "elapsed_s": 1.5}
DPO = {
    "rewards_chosen": 0.2,
    "rewards_rejected": -0.1,
    "rewards_margin": 0.3,
    "rewards_accuracy": 0.75,
    "logps_chosen": -12.0,
    "logps_rejected": -15.0,
}
OWN = {"sft": {"token_accuracy": 0.5}, "dpo": DPO, "grpo": {"rl": RLMetrics(samples=8, reward_mean=0.25)}}


def others(kind: type, objective: str) -> set[str]:
    return {f for name, fields in OBJECTIVE_FIELDS[kind].items() if name != objective for f in fields}


@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_a_step_line_carries_its_objectives_metrics_only(objective: str) -> None:
    record = StepRecord(**COMMON, **OWN[objective])
    line = json.loads(encode(record))
    assert set(OBJECTIVE_FIELDS[StepRecord][objective]) <= set(line)
    assert not others(StepRecord, objective) & set(line), line
    assert parse_record(encode(record)) == record  # the others read as None


def test_an_eval_line_carries_its_objectives_metrics_only() -> None:
    sft = json.loads(encode(EvalRecord(step=2, eval_loss=1.0, eval_token_accuracy=0.4, eval_tokens=30)))
    assert sft["eval_token_accuracy"] == 0.4 and sft["eval_tokens"] == 30
    assert not others(EvalRecord, "sft") & set(sft)
    grpo = EvalRecord(step=0, eval_loss=None, rl=RLMetrics(samples=2))
    line = json.loads(encode(grpo))
    assert line["eval_loss"] is None and line["rl"]["samples"] == 2  # a common field stays, null or not
    assert not others(EvalRecord, "grpo") & set(line)
    assert parse_record(encode(grpo)) == grpo


def test_an_own_metric_the_objective_set_to_none_is_written() -> None:
    line = json.loads(encode(StepRecord(**COMMON, token_accuracy=None)))
    assert "token_accuracy" in line and line["token_accuracy"] is None


def test_a_line_written_before_with_every_objectives_fields_reads_the_same() -> None:
    old = {"type": "step", **COMMON, **dict.fromkeys(DPO), "token_accuracy": 0.5, "rl": None}
    record = parse_record(json.dumps(old))
    assert record == StepRecord(**COMMON, token_accuracy=0.5)
    old_dpo = {"type": "eval", "step": 2, "eval_loss": 0.6, "eval_token_accuracy": None, "eval_tokens": None}
    assert parse_record(json.dumps(old_dpo | DPO)) == EvalRecord(step=2, eval_loss=0.6, **DPO)


def test_every_objective_field_is_a_field_of_its_record() -> None:
    assert set(OBJECTIVE_FIELDS[StepRecord]["dpo"]) == set(PreferenceMetrics.model_fields)
    for kind, by_objective in OBJECTIVE_FIELDS.items():
        for fields in by_objective.values():
            assert set(fields) <= set(kind.model_fields), (kind, fields)
