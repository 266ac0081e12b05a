"""OpenAI's job events: ftune's job events (type `message`), a /v1 job's hyperparameters as chosen at
creation (type `message`: what "auto" picked, batch_size in examples per step), and one `metrics` event
per logged step, read from the run's metrics records as they stand after every resume. Newest first, as
on OpenAI."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel

from api.openai.hyperparameters import AUTO_BATCH_KEY, AUTO_BATCH_MAX
from core.run_protocol import EvalRecord, StepRecord, read_records
from core.storage import Storage
from models.tables import Job, JobEvent

Level = Literal["info", "warn", "error"]
WARN_KINDS = ("retry", "lost", "expired", "requeued", "cancel_requested")


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Level
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None = None


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent]
    has_more: bool


def _level(ev: JobEvent) -> Level:
    if "fail" in ev.kind or "error" in ev.kind:
        return "error"
    return "warn" if any(w in ev.kind for w in WARN_KINDS) else "info"


def _message_event(ev: JobEvent) -> tuple[float, FineTuningJobEvent]:
    at = ev.created_at.timestamp()
    out = FineTuningJobEvent(
        id=f"ftevent-{ev.id}",
        created_at=int(at),
        level=_level(ev),
        message=_samples_message(ev) if ev.kind == "samples" else ev.message,
        type="message",
        data=ev.data,
    )
    return at, out


def _samples_message(ev: JobEvent) -> str:
    """A samples event's message with its first prompt and both completions, shortened, so that a list of
    events shows what the tuning changed (the whole set is in data.items and GET /jobs/{id}/samples)."""
    items = (ev.data or {}).get("items") or []
    if not items:
        return ev.message
    first = items[0]
    prompt = first["prompt"] if isinstance(first["prompt"], str) else first["prompt"][-1]["content"]
    base, tuned = _short(first["base"]), _short(first["tuned"])
    return f"{ev.message}; first: {_short(prompt)} -> base {base}, tuned {tuned}"


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


PREFERENCE_METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_margin",
    "rewards_accuracy",
    "logps_chosen",
    "logps_rejected",
)


def reinforcement_metrics(r: StepRecord, ev: EvalRecord | None) -> dict[str, Any]:
    """What OpenAI's reinforcement jobs report per step: scores (train_reward_mean and, at an evaluated
    step, valid_reward_mean; each named grader's mean as <name>_mean), the grader errors counted over the
    step's samples, and the step's timing in seconds (sampling, grading, training, eval, full_iteration)."""
    assert r.rl is not None
    scores: dict[str, Any] = {"train_reward_mean": r.rl.reward_mean, "train_reward_std": r.rl.reward_std}
    scores |= {f"{name}_mean": v for name, v in r.rl.scores.items()}
    timing = dict(r.rl.timing)
    if ev is not None and ev.rl is not None:
        scores["valid_reward_mean"] = ev.rl.reward_mean
        scores |= {f"valid_{name}_mean": v for name, v in ev.rl.scores.items()}
        timing["eval"] = sum(ev.rl.timing.values())
    timing["full_iteration"] = sum(timing.values())
    rl = r.rl
    usage = {"samples": rl.samples, "completion_tokens_mean": rl.completion_tokens_mean}
    loss = {"clip_ratio_region": rl.clip_ratio_region, "kl": rl.kl, "truncated_share": rl.truncated_share}
    return {"scores": scores, "errors": dict(rl.errors), "timing": {"step": timing}, "usage": usage} | loss


def metrics_events(job: Job, storage: Storage) -> list[tuple[float, FineTuningJobEvent]]:
    """One event per logged step: step, train_loss, train_mean_token_accuracy (the share of the step's
    target tokens whose argmax prediction is right; null for dpo), and valid_loss /
    valid_mean_token_accuracy at steps that were evaluated; a dpo job adds train_/valid_ rewards_chosen,
    rewards_rejected, rewards_margin, rewards_accuracy and logps; a reinforcement job adds scores, errors,
    timing and usage (reinforcement_metrics), and one event at step 0 for its evaluation before training
    (the baseline)."""
    records = read_records(storage.metrics_path(job.id))
    evals = {r.step: r for r in records if isinstance(r, EvalRecord)}
    started = [e.created_at for e in job.events if e.kind == "training_started"]
    origin: datetime = started[0] if started else job.created_at
    out = []
    baseline = evals.get(0)
    if baseline is not None and baseline.rl is not None:
        at = origin.timestamp()
        data0 = {"step": 0, "scores": {"valid_reward_mean": baseline.rl.reward_mean}}
        message = f"Step 0: valid reward mean={baseline.rl.reward_mean}"
        event = FineTuningJobEvent(
            id=f"ftevent-{job.id[:8]}-step-0", created_at=int(at), level="info", message=message,
            type="metrics", data=data0 | {"errors": dict(baseline.rl.errors)},
        )  # fmt: skip
        out.append((at, event))
    for r in records:
        if not isinstance(r, StepRecord):
            continue
        at = (origin + timedelta(seconds=r.elapsed_s)).timestamp()
        data: dict[str, Any] = {
            "step": r.step,
            "total_steps": r.total_steps,
            "train_loss": r.loss,
            "train_mean_token_accuracy": r.token_accuracy,
        }
        if r.rewards_accuracy is not None:  # a dpo job: its preference metrics, under TRL's names
            data |= {f"train_{k}": getattr(r, k) for k in PREFERENCE_METRICS}
        ev = evals.get(r.step)
        if ev is not None:
            data |= {"valid_loss": ev.eval_loss, "valid_mean_token_accuracy": ev.eval_token_accuracy}
            if ev.rewards_accuracy is not None:
                data |= {f"valid_{k}": getattr(ev, k) for k in PREFERENCE_METRICS}
        if r.rl is not None:
            data |= reinforcement_metrics(r, ev)
        loss = "n/a" if r.loss is None else f"{r.loss:.4f}"
        message = f"Step {r.step}/{r.total_steps}: training loss={loss}"
        if r.rl is not None and r.rl.reward_mean is not None:
            message += f", train reward mean={r.rl.reward_mean:.4f}"
        event = FineTuningJobEvent(
            id=f"ftevent-{job.id[:8]}-step-{r.step}",
            created_at=int(at),
            level="info",
            message=message,
            type="metrics",
            data=data,
        )
        out.append((at, event))
    return out


def hyperparameters_event(job: Job) -> list[tuple[float, FineTuningJobEvent]]:
    """A /v1 job's hyperparameters as chosen when it was created (numbers, no "auto"), with batch_size
    as examples per optimizer step and, where auto chose it, from how many training examples."""
    request = job.openai or {}
    hp = request.get("hyperparameters")
    if not hp:
        return []
    auto = request.get(AUTO_BATCH_KEY)
    shown = {k: v for k, v in hp.items() if isinstance(v, int | float | str)}
    batch = f"batch_size {shown.pop('batch_size', None)} (examples per optimizer step"
    if auto:
        batch += f"; auto: ~0.2% of {auto['training_examples']} training examples, 1 to {AUTO_BATCH_MAX}"
    parts = [f"{k} {shown.pop(k)}" for k in ("n_epochs",) if k in shown] + [batch + ")"]
    parts += [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()]
    at = job.created_at.timestamp()
    data = {"hyperparameters": hp} | ({"training_examples": auto["training_examples"]} if auto else {})
    message = "Hyperparameters: " + ", ".join(parts)
    event = FineTuningJobEvent(
        id=f"ftevent-{job.id[:8]}-hyperparameters", created_at=int(at), level="info", message=message,
        type="message", data=data,
    )  # fmt: skip
    return [(at, event)]


def job_events(job: Job, storage: Storage) -> list[FineTuningJobEvent]:
    """Every event of the job, newest first (ties: the later-made one first)."""
    timed = [*hyperparameters_event(job), *(_message_event(e) for e in job.events)]
    timed += metrics_events(job, storage)
    ordered = sorted(enumerate(timed), key=lambda p: (p[1][0], p[0]), reverse=True)
    return [event for _, (_, event) in ordered]


def page(
    events: list[FineTuningJobEvent], after: str | None, limit: int
) -> tuple[list[FineTuningJobEvent], bool]:
    """The events past the one with id `after` (older ones), at most `limit`; whether more follow."""
    start = 0
    if after is not None:
        ids = [e.id for e in events]
        start = ids.index(after) + 1 if after in ids else len(events)
    rows = events[start : start + limit]
    return rows, start + limit < len(events)
