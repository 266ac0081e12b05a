"""What a job trains, behind one protocol: sft, dpo and grpo are each an `Objective` the recipe calls.

An objective says how its dataset is read (`load`: the items a step's rows index), what one optimizer
step does with a global batch of them (`train_step`), how a held-out split is evaluated (`evaluate`),
and which of its items give the before/after sample prompts (`sample_prompts`). The recipe
(training.recipe), the token statistics (training.token_stats) and the samples (training.samples) call
these and never ask which objective runs. Its planner terms are the planner's (planner: the
reference's forward, grpo's rollouts), which admission runs without torch.

Each objective has one home, a package here: its data where training.data's examples are not it (dpo's
pairs), its loss, its step (on training.step's shared accumulation and update), its metrics (what its
step and eval records carry, core.run_protocol.OBJECTIVE_FIELDS) and its evaluation. The reference
policy dpo and grpo compare with is the model layer's (training.reference).

Adding an objective: a package with a class that has these members, and a line in OBJECTIVES.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.spec import JobSpec
from training.objectives.base import Context, Evaluation, Objective
from training.objectives.dpo import Dpo
from training.objectives.grpo import Grpo
from training.objectives.sft import Sft

__all__ = ["Context", "Evaluation", "Objective", "build", "dataset_reader", "objective_class"]

OBJECTIVES: dict[str, type[Objective]] = {"sft": Sft, "dpo": Dpo, "grpo": Grpo}


def objective_class(spec: JobSpec) -> type[Objective]:
    return OBJECTIVES[spec.objective]


def dataset_reader(spec: JobSpec, model_dir: Path, tokenizer: Any = None) -> tuple[Callable[..., Any], Any]:
    """How a run reads its dataset, for training and its token statistics alike: (load, what load tokenizes
    with). The objective's load with the base's tokenizer (`tokenizer` where the caller has it, else loaded
    here); for a vision-language base training.vision's with the base's processor, whose image tokens count
    as the model sees them. Local files only, never remote code (training.model.load_tokenizer)."""
    from training.vision_model import is_vision_base

    if is_vision_base(model_dir):
        from training import vision

        return vision.load_for_training, vision.load_processor(model_dir)
    if tokenizer is None:
        from training.model import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    return objective_class(spec).load, tokenizer


def build(ctx: Context) -> Objective:
    return objective_class(ctx.spec)(ctx)
