"""Forward/backward transients: activations saved for backward, autocast and dequantized weight copies,
framework gradient buckets, the larger of the loss head and a layer's worst moment, and FSDP's unsharded
units; and what the caching allocator's reuse depends on (Churn, for planner.allocator)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.context import Context
from planner.gpus import MiB
from planner.memory import (
    ActivationSetup,
    backward_working_bytes_per_token,
    chunked_loss_bytes,
    dequant_excess_bytes,
    flash_backward_bytes,
    fused_gate,
    fused_norm,
    largest_saved_tensor_per_token,
    layer_saved_bytes_per_token,
    logits_bytes_per_token,
    lora_forward_transient_per_token,
    mlp_saved_bytes_per_token,
    nf4_bytes,
    norm_input_bytes,
    unpack_excess_bytes,
)
from planner.moe import expert_weight_bytes
from planner.moe_terms import moe_terms, recomputed_stack_bytes
from planner.rollouts import rollout
from planner.types import Term, idle
from planner.vision import vision_terms

NCCL_BYTES = 300 * MiB  # NCCL communicator buffers when num_gpus > 1
# Packed rows: how many examples a micro-batch of T tokens is assumed to hold, T / this (the token
# statistics give its widest example, not its count). Short instruction data packs ~30-token examples
# (examples/alpaca_small.jsonl: 91-126 per 4 x 1024 tokens); flash attention's backward grows with it.
PACKED_EXAMPLE_TOKENS = 32


def forward_backward_terms(c: Context) -> list[Term]:
    activations, layer_bytes = _activations(c)
    tower, projector = vision_terms(c)
    terms = [activations, *moe_terms(c), *projector]
    if c.autocast and c.compute_b < 4 and (not c.full or c.store_b == 4):
        terms.append(
            Term(
                name="autocast weight copies",
                bytes=c.trainable * c.compute_b // c.spec.num_gpus,
                note=(f"fp32 trainable weights cast to {c.compute} and cached for the forward/backward"),
            )
        )
    block_copy, copy_why = _block_weight_copy(c)
    if block_copy and not c.spec.gradient_checkpointing:
        terms.append(
            Term(
                name="frozen weight copies kept by matmuls",
                bytes=c.arch.num_layers * block_copy,
                note=f"every block linear's {copy_why}, saved by its matmul for the input gradient",
            )
        )
    if c.runtime.grad_bucket_bytes:
        terms.append(
            Term(
                name="framework gradient buckets",
                bytes=c.runtime.grad_bucket_bytes,
                note="kept by the training framework through backward (e.g. DeepSpeed ZeRO-2 reduce buckets)",
            )
        )
    # Backward first runs the loss (all activations still alive), then the blocks one at a time, after
    # the vocab-sized buffers are freed: the peak is the larger of the two, the other is listed at 0.
    loss_phase = _loss_phase(c)
    layer_phase = _layer_phase(c, layer_bytes, block_copy, copy_why)
    loss_total, layer_total = sum(t.bytes for t in loss_phase), sum(t.bytes for t in layer_phase)
    if loss_total >= layer_total:
        terms += loss_phase + idle(layer_phase, "the loss at backward start is larger")
    else:
        terms += idle(loss_phase, "a layer's backward is larger") + layer_phase
    # The frozen tower runs first and keeps nothing: its transient peak is freed before the language model's
    # activations build up, so it counts only where it is larger than they are at backward.
    if sum(t.bytes for t in tower) <= activations.bytes + max(loss_total, layer_total):
        tower = idle(tower, "the vision tower's forward is freed before the language model's backward")
    terms += tower
    if c.spec.num_gpus > 1:
        terms += _fsdp_terms(c)
    if c.spec.preference.uses_reference:
        terms.append(reference_logps_term(c))
    return terms


def reference_terms(c: Context) -> list[Term]:
    """Objective dpo with a reference (sigmoid, ipo), and grpo with a KL term (beta > 0): each micro-batch
    first runs the reference policy (the adapter disabled, or the frozen starting adapter) without grad,
    then the policy. The no-grad forward keeps no activation: a layer's tensors are freed as the next one
    runs; its largest moment is the log-probs of the completions (dpo: both sides'): with the chunked head
    one chunk's vocab-sized buffers and the scored positions' hidden states (no gradient:
    planner.memory.chunked_loss_bytes), else the logits (e B per vocab entry), an fp32 copy when they
    are half precision, and log_softmax's fp32 output. Its result (reference_logps_term) is kept through
    the policy's forward and backward. The phase is compared with forward/backward and the step."""
    e, arch = c.act_b, c.arch
    layer = c.tokens * e * (arch.hidden_size + 3 * arch.intermediate_size)  # a block's MLP at its widest
    if c.fused_loss:
        head = chunked_loss_bytes(arch, e, c.res_b, c.logit_tokens, _head_cast(c), grad=False)
        logits = head.transient + head.kept
        what = (
            f"chunked head: {head.chunk} of {c.logit_tokens} scored tokens at a time x vocab "
            f"{arch.vocab_size:,} (logits, fp32 log-probs) + the scored hidden states"
        )
    else:
        per_entry = e + (4 if e < 4 else 0) + 4
        logits = c.logit_tokens * arch.vocab_size * per_entry
        what = (
            f"{c.logit_tokens} scored tokens x vocab {arch.vocab_size:,} x {per_entry} B (logits, their fp32 "
            "log-probs)"
        )
    return [
        Term(
            name="reference forward (no activations kept)",
            bytes=max(logits, layer),
            note=(
                f"no-grad forward of {'the sampled sequences' if c.spec.rl.enabled else 'both sides'}: {what}"
                + ("" if logits >= layer else "; a block's MLP tensors are larger")
            ),
        )
    ]


def reference_logps_term(c: Context) -> Term:
    """What the reference forward leaves for the policy's loss: dpo's summed log-prob of each side; grpo's
    per-token log-probs of the completions, flat and as padded [sequences, longest] rows (fp32 both)."""
    if c.spec.rl.enabled:
        return Term(
            name="reference log-probs",
            bytes=2 * c.logit_tokens * 4,
            note=(
                f"the reference's log-prob of each of {c.logit_tokens} completion tokens (fp32), flat "
                "and padded"
            ),
        )
    pairs = c.spec.micro_batch_size
    return Term(
        name="reference log-probs",
        bytes=2 * pairs * 4,
        note=f"the reference's summed log-prob of each side of the micro-batch's {pairs} pairs (fp32)",
    )


def loss_buffer_bytes(c: Context) -> int:
    """The vocab-sized buffers of the logits and the loss (see planner.memory.logits_bytes_per_token)."""
    return c.logit_tokens * logits_bytes_per_token(c.arch, c.act_b, c.runtime.loss_fp32)


def activation_setup(c: Context) -> ActivationSetup:
    """What decides the tensors a block saves, for this plan."""
    spec = c.spec
    b = spec.batch.micro_sequences
    gqa = c.arch.num_kv_heads != c.arch.num_heads
    # packed rows on a GPU in half precision: a varlen call that repeats k and v (Runtime.varlen_gqa)
    varlen_repeats = (
        spec.packing and spec.attn_implementation == "sdpa" and gqa and not c.cpu and c.act_b < 4
        and not c.runtime.varlen_gqa
    )  # fmt: skip
    return ActivationSetup(
        compute_bytes=c.act_b,
        autocast=c.autocast,
        full=c.full,
        lora=c.lora,
        lora_r=spec.lora_r,
        lora_dropout=spec.lora_dropout > 0,
        attn=spec.attn_implementation,
        kv_repeated=(spec.attn_implementation == "sdpa" and b > 1 and not spec.packing) or varlen_repeats,
        seq_len=c.seq_len,
        mask_bytes=4 if c.cpu else 1,  # a CPU dropout keeps a mask in the fp32 adapter dtype
        lora_bytes=c.lora_act_b,
        residual_bytes=c.res_b,
        lora_input_cast=lora_input_cast(c),
        fused_norms=fused(c) and fused_norm(c.arch),
        fused_gate=fused(c) and fused_gate(c.arch),
    )


def fused(c: Context) -> bool:
    """Whether the engine fuses norms and gates (Runtime.fused_norm_mlp): ftune's does on a GPU."""
    return c.runtime.fused_norm_mlp and not c.cpu


def lora_input_cast(c: Context) -> bool:
    """Whether peft casts a LoRA layer's input to the fp32 adapter under autocast (which casts it back):
    its plain layer does unless the engine turned that off (ftune's, on a GPU:
    training.model.skip_adapter_input_casts); its 4-bit layer asks CUDA's autocast, so only on a CPU."""
    if c.spec.method == "lora":
        return c.runtime.lora_input_cast or c.cpu
    return c.cpu


def micro_batch_sequences(c: Context) -> int:
    """Sequences in the planned micro-batch: its rows, or for packed rows an estimate of the examples in
    them (PACKED_EXAMPLE_TOKENS each, or the widest example's length when that is shorter)."""
    spec = c.spec
    if not spec.packing or spec.rl.enabled:  # grpo's are known: num_generations per prompt
        return spec.batch.micro_sequences
    return max(1, -(-c.tokens // min(PACKED_EXAMPLE_TOKENS, max(1, c.seq_len))))


def _flash_backward(c: Context) -> tuple[int, int]:
    """A layer's flash-attention backward buffers over the whole micro-batch (all, largest) where the engine
    runs one flash kernel for it: a GPU in half precision (or fp32 queries under autocast, cast for it:
    training.packing) with SDPA or flash_attention_2. (0, 0): none that size (eager, fp32, a CPU)."""
    if c.cpu or c.act_b == 4 or c.spec.attn_implementation == "eager":
        return 0, 0
    return flash_backward_bytes(c.arch, c.act_b, c.tokens, micro_batch_sequences(c))


def _activations(c: Context) -> tuple[Term, int]:
    """What forward saves for backward, and one layer's share (which a recomputed layer holds again)."""
    spec, arch, tokens = c.spec, c.arch, c.tokens
    h = arch.hidden_size
    setup = activation_setup(c)
    per_layer, parts = layer_saved_bytes_per_token(arch, setup)
    layer_bytes = int(per_layer * tokens)
    res_b = c.res_b  # dtype of the residual stream between blocks (a checkpointed layer's input)
    final_norm = norm_input_bytes(setup) * h * tokens  # the final norm keeps its (fp32 upcast) input
    if spec.gradient_checkpointing:
        act = arch.num_layers * res_b * h * tokens + final_norm
        act_note = (
            f"checkpointing: each of {arch.num_layers} layers keeps its input ({res_b} B x hidden x "
            f"{tokens} tokens) + the final norm's input"
        )
    else:
        act = arch.num_layers * layer_bytes + final_norm
        act_note = f"{arch.num_layers} layers x {tokens} tokens x {per_layer:,.0f} B/token + final norm"
    padded = c.shape.describe() if c.shape else "sequences padded to max_seq_len (data lengths unknown)"
    act_note += f"; per layer B/token: {', '.join(parts)}; {padded}"
    return Term(name="activations", bytes=int(act), note=act_note), layer_bytes


# Autocast casts frozen fp32 weights to the compute dtype at each use; the matmul keeps that copy for
# the input gradient. Block linears: every layer's without checkpointing, one layer's with it.
def _frozen_cast(c: Context) -> bool:
    return c.autocast and c.compute_b < 4 and not c.full


def _dequant_kept(c: Context) -> bool:
    """QLoRA whose dequantized weights the matmuls save (Runtime.dequant_saved: auto-gptq)."""
    return c.spec.method == "qlora" and c.runtime.dequant_saved


def _block_weight_copy(c: Context) -> tuple[int, str]:
    """Bytes of one layer's frozen block-linear weight copies kept for backward (0: none), and why."""
    block_copy = 0
    copy_why = ""
    if _frozen_cast(c) and c.spec.method == "lora" and c.store_b == 4:
        block_copy = sum(m.weight_numel for m in c.arch.block_linears) * c.compute_b
        copy_why = f"fp32 weight cast to {c.compute} by autocast"
    if _dequant_kept(c):
        block_copy = sum(m.weight_numel for m in c.arch.block_linears) * c.act_b
        copy_why = (
            f"4-bit weight dequantized to {c.compute if c.autocast else c.store} by torch ops (auto-gptq)"
        )
    return block_copy, copy_why


def _head_cast(c: Context) -> bool:
    """autocast casts a frozen fp32 lm_head weight to the compute dtype for its matmuls."""
    head_b = (4 if c.fp32_upcast else c.store_b) if c.spec.method == "qlora" else c.store_b
    return _frozen_cast(c) and head_b == 4


def _loss_phase(c: Context) -> list[Term]:
    """The loss head's largest moment, all activations alive: the chunked head's (training.loss, inside
    forward), or the plain head's logits and loss buffers at backward start (+ a cast lm_head copy)."""
    arch, e, cdt, loss_fp32 = c.arch, c.act_b, c.compute, c.runtime.loss_fp32
    if c.fused_loss:
        head = chunked_loss_bytes(arch, e, c.res_b, c.logit_tokens, _head_cast(c))
        return [
            Term(
                name="logits and loss",
                bytes=head.transient + head.kept,
                note=(
                    f"chunked head (training.loss): {head.chunk} of {c.logit_tokens} scored tokens at a "
                    f"time x vocab {arch.vocab_size:,}: the chunk's logits ({e} B), their fp32 copy and "
                    "logsumexp's fp32 buffer, freed after each chunk"
                    + (f" (+ the lm_head weight cast to {cdt})" if _head_cast(c) else "")
                    + f"; kept: {c.logit_tokens} scored tokens x hidden {arch.hidden_size:,} x {c.res_b} B, "
                    "their hidden states and gradients, + the fp32 loss per token"
                ),
            )
        ]
    loss_phase = []
    if _head_cast(c):
        loss_phase.append(
            Term(
                name="lm_head compute-dtype copy",
                bytes=arch.vocab_size * arch.hidden_size * c.compute_b,
                note=(
                    f"the frozen fp32 lm_head weight cast to {cdt} by autocast for the logits matmul, which "
                    "keeps the copy until the lm_head's backward"
                ),
            )
        )
    loss_phase += [
        Term(
            name="logits and loss",
            bytes=loss_buffer_bytes(c),
            note=(
                f"{c.logit_tokens} scored tokens x vocab {arch.vocab_size:,} x "
                f"{logits_bytes_per_token(arch, e, loss_fp32) // arch.vocab_size} B: forward keeps "
                f"the logits ({e} B), their {'fp32 ' if loss_fp32 else ''}copy and the log-probs; "
                "backward starts with the log-probs and two gradients"
                + ("" if loss_fp32 else f", all in {cdt} (no fp32 upcast)")
            ),
        )
    ]
    return loss_phase


def _layer_phase(c: Context, layer_bytes: int, block_copy: int, copy_why: str) -> list[Term]:
    """One block's backward: the recomputed layer (checkpointing), gradients in flight, QLoRA's
    dequantized weight."""
    arch, e, cdt, tokens = c.arch, c.act_b, c.compute, c.tokens
    layer_phase: list[Term] = []
    if c.spec.gradient_checkpointing:
        layer_phase.append(
            Term(
                name="recomputed layer",
                bytes=layer_bytes + block_copy + recomputed_stack_bytes(c),
                note="backward re-runs one checkpointed layer's forward and holds what it saves"
                + (f" (+ its linears' weight copies: {copy_why}, kept by the matmuls)" if block_copy else "")
                + (" (+ its LoRA'd expert stacks, W + B A)" if recomputed_stack_bytes(c) else ""),
            )
        )
    grads = tokens * backward_working_bytes_per_token(arch, e, c.res_b)
    lora_peak, module = lora_forward_transient_per_token(
        arch,
        c.lora,
        act_bytes=e,
        residual_bytes=c.res_b,
        adapter_bytes=c.trainable_b,
        casts_input=lora_input_cast(c) or not c.autocast,
        dropout=c.spec.lora_dropout > 0,
        fused_add=c.runtime.lora_fused_add and c.spec.method == "lora",  # not bitsandbytes' 4-bit layer
    )
    # the LoRA branch's copies, in forward (every layer's activations alive) or in a checkpointed layer's
    # recomputation (its output's gradient alive)
    incoming = c.res_b * arch.hidden_size if c.spec.gradient_checkpointing else 0
    forward = tokens * (lora_peak + incoming)
    # the attention's backward: flash's buffers beside the gradients of the block's output (residual dtype)
    # and of the attention output, once the MLP's backward has freed the MLP's saved tensors
    flash, _ = _flash_backward(c)
    attention = 0
    if flash:
        incoming_attn = c.res_b * arch.hidden_size + e * arch.num_heads * arch.head_dim
        attention = flash + int(
            tokens * (incoming_attn - mlp_saved_bytes_per_token(arch, activation_setup(c)))
        )
    working = max(grads, forward, attention)
    if working == grads:
        why = f"grads in flight through one block: hidden ({c.res_b} B) + 2 x intermediate ({e} B) per token"
    elif working == forward:
        why = (
            f"{module}'s LoRA input copies (cast to the adapter's dtype, dropout) and output sums, larger "
            "than a block's gradients in flight"
            + (" (+ the recomputed layer's incoming gradient)" if incoming else "")
        )
    else:
        why = (
            f"flash attention's backward: fp32 dq accumulator over {tokens} tokens + 128 rows for each of "
            f"~{micro_batch_sequences(c)} sequences, softmax_d, dq/dk/dv (GQA: per query head first), beside "
            "the block's output and attention-output gradients"
        )
    layer_phase.append(Term(name="backward working buffers", bytes=working, note=why))
    if _dequant_kept(c):
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
    if c.spec.method == "qlora" and not _dequant_kept(c):
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
    return layer_phase


def _fsdp_terms(c: Context) -> list[Term]:
    """Unsharded parameters and gradients in flight, and the communicators, when num_gpus > 1."""
    arch, sb = c.arch, c.store_b
    layer_w = (
        sum(nf4_bytes(m.weight_numel) for m in arch.block_linears)
        + arch.norm_params_per_layer * sb
        + expert_weight_bytes(arch, sb)[1] // arch.num_layers  # bitsandbytes leaves the experts as they are
        if c.spec.method == "qlora"
        else arch.layer_params * sb
    )
    root = (arch.embedding_params + arch.lm_head_params + arch.final_norm_params) * sb
    terms = [
        Term(
            name="FSDP all-gathered units",
            bytes=int(2 * layer_w + root),
            note=(
                "two decoder layers unsharded (current + prefetched next) + the root unit (embeddings, "
                "lm_head, final norm) which FSDP2 keeps unsharded between forward and backward"
            ),
        )
    ]
    if c.full:
        grad_b = c.trainable_b
        terms.append(
            Term(
                name="FSDP unsharded gradients",
                bytes=(arch.layer_params * grad_b + root // sb * grad_b),
                note="one layer's and the root unit's full gradients before reduce-scatter",
            )
        )
    if not c.cpu:  # gloo, a CPU's backend, keeps no such buffers (measured: bench/planner_self.py)
        terms.append(Term(name="NCCL buffers", bytes=NCCL_BYTES, note="communicator buffers, ~300 MiB"))
    return terms


@dataclass(frozen=True)
class Churn:
    """What the caching allocator's reuse depends on (planner.allocator): the largest tensors a step
    keeps and the largest it frees again, at the planned micro-batch."""

    kept_class: float  # bytes per token of the largest tensors a block keeps for backward
    kept_alive: int  # bytes of that size class alive at the peak (every layer's; checkpointing: one layer's)
    transient_class: float  # bytes per token of the largest tensor a block makes and frees within itself
    largest_buffer: int  # the largest single transient buffer of a step, bytes


def churn(c: Context) -> Churn:
    arch, tokens, e = c.arch, c.tokens, c.act_b
    setup = activation_setup(c)
    kept, count = largest_saved_tensor_per_token(arch, setup)
    layers = 1 if c.spec.gradient_checkpointing else arch.num_layers
    adapter = c.trainable_b
    casts = c.spec.method != "qlora" or not c.autocast
    transient = float(max(e * arch.intermediate_size, c.res_b * arch.hidden_size))  # gradients in backward
    block = {b.name for b in arch.block_linears}
    for m, _ in c.lora:
        if m.name not in block:
            continue
        x_b = c.res_b if m.group in ("attn_in", "mlp_in") else e
        cast = adapter if casts and x_b != adapter else 0
        transient = max(transient, m.in_features * (cast or (x_b if c.spec.lora_dropout > 0 else 0)))
        transient = max(transient, m.out_features * e)
    buffers = [int(transient * tokens), _flash_backward(c)[1]]
    if c.fused_loss:
        head = chunked_loss_bytes(arch, e, c.res_b, c.logit_tokens, _head_cast(c))
        buffers.append(head.chunk * arch.vocab_size * 4)
    else:
        buffers.append(c.logit_tokens * arch.vocab_size * 4)
    if c.spec.method == "qlora":
        buffers.append(arch.largest_linear_numel * e)
    if c.spec.rl.enabled:
        buffers.append(rollout(c).largest_buffer)
    return Churn(
        kept_class=kept,
        kept_alive=int(kept * count * tokens * layers),
        transient_class=transient,
        largest_buffer=max(buffers),
    )
