"""Names of fine-tuned models, as OpenAI writes them: `ft:<base>:<tenant>:<suffix>:<job id>`.

One definition for the /v1 job object (`fine_tuned_model`), continuing a job from its model, the model
list and chat completions. A checkpoint's name adds `:ckpt-step-<n>`. Only the job id (and the step)
identify the model: the other parts are for people, and every lookup still checks the tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.spec import ID_RE

PREFIX = "ft:"
_UNSAFE = re.compile(r"[^A-Za-z0-9._/-]+")
_CHECKPOINT = re.compile(r"^ckpt-step-([0-9]{1,9})$")


@dataclass(frozen=True)
class FineTunedName:
    job_id: str
    step: int | None = None  # a checkpoint's model, else the final adapter


def _part(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-")


def fine_tuned_model(base_model: str, tenant: str, suffix: str | None, job_id: str) -> str:
    return f"{PREFIX}{_part(base_model)}:{_part(tenant)}:{_part(suffix or '')}:{job_id}"


def checkpoint_model(fine_tuned: str, step: int) -> str:
    return f"{fine_tuned}:ckpt-step-{step}"


def is_fine_tuned(model: str) -> bool:
    return model.startswith(PREFIX)


def parse(model: str) -> FineTunedName | None:
    """The job (and checkpoint step) a `ft:` name points at, or None if it is not a well-formed one."""
    if not is_fine_tuned(model):
        return None
    parts = model[len(PREFIX) :].split(":")
    step = None
    if len(parts) == 5:
        m = _CHECKPOINT.match(parts[4])
        if m is None:
            return None
        step = int(m.group(1))
        parts = parts[:4]
    if len(parts) != 4 or not ID_RE.match(parts[3]):
        return None
    return FineTunedName(job_id=parts[3], step=step)
