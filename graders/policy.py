"""What a server grades with: one check for a job's admission and for /v1/fine_tuning/alpha/graders alike.

Python graders only where the operator enabled the sandbox (GraderError python_grader_disabled, from
parse_grader) and where it isolates them (python_grader_unavailable naming why, e.g. a kernel or seccomp
profile that refuses namespaces: graders.sandbox.why_unavailable, probed once per process);
score_model and label_model graders only with a judge endpoint configured (grader_model_not_configured,
naming the first such grader's type field), naming a model on the operator's allow-list
(grader_model_not_allowed, naming its model field) and asking at most the operator's max_completion_tokens
(grader_model_tokens_over_limit, naming sampling_params.max_completions_tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from core.errors import InvalidInput
from core.judge_config import ALLOWED_MODELS_SETTING, JudgeConfig
from graders.base import Grader
from graders.model_graders import LabelModelGrader, ScoreModelGrader
from graders.multi import MultiGrader
from graders.parse import parse_grader
from graders.python_code import PythonGrader
from graders.sandbox import UNAVAILABLE, why_unavailable

ModelGrader = ScoreModelGrader | LabelModelGrader


def admitted(
    raw: Any,
    *,
    python_enabled: bool,
    judge: JudgeConfig | None,
    param: str = "grader",
    sandbox: Callable[[], str | None] = why_unavailable,
) -> Grader:
    """The grader `raw` as this server would run it, or the error that refuses it. `judge`: the operator's
    judge and its bounds (JudgeConfig.from_settings); None: there is none. `sandbox`: why python graders
    cannot run here, None where they can (asked only of a grader holding one)."""
    grader = parse_grader(raw, allow_python=python_enabled, param=param)
    for child, at in graders_in(grader, raw, param):
        if isinstance(child, PythonGrader):
            check_sandboxed(at, sandbox)
        elif isinstance(child, ScoreModelGrader | LabelModelGrader):
            check_judged(child, at, judge)
    return grader


def check_sandboxed(at: str, sandbox: Callable[[], str | None]) -> None:
    """Refuse the python grader at `at` (its path) where the sandbox cannot isolate it."""
    why = sandbox()
    if why is not None:
        raise InvalidInput(
            f"{at}.type: python graders cannot run on this server, its sandbox cannot isolate them ({why}); "
            "the operator runs ftune where Linux namespaces are allowed (not under Docker's default seccomp "
            "profile), or turns python graders off",
            code=UNAVAILABLE,
            param=f"{at}.type",
        )


def check_judged(grader: ModelGrader, at: str, judge: JudgeConfig | None) -> None:
    """Refuse the model grader at `at` (its path) unless the operator's judge will run it as it is."""
    if judge is None:
        raise InvalidInput(
            f"{at}.type is a model grader, and this server has no judge model endpoint configured "
            "(the operator sets FTUNE_GRADER_MODEL_BASE_URL)",
            code="grader_model_not_configured",
            param=f"{at}.type",
        )
    if not judge.allows(grader.model):
        listed = ", ".join(judge.allowed_models)
        why = f"it allows {listed}" if listed else f"the operator lists them in {ALLOWED_MODELS_SETTING}"
        raise InvalidInput(
            f"{at}.model: {grader.model!r} is not one of this server's judge models ({why})",
            code="grader_model_not_allowed",
            param=f"{at}.model",
        )
    params = (grader.sampling_params or {}) if isinstance(grader, ScoreModelGrader) else {}
    asked, bound = params.get("max_completions_tokens"), judge.max_completion_tokens
    if asked is not None and asked > bound:
        field = f"{at}.sampling_params.max_completions_tokens"
        raise InvalidInput(
            f"{field}: {asked} is over this server's bound of {bound} tokens per judge call",
            code="grader_model_tokens_over_limit",
            param=field,
        )


def graders_in(grader: Grader, raw: Any, param: str = "grader") -> Iterator[tuple[Grader, str]]:
    """Each grader in the tree, the tree's own first, with its path (`param` of its JSON object)."""
    yield grader, param
    if isinstance(grader, MultiGrader):
        given = raw.get("graders") if isinstance(raw, dict) else None
        if isinstance(given, dict) and isinstance(given.get("type"), str):  # the single-grader form
            yield from graders_in(next(iter(grader.graders.values())), given, f"{param}.graders")
            return
        for key, child in grader.graders.items():
            sub = given.get(key) if isinstance(given, dict) else None
            yield from graders_in(child, sub, f"{param}.graders.{key}")
