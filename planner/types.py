"""The planner's shapes: what it is told beyond the JobSpec (Runtime) and what it answers (Plan of Terms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

GiB = 2**30


class Term(BaseModel):
    name: str
    bytes: int
    note: str


class Suggestion(BaseModel):
    change: dict[str, Any]
    description: str
    plan_total_bytes: int
    fits: bool


class BatchShape(BaseModel):
    """The largest micro-batch the engine forms from a job's data (its token statistics), which the
    planner counts with instead of the worst case, every sequence padded to max_seq_len."""

    tokens: int  # tokens of the largest micro-batch, padding included, all its sequences (dpo: both sides)
    seq_len: int  # its widest sequence: the longest padded row, or a packed row's longest example
    targets: int  # the most scored tokens in a micro-batch: the engine computes logits for these only

    def token_stats(self) -> dict[str, int]:
        """The fields of a job's token statistics (core.data.token_stats) that carry this shape."""
        return {
            "max_micro_batch_tokens": self.tokens,
            "longest_sequence": self.seq_len,
            "max_micro_batch_targets": self.targets,
        }

    @classmethod
    def from_token_stats(cls, stats: dict[str, Any] | None) -> BatchShape | None:
        """The shape in a job's token statistics once they are ready (None: lengths not known yet)."""
        stats = stats or {}
        if stats.get("status", "ready") != "ready" or not stats.get("max_micro_batch_targets"):
            return None
        return cls(
            tokens=int(stats["max_micro_batch_tokens"]),
            seq_len=int(stats["longest_sequence"]),
            targets=int(stats["max_micro_batch_targets"]),
        )

    def describe(self) -> str:
        return (
            f"the data's largest micro-batch: {self.tokens} tokens, longest sequence {self.seq_len}, "
            f"{self.targets} scored"
        )


class Plan(BaseModel):
    gpu: str
    num_gpus: int
    method: str
    total_params: int
    # parameters one token uses: total_params less the experts it is not routed to (a MoE base; dense: total)
    active_params: int = 0
    trainable_params: int
    breakdown: list[Term]
    allocated_bytes: int  # the bytes in use at the peak: compare with max_memory_allocated
    # the caching allocator's segments at their peak: allocated + its cached free blocks (fragmentation);
    # compare with max_memory_reserved. On a CPU (no caching allocator): allocated_bytes.
    reserved_bytes: int = 0
    total_bytes: int  # reserved + the CUDA context: what the device must have
    # Not in total_bytes (cached blocks the allocator frees and retries with before an OOM, so they never
    # decide a fit) but in what nvidia-smi or torch.cuda.max_memory_reserved show (planner.allocator):
    # the plain loss head's half-precision logits segments, which its fp32 buffers cannot reuse
    loss_segments_bytes: int = 0
    usable_bytes: int
    fits: bool
    headroom_bytes: int
    # What the activations and logits were counted for: None is the worst case (every micro-batch
    # micro_batch_size x max_seq_len tokens), else the data's largest micro-batch (token statistics).
    batch_shape: BatchShape | None = None
    planned_tokens: int = 0  # tokens per micro-batch the plan counts with
    est_seconds_per_epoch: float | None = None
    speed_note: str | None = None
    suggestions: list[Suggestion] = []


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def idle(terms: list[Term], why: str) -> list[Term]:
    """Terms of a phase that is not at the peak: 0 bytes, their size kept in the note."""
    return [
        Term(name=t.name, bytes=0, note=f"{gib(t.bytes)} not at the peak ({why}): {t.note}") for t in terms
    ]


@dataclass(frozen=True)
class Runtime:
    """What the training framework keeps that a JobSpec does not say. FTUNE is ftune's engine; the
    defaults otherwise describe the usual transformers/peft loop (bench/planner_accuracy.py states these
    per published run)."""

    # peft's prepare_model_for_kbit_training (TRL/HF QLoRA recipes) casts every non-quantized parameter
    # (embeddings, lm_head, norms) to fp32; ftune keeps them in the compute dtype.
    kbit_fp32_upcast: bool = False
    # The loss in fp32 (autocast's cross_entropy, transformers' .float()); False for a half-precision
    # model run without autocast (DeepSpeed's fp16/bf16 engines), whose loss runs in the logits' dtype.
    loss_fp32: bool = True
    # Gradient buckets a framework keeps on the GPU through backward, e.g. DeepSpeed ZeRO-2 with
    # contiguous_gradients + overlap_comm: two reduce buckets of reduce_bucket_size half-precision values.
    grad_bucket_bytes: int = 0
    # The whole model, adapters included, cast to half precision and run without autocast, the optimizer
    # keeping fp32 master copies: DeepSpeed's fp16/bf16 engine (engine.module.half(); ZeRO-1/2 keep an fp32
    # partition of the trainable params, Adam m and v in fp32 and a contiguous half-precision gradient
    # partition; the step flattens the half gradients and casts them to fp32: 2 + 4 B/param transient).
    half_model_master: bool = False
    # Every micro-batch has the same shape (batches padded to max_seq_len, rows always full): the caching
    # allocator then reuses one step's blocks for the next (planner.allocator); False: lengths vary.
    fixed_shapes: bool = False
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (ftune's training process sets it): the allocator grows
    # one mapping instead of adding segments, so batches of varying lengths strand nothing
    # (planner.allocator); False: torch's default segments.
    expandable_segments: bool = False
    # Packed rows' attention takes grouped k and v as they are (flash-attn's varlen, torch's varlen from 2.12
    # with enable_gqa). ftune's packed attention on a torch whose varlen has no enable_gqa repeats k and v to
    # every query head (training.packing), which the kernel then saves: FTUNE assumes that (a plan made
    # without the worker's torch at hand); training.memory asks the torch it runs on.
    varlen_gqa: bool = True
    # 4-bit linears dequantized with plain torch ops inside forward, the half-precision weight then fed to
    # torch.matmul, which saves it for the input gradient: auto-gptq's trainable QuantLinear (cuda-old path,
    # used by transformers' GPTQ loading for training). A recomputed layer (or, without checkpointing, every
    # layer) keeps all its linears' dequantized weights until its backward. bitsandbytes' MatMul4Bit saves
    # only the packed weight and dequantizes again in backward (False).
    dequant_saved: bool = False
    # The model's loss copies the shifted logits (logits[..., :-1, :].contiguous(): GPT-2-derived remote code
    # such as Qwen-1, transformers before 4.46) before the cross-entropy: one more logits-sized segment.
    loss_shift_copy: bool = False
    # The loss head runs over chunks of scored tokens and never holds [scored tokens, vocab] logits
    # (ftune's engine, training.loss; for a model whose lm_head is a frozen plain Linear without logit
    # soft-capping or scaling, see planner.context.fused_loss). False: the whole logits and an fp32
    # cross-entropy (transformers' loss, TRL, DeepSpeed, ...: every run bench/planner_accuracy.py cites).
    fused_loss: bool = False
    # Under autocast peft casts a LoRA layer's input to the fp32 adapter, and autocast casts that copy back
    # for the matmul: every wrapped linear keeps a copy of its own input. ftune's engine turns the cast off
    # on a GPU (training.model.skip_adapter_input_casts): lora_A then keeps the tensor the base linear read.
    lora_input_cast: bool = True
    # A plain LoRA layer adds its scaled update inside the update's GEMM (ftune's training.lora_add): no
    # tensor of the layer's output size beside the output. False: peft's lora_B output, its scaled copy, sum.
    lora_fused_add: bool = False
    # On a GPU each Llama-formula RMSNorm and each gated MLP's act(gate) * up run as one autograd function
    # (ftune's training.fused): a norm keeps its input in its own dtype instead of an fp32 copy, and the MLP
    # keeps no act(gate) (planner.memory.fused_norm, fused_gate say for which families).
    fused_norm_mlp: bool = False


FTUNE = Runtime(
    fused_loss=True,
    expandable_segments=True,
    varlen_gqa=False,
    lora_input_cast=False,
    lora_fused_add=True,
    fused_norm_mlp=True,
)
