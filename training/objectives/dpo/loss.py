"""dpo's losses: a micro-batch's share of the step's loss, against the reference policy.

A micro-batch holds whole pairs, each pair's chosen side then its rejected side (pairs.Sequences). A
side's log-probability is the sum of its completion tokens' log-probabilities (the prompt is not
scored). With beta and, per pair, the policy's log-probs (c, r) and the reference's (c0, r0):
  sigmoid  -log sigmoid(beta ((c - c0) - (r - r0)))                         the DPO paper (Rafailov 2023)
  ipo      ((c - c0) / |c| - (r - r0) / |r| - 1 / (2 beta))^2               IPO (Azar 2023), per token as
                                                                            TRL takes it (|x|: tokens)
  simpo    -log sigmoid(beta (c / |c| - r / |r|) - simpo_gamma)             SimPO (Meng 2024), no reference
The step's loss is the mean over its pairs, plus rpo_alpha x the mean negative log-likelihood of the
step's chosen completion tokens (RPO; TRL's loss_type "sft" weighted alpha). Each micro-batch adds its
pairs' losses divided by the step's pairs (and its chosen tokens' NLL by the step's chosen tokens), so
any split of a step into micro-batches and ranks gives the same gradient, as for sft.

The reference's log-probs come from the same model (training.reference: the base alone, or an earlier
adapter's frozen copy), in every micro-batch, under no_grad, before the policy's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.spec import JobSpec
from training.loss import token_losses
from training.reference import reference_policy
from training.step import Batch, Parts


@dataclass(frozen=True)
class Totals:
    """What a step's loss is normalised by, over all its micro-batches and ranks."""

    pairs: int
    chosen_tokens: int  # target tokens of the chosen sides (rpo_alpha's NLL is a mean over them)


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
    """The per-pair loss of spec.loss_type (module docstring) and the pairs' rewards (metrics)."""
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
    """(this micro-batch's share of the step's loss, its metric sums over pairs (metrics.STAT_NAMES),
    detached). The reference forward runs first, without grad, then the policy's."""
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
