"""The judge of score_model and label_model graders as the operator configures it (the grader_model_*
settings): where it is and the bounds on it. A contract that admission, /run and a training run share
(core.run_protocol.GradingConfig carries it to training); graders.judge connects to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.settings import Settings

GRADING_TENANT_HEADER = "X-Ftune-Grading-Tenant"
ALLOWED_MODELS_SETTING = "FTUNE_GRADER_MODEL_ALLOWED_MODELS"


@dataclass(frozen=True)
class JudgeConfig:
    """The judge endpoint and the operator's bounds on it, as admission, /run and a training run see them
    (core.run_protocol.GradingConfig carries it to training). `allowed_models`: names as listed, or a name
    ending in * for every name starting with the rest ("ft:*": the grading tenant's own models, where the
    judge is ftune's own /v1). `max_tokens_per_run` 0: no bound."""

    base_url: str
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 60
    structured_outputs: bool = True
    allowed_models: tuple[str, ...] = ()
    max_completion_tokens: int = 4096
    max_concurrent_per_tenant: int = 2
    max_tokens_per_run: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> JudgeConfig | None:
        """The operator's judge; None where none is configured (model graders are refused)."""
        if not settings.grader_model_base_url:
            return None
        return cls(
            base_url=settings.grader_model_base_url,
            api_key=settings.grader_model_api_key,
            timeout_seconds=settings.grader_model_timeout_seconds,
            structured_outputs=settings.grader_model_structured_outputs,
            allowed_models=tuple(settings.grader_model_allowed_models),
            max_completion_tokens=settings.grader_model_max_completion_tokens,
            max_concurrent_per_tenant=settings.grader_model_max_concurrent_per_tenant,
            max_tokens_per_run=settings.grader_model_max_tokens_per_run,
        )

    def allows(self, model: str) -> bool:
        return any(
            model == name or (name.endswith("*") and model.startswith(name[:-1]))
            for name in self.allowed_models
        )
