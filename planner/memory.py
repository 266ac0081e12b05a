"""Byte formulas the planner adds up: weight storage formats and what a decoder block saves for backward.

Pure functions of shapes, no policy. Every formula states where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.arch import Architecture, LinearModule
from planner.moe import routed_backward_per_token, routed_saved_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# bitsandbytes 4-bit (NF4/FP4): two 4-bit codes per uint8; one absmax per block of 64 values.
NF4_BLOCK = 64
# double quant ("compress_statistics"): absmaxes - their mean quantized to uint8 blockwise (256),
# with an fp32 absmax per 256-block and one fp32 offset (the mean).
NF4_NESTED_BLOCK = 256
NF4_CODE_BYTES = 16 * 4  # the 16-entry fp32 code table every quantized tensor carries
# bitsandbytes 8-bit optimizers: uint8 states, one fp32 absmax per block of 256 per state.
OPT8_BLOCK = 256


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def nf4_bytes(numel: int, double_quant: bool = True, blocksize: int = NF4_BLOCK) -> int:
    """Bytes of one bitsandbytes 4-bit tensor: packed codes + quantization constants (+ the code table)."""
    blocks = _ceil_div(numel, blocksize)
    packed = _ceil_div(numel, 2)
    # double quant: uint8 absmax + fp32 scale per 256 of them + fp32 offset; otherwise fp32 absmax
    nested = blocks + _ceil_div(blocks, NF4_NESTED_BLOCK) * 4 + 4
    return packed + (nested if double_quant else blocks * 4) + NF4_CODE_BYTES


def int8_bytes(rows: int, cols: int) -> int:
    """LLM.int8 (bitsandbytes Linear8bitLt): int8 weight + one fp32 scale per output row (SCB)."""
    return rows * cols + rows * 4


def adam8bit_state_bytes(numel: int) -> int:
    """bitsandbytes blockwise 8-bit Adam: m and v as uint8 + an fp32 absmax per 256-block each."""
    return 2 * (numel + _ceil_div(numel, OPT8_BLOCK) * 4)


@dataclass(frozen=True)
class ActivationSetup:
    """What decides the tensors a block saves: compute precision, method, LoRA wrap, attention kernel."""

    compute_bytes: int  # 2 under bf16/fp16 autocast, 4 in plain fp32
    autocast: bool  # LoRA's fp32 adapters then run in the compute dtype (inputs cast and saved)
    full: bool  # every weight trainable: linear inputs and norm outputs saved for weight grads
    lora: tuple[tuple[LinearModule, int], ...]  # wrapped block linears and in how many layers
    lora_r: int
    lora_dropout: bool
    attn: str  # sdpa | eager | flash_attention_2
    kv_repeated: bool  # k/v expanded to all query heads before attention (repeat_kv)
    seq_len: int
    mask_bytes: int = 1  # dropout mask per element: CUDA's fused dropout keeps a bool; a CPU one a float
    lora_bytes: int = 0  # lora_A's saved input copy; 0: the compute dtype under autocast, else fp32
    residual_bytes: int = 0  # the residual stream's dtype (the norms' outputs); 0: the compute dtype
    # under autocast, peft casts a LoRA input to the fp32 adapter first (Runtime.lora_input_cast)
    lora_input_cast: bool = True
    # fused norms and gates (Runtime.fused_norm_mlp, where fused_norm and fused_gate hold)
    fused_norms: bool = False
    fused_gate: bool = False


# The families whose modules training.fused replaces (its tests check this against each family's model):
# RMSNorm of Llama's formula (Gemma's scales by 1 + weight), and Llama's MLP forward with separate
# gate_proj and up_proj (Phi-3 has one gate_up_proj) and an activation it knows.
FUSED_NORM_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"})
FUSED_GATE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})
FUSED_GATE_ACTS = frozenset({"silu", "swish", "gelu_pytorch_tanh"})


def fused_norm(arch: Architecture) -> bool:
    return arch.model_type in FUSED_NORM_TYPES


def fused_gate(arch: Architecture) -> bool:
    return arch.gated_mlp and arch.model_type in FUSED_GATE_TYPES and arch.hidden_act in FUSED_GATE_ACTS


def norm_input_bytes(s: ActivationSetup) -> int:
    """Bytes per value a norm keeps of its input: its fp32 upcast, or fused, the input itself."""
    return (s.residual_bytes or s.compute_bytes) if s.fused_norms else 4


def lora_input_copy_bytes(s: ActivationSetup, m: LinearModule) -> int:
    """Bytes per feature of m's input that lora_A keeps as a copy of its own for backward; 0: it keeps the
    very tensor the base linear read (q/k/v share it, gate/up share theirs). A new tensor is dropout's
    output; under autocast, autocast's cast for the matmul, made from peft's fp32 cast of the input
    (s.lora_input_cast) or from an input outside the compute dtype (an fp32 residual stream's norm
    output); without autocast, peft's cast to the fp32 adapter when the activations are not fp32."""
    e, lora_e = s.compute_bytes, _lora_bytes(s)
    if s.lora_dropout:
        return lora_e
    if s.autocast:
        x_b = (s.residual_bytes or e) if m.group in ("attn_in", "mlp_in") else e
        return lora_e if (s.lora_input_cast or x_b != e) else 0
    return lora_e if e != 4 else 0


def _lora_bytes(s: ActivationSetup) -> int:
    """Bytes per value of what lora_A saves (its input copy, its r outputs)."""
    return s.lora_bytes or (s.compute_bytes if s.autocast else 4)


def layer_saved_bytes_per_token(arch: Architecture, s: ActivationSetup) -> tuple[float, list[str]]:
    """Bytes one decoder block keeps for backward per token, averaged over layers, and its parts.

    Derived from a Llama block (and checked on CPU with saved-tensor hooks):
      - each RMSNorm/LayerNorm keeps its fp32 upcast input (4 B x hidden); fused (fused_norms) its
        input as it is; full FT also its output
      - a frozen base linear keeps nothing (autograd saves an input only for a weight gradient);
        a LoRA-wrapped one keeps what lora_A reads, plus lora_A's r outputs (see _lora_saved_per_token)
      - SDPA/flash keep q, k, v, the output and a fp32 logsumexp per head; eager keeps q, k, v
        (k, v repeated to all heads), the fp32 softmax and its compute-dtype copy: (4 + 2) x heads x seq
      - a gated MLP keeps gate (act input), act output and up (the product's operands): 3 x inter;
        fused (fused_gate) gate and up: 2 x inter;
        a plain MLP keeps the activation's input (python GELUs like gelu_new keep 4 tensors)
      - full FT: the input of each distinct linear input group (q/k/v share one, gate/up share one)
      - a sparse (MoE) block: its gate/act/up rows as above (intermediate_size = top_k x an expert's
        width), and its router's and experts' own tensors (planner.moe.routed_saved_per_token)
    """
    e, h = s.compute_bytes, arch.hidden_size
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    parts: dict[str, float] = {}
    norm_b = norm_input_bytes(s)
    parts["norm inputs" + (" (fp32)" if norm_b == 4 else "")] = norm_b * h * arch.norms_per_layer
    if arch.qk_norm:
        q_b = e if s.fused_norms else 4  # fused: the q and k projections' outputs as they are
        parts["q/k norm inputs" + (" (fp32)" if q_b == 4 else "")] = q_b * (q_dim + kv_dim)
    if s.full:
        parts["norm outputs"] = e * h * arch.norms_per_layer
    kv = q_dim if (s.kv_repeated or s.attn == "eager") else kv_dim
    if s.attn == "eager":
        parts["q, k, v"] = e * (q_dim + 2 * kv)
        parts["attention probs (fp32 + copy)"] = (4 + e) * arch.num_heads * s.seq_len
    else:
        parts["q, k, v, attention out"] = e * (2 * q_dim + 2 * kv) + 4 * arch.num_heads
    inter = arch.intermediate_size
    if arch.gated_mlp and s.fused_gate:
        parts["gate, up"] = 2 * e * inter
    elif arch.gated_mlp:
        parts["gate, act, up"] = 3 * e * inter
    else:
        parts["activation input"] = (4 if arch.hidden_act in ("gelu_new", "gelu_fast") else 1) * e * inter
    if arch.experts:  # a sparse block: inter is top_k rows of an expert's width (planner.moe)
        parts["router, expert outputs, routing"] = routed_saved_per_token(arch, e, s.residual_bytes, s.lora)
    if s.full:
        groups = {m.group: m.in_features for m in arch.block_linears}
        if s.attn != "eager":
            groups.pop("attn_out", None)  # the attention output is already kept by SDPA/flash
        parts["linear inputs"] = e * sum(groups.values())
    elif s.lora:
        parts["LoRA inputs (dropout mask + cast), A outputs"] = _lora_saved_per_token(arch, s)
    return sum(parts.values()), [f"{k} {v:,.0f}" for k, v in parts.items() if v]


def mlp_saved_bytes_per_token(arch: Architecture, s: ActivationSetup) -> float:
    """The part of layer_saved_bytes_per_token that the MLP's backward frees before the attention's runs:
    the post-attention norm's input, the MLP's own tensors and its linears' LoRA copies."""
    e, inter = s.compute_bytes, arch.intermediate_size
    kept = (2 if s.fused_gate else 3) if arch.gated_mlp else 1
    mlp = float(kept * e * inter + norm_input_bytes(s) * arch.hidden_size)
    mlp += routed_saved_per_token(arch, e, s.residual_bytes, s.lora)
    block = {b.name for b in arch.block_linears}
    for m, layers in s.lora:
        own = lora_input_copy_bytes(s, m)
        if m.name in block and m.group in ("mlp_in", "mlp_mid") and own:
            mlp += (own + (s.mask_bytes if s.lora_dropout else 0)) * m.in_features * layers / arch.num_layers
    return mlp


def largest_saved_tensor_per_token(arch: Architecture, s: ActivationSetup) -> tuple[float, int]:
    """The largest tensors one block keeps for backward (bytes per token each; those of
    layer_saved_bytes_per_token) and how many of them (within 10% of that size) a block keeps: the size
    class whose blocks the caching allocator cannot reuse for a longer batch's (planner.allocator)."""
    e, h, inter = s.compute_bytes, arch.hidden_size, arch.intermediate_size
    sizes = [float(norm_input_bytes(s) * h)] * arch.norms_per_layer + [e * arch.num_heads * arch.head_dim]
    if s.attn == "eager":
        sizes += [4.0 * arch.num_heads * s.seq_len, e * arch.num_heads * s.seq_len]
    gated = 2 if s.fused_gate else 3
    sizes += [e * inter] * (
        gated if arch.gated_mlp else (4 if arch.hidden_act in ("gelu_new", "gelu_fast") else 1)
    )
    block = {b.name: b for b in arch.block_linears}
    for m, _ in s.lora:
        own = lora_input_copy_bytes(s, m)
        if m.name in block and own:
            sizes.append(own * m.in_features)
            if s.lora_dropout:
                sizes.append(s.mask_bytes * m.in_features)
    if s.full:
        sizes += [e * m.in_features for m in arch.block_linears]
    largest = max(sizes)
    return largest, sum(1 for x in sizes if x >= 0.9 * largest)


def flash_backward_bytes(
    arch: Architecture, compute_bytes: int, tokens: int, sequences: int
) -> tuple[int, int]:
    """(Bytes a flash-attention backward allocates for one layer, its largest buffer.) FlashAttention-2's
    backward (PyTorch's flash_api.cpp, the varlen path and the padded one alike) accumulates dq in fp32 over
    tokens + 128 rows per sequence x heads x head_dim (rounded up to 32), with softmax_d (fp32, heads x
    those rows); it writes dq, dk, dv, and under GQA first dk and dv for every query head."""
    heads, kv, d, e = arch.num_heads, arch.num_kv_heads, arch.head_dim, compute_bytes
    rows = tokens + 128 * sequences
    accum = rows * heads * _ceil_div(d, 32 if d <= 128 else 64) * (32 if d <= 128 else 64) * 4
    others = (
        heads * rows * 4
        + tokens * (heads + 2 * kv) * d * e
        + (2 * tokens * heads * d * e if kv != heads else 0)
    )
    return accum + others, accum


def _lora_saved_per_token(arch: Architecture, s: ActivationSetup) -> float:
    """What LoRA adds per token (averaged over layers): lora_A's saved input and lora_B's (r outputs).

    lora_A saves its input for its weight gradient. When that input is a new tensor per module
    (lora_input_copy_bytes: cast by autocast or peft, or passed through dropout, which also keeps its
    mask) each wrapped module keeps its own copy. Otherwise lora_A saves the very tensor the frozen base
    linear read: one per input group (q/k/v share one, gate/up another), and none for o_proj under
    SDPA/flash, whose input is the attention output the kernel already keeps.
    """
    e, lora_e = s.compute_bytes, _lora_bytes(s)
    block = {b.name for b in arch.block_linears}
    total = 0.0
    shared: dict[str, float] = {}
    for m, layers in s.lora:
        if m.name not in block:
            continue
        share = layers / arch.num_layers
        total += lora_e * s.lora_r * share
        own = lora_input_copy_bytes(s, m)
        if own:
            total += (own + (s.mask_bytes if s.lora_dropout else 0)) * m.in_features * share
        elif not (m.group == "attn_out" and s.attn != "eager"):
            shared[m.group] = max(shared.get(m.group, 0.0), e * m.in_features * share)
    return total + sum(shared.values())


def backward_working_bytes_per_token(arch: Architecture, compute_bytes: int, residual_bytes: int = 0) -> int:
    """Gradients in flight through one block, beside its saved tensors: the residual-stream gradient (in
    the residual stream's dtype, `residual_bytes`; default the compute dtype) and, at the worst moment (the
    backward of the MLP's elementwise product), two intermediate-sized gradients; the product's own saved
    input is freed by then."""
    dense = (residual_bytes or compute_bytes) * arch.hidden_size + compute_bytes * 2 * arch.intermediate_size
    return max(dense, routed_backward_per_token(arch, compute_bytes, residual_bytes))  # a sparse block's


def lora_forward_transient_per_token(
    arch: Architecture,
    lora: tuple[tuple[LinearModule, int], ...],
    *,
    act_bytes: int,
    residual_bytes: int,
    adapter_bytes: int,
    casts_input: bool,
    dropout: bool,
    fused_add: bool = False,
) -> tuple[int, str]:
    """The largest moment of one LoRA-wrapped block linear's forward, in bytes per token beyond what the
    block saves (and the module's name). peft's LoRA layer casts its input to the adapter's dtype
    (`casts_input`: the plain layer always does; bitsandbytes' 4-bit one only without autocast) and runs
    the dropout on that, so beside the base output it holds, until lora_A has made its own (saved) copy,
    the cast input and the dropout's output: in_features x (adapter B + dropout B). The output side: the
    base output and the scaled LoRA output before they are added, 2 x out_features x compute B; with the
    update added inside its GEMM (`fused_add`: training.lora_add) the base output alone.
    A linear's input is a norm's output (the residual stream's dtype) for q/k/v and gate/up, the compute
    dtype's attention output or MLP product for o_proj and down_proj (checked against an allocation trace
    of the engine: the recomputed down_proj's fp32 input copies make the peak of a checkpointed step)."""
    block = {b.name for b in arch.block_linears}
    worst, name = 0, ""
    for m, _ in lora:
        if m.name not in block:
            continue
        x_b = residual_bytes if m.group in ("attn_in", "mlp_in") else act_bytes
        cast = adapter_bytes if casts_input and x_b != adapter_bytes else 0
        inputs = m.in_features * (cast + ((cast or x_b) if dropout else 0))
        outputs = (1 if fused_add else 2) * m.out_features * act_bytes
        if max(inputs, outputs) > worst:
            worst, name = max(inputs, outputs), m.name
    return worst, name


def dequant_excess_bytes(arch: Architecture, compute_bytes: int, tokens: int) -> int:
    """QLoRA's dequantized weight lives only inside one matmul, when the second intermediate-sized
    gradient of the working set does not exist: it adds only what it exceeds that gradient by."""
    return max(0, arch.largest_linear_numel * compute_bytes - compute_bytes * arch.intermediate_size * tokens)


def unpack_excess_bytes(arch: Architecture, compute_bytes: int, tokens: int) -> int:
    """auto-gptq's torch dequantization (the path training takes) shifts the packed int32 words into an
    int32 tensor of one value per weight, copies it to int8, then scales into the half-precision weight:
    5 B per weight at the worst moment, 3 B beyond the half copy the matmul then keeps. Counted for the
    largest block linear, beyond the intermediate-sized gradients it never coexists with (it runs in the
    recomputed forward, before the block's backward)."""
    unpack = 3 * arch.largest_linear_numel
    return max(0, unpack - compute_bytes * 2 * arch.intermediate_size * tokens)


def logits_bytes_per_token(arch: Architecture, compute_bytes: int, loss_fp32: bool = True) -> int:
    """The plain causal-LM loss head (the logits of every scored token at once), per token: bytes per
    vocab entry x vocab. ftune's engine takes it only where its chunked head cannot serve (loss_phase_bytes).

    fp32 loss (ftune's loop, transformers' loss, autocast's cross_entropy): forward keeps the logits
    (e B), their fp32 copy (.float(), or the contiguous copy of the shifted slice) and log_softmax's
    fp32 output: e + 8. Backward starts with the kept log-probs, nll_loss's dense fp32 gradient and
    log_softmax's fp32 input gradient: 12 (nothing references the logits by then). The peak is the
    larger, 12 B for e <= 4 (measured on CPU in tests/training/test_planner_vs_measured.py).
    A loss in the logits' own dtype (a half-precision model run without autocast, e.g. DeepSpeed's
    fp16 engine): the same three tensors at e bytes each.
    """
    per_entry = max(compute_bytes + 8, 12) if loss_fp32 else 3 * compute_bytes
    return arch.vocab_size * per_entry


# The engine's loss head (training.loss) runs the lm_head and cross-entropy over chunks of scored tokens
# whose fp32 logits take at most this much; the planner counts one chunk's vocab-sized buffers.
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(vocab_size: int) -> int:
    """Scored tokens per chunk of the engine's loss head."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class ChunkedLoss:
    """ftune's chunked loss head (training.loss) for a micro-batch's scored tokens, at its largest moment."""

    chunk: int  # tokens of the largest chunk: min(scored, loss_chunk_tokens(vocab))
    transient: int  # one chunk's vocab-sized buffers at their widest (+ a cast lm_head weight), bytes
    kept: int  # alive through every chunk: the [scored, hidden] inputs and gradients, the loss per token


def chunked_loss_bytes(
    arch: Architecture, compute_bytes: int, hidden_bytes: int, scored: int, head_cast: bool, grad: bool = True
) -> ChunkedLoss:
    """training.loss._LinearCrossEntropy, inside forward with no autograd graph. Per chunk of c tokens:
    F.linear makes the logits in the compute dtype (e B per vocab entry) and .float() their fp32 copy
    (4); logsumexp subtracts the row max into a second fp32 buffer (4) while the copy lives: 8 B per vocab
    entry; the softmax is then made in place and cast to the compute dtype (e) for the gradient matmul,
    for which autocast also casts a frozen fp32 lm_head (`head_cast`: V x hidden x e, one copy at a time,
    none kept): max(e + 4, 8) x c x V, or (4 + e) x c x V + the weight copy if that is more.
    Kept through the chunks: h, the scored positions' hidden states [scored, hidden] in the residual
    stream's dtype (`hidden_bytes`), the fp32 loss per token and, when the head is trained through
    (`grad`; not a no-grad reference forward), their gradient grad_h (h's shape and dtype, saved for
    backward) and the chunk's gradient rows [c, hidden] in the compute dtype before they are copied in.
    """
    e, vocab, hidden = compute_bytes, arch.vocab_size, arch.hidden_size
    c = min(scored, loss_chunk_tokens(vocab))
    copy = vocab * hidden * e if head_cast else 0
    transient = max(c * vocab * max(e + 4, 8), c * vocab * (4 + e) + copy)
    kept = scored * (hidden * hidden_bytes + 4)
    if grad:
        kept += scored * hidden * hidden_bytes + c * hidden * e
    return ChunkedLoss(chunk=c, transient=transient, kept=kept)
