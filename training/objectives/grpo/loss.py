"""grpo's loss as TRL 1.16's GRPOTrainer computes it: advantages, per-token log-probs, the loss.

Pure torch on tensors a caller already holds: no model, no batch building, no generation.

Advantages (one reward per completion, G completions per prompt, in prompt-major order):
  A_i = (r_i - mean_group(r)) / (std + 1e-4)       std: the group's ("group"), the batch's ("batch"),
                                                   or no division at all ("none"); Bessel-corrected
A NaN reward (a grader that could not score) is left out of its group's mean and std and gets A = 0.

Per-token log-probs: log softmax(z / temperature)[id] in fp32 (fp64 for fp64 logits), where z are the
logits that predict the completion tokens.

Loss, per completion token t of sequence i, with logp the policy's log-prob (with gradient), old the
log-probs the completions were sampled under (logp detached when absent: on-policy, ratio 1 with
gradient), ref the reference's:
  token level     w_it = exp(logp_it - old_it)
  sequence level  w_i  = exp(mean over i's tokens of (logp - old))                   GSPO (Zheng 2025)
  l_it = -min(w A_i, clip(w, 1 - eps_low, 1 + eps_high) A_i)                         PPO's clip, DAPO's
                                                                                     eps_high (Yu 2025)
       + beta w (exp(ref - logp) - (ref - logp) - 1)          when beta != 0: k3's KL estimator, times w
                                                              (TRL's use_bias_correction_kl, on by default)
The step's loss (N sequences and M completion tokens over all its micro-batches and ranks, L the
configured max_completion_length), by loss_type:
  grpo     sum_i (sum_t l_it / |i|) / N      each sequence's token mean, mean over sequences
  bnpo     sum_it l_it / M                   the token mean
  dr_grpo  sum_it l_it / (N L)               Dr. GRPO (Liu 2025): a constant, no length bias
  dapo     sum_it l_it / M                   TRL's default; the token mean over the whole step
Each micro-batch returns its part of these sums divided by the step's totals (StepTotals), so the
micro-batch losses add up to the step's loss exactly, for every loss type. TRL's single batch is the
case StepTotals = the batch's own. TRL itself normalises bnpo by each micro-batch's own tokens and grpo /
dr_grpo by each micro-batch's own sequences, then divides by the accumulation steps (a mean of micro-
batch means): equal to the step's loss only when micro-batches hold equal token counts (bnpo) or equal
sequence counts (grpo, dr_grpo; TRL's micro-batches do). Its dapo divides by the generation batch's
tokens scaled to one step: the step's own count, as here, when a generation is one step (the default).
ftune normalises by the step's totals on purpose: accumulation equals one big batch. So bnpo and dapo
are the same loss here.

Left out (TRL default-off): delta (two-sided clipping), top_entropy_quantile < 1, entropy_coef,
off_policy_mask_threshold, vLLM's importance-sampling correction (needs use_vllm), the MoE aux loss,
tool masks, the cispo / sapo / vespo / luspo losses, normalize_then_sum over several reward functions;
mask_truncated_completions belongs to the caller (zero the truncated rows of completion_mask). Of TRL's
metrics, clip_ratio/{low,high,region}_mean and kl are here; clip_ratio/low_min, high_max and entropy
are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ISLevel = Literal["token", "sequence"]

# TRL 1.16 GRPOConfig's defaults.
DEFAULT_LOSS_TYPE: LossType = "dapo"
DEFAULT_BETA = 0.0
DEFAULT_EPSILON = 0.2  # epsilon_high defaults to epsilon
DEFAULT_SCALE_REWARDS: ScaleRewards = "group"
DEFAULT_IS_LEVEL: ISLevel = "token"
STD_EPS = 1e-4  # added to the std before dividing, as TRL does

# Sums over a micro-batch, in this order (one vector: one read and one all-reduce per step; metrics()).
STAT_NAMES = ("clip_low", "clip_high", "clip_region", "clip_count", "kl", "kl_count")
# Rows of logits turned into fp32 at a time: about 128 MiB of fp32 whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class StepTotals:
    """What a step's loss is normalised by, over all its micro-batches and ranks."""

    sequences: int
    completion_tokens: int  # completion_mask's sum


# ---- advantages


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """trl.trainer.utils.nanstd: Bessel-corrected, NaNs ignored, NaN for fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: ScaleRewards | bool = DEFAULT_SCALE_REWARDS
) -> torch.Tensor:
    """Each completion's advantage over its group (module docstring), as TRL's
    _generate_and_score_completions computes it for one reward function ("sum_then_normalize").
    `rewards`: [num_prompts * num_generations], each prompt's completions together; NaN = unscorable.
    scale_rewards True / False are GRPOConfig's legacy spellings of "group" / "none"."""
    scale = ("group" if scale_rewards else "none") if isinstance(scale_rewards, bool) else scale_rewards
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean
    if scale == "group":
        if num_generations > 1:
            std = _nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    elif scale == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', not {scale_rewards!r}")
    return torch.nan_to_num(advantages, nan=0.0)


# ---- per-token log-probs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / T) at ids, a chunk of rows at a time in fp32: saves the logits as they come
    (bf16 stays bf16) and one logsumexp per row, never a full-vocabulary fp32 copy; the backward
    recomputes each chunk's softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, 1)
        dtype = _compute_dtype(logits.dtype)
        rows = max(1, _CHUNK_ELEMENTS // vocab)
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, flat.shape[0], rows):
            z = flat[s : s + rows].to(dtype) / temperature
            lse[s : s + rows] = torch.logsumexp(z, dim=-1)
            out[s : s + rows] = z.gather(-1, flat_ids[s : s + rows]).squeeze(-1) - lse[s : s + rows]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return out.view(ids.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, ids, lse = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, 1)
        dtype = _compute_dtype(logits.dtype)
        g = grad.reshape(-1, 1).to(dtype)
        rows = max(1, _CHUNK_ELEMENTS // vocab)
        out = torch.empty_like(flat)
        for s in range(0, flat.shape[0], rows):
            z = flat[s : s + rows].to(dtype) / temperature
            gs = g[s : s + rows]
            # d logp_id / dz = onehot(id) - softmax(z); then through z = logits / T
            d = -gs * torch.exp(z - lse[s : s + rows].unsqueeze(-1))
            d.scatter_add_(-1, flat_ids[s : s + rows], gs)
            out[s : s + rows] = d / temperature
        return out.view(logits.shape), None, None


def per_token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at ids: [..., T, V] and [..., T] -> [..., T], in fp32
    (fp64 for fp64 logits) whatever the logits' dtype, as TRL scores completions (its fused LM head
    works in fp32 always). `logits[..., t, :]` must be the ones that predict `ids[..., t]` (shifted by
    the caller); padded positions need a valid id and are masked by the loss."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    result: torch.Tensor = _TokenLogps.apply(logits, ids, temperature)
    return result


# ---- the loss


def grpo_token_loss(
    per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = DEFAULT_BETA,
    epsilon_low: float = DEFAULT_EPSILON,
    epsilon_high: float = DEFAULT_EPSILON,
    loss_type: LossType = DEFAULT_LOSS_TYPE,
    importance_sampling_level: ISLevel = DEFAULT_IS_LEVEL,
    max_completion_length: int,
    normalizer: StepTotals | None = None,
    kl_bias_correction: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step's loss, its metric sums (STAT_NAMES), detached), TRL 1.16's
    GRPOTrainer._compute_loss (module docstring). Tensors are [B, T] (advantages [B] or [B, T]);
    `normalizer`: the step's totals, None for this batch alone (then the loss is TRL's)."""
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level must be 'token' or 'sequence', not {importance_sampling_level!r}"
        )
    mask = completion_mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    kl = None
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        if kl_bias_correction:
            kl = kl * coef_1
        token_loss = token_loss + beta * kl

    masked = token_loss * mask
    if loss_type == "grpo":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_seq.sum() / (normalizer.sequences if normalizer else per_seq.shape[0])
    elif loss_type in ("bnpo", "dapo"):
        tokens = max(normalizer.completion_tokens, 1) if normalizer else mask.sum().clamp(min=1.0)
        loss = masked.sum() / tokens
    elif loss_type == "dr_grpo":
        seqs = normalizer.sequences if normalizer else token_loss.shape[0]
        loss = masked.sum() / (seqs * max_completion_length)
    else:
        raise ValueError(f"loss_type must be one of grpo, bnpo, dr_grpo, dapo, not {loss_type!r}")
    return loss, _stats(coef_1, advantages, mask, kl, epsilon_low, epsilon_high)


@torch.no_grad()
def _stats(
    coef_1: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    epsilon_low: float,
    epsilon_high: float,
) -> torch.Tensor:
    """TRL's clip-ratio and KL metrics as sums and counts (fp64: exact counts), so a step's micro-batches
    and ranks add up before one division. A sequence-level ratio is counted once per sequence, as TRL
    does (every sequence, an empty one too)."""
    m = mask.to(torch.float64)
    low = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).to(torch.float64)
    high = ((coef_1 > 1 + epsilon_high) & (advantages > 0)).to(torch.float64)
    region = torch.maximum(low, high)
    if low.shape[-1] == 1:  # one ratio per sequence
        sums = [low.sum(), high.sum(), region.sum(), m.new_tensor(float(low.shape[0]))]
    else:
        sums = [(low * m).sum(), (high * m).sum(), (region * m).sum(), m.sum()]
    if kl is None:
        sums += [m.new_zeros(()), m.new_zeros(())]
    else:
        sums += [(kl.to(torch.float64) * m).sum(), m.sum()]
    return torch.stack(sums)


def metrics(stats: list[float]) -> dict[str, float]:
    """TRL's names for a step's summed STAT_NAMES (kl only when the KL term was on)."""
    s = dict(zip(STAT_NAMES, stats, strict=True))
    clips = max(s["clip_count"], 1.0)
    out = {
        "clip_ratio/low_mean": s["clip_low"] / clips,
        "clip_ratio/high_mean": s["clip_high"] / clips,
        "clip_ratio/region_mean": s["clip_region"] / clips,
    }
    if s["kl_count"]:
        out["kl"] = s["kl"] / s["kl_count"]
    return out
