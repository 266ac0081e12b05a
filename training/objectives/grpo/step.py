"""One grpo optimizer step on a global batch of prompts (training.objectives.grpo says what it does)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from training import step as shared
from training.batches import Step, split_step
from training.loss import token_losses
from training.objectives.base import Context
from training.objectives.grpo import loss as grpo_loss
from training.objectives.grpo.metrics import note, summarize
from training.objectives.grpo.rollout import Grading, sample
from training.reference import reference_policy
from training.rollouts import PromptItem
from training.step import Batch, Parts, StepResult


def train_step(
    ctx: Context,
    grading: Grading,
    items: Sequence[PromptItem],
    step: Step,
    *,
    lr: float,
    dropout_key: Sequence[int],
    step_no: int,
) -> StepResult:
    """Sample, grade, then train on the global batch `step` (rows of indices into `items`); `step_no`:
    the steps done before it (seeds the rollouts and, with `dropout_key`, the dropout masks)."""
    parts, spec = ctx.parts, ctx.spec
    rl, n = spec.rl, spec.num_generations
    prompts = [items[i] for row in step for i in row]
    where = {i: k for k, i in enumerate(i for row in step for i in row)}  # item -> prompt position

    start = time.perf_counter()
    answers = sample(ctx, prompts, n, rl.temperature, (spec.seed, step_no), rl.rollout_prompts)
    sampled = time.perf_counter()
    completions = [c for group in answers for c in group]  # prompt-major: k * n + g
    grades = grading.grade([(p, c) for p, group in zip(prompts, answers, strict=True) for c in group])
    graded = time.perf_counter()

    rewards = torch.tensor([g.reward for g in grades], dtype=torch.float64)
    advantages = grpo_loss.group_advantages(rewards, n, rl.scale_rewards).float()
    seqs = [c.sequence(p.input_ids) for p, group in zip(prompts, answers, strict=True) for c in group]
    totals = grpo_loss.StepTotals(len(seqs), sum(len(c.ids) for c in completions))
    split = split_step(spec, {i: items[i].length for i in where}, step)
    micro = [[where[i] * n + g for i in idx for g in range(n)] for idx in split]
    micro_batches = [shared.make_batch(spec, seqs, idx, ctx.pad_id) for idx in micro]
    stats: list[torch.Tensor] = []
    which = iter(micro)

    def loss_fn(batch: Batch) -> torch.Tensor:
        idx = next(which)
        lengths = [len(completions[k].ids) for k in idx]
        loss, s = micro_batch_loss(parts, batch, lengths, advantages[idx], totals)
        stats.append(s)
        return loss

    # a step's sequences are its own (sampled now): the step, not only the epoch, names their masks
    layouts = shared.dropout_layouts(spec, seqs, micro, (*dropout_key, step_no))
    local_loss = shared.accumulate_gradients(parts, micro_batches, loss_fn, layouts=layouts)
    summed = torch.stack(stats).sum(0) if stats else torch.zeros(len(grpo_loss.STAT_NAMES))
    norm = shared.optimizer_step(parts, lr)
    # the step's one host read: loss, grad norm and the loss's metric sums together
    values = torch.cat([local_loss.double().reshape(1), norm.double().reshape(1).to(summed.device), summed])
    loss, grad_norm, *sums = values.tolist()
    trained = time.perf_counter()

    timing = {"sampling": sampled - start, "grading": graded - sampled, "training": trained - graded}
    rl_metrics = summarize(grades, completions, grpo_loss.metrics(sums), timing)
    tokens = sum(len(s.input_ids) for s in seqs)
    fields = {"rl": rl_metrics}
    return StepResult(
        loss, grad_norm, tokens, totals.completion_tokens, lr, fields=fields, note=f" {note(rl_metrics)}"
    )


def micro_batch_loss(
    parts: Parts,
    batch: Batch,
    lengths: list[int],
    advantages: torch.Tensor,
    totals: grpo_loss.StepTotals,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's share of the step's GRPO loss and its metric sums (loss.STAT_NAMES). With beta > 0
    the reference's log-probs (training.reference) come first, under no_grad, as dpo's do."""
    spec = parts.spec
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


def padded(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """A micro-batch's flat per-target values (training.loss order: sequence by sequence, each in token
    order) as [sequences, longest] rows, zero past each row's length; differentiable. The lengths are
    the host's, so nothing is read from the device."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    pos = torch.arange(int(sum(lengths))) - starts[seq]
    out = values.new_zeros(len(lengths), max(lengths))
    return out.index_put((seq.to(values.device), pos.to(values.device)), values)
