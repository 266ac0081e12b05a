"""Objective grpo: reinforcement fine-tuning with GRPO, as TRL 1.16's GRPOTrainer computes it.

One optimizer step on a global batch of prompts (training.rollouts.PromptItem):
1. sampling: each prompt answered num_generations times by the policy being trained (training.rollouts,
   seeded by (seed, step): a resumed run samples what an uninterrupted one would), rollout_prompts
   prompts per generate() call (all of the step's by default: the samples, like the step, do not
   depend on its split into micro-batches);
2. grading: every answer scored by the spec's grader (core.graders; OpenAI's grader JSON) against its
   dataset row, in a bounded thread pool; a failed grade scores 0 and counts its error;
3. training: group-relative advantages and GRPO's clipped loss (training.grpo_loss) over micro-batches
   of whole groups (micro_batch_size prompts x num_generations completions each), each micro-batch its
   share of the step's loss over the step's totals, so accumulation equals one big batch. With beta > 0
   the reference's log-probs come from the same model with the adapter off (training.dpo's
   reference_policy: no second model), under no_grad before the policy's forward, as DPO does. One
   update per rollout batch: the sampling policy is the one being trained (TRL's num_iterations 1), so
   the old log-probs are the current ones, detached.
The three phases are timed apart (the step record's rl.timing). Evaluation grades one greedy answer to
each of the first eval_samples validation prompts (rl.reward_mean of the eval record).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from core.graders import GradeContext, count_errors, grade_many, make_sample, parse_grader
from core.run_protocol import RLMetrics
from core.spec import JobSpec
from training import dropout, grpo_loss, rollouts
from training.batches import Step, split_step
from training.dpo import reference_policy
from training.grading import grade_context
from training.loss import token_losses
from training.objectives.base import BaseObjective, Context, Evaluation
from training.rollouts import Completion, PromptItem
from training.samples import Prompt
from training.step import Batch, StepResult, accumulate_gradients, make_batch, optimizer_step


class Grpo(BaseObjective):
    evaluates_at_start = True  # the reward before training: the start of the curve

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        rl = ctx.spec.rl
        assert rl.grader is not None  # the spec's check
        self.grader = parse_grader(rl.grader, allow_python=True)
        self.grading: GradeContext = grade_context(ctx.config)
        self.workers = ctx.config.grading.concurrency

    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        return rollouts.load_for_training(path, tokenizer, spec, column_mapping)

    # ---- one optimizer step

    def train_step(
        self, items: Sequence[Any], step: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        ctx, spec = self.ctx, self.ctx.spec
        parts, rl, n = ctx.parts, spec.rl, spec.num_generations
        prompts: list[PromptItem] = [items[i] for row in step for i in row]
        where = {i: k for k, i in enumerate(i for row in step for i in row)}  # item -> prompt position

        start = time.perf_counter()
        answers = self._sample(prompts, n, rl.temperature, (spec.seed, step_no), rl.rollout_prompts)
        sampled = time.perf_counter()
        completions = [c for group in answers for c in group]  # prompt-major: k * n + g
        grades = grade_many(
            self.grader,
            [(make_sample(c.text), p.item) for p, group in zip(prompts, answers, strict=True) for c in group],
            self.grading,
            max_workers=self.workers,
        )
        graded = time.perf_counter()

        rewards = torch.tensor([g.reward for g in grades], dtype=torch.float64)
        advantages = grpo_loss.group_advantages(rewards, n, rl.scale_rewards).float()
        seqs = [c.sequence(p.input_ids) for p, group in zip(prompts, answers, strict=True) for c in group]
        totals = grpo_loss.StepTotals(len(seqs), sum(len(c.ids) for c in completions))
        split = split_step(spec, {i: items[i].length for i in where}, step)
        micro = [[where[i] * n + g for i in idx for g in range(n)] for idx in split]
        micro_batches = [make_batch(spec, seqs, idx, ctx.pad_id) for idx in micro]
        # a step's sequences are its own (sampled now): the step, not only the epoch, names their masks
        key = (*dropout_key, step_no)
        layouts = [dropout.layout(spec, seqs, idx, key) for idx in micro] if spec.lora_dropout else None
        stats: list[torch.Tensor] = []
        which = iter(micro)

        def loss_fn(batch: Batch) -> torch.Tensor:
            idx = next(which)
            loss, s = self._micro_batch_loss(
                batch, [len(completions[k].ids) for k in idx], advantages[idx], totals
            )
            stats.append(s)
            return loss

        local_loss, _ = accumulate_gradients(parts, micro_batches, layouts=layouts, loss_fn=loss_fn)
        summed = torch.stack(stats).sum(0) if stats else torch.zeros(len(grpo_loss.STAT_NAMES))
        norm = optimizer_step(parts, lr)
        # the step's one host read: loss, grad norm and the loss's metric sums together
        values = torch.cat(
            [local_loss.double().reshape(1), norm.double().reshape(1).to(summed.device), summed]
        )
        loss, grad_norm, *sums = values.tolist()
        trained = time.perf_counter()

        timing = {"sampling": sampled - start, "grading": graded - sampled, "training": trained - graded}
        rl_metrics = summarize(grades, completions, grpo_loss.metrics(sums), timing)
        return StepResult(
            loss,
            grad_norm,
            sum(len(s.input_ids) for s in seqs),
            totals.completion_tokens,
            lr,
            fields={"rl": rl_metrics},
            note=f" reward {_show(rl_metrics.reward_mean)}",
        )

    def _sample(
        self, prompts: Sequence[PromptItem], n: int, temperature: float, seed: Sequence[int], chunk: int
    ) -> list[list[Completion]]:
        parts, spec = self.ctx.parts, self.ctx.spec
        return rollouts.sample(
            parts.model,
            self.ctx.tokenizer,
            [p.input_ids for p in prompts],
            n=n,
            temperature=temperature,
            max_new_tokens=spec.max_completion_tokens,
            seed=seed,
            device=parts.device,
            autocast=parts.autocast,
            chunk=chunk,
        )

    def _micro_batch_loss(
        self, batch: Batch, lengths: list[int], advantages: torch.Tensor, totals: grpo_loss.StepTotals
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's share of the step's GRPO loss and its metric sums (grpo_loss.STAT_NAMES)."""
        parts, spec = self.ctx.parts, self.ctx.spec
        rl = spec.rl
        ref = None
        if spec.uses_reference:
            with torch.no_grad(), reference_policy(parts.model):
                ref_losses, _ = token_losses(
                    parts.model, batch, parts.device, parts.autocast, temperature=rl.temperature
                )
            ref = padded(-ref_losses, lengths)
        losses, _ = token_losses(parts.model, batch, parts.device, parts.autocast, temperature=rl.temperature)
        logps = padded(-losses, lengths)
        mask = padded(torch.ones_like(losses), lengths).bool()
        return grpo_loss.grpo_token_loss(
            logps,
            mask,
            advantages.to(logps.device),
            ref_per_token_logps=ref,
            beta=spec.beta,
            epsilon_low=rl.epsilon,
            epsilon_high=rl.epsilon_upper,
            loss_type=spec.loss_type,  # type: ignore[arg-type]  # a grpo loss type (PreferenceArgs.check)
            importance_sampling_level=rl.importance_sampling_level,
            max_completion_length=spec.max_completion_tokens,
            normalizer=totals,
        )

    # ---- evaluation and samples

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation:
        """The mean reward of one greedy answer to each of the first eval_samples validation prompts."""
        spec = self.ctx.spec
        chosen: list[PromptItem] = list(items[: spec.eval_samples or len(items)])
        start = time.perf_counter()
        # one answer each: as many prompts per generate() call as a step's rollouts have sequences
        groups = self._sample(chosen, 1, 0.0, (spec.seed, step_no), spec.rl.rollout_sequences)
        answers = [group[0] for group in groups]
        sampled = time.perf_counter()
        grades = grade_many(
            self.grader,
            [(make_sample(c.text), p.item) for p, c in zip(chosen, answers, strict=True)],
            self.grading,
            max_workers=self.workers,
        )
        timing = {"sampling": sampled - start, "grading": time.perf_counter() - sampled}
        metrics = summarize(grades, answers, {}, timing)
        return Evaluation(None, {"rl": metrics}, f"reward {_show(metrics.reward_mean)}")

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        return [
            Prompt(tokenizer.decode(p.input_ids, skip_special_tokens=True), p.input_ids) for p in items[:n]
        ]


def padded(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """A micro-batch's flat per-target values (training.loss order: sequence by sequence, each in token
    order) as [sequences, longest] rows, zero past each row's length; differentiable. The lengths are
    the host's, so nothing is read from the device."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    pos = torch.arange(int(sum(lengths))) - starts[seq]
    out = values.new_zeros(len(lengths), max(lengths))
    return out.index_put((seq.to(values.device), pos.to(values.device)), values)


def summarize(
    grades: Sequence[Any],
    completions: Sequence[Completion],
    loss_metrics: dict[str, float],
    timing: dict[str, float],
) -> RLMetrics:
    """RLMetrics of graded samples: reward mean and std over those that scored a number, each named
    sub-grader's mean, how many samples hit each grader error, completion lengths, the loss's clip
    ratios and KL (TRL's names), and the step's timing."""
    rewards = [g.reward for g in grades if not math.isnan(g.reward)]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = None
    if mean is not None and len(rewards) > 1:
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    subs: dict[str, list[float]] = {}
    for g in grades:
        for name, value in g.sub_rewards.items():
            subs.setdefault(name, []).append(value)
    n = max(len(completions), 1)
    return RLMetrics(
        samples=len(grades),
        reward_mean=mean,
        reward_std=std,
        scores={k: sum(v) / len(v) for k, v in subs.items()},
        errors=count_errors(grades),
        completion_tokens_mean=sum(len(c.ids) for c in completions) / n,
        truncated_share=sum(c.truncated for c in completions) / n,
        clip_ratio_low=loss_metrics.get("clip_ratio/low_mean"),
        clip_ratio_high=loss_metrics.get("clip_ratio/high_mean"),
        clip_ratio_region=loss_metrics.get("clip_ratio/region_mean"),
        kl=loss_metrics.get("kl"),
        timing={k: round(v, 4) for k, v in timing.items()},
    )


def _show(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
