"""Jobs: each job definition of the source (method, hyperparameters, suffix, seed, training and validation
files), mapped onto a local base model and created in ftune once.

What is copied is the definition, as the source's job object states it; ftune trains the copy anew.
A job is created with an Idempotency-Key made from its source id and with `metadata.imported_from` set
to it, so a rerun finds it (listed) or gets it back (replayed) instead of making a second one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openai.types.fine_tuning import FineTuningJob

from cli.openai_import.files import FileMap

MARK = "imported_from"  # metadata key: the source job's id
MAX_METADATA = 16  # pairs, on OpenAI and ftune
# Definitions copied by default: the job trained, trains, or is about to. Failed and cancelled ones only
# with --include-failed (often a mistake the user already fixed in a later job).
COPIED_STATUSES = {"validating_files", "queued", "running", "paused", "succeeded"}


@dataclass
class Definition:
    body: dict[str, Any]  # the create request, as client.fine_tuning.jobs.create(**body) takes it
    notes: list[str] = field(default_factory=list)  # what the copy leaves out, said under its line


def source_jobs(jobs: Any) -> list[FineTuningJob]:
    """Every job of a `client.fine_tuning.jobs` (the SDK walks every page), oldest first."""
    return sorted(jobs.list(limit=100), key=lambda j: (j.created_at, j.id))


def imported(jobs: Any) -> dict[str, FineTuningJob]:
    """ftune's jobs imported before, by their source job's id (`metadata.imported_from`)."""
    out: dict[str, FineTuningJob] = {}
    for job in source_jobs(jobs):
        source_id = (job.metadata or {}).get(MARK)
        if source_id:
            out.setdefault(source_id, job)  # the oldest, were there ever two
    return out


def known_files(jobs: list[FineTuningJob], copies: dict[str, FineTuningJob]) -> dict[str, str]:
    """Source file id -> ftune file id, as the jobs imported before show them (for a dry run's plan)."""
    out: dict[str, str] = {}
    for job in jobs:
        copy = copies.get(job.id)
        if copy is None:
            continue
        out[job.training_file] = copy.training_file
        if job.validation_file and copy.validation_file:
            out[job.validation_file] = copy.validation_file
    return out


def _method(job: FineTuningJob) -> dict[str, Any]:
    """The job's method with its hyperparameters (numbers or "auto"), nulls left out; a job from before
    `method` existed is supervised with its top-level hyperparameters."""
    if job.method is not None:
        return job.method.to_dict(mode="json", exclude_none=True)
    hp = job.hyperparameters.to_dict(mode="json", exclude_none=True)
    return {"type": "supervised", "supervised": {"hyperparameters": hp}}


def _suffix(job: FineTuningJob) -> str | None:
    """The suffix the user gave: `user_provided_suffix`, else the fourth part of `ft:base:org:suffix:id`."""
    given = (job.model_extra or {}).get("user_provided_suffix")
    if isinstance(given, str) and given:
        return given
    parts = (job.fine_tuned_model or "").split(":")
    return (parts[3] or None) if len(parts) == 5 and parts[0] == "ft" else None


def _metadata(job: FineTuningJob, notes: list[str]) -> dict[str, str]:
    metadata = dict(job.metadata or {})
    if MARK in metadata or len(metadata) < MAX_METADATA:
        metadata[MARK] = job.id
    else:
        notes.append(
            f"its metadata has {MAX_METADATA} pairs, none left for {MARK} (its Idempotency-Key still keeps "
            "a rerun from copying it twice)"
        )
    return metadata


def _unmapped(model: str) -> str:
    if model.startswith("ft:"):
        return (
            f"its base {model!r} is a fine-tuned model, whose weights cannot be copied; map it to a "
            f"local model to train from that instead: --model {model}=<local model>"
        )
    return f"its base {model!r} has no mapping: --model {model}=<local model>"


def definition(job: FineTuningJob, models: dict[str, str], files: FileMap) -> Definition | str:
    """The create request for a copy of `job`, or why there can be none."""
    local = models.get(job.model)
    if local is None:
        return _unmapped(job.model)
    for name, file_id in (("training", job.training_file), ("validation", job.validation_file)):
        if file_id and (why := files.missing(file_id)):
            return f"its {name} file {file_id} {why}"
    notes: list[str] = []
    body: dict[str, Any] = {"model": local, "training_file": files.ids[job.training_file]}
    if job.validation_file:
        body["validation_file"] = files.ids[job.validation_file]
    if (suffix := _suffix(job)) is not None:
        body["suffix"] = suffix
    if job.seed is not None:
        body["seed"] = job.seed
    body["metadata"] = _metadata(job, notes)
    body["method"] = _method(job)
    integrations = [i.type for i in job.integrations or []]
    if integrations:
        notes.append(f"its integrations ({', '.join(integrations)}) are not copied: ftune has none")
    return Definition(body, notes)


def describe(job: FineTuningJob, models: dict[str, str]) -> str:
    method = job.method.type if job.method is not None else "supervised"
    local = models.get(job.model)
    base = f"{job.model} -> {local}" if local and local != job.model else job.model
    return f"{method} on {base}, {job.status} on the source"
