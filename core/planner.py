"""Memory-feasibility planner: estimate(spec, arch, gpu) -> Plan (per-GPU breakdown, verdict, suggestions).

Model of the peak (per GPU), each piece a named Term with its assumption in `note`:
  persistent   base weights (+ NF4 constants), LoRA adapters, gradients, optimizer states, master weights
  fwd/bwd      activations saved for backward, autocast copies, FSDP all-gathered units, and the larger of
                 loss      logits + loss buffers at backward start (+ a cast lm_head copy)
                 layer     one block's backward: recomputed layer (checkpointing), gradients in flight,
                           QLoRA's dequantized weight
  step         paged optimizer states (paged in), AdamW temporaries, grad-norm buffers
  peak = persistent + max(fwd/bwd, step) + CUDA context + fragmentation margin
allocated_bytes (the peak without the last two) is what a run measures: max_memory_allocated on CUDA,
live tensor bytes on a CPU (tests/training/test_planner_vs_measured.py holds it within 15% there).
A phase that is not the peak is listed with 0 bytes and its size in the note, so terms sum to total.
What a training framework keeps beyond the JobSpec (ftune's engine by default) is a Runtime.
Cached blocks the allocator keeps reserved but would free (and retry) before an OOM are reported beside
the total, not in it, for comparing with nvidia-smi or max_memory_reserved: loss_segments_bytes (the
half-precision logits' segments an fp32 loss's gradients cannot reuse) and varlen_cache_bytes (an earlier,
shorter batch's loss buffers on data of varying lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from core.arch import Architecture
from core.gpus import Gpu, MiB
from core.memory import (
    DTYPE_BYTES,
    ActivationSetup,
    adam8bit_state_bytes,
    backward_working_bytes_per_token,
    dequant_excess_bytes,
    layer_saved_bytes_per_token,
    logits_bytes_per_token,
    nf4_bytes,
    unpack_excess_bytes,
)
from core.spec import JobSpec

CUDA_CONTEXT_BYTES = 500 * MiB  # CUDA context + cuBLAS workspace, outside torch's allocator
NCCL_BYTES = 300 * MiB  # NCCL communicator buffers when num_gpus > 1
FRAGMENTATION = 0.08  # caching-allocator margin over the bytes in use (reserved vs allocated)
MFU = {"full": 0.40, "lora": 0.40, "qlora": 0.28}  # assumed model-FLOPs utilisation
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


class Plan(BaseModel):
    gpu: str
    num_gpus: int
    method: str
    total_params: int
    trainable_params: int
    breakdown: list[Term]
    allocated_bytes: int  # total minus CUDA context and fragmentation: compare with max_memory_allocated
    total_bytes: int
    # Not in total_bytes (cached blocks the allocator frees and retries with before an OOM, so they never
    # decide a fit) but in what nvidia-smi or torch.cuda.max_memory_reserved show (see _estimate):
    loss_segments_bytes: int = 0  # half-precision logits segments the fp32 loss gradients cannot reuse
    varlen_cache_bytes: int = 0  # blocks kept from earlier, shorter batches on data of varying lengths
    usable_bytes: int
    fits: bool
    headroom_bytes: int
    est_seconds_per_epoch: float | None = None
    speed_note: str | None = None
    suggestions: list[Suggestion] = []


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def compute_dtype(spec: JobSpec, arch: Architecture, gpu: Gpu) -> str:
    """mixed_precision auto: bf16 autocast, fp16 on GPUs without bf16; "no": the storage dtype."""
    mp = spec.mixed_precision
    if mp == "auto":
        return "bfloat16" if gpu.bf16_supported else "float16"
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mp, storage_dtype(spec, arch))


def storage_dtype(spec: JobSpec, arch: Architecture | None) -> str:
    """torch_dtype "auto" loads what config.json says (transformers' rule), float32 when it says nothing."""
    if spec.torch_dtype != "auto":
        return spec.torch_dtype
    return (arch.config_dtype if arch else None) or "float32"


def _idle(terms: list[Term], why: str) -> list[Term]:
    """Terms of a phase that is not at the peak: 0 bytes, their size kept in the note."""
    return [
        Term(name=t.name, bytes=0, note=f"{_gib(t.bytes)} not at the peak ({why}): {t.note}") for t in terms
    ]


@dataclass(frozen=True)
class Runtime:
    """What the training framework keeps that a JobSpec does not say; the default is ftune's engine.
    bench/planner_accuracy.py states these per published run."""

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
    # 4-bit linears dequantized with plain torch ops inside forward, the half-precision weight then fed to
    # torch.matmul, which saves it for the input gradient: auto-gptq's trainable QuantLinear (cuda-old path,
    # used by transformers' GPTQ loading for training). A recomputed layer (or, without checkpointing, every
    # layer) keeps all its linears' dequantized weights until its backward. bitsandbytes' MatMul4Bit saves
    # only the packed weight and dequantizes again in backward (False).
    dequant_saved: bool = False
    # The model's loss copies the shifted logits (logits[..., :-1, :].contiguous(): GPT-2-derived remote code
    # such as Qwen-1, transformers before 4.46) before the cross-entropy: one more logits-sized segment.
    loss_shift_copy: bool = False


FTUNE = Runtime()


def estimate(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens_per_epoch: int | None = None,
    *,
    suggest: bool = True,
    runtime: Runtime = FTUNE,
) -> Plan:
    plan = _estimate(spec, arch, gpu, tokens_per_epoch, runtime)
    if suggest and not plan.fits:
        from core.suggest import suggestions

        plan = plan.model_copy(update={"suggestions": suggestions(spec, arch, gpu, runtime)})
    return plan


def _base_weight_terms(
    spec: JobSpec, arch: Architecture, runtime: Runtime, store: str, shard: str
) -> list[Term]:
    """The frozen base: NF4 block linears + the layers bitsandbytes leaves unquantized, or all in `store`."""
    n, sb, total_params = spec.num_gpus, DTYPE_BYTES[store], arch.total_params
    terms: list[Term] = []
    if spec.method == "qlora":
        q_bytes = arch.num_layers * sum(nf4_bytes(m.weight_numel) for m in arch.block_linears)
        q_params = arch.num_layers * sum(m.weight_numel for m in arch.block_linears)
        rest = total_params - q_params
        terms.append(
            Term(
                name="base weights (NF4)",
                bytes=q_bytes // n,
                note=(
                    f"{q_params:,} block linear weights in 4-bit NF4: 0.5 B/param + uint8 absmax "
                    "per 64 values, fp32 scale per 256 absmaxes (double quant) = "
                    f"{q_bytes / q_params:.4f} B/param{shard}"
                ),
            )
        )
        up = runtime.kbit_fp32_upcast
        qb = 4 if up else sb
        how = "cast to fp32 by prepare_model_for_kbit_training" if up else f"in {store}"
        terms.append(
            Term(
                name="unquantized weights",
                bytes=rest * qb // n,
                note=(
                    f"{rest:,} params {how}: embeddings, lm_head, norms, biases (bitsandbytes quantizes "
                    f"only the decoder-block linears){shard}"
                ),
            )
        )
    else:
        terms.append(
            Term(
                name="base weights",
                bytes=total_params * sb // n,
                note=(f"{total_params:,} params in {store} ({sb} B/param){shard}"),
            )
        )
    return terms


def _estimate(
    spec: JobSpec, arch: Architecture, gpu: Gpu, tokens_per_epoch: int | None, runtime: Runtime = FTUNE
) -> Plan:
    n = spec.num_gpus
    method = spec.method
    cpu = gpu.kind == "cpu"
    # the engine loads QLoRA's unquantized layers (and dequantizes) in its device dtype (training.model)
    store = ("float32" if cpu else "bfloat16") if method == "qlora" else storage_dtype(spec, arch)
    cdt = compute_dtype(spec, arch, gpu)
    half_model = runtime.half_model_master and cdt != "float32"
    if half_model:
        store = cdt  # the framework casts the whole model to its half dtype and runs it without autocast
    sb = DTYPE_BYTES[store]
    autocast = spec.mixed_precision != "no" and cdt != "float32" and not half_model
    ce = DTYPE_BYTES[cdt]  # what autocast casts to
    e = ce if autocast else sb
    lora_b = 0
    if method == "qlora" and cpu:
        # on a CPU the engine loads QLoRA in fp32 and bitsandbytes computes in fp32: the activations stay
        # fp32; autocast only casts the LoRA branch
        e, lora_b = 4, (ce if autocast else 0)
    if half_model:
        lora_b = e  # the adapters are half precision too: lora_A reads (and saves) a half-precision input
    full = method == "full"
    lora = () if full else tuple(arch.lora_targets(spec.lora_target_modules))
    total_params = arch.total_params
    trainable = (
        total_params if full else sum(spec.lora_r * (m.in_features + m.out_features) * k for m, k in lora)
    )
    shard = f" / {n} GPUs (FSDP shard)" if n > 1 else ""

    persistent: list[Term] = _base_weight_terms(spec, arch, runtime, store, shard)
    # -- trainable state ------------------------------------------------------------------------------
    if full:
        grad_b = sb
        master = 4 if (spec.master_weights and sb < 4) else 0
        state_elem = 4 if (master or sb == 4) else sb
    else:
        adapter_b = sb if half_model else 4
        persistent.append(
            Term(
                name="LoRA adapters",
                bytes=trainable * adapter_b // n,
                note=(
                    f"{trainable:,} params (r={spec.lora_r}, {len(lora)} module kinds) in "
                    + (
                        f"{store} (the framework casts the whole model)"
                        if half_model
                        else "fp32 (peft keeps adapters in fp32)"
                    )
                    + shard
                ),
            )
        )
        grad_b, master, state_elem = adapter_b, (4 if half_model else 0), 4
    persistent.append(
        Term(
            name="gradients",
            bytes=trainable * grad_b // n,
            note=(f"{trainable:,} x {grad_b} B, kept whole through accumulation{shard}"),
        )
    )
    if full or master:
        persistent.append(
            Term(
                name="master weights",
                bytes=trainable * master // n,
                note=(
                    f"fp32 copies, 4 B/param{shard}"
                    if master
                    else "none: "
                    + (
                        "weights are already fp32"
                        if sb == 4
                        else "master_weights is off (pure low-precision)"
                    )
                ),
            )
        )
    if spec.optimizer == "adamw":
        opt_bytes, opt_note = (
            trainable * 2 * state_elem,
            f"AdamW m and v in {'fp32' if state_elem == 4 else store}",
        )
    else:
        opt_bytes = adam8bit_state_bytes(trainable)
        opt_note = "bitsandbytes 8-bit AdamW: uint8 m and v + fp32 absmax per 256 values (~2.03 B/param)"
    paged = spec.optimizer == "paged_adamw_8bit"
    if not paged:
        persistent.append(Term(name="optimizer states", bytes=opt_bytes // n, note=f"{opt_note}{shard}"))

    # -- forward/backward transients --------------------------------------------------------------------
    upcast = method == "qlora" and runtime.kbit_fp32_upcast
    b, s = spec.micro_batch_size, spec.max_seq_len
    tokens = b * s
    h = arch.hidden_size
    setup = ActivationSetup(
        compute_bytes=e,
        autocast=autocast,
        full=full,
        lora=lora,
        lora_r=spec.lora_r,
        lora_dropout=spec.lora_dropout > 0,
        attn=spec.attn_implementation,
        kv_repeated=spec.attn_implementation == "sdpa" and b > 1,
        seq_len=s,
        mask_bytes=4 if cpu else 1,  # a CPU dropout keeps a mask in the fp32 adapter dtype
        lora_bytes=lora_b,
    )
    per_layer, parts = layer_saved_bytes_per_token(arch, setup)
    layer_bytes = int(per_layer * tokens)
    res_b = 4 if upcast else e  # dtype of the residual stream between blocks
    final_norm = 4 * h * tokens  # the final norm keeps its fp32 input
    if spec.gradient_checkpointing:
        act = arch.num_layers * res_b * h * tokens + final_norm
        act_note = (
            f"checkpointing: each of {arch.num_layers} layers keeps its input ({res_b} B x hidden x "
            f"{tokens} tokens) + the final norm's fp32 input"
        )
    else:
        act = arch.num_layers * layer_bytes + final_norm
        act_note = f"{arch.num_layers} layers x {tokens} tokens x {per_layer:,.0f} B/token + final norm"
    act_note += f"; per layer B/token: {', '.join(parts)}; sequences padded to max_seq_len"
    fwd: list[Term] = [Term(name="activations", bytes=int(act), note=act_note)]
    if autocast and ce < 4 and (not full or sb == 4):
        fwd.append(
            Term(
                name="autocast weight copies",
                bytes=trainable * ce // n,
                note=(f"fp32 trainable weights cast to {cdt} and cached for the forward/backward"),
            )
        )
    # Autocast casts frozen fp32 weights to the compute dtype at each use; the matmul keeps that copy for
    # the input gradient. Block linears: every layer's without checkpointing, one layer's with it.
    frozen_cast = autocast and ce < 4 and not full
    block_copy = 0
    copy_why = ""
    if frozen_cast and method == "lora" and sb == 4:
        block_copy = sum(m.weight_numel for m in arch.block_linears) * ce
        copy_why = f"fp32 weight cast to {cdt} by autocast"
    dequant_kept = method == "qlora" and runtime.dequant_saved
    if dequant_kept:
        block_copy = sum(m.weight_numel for m in arch.block_linears) * e
        copy_why = f"4-bit weight dequantized to {cdt if autocast else store} by torch ops (auto-gptq)"
    if block_copy and not spec.gradient_checkpointing:
        fwd.append(
            Term(
                name="frozen weight copies kept by matmuls",
                bytes=arch.num_layers * block_copy,
                note=f"every block linear's {copy_why}, saved by its matmul for the input gradient",
            )
        )
    if runtime.grad_bucket_bytes:
        fwd.append(
            Term(
                name="framework gradient buckets",
                bytes=runtime.grad_bucket_bytes,
                note="kept by the training framework through backward (e.g. DeepSpeed ZeRO-2 reduce buckets)",
            )
        )
    # Backward first runs the loss (all activations still alive), then the blocks one at a time, after
    # the vocab-sized buffers are freed: the peak is the larger of the two, the other is listed at 0.
    head_b = (4 if upcast else sb) if method == "qlora" else sb
    loss_phase = []
    if frozen_cast and head_b == 4:
        loss_phase.append(
            Term(
                name="lm_head compute-dtype copy",
                bytes=arch.vocab_size * h * ce,
                note=(
                    f"the frozen fp32 lm_head weight cast to {cdt} by autocast for the logits matmul, which "
                    "keeps the copy until the lm_head's backward"
                ),
            )
        )
    loss_bytes = tokens * logits_bytes_per_token(arch, e, runtime.loss_fp32)
    loss_phase += [
        Term(
            name="logits and loss",
            bytes=loss_bytes,
            note=(
                f"{tokens} tokens x vocab {arch.vocab_size:,} x "
                f"{logits_bytes_per_token(arch, e, runtime.loss_fp32) // arch.vocab_size} B: forward keeps "
                f"the logits ({e} B), their {'fp32 ' if runtime.loss_fp32 else ''}copy and the log-probs; "
                "backward starts with the log-probs and two gradients"
                + ("" if runtime.loss_fp32 else f", all in {cdt} (no fp32 upcast)")
            ),
        )
    ]
    layer_phase: list[Term] = []
    if spec.gradient_checkpointing:
        layer_phase.append(
            Term(
                name="recomputed layer",
                bytes=layer_bytes + block_copy,
                note="backward re-runs one checkpointed layer's forward and holds what it saves"
                + (f" (+ its linears' weight copies: {copy_why}, kept by the matmuls)" if block_copy else ""),
            )
        )
    layer_phase.append(
        Term(
            name="backward working buffers",
            bytes=tokens * backward_working_bytes_per_token(arch, e),
            note="grads in flight through one block: hidden + 2 x intermediate per token",
        )
    )
    if dequant_kept:
        layer_phase.append(
            Term(
                name="GPTQ unpacking buffer",
                bytes=unpack_excess_bytes(arch, e, tokens),
                note=(
                    f"largest block linear ({arch.largest_linear_numel:,} weights) unpacked by torch ops: an "
                    "int32 value per weight and its int8 copy (5 B), 3 B beyond the half copy counted above; "
                    "counted beyond the intermediate-sized gradients it never coexists with"
                ),
            )
        )
    if method == "qlora" and not dequant_kept:
        layer_phase.append(
            Term(
                name="QLoRA dequantization buffer",
                bytes=dequant_excess_bytes(arch, e, tokens),
                note=(
                    f"largest block linear ({arch.largest_linear_numel:,} weights) dequantized to {cdt}, "
                    "one at a time, inside a matmul: counted beyond the intermediate-sized gradient it "
                    "never coexists with"
                ),
            )
        )
    loss_total, layer_total = sum(t.bytes for t in loss_phase), sum(t.bytes for t in layer_phase)
    if loss_total >= layer_total:
        fwd += loss_phase + _idle(layer_phase, "the loss at backward start is larger")
    else:
        fwd += _idle(loss_phase, "a layer's backward is larger") + layer_phase
    if n > 1:
        layer_w = (
            sum(nf4_bytes(m.weight_numel) for m in arch.block_linears) + arch.norm_params_per_layer * sb
            if method == "qlora"
            else arch.layer_params * sb
        )
        root = (arch.embedding_params + arch.lm_head_params + arch.final_norm_params) * sb
        fwd.append(
            Term(
                name="FSDP all-gathered units",
                bytes=int(2 * layer_w + root),
                note=(
                    "two decoder layers unsharded (current + prefetched next) + the root unit (embeddings, "
                    "lm_head, final norm) which FSDP2 keeps unsharded between forward and backward"
                ),
            )
        )
        if full:
            fwd.append(
                Term(
                    name="FSDP unsharded gradients",
                    bytes=(arch.layer_params * grad_b + root // sb * grad_b),
                    note="one layer's and the root unit's full gradients before reduce-scatter",
                )
            )
        fwd.append(Term(name="NCCL buffers", bytes=NCCL_BYTES, note="communicator buffers, ~300 MiB stated"))

    # -- optimizer step transients ----------------------------------------------------------------------
    step: list[Term] = []
    if paged:
        step.append(
            Term(
                name="optimizer states (paged)",
                bytes=opt_bytes // n,
                note=(
                    f"{opt_note}; in CUDA unified memory: evicted to CPU under pressure during "
                    "forward/backward, "
                    f"paged back for the optimizer step, so counted in the step phase only{shard}"
                ),
            )
        )
    if half_model:
        step.append(
            Term(
                name="fp32 gradient copy for the step",
                bytes=trainable * (grad_b + 4) // n,
                note=(
                    "the engine flattens the half-precision gradient partition and casts it to fp32 for "
                    f"its fused Adam (no further temporaries): {grad_b} + 4 B/param{shard}"
                ),
            )
        )
    elif spec.optimizer == "adamw":
        largest = max((spec.lora_r * max(m.in_features, m.out_features) for m, _ in lora), default=0)
        step.append(
            Term(
                name="optimizer step temporaries",
                bytes=(largest if cpu and not full else trainable) * state_elem // n,
                note=(
                    "torch AdamW on a CPU runs tensor by tensor: sqrt(v) of the largest one"
                    if cpu
                    else "torch foreach AdamW allocates sqrt(v) for all params at once (a state-sized buffer)"
                ),
            )
        )
    n_tensors = (
        (arch.num_layers * (len(arch.block_linears) * 2 + 4) + 4) if full else 2 * sum(k for _, k in lora)
    )
    step.append(
        Term(
            name="gradient-norm buffers",
            bytes=n_tensors * 4 + (0 if cpu else 4 * MiB),
            note="clip_grad_norm_: one fp32 norm per trainable tensor"
            + ("" if cpu else " + a 4 MiB CUDA reduction workspace"),
        )
    )

    fwd_total, step_total = sum(t.bytes for t in fwd), sum(t.bytes for t in step)
    if fwd_total >= step_total:
        step = _idle(step, "the step phase is smaller")
    else:
        fwd = _idle(fwd, "the forward/backward phase is smaller")
    used = sum(t.bytes for t in persistent) + max(fwd_total, step_total)
    tail = [
        Term(
            name="CUDA context",
            bytes=0 if cpu else CUDA_CONTEXT_BYTES,
            note="none on a CPU" if cpu else "CUDA context + cuBLAS workspace, ~500 MiB",
        ),
        Term(
            name="allocator fragmentation",
            bytes=int(used * FRAGMENTATION),
            note=(f"{FRAGMENTATION:.0%} of the bytes in use (caching allocator: reserved vs allocated)"),
        ),
    ]
    breakdown = persistent + fwd + step + tail
    total = sum(t.bytes for t in breakdown)
    # Reserved beyond allocated with fixed shapes too. Each vocab-sized buffer is a cudaMalloc segment of
    # its own (nothing cached is that large when it is first made) and freed blocks merge only inside their
    # segment. An fp32 loss over half-precision logits makes, in forward, the logits (e B per vocab entry),
    # [their shifted contiguous copy (e)], the fp32 copy (4) and the log-probs (4); in backward, with the
    # log-probs still held, two 4 B gradients: one reuses the fp32 copy's segment, the other fits in no
    # e-byte segment and maps a new one. From the next step on the same segments serve every step, so
    # reserved stays above allocated by the logits' (and the shifted copy's) segments. Not with a loss in
    # the logits' dtype (every buffer the same size) nor fp32 logits.
    shifted = 2 if runtime.loss_shift_copy else 1
    loss_segments = shifted * tokens * arch.vocab_size * e if not cpu and runtime.loss_fp32 and e < 4 else 0
    # Reserved (not allocated) memory on data whose lengths vary from batch to batch. The caching allocator
    # keeps freed blocks and only merges free neighbours inside one segment. The vocab-sized loss buffers
    # (logits, their fp32 copy, log-probs, their gradients: the largest single tensors of a step, one per
    # buffer, hundreds of MiB to GiBs) of a batch shorter than the longest cannot hold the longest batch's,
    # so the longest batch maps new segments beside them: max_memory_reserved exceeds the padded plan by
    # about one earlier batch's loss buffers (counted at this plan's size, an assumption: the earlier
    # batch's length is not known; it holds when many batches are near the longest). Smaller tensors
    # (per-layer activations) are served from split cached blocks. Capped by the device: a failed
    # cudaMalloc frees the cached blocks and retries, so this never causes an OOM and stays out of
    # total_bytes and the verdict.
    room = max(0, gpu.memory_bytes - total)  # reserved never exceeds the device
    loss_segments = min(loss_segments, room)
    varlen_cache = 0 if cpu else min(loss_bytes, room - loss_segments)
    usable = gpu.usable_bytes
    seconds, speed_note = _speed(spec, arch, gpu, trainable, tokens_per_epoch)
    return Plan(
        gpu=gpu.name,
        num_gpus=n,
        method=method,
        total_params=total_params,
        trainable_params=trainable,
        breakdown=breakdown,
        allocated_bytes=used,
        total_bytes=total,
        loss_segments_bytes=loss_segments,
        varlen_cache_bytes=varlen_cache,
        usable_bytes=usable,
        fits=total <= usable,
        headroom_bytes=usable - total,
        est_seconds_per_epoch=seconds,
        speed_note=speed_note,
    )


def _speed(
    spec: JobSpec, arch: Architecture, gpu: Gpu, trainable: int, tokens: int | None
) -> tuple[float | None, str | None]:
    """FLOPs/token: forward F = 2 x matmul weights + causal attention 2 x seq x q_dim per layer;
    backward = 2F (full: grads w.r.t. activations and weights) or F + attention (LoRA/QLoRA: activations
    only, frozen weights) + 6 x LoRA params; checkpointing re-runs the forward. Time = FLOPs x tokens /
    (num_gpus x dense bf16 FLOP/s x assumed MFU)."""
    if tokens is None or gpu.bf16_flops is None:
        return None, "needs tokens_per_epoch and a known GPU type" if gpu.bf16_flops is None else None
    f_lin = 2 * arch.matmul_params
    f_attn = 2 * spec.max_seq_len * arch.num_heads * arch.head_dim * arch.num_layers
    fwd = f_lin + f_attn
    bwd = 2 * fwd if spec.method == "full" else f_lin + 2 * f_attn + 6 * trainable
    per_token = fwd + bwd + (fwd if spec.gradient_checkpointing else 0)
    mfu = MFU[spec.method]
    seconds = per_token * tokens / (spec.num_gpus * gpu.bf16_flops * mfu)
    return seconds, (
        f"{per_token / 1e9:.1f} GFLOP/token x {tokens:,} tokens at {mfu:.0%} of "
        f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s x {spec.num_gpus} GPU(s)"
    )
