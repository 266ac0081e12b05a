"""OpenAI's job checkpoints over the checkpoints ftune keeps (Artifact rows), with their step's metrics,
and the job's result file: a CSV of its metrics per step."""

from __future__ import annotations

import csv
import io
from typing import Any, Literal

from pydantic import BaseModel

from api.openai.job_objects import fine_tuned_model
from core import ft_names
from core.run_protocol import EvalRecord, StepRecord, read_records
from core.storage import Storage
from models.tables import Artifact, Job

RESULT_COLUMNS = ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: CheckpointMetrics


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


def _by_step(job: Job, storage: Storage) -> tuple[dict[int, StepRecord], dict[int, EvalRecord]]:
    records = read_records(storage.metrics_path(job.id))
    steps = {r.step: r for r in records if isinstance(r, StepRecord)}
    evals = {r.step: r for r in records if isinstance(r, EvalRecord)}
    return steps, evals


def checkpoint_objects(job: Job, rows: list[Artifact], storage: Storage) -> list[FineTuningJobCheckpoint]:
    steps, evals = _by_step(job, storage)
    name = fine_tuned_model(job)
    out = []
    for art in rows:
        step = art.step or 0
        metrics = CheckpointMetrics(step=step)
        if (s := steps.get(step)) is not None:
            metrics.train_loss = s.loss
            metrics.train_mean_token_accuracy = s.token_accuracy
        if (e := evals.get(step)) is not None:
            # ftune evaluates on the whole validation set, so the "full" numbers are the same ones.
            metrics.valid_loss = metrics.full_valid_loss = e.eval_loss
            acc = e.eval_token_accuracy
            metrics.valid_mean_token_accuracy = metrics.full_valid_mean_token_accuracy = acc
        out.append(
            FineTuningJobCheckpoint(
                id=f"ftckpt-{art.id}",
                created_at=int(art.created_at.timestamp()),
                fine_tuned_model_checkpoint=ft_names.checkpoint_model(name, step),
                fine_tuning_job_id=job.id,
                step_number=step,
                metrics=metrics,
            )
        )
    return out


def result_csv(job: Job, storage: Storage) -> bytes:
    """step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy; one row per logged step.
    train_accuracy: the step's token accuracy (StepRecord.token_accuracy; empty for dpo)."""
    steps, evals = _by_step(job, storage)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for step in sorted(steps):
        ev = evals.get(step)
        row: list[Any] = [step, steps[step].loss, steps[step].token_accuracy]
        row += [ev.eval_loss, ev.eval_token_accuracy] if ev is not None else [None, None]
        writer.writerow(["" if v is None else v for v in row])
    return buf.getvalue().encode()
