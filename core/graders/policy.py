"""What a server grades with: one check for a job's admission and for /v1/fine_tuning/alpha/graders alike.

Python graders only where the operator enabled the sandbox (GraderError python_grader_disabled, from
parse_grader); score_model and label_model graders only with a judge endpoint configured
(grader_model_not_configured, naming the first such grader's type field).
"""

from __future__ import annotations

from typing import Any

from core.errors import InvalidInput
from core.graders.base import Grader
from core.graders.multi import MultiGrader
from core.graders.parse import parse_grader

JUDGED = ("score_model", "label_model")


def admitted(raw: Any, *, python_enabled: bool, judge_configured: bool, param: str = "grader") -> Grader:
    """The grader `raw` as this server would run it, or the error that refuses it."""
    grader = parse_grader(raw, allow_python=python_enabled, param=param)
    judged = judged_param(grader, raw, param)
    if judged is not None and not judge_configured:
        raise InvalidInput(
            f"{judged} is a model grader, and this server has no judge model endpoint configured "
            "(the operator sets FTUNE_GRADER_MODEL_BASE_URL)",
            code="grader_model_not_configured",
            param=judged,
        )
    return grader


def judged_param(grader: Grader, raw: Any, param: str = "grader") -> str | None:
    """The path of the first score_model or label_model grader's type in the tree (None: there is none)."""
    if grader.type in JUDGED:
        return f"{param}.type"
    if isinstance(grader, MultiGrader):
        given = raw.get("graders") if isinstance(raw, dict) else None
        if isinstance(given, dict) and isinstance(given.get("type"), str):  # the single-grader form
            child = next(iter(grader.graders.values()))
            return judged_param(child, given, f"{param}.graders")
        for key, child in grader.graders.items():
            sub = given.get(key) if isinstance(given, dict) else None
            found = judged_param(child, sub, f"{param}.graders.{key}")
            if found is not None:
                return found
    return None
