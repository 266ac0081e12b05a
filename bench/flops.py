"""FLOPs per trained token and MFU, counted two ways: every bench that prints an MFU takes it from here
(bench/gpu_vs_trl.py, bench/gpu_check.py).

MFU = FLOPs per real token x real tokens/s / the GPU's dense bf16 peak (planner.gpus: an H200's and an
H100 SXM's 989 TFLOP/s). Real tokens: input tokens, padding never counted (it does no useful work).

**The LoRA count** (the goal's; DESIGN.md "On GPUs"), per token:

    F_lora = 4 N_mm + 6 N_lora + 3 A_fwd

  N_mm    the weights that multiply each token: the decoder blocks' linear layers and the output layer
          (lm_head: tied to the embedding or not, it is a matmul) = core.arch's matmul_params. The input
          embedding is a lookup (no FLOPs), norms are negligible; both are left out.
  4 N_mm  the forward's 2 FLOPs (a multiply and an add) per weight, and the backward's activation gradient
          dX = dY W^T, 2 more. A frozen weight has no weight gradient dW = X^T dY, the third 2N of full
          training's 6N (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1: C ~ 6N
          = 2N forward + 4N backward).
  6 N_lora  LoRA's A and B are trained: forward, activation gradient and weight gradient, 2 each.
  A_fwd   attention's forward, which has no weights and so no N: per layer, QK^T and PV each cost
          2 x d_attn FLOPs per (query, key) pair (d_attn = heads x head_dim). A causal sequence of s tokens
          has s(s+1)/2 pairs, so per layer and sequence 2 x 2 x d_attn x s(s+1)/2 = 2 d_attn s(s+1); per
          token, summed over the sequences trained and divided by their tokens. Its backward (dQ, dK from
          QK^T; dP, dV from PV) is twice the forward, frozen base or not (the gradient must flow through
          attention to earlier layers' LoRA weights): 3 A_fwd in all.

  Sources and conventions: the field's LoRA count, 2N forward + 2N backward with no weight gradient,
  plus attention; the attention term is PaLM's (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T per
  token, forward and backward, whose MFU also leaves out rematerialised FLOPs) with causal pairs in
  place of PaLM's full T x T square: FlashAttention-2's benchmark convention (Dao 2023), which halves
  causal attention. The lower of the two counts: an MFU by it cannot be raised by work a causal kernel
  skips. `attention_fwd_per_token(..., causal=False)` gives PaLM's (reported beside, in the JSON).
  Packed rows: each sequence attends only within itself (varlen), so s is each example's length, not the
  row's. Gradient checkpointing's recomputed forward is not counted (a model-FLOPs utilisation, not a
  hardware one: PaLM appendix B), nor QLoRA's dequantisation: the same model FLOPs with or without.

**The 6N count**, beside it as in every earlier table: 6 x N_total (every parameter, embeddings and output
layer included), no attention. For LoRA it overstates the work (no weight gradients) and, at short
sequences, slightly understates it (no attention); kept so that the tables of 2026-11-26..28 compare.

N is stated three ways (`FlopCount.describe`): N_total (with embeddings and the output layer), N_mm (without
the embeddings, with the output layer: what 4N uses) and N_blocks (without either: Kaplan's non-embedding N).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopCount:
    n_total: int  # every parameter: embeddings, blocks, norms, output layer
    n_matmul: int  # blocks' linear weights + the output layer (what multiplies each token)
    n_blocks: int  # blocks' linear weights alone
    n_lora: int  # LoRA's A and B (trained)
    attn_fwd_per_token: float  # causal pairs (module docstring)
    attn_fwd_per_token_full: float  # PaLM's full T x T square, for reference
    tokens_per_sequence: float  # token-weighted mean sequence length of the data (sum s^2 / sum s)

    @property
    def lora_per_token(self) -> float:
        return 4 * self.n_matmul + 6 * self.n_lora + 3 * self.attn_fwd_per_token

    @property
    def six_n_per_token(self) -> float:
        return 6 * self.n_total

    def mfu(self, tokens_per_s: float | None, peak_flops: float | None) -> dict[str, float | None]:
        """{"mfu_6n", "mfu_lora"} at `tokens_per_s` real tokens a second; None where either is unknown."""
        if not tokens_per_s or not peak_flops:
            return {"mfu_6n": None, "mfu_lora": None}
        return {
            "mfu_6n": self.six_n_per_token * tokens_per_s / peak_flops,
            "mfu_lora": self.lora_per_token * tokens_per_s / peak_flops,
        }

    def describe(self) -> str:
        """One line for a bench's header: N three ways and both counts per token."""
        return (
            f"N_total {_n(self.n_total)} (with embeddings and lm_head), "
            f"N_mm {_n(self.n_matmul)} (without embeddings, with lm_head), "
            f"N_blocks {_n(self.n_blocks)} (without either), N_lora {_n(self.n_lora)}; "
            f"per real token: LoRA count 4 N_mm + 6 N_lora + 3 A_fwd = {_n(self.lora_per_token)}FLOP "
            f"(A_fwd {_n(self.attn_fwd_per_token)}FLOP, causal, sequences of "
            f"{self.tokens_per_sequence:.0f} tokens token-weighted), "
            f"6 N_total = {_n(self.six_n_per_token)}FLOP"
        )

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> FlopCount:
        """The count back from its `as_json()`."""
        return cls(
            n_total=found["n_total"],
            n_matmul=found["n_matmul"],
            n_blocks=found["n_blocks"],
            n_lora=found["n_lora"],
            attn_fwd_per_token=found["attn_fwd_per_token"],
            attn_fwd_per_token_full=found["attn_fwd_per_token_full_square"],
            tokens_per_sequence=found["tokens_per_sequence"],
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "n_total": self.n_total,
            "n_matmul": self.n_matmul,
            "n_blocks": self.n_blocks,
            "n_lora": self.n_lora,
            "attn_fwd_per_token": self.attn_fwd_per_token,
            "attn_fwd_per_token_full_square": self.attn_fwd_per_token_full,
            "tokens_per_sequence": self.tokens_per_sequence,
            "lora_flops_per_token": self.lora_per_token,
            "six_n_flops_per_token": self.six_n_per_token,
            "lora_formula": "4 * n_matmul + 6 * n_lora + 3 * attn_fwd_per_token (causal pairs)",
            "six_n_formula": "6 * n_total",
        }


def _n(x: float) -> str:
    """1.234G, 12.6M, 3.4k: a count for a header line."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.4g}"


def attention_fwd_per_token(
    num_layers: int, attn_dim: int, lengths: Iterable[int], max_len: int | None = None, causal: bool = True
) -> float:
    """Attention's forward FLOPs per token over sequences of `lengths` tokens (each cut at `max_len`, as
    both engines truncate): per layer 2 d_attn s(s+1) a causal sequence (4 d_attn s^2 the full square),
    summed, divided by the tokens."""
    seqs = [min(n, max_len) if max_len else n for n in lengths if n > 0]
    tokens = sum(seqs)
    if not tokens:
        return 0.0
    pairs = sum(s * (s + 1) / 2 if causal else s * s for s in seqs)
    return 2 * 2 * attn_dim * num_layers * pairs / tokens


def count(arch, lengths: Iterable[int], n_lora: int, max_len: int | None = None) -> FlopCount:
    """`arch`: core.arch's Architecture of the model; `lengths`: the token lengths of the sequences trained
    (each example as its engine tokenizes it); `n_lora`: the trainable LoRA parameters."""
    seqs = [min(n, max_len) if max_len else n for n in lengths if n > 0]
    attn_dim = arch.num_heads * arch.head_dim
    blocks = arch.num_layers * sum(m.weight_numel for m in arch.block_linears)
    tokens = sum(seqs)
    return FlopCount(
        n_total=arch.total_params,
        n_matmul=arch.matmul_params,
        n_blocks=blocks,
        n_lora=n_lora,
        attn_fwd_per_token=attention_fwd_per_token(arch.num_layers, attn_dim, seqs),
        attn_fwd_per_token_full=attention_fwd_per_token(arch.num_layers, attn_dim, seqs, causal=False),
        tokens_per_sequence=sum(s * s for s in seqs) / tokens if tokens else 0.0,
    )
