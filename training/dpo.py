"""Preference tuning: DPO's losses, the reference policy, and one optimizer step on preference pairs.

A micro-batch holds whole pairs, each pair's chosen side then its rejected side (training.preference).
A side's log-probability is the sum of its completion tokens' log-probabilities (the prompt is not
scored). With beta and, per pair, the policy's log-probs (c, r) and the reference's (c0, r0):
  sigmoid  -log sigmoid(beta ((c - c0) - (r - r0)))                         the DPO paper (Rafailov 2023)
  ipo      ((c - c0) / |c| - (r - r0) / |r| - 1 / (2 beta))^2               IPO (Azar 2023), per token as
                                                                            TRL takes it (|x|: tokens)
  simpo    -log sigmoid(beta (c / |c| - r / |r|) - simpo_gamma)             SimPO (Meng 2024), no reference
The step's loss is the mean over its pairs, plus rpo_alpha x the mean negative log-likelihood of the
step's chosen completion tokens (RPO; TRL's loss_type "sft" weighted alpha). Each micro-batch adds its
pairs' losses divided by the step's pairs (and its chosen tokens' NLL by the step's chosen tokens), so
any split of a step into micro-batches and ranks gives the same gradient, as for SFT.

Rewards (the metrics): beta (c - c0) and beta (r - r0); for simpo beta c / |c| and beta r / |r|.

The reference policy is the model the adapter starts from, and never a second copy of the base:
- a fresh adapter: the base alone, peft's disable_adapter() for the reference forward;
- a job continuing from an earlier adapter (spec.init_from): that adapter loaded twice on the one base,
  "default" (trained) and "ref" (frozen, no dropout); the reference forward switches every LoRA layer
  to "ref" (training.model.load_model builds both).
It runs in every micro-batch, under no_grad, before the policy's forward (so no activation of either is
kept while the other runs), on the same batch: not precomputed. Why: the reference is then a pure
function of frozen weights and the batch, so resume, accumulation and FSDP need nothing more (no
stored log-probs to checkpoint, shard or keep in step with the batch order), and the numbers are TRL's
own (its default, precompute_ref_log_probs=False). Its cost is one forward without backward per micro-
batch (about a third of a step without checkpointing); precomputing would save that only from the
second epoch on, and DPO runs are usually one epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.spec import JobSpec
from training import distributed, dropout
from training.batches import Step, rank_share, split_step
from training.loss import token_losses
from training.preference import Pair, Sequences, sequence_indices
from training.step import Batch, Parts, StepResult, accumulate_gradients, make_batch, optimizer_step

REF_ADAPTER = "ref"
# Sums over a micro-batch's pairs, in this order (one vector, one read and one all-reduce per step).
STAT_NAMES = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected")


@dataclass(frozen=True)
class Totals:
    """What a step's loss is normalised by, over all its micro-batches and ranks."""

    pairs: int
    chosen_tokens: int  # target tokens of the chosen sides (rpo_alpha's NLL is a mean over them)


# ---- the reference policy


@contextmanager
def reference_policy(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as the reference: the "ref" adapter where there is one, else the base alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not any(REF_ADAPTER in getattr(m, "lora_A", {}) for m in layers):
        with model.disable_adapter():  # type: ignore[operator]
            yield
        return
    # Switch the layers only: peft's set_adapter would also flip requires_grad on the adapters.
    saved = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [REF_ADAPTER]
        yield
    finally:
        for m, active in zip(layers, saved, strict=True):
            m._active_adapter = active


# ---- log-probs and losses


def sequence_logps(parts: Parts, batch: Batch, n_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the completion tokens' log-probs, number of completion tokens) per sequence of a
    micro-batch collated from `n_seqs` sequences (training.step.make_batch), in fp32."""
    losses, _ = token_losses(parts.model, batch, parts.device, parts.autocast)
    seq = batch["target_sequence"].to(losses.device, non_blocking=True)  # type: ignore[union-attr]
    sums = torch.zeros(n_seqs, device=losses.device).index_add_(0, seq, -losses)
    counts = torch.bincount(seq, minlength=n_seqs).to(sums.dtype)
    return sums, counts


@dataclass(frozen=True)
class PairLosses:
    losses: torch.Tensor  # per pair
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_losses(
    spec: JobSpec,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
) -> PairLosses:
    """The per-pair loss of spec.loss_type (module docstring) and the pairs' rewards."""
    beta = spec.beta
    if spec.loss_type == "simpo":
        c_avg, r_avg = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
        losses = -F.logsigmoid(beta * (c_avg - r_avg) - spec.simpo_gamma)
        return PairLosses(losses, beta * c_avg.detach(), beta * r_avg.detach())
    assert ref_chosen is not None and ref_rejected is not None
    c_ratio, r_ratio = chosen - ref_chosen, rejected - ref_rejected
    if spec.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (c_ratio - r_ratio))
    else:  # ipo
        delta = c_ratio / chosen_len.clamp(min=1) - r_ratio / rejected_len.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, beta * c_ratio.detach(), beta * r_ratio.detach())


def micro_batch_loss(
    parts: Parts, batch: Batch, n_pairs: int, totals: Totals
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step's loss, its metric sums over pairs (STAT_NAMES), detached).
    The reference forward runs first, without grad, then the policy's."""
    spec = parts.spec
    ref = None
    if spec.preference.uses_reference:
        with torch.no_grad(), reference_policy(parts.model):
            ref, _ = sequence_logps(parts, batch, 2 * n_pairs)
    logps, counts = sequence_logps(parts, batch, 2 * n_pairs)
    chosen, rejected = logps[0::2], logps[1::2]
    out = pair_losses(
        spec,
        chosen,
        rejected,
        counts[0::2],
        counts[1::2],
        ref[0::2] if ref is not None else None,
        ref[1::2] if ref is not None else None,
    )
    loss = out.losses.sum() / totals.pairs
    if spec.rpo_alpha:
        loss = loss + spec.rpo_alpha * -chosen.sum() / totals.chosen_tokens
    stats = torch.stack(
        [
            out.chosen_rewards.sum(),
            out.rejected_rewards.sum(),
            (out.chosen_rewards > out.rejected_rewards).float().sum(),
            chosen.detach().sum(),
            rejected.detach().sum(),
        ]
    )
    return loss, stats


# ---- one optimizer step


def train_step(
    parts: Parts,
    pairs: Sequence[Pair],
    pad_id: int,
    step: Step,
    *,
    lr: float,
    dropout_key: Sequence[int] = (),
) -> StepResult:
    """training.step.train_step on preference pairs: `step` holds pair indices; each micro-batch holds
    whole pairs; the loss is normalised by the step's pairs. Returns the step's mean metrics too."""
    spec = parts.spec
    lengths = {i: pairs[i].length for row in step for i in row}
    totals = Totals(len(lengths), sum(pairs[i].chosen.num_targets for i in lengths))
    split = split_step(spec, lengths, step)
    mine, padding = rank_share(len(split), distributed.rank(), distributed.world_size())
    chosen = [split[k] for k in mine] + [split[mine[0] if mine else 0]] * padding
    seqs = Sequences(pairs)
    micro = [sequence_indices(idx) for idx in chosen]
    micro_batches = [make_batch(spec, seqs, idx, pad_id) for idx in micro]
    layouts = [dropout.layout(spec, seqs, idx, dropout_key) for idx in micro] if spec.lora_dropout else None
    stats: list[torch.Tensor] = []
    sizes = iter([len(idx) for idx in chosen])

    def loss_fn(batch: Batch) -> torch.Tensor:
        loss, s = micro_batch_loss(parts, batch, next(sizes), totals)
        stats.append(s)
        return loss

    local_loss, _ = accumulate_gradients(
        parts, micro_batches, padding=padding, layouts=layouts, loss_fn=loss_fn
    )
    real = stats[: len(stats) - padding]
    local = torch.stack(real).sum(0) if real else torch.zeros(len(STAT_NAMES))
    # the step's one read of the device: loss and metric sums together, summed over ranks
    values = distributed.sum_list_over_ranks([float(local_loss), *local.tolist()])
    grad_norm = float(optimizer_step(parts, lr))
    return StepResult(
        values[0],
        grad_norm,
        sum(lengths.values()),
        sum(pairs[i].num_targets for i in lengths),
        lr,
        fields=(m := metrics(values[1:], totals.pairs)),
        note=f" reward accuracy {m['rewards_accuracy']:.3f}",
    )


def metrics(sums: Sequence[float], n_pairs: int) -> dict[str, float]:
    """Means over pairs of STAT_NAMES' sums, plus the reward margin."""
    out = {name: v / n_pairs for name, v in zip(STAT_NAMES, sums, strict=True)}
    out["rewards_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
    return out


# ---- evaluation on held-out pairs


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean DPO loss per pair (+ rpo_alpha x the chosen NLL per token)
    metrics: dict[str, float]
    pairs: int


@torch.no_grad()
def evaluate(parts: Parts, pairs: Sequence[Pair], pad_id: int, batch_pairs: int) -> EvalResult:
    """The step's loss and metrics over `pairs`, in eval mode (no dropout), batch_pairs pairs a batch."""
    model = parts.model
    was_training = model.training
    model.eval()
    totals = Totals(len(pairs), sum(p.chosen.num_targets for p in pairs))
    seqs = Sequences(pairs)
    spec = parts.spec.model_copy(update={"packing": False})  # padded batches, as SFT evaluates
    loss, sums = 0.0, torch.zeros(len(STAT_NAMES))
    order = sorted(range(len(pairs)), key=lambda i: pairs[i].length)
    try:
        for start in range(0, len(order), batch_pairs):
            idx = order[start : start + batch_pairs]
            batch = make_batch(spec, seqs, sequence_indices(idx), pad_id)
            part, s = micro_batch_loss(parts, batch, len(idx), totals)
            loss += float(part)
            sums += s.cpu()
    finally:
        model.train(was_training)
    return EvalResult(loss, metrics(sums.tolist(), len(pairs)), len(pairs))
