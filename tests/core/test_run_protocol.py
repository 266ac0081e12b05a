"""The run protocol: typed records, the resume rule, torn lines, the tail."""

from __future__ import annotations

import math
from pathlib import Path

from core.run_protocol import (
    CheckpointRecord,
    EvalRecord,
    RecordTail,
    StartRecord,
    StepRecord,
    encode,
    parse_record,
    read_records,
)


def _step(step: int, loss: float = 1.0) -> StepRecord:
    return StepRecord(step=step, total_steps=6, epoch=step / 6, loss=loss, lr=1e-4, tokens=8, elapsed_s=step)


def _write(path: Path, *records: object, torn: str = "") -> None:
    path.write_text("".join(encode(r) + "\n" for r in records) + torn)  # type: ignore[arg-type]


def test_a_resume_supersedes_the_dead_attempts_later_records(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = [StartRecord(total_steps=6, num_examples=10), *map(_step, range(1, 5))]
    ckpt = CheckpointRecord(step=2, path="checkpoints/step-2")
    dead = [EvalRecord(step=3, eval_loss=0.5), CheckpointRecord(step=4, path="x")]
    resumed = [StartRecord(total_steps=6, num_examples=10, resumed_from_step=2), _step(3, 0.7), _step(4, 0.6)]
    _write(path, *first[:3], ckpt, *first[3:], *dead, *resumed, torn='{"type": "step", "st')
    records = read_records(path)
    steps = [(r.step, r.loss) for r in records if isinstance(r, StepRecord)]
    assert steps == [(1, 1.0), (2, 1.0), (3, 0.7), (4, 0.6)]  # the dead attempt's steps 3 and 4 are gone
    assert [r.step for r in records if isinstance(r, CheckpointRecord)] == [2]
    assert not [r for r in records if isinstance(r, EvalRecord)]


def test_non_finite_losses_are_written_as_null_and_read_back() -> None:
    line = encode(_step(1, math.nan))
    assert '"loss":null' in line
    rec = parse_record(line)
    assert isinstance(rec, StepRecord) and rec.loss is None


def test_foreign_and_torn_lines_are_skipped() -> None:
    assert parse_record(b'{"type": "nonsense", "step": 1}') is None
    assert parse_record(b'{"type": "step"') is None
    assert parse_record(b"[1, 2]") is None


def test_tail_returns_complete_records_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = RecordTail(path)
    assert tail.read_new() == []  # no file yet
    line = encode(_step(1))
    path.write_text(line[:10])
    assert tail.read_new() == []  # half a line: nothing yet
    with path.open("a") as f:
        f.write(line[10:] + "\n")
    assert tail.read_new() == [_step(1)]
    assert tail.read_new() == []
