"""The grading context of a grpo run (graders.GradeContext) from its run.json's GradingConfig."""

from __future__ import annotations

from core.run_protocol import RunConfig
from graders import GradeContext
from graders.judge import connect
from graders.sandbox import SandboxLimits, SandboxRunner


def grade_context(config: RunConfig) -> GradeContext:
    """Python graders in the sandbox when the operator enabled them; score_model and label_model graders
    through the configured OpenAI-compatible endpoint when there is one, within the operator's bounds and
    acting for the job's tenant (graders.judge; else they count a model_grader_server_error, which
    admission prevents by refusing such a job)."""
    g = config.grading
    python = None
    if g.python_cpu_seconds is not None:
        limits = SandboxLimits(
            cpu_seconds=g.python_cpu_seconds,
            memory_bytes=g.python_memory_mb * 2**20,
            wall_seconds=g.python_timeout_seconds,
        )
        python = SandboxRunner(limits)
    chat = connect(g.judge, g.tenant_id) if g.judge is not None else None
    return GradeContext(chat=chat, python=python)
