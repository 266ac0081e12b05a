"""Memory of the inference engine (inference/): one base model serving up to `max_adapters` LoRA adapters.

A pure function of the architecture, like the training planner: the API subtracts it from a device's memory
when a training job and the engine share it, and the engine derives from it how many adapters it may keep
resident under a memory budget (`max_resident_adapters`). Terms, each an upper bound:
  base weights   every parameter once, in the dtype the engine loads (config.json's, like training), and
                 the rotary inverse frequencies (an fp32 buffer of head_dim / 2, and its original copy)
  LoRA adapters  max_adapters x r x (in + out) per wrapped linear (arch.lora_targets), in fp32: peft keeps
                 adapter weights in fp32 whatever the base dtype (autocast_adapter_dtype)
  KV cache       k and v of every layer for the tokens the engine may hold (num_kv_heads x head_dim each):
                 its batch's budget `max_batch_tokens` (rows x the longest any may grow; inference.batcher)
                 or one lone request of max_seq_len, whichever is more; plus one layer's worth again: a
                 growing cache concatenates a layer's new tensors while the old ones are still alive
  prefill        the forward of the prompts prefilled together (within the same tokens): the residual
                 stream, q/k/v/attention out, and a gated MLP's gate, up and product for every prompt token
                 of one layer at a time (SDPA's fused kernels materialize no seq x seq scores; the eager
                 kernel would add heads x seq^2)
  logits         generation computes logits for the last position only: per sequence (max_batch rows)
                 the vocab row in the model dtype, its fp32 copy, the processed scores and probabilities
"""

from __future__ import annotations

from core.arch import Architecture
from planner.memory import DTYPE_BYTES
from planner.types import Term, gib

ADAPTER_BYTES = 4  # peft's adapter weights: fp32
DEFAULT_TARGETS: list[str] | str = "all-linear"


def adapter_bytes(arch: Architecture, lora_r: int, targets: list[str] | str = DEFAULT_TARGETS) -> int:
    """Bytes of one resident LoRA adapter of rank `lora_r` on these target modules (A and B, fp32)."""
    return arch.lora_params(targets, lora_r) * ADAPTER_BYTES


def serving_terms(
    arch: Architecture,
    *,
    max_adapters: int,
    lora_r: int = 64,
    lora_targets: list[str] | str = DEFAULT_TARGETS,
    max_batch: int = 1,
    max_seq_len: int = 2048,
    max_batch_tokens: int | None = None,
    dtype: str | None = None,
) -> tuple[list[Term], int]:
    """The engine's memory by term and their total (bytes). `max_batch`: rows decoding at once;
    `max_batch_tokens`: the batch's KV budget (None: max_batch x max_seq_len); a lone request may still
    reach `max_seq_len`. `dtype`: the base weights' (None: config.json's, float32 when it says nothing, as
    the engine loads them). Adapters are counted at rank `lora_r` on `lora_targets`: pass the largest rank
    and widest targets the engine may be asked to serve."""
    store = dtype or arch.config_dtype or "float32"
    e = DTYPE_BYTES[store]
    tokens = max_batch * max_seq_len if max_batch_tokens is None else max(max_batch_tokens, max_seq_len)
    one_adapter = adapter_bytes(arch, lora_r, lora_targets)
    kv_per_token_layer = 2 * arch.num_kv_heads * arch.head_dim * e
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    mlp = (3 if arch.gated_mlp else 1) * arch.intermediate_size
    prefill_per_token = e * (2 * arch.hidden_size + 2 * q_dim + 2 * kv_dim + mlp) + 4 * arch.hidden_size
    logits_per_seq = arch.vocab_size * (e + 3 * 4)
    terms = [
        Term(
            name="base weights",
            bytes=arch.total_params * e + arch.head_dim * 4,
            note=(
                f"{arch.total_params:,} params in {store} ({e} B/param) + rotary buffers, one copy for "
                "every adapter"
            ),
        ),
        Term(
            name="LoRA adapters",
            bytes=max_adapters * one_adapter,
            note=(
                f"{max_adapters} resident x {one_adapter:,} B (r={lora_r} on {lora_targets}, fp32); "
                "the least recently used is evicted beyond that"
            ),
        ),
        Term(
            name="KV cache",
            bytes=(arch.num_layers + 1) * kv_per_token_layer * tokens,
            note=(
                f"k, v of {arch.num_layers} layers (+1 while a layer's cache grows) x {arch.num_kv_heads} "
                f"kv heads x {arch.head_dim} x {e} B for {tokens:,} tokens"
            ),
        ),
        Term(
            name="prefill activations",
            bytes=prefill_per_token * tokens,
            note=(
                f"one layer's forward over {tokens:,} prompt tokens: residual, q/k/v/out, MLP "
                f"({prefill_per_token:,} B/token; SDPA, no seq x seq scores)"
            ),
        ),
        Term(
            name="logits",
            bytes=logits_per_seq * max_batch,
            note=f"last position only: {arch.vocab_size:,} vocab x ({e} + 3 x 4) B x {max_batch} sequences",
        ),
    ]
    return terms, sum(t.bytes for t in terms)


def serving_bytes(arch: Architecture, **kwargs) -> int:
    """The engine's memory bound in bytes (serving_terms' total)."""
    return serving_terms(arch, **kwargs)[1]


def max_resident_adapters(
    arch: Architecture,
    memory_bytes: int,
    *,
    lora_r: int,
    lora_targets: list[str] | str = DEFAULT_TARGETS,
    max_batch: int = 1,
    max_seq_len: int = 2048,
    max_batch_tokens: int | None = None,
    dtype: str | None = None,
) -> int:
    """How many adapters of this shape fit beside the base and the generation buffers in `memory_bytes`
    (0: not even the base and one request fit)."""
    _, fixed = serving_terms(
        arch,
        max_adapters=0,
        lora_r=lora_r,
        lora_targets=lora_targets,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        max_batch_tokens=max_batch_tokens,
        dtype=dtype,
    )
    one = adapter_bytes(arch, lora_r, lora_targets)
    return max(0, (memory_bytes - fixed) // one) if one else 0


def describe(terms: list[Term]) -> str:
    """One line per term, for logs and the bench."""
    return "\n".join(f"{t.name:>20} {gib(t.bytes):>12}  {t.note}" for t in terms)
