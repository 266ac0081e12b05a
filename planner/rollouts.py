"""Objective grpo's rollout phase: sampling with generate() before the step trains (training.rollouts).

The engine samples rollout_prompts prompts at a time (rollout_batch_size, by default all of a step's),
num_generations answers each, in eval mode without grad: generate() expands the prompts to rows =
rollout_prompts x num_generations sequences, left-padded
to the longest prompt P (the data's longest when its shape is known, else the worst case max_prompt_tokens
= max_seq_len - max_completion_tokens), then decodes up to max_completion_tokens C tokens with
transformers' DynamicCache. Nothing of the training phase is alive then (no activations, no logits), so
the phase is compared with forward/backward and the step, like dpo's reference forward. Its two moments:
  decode     the KV cache at its end, 2 (k, v) x layers x kv_heads x head_dim x e B x rows x (P + C) (keys
             in the residual stream's dtype where that is wider: key_bytes), and
             the step's largest transient: the sampling buffers over [rows, vocab] (the logits in e B, the
             fp32 copy generate() samples from, temperature's scaled copy when temperature != 1, softmax's
             probabilities and multinomial's exponential draws: 4 B each), or one layer's k and v repeated to
             every query head (SDPA under a padding mask: transformers' repeat_kv), or one layer's key
             concatenated with its new token (torch.cat keeps the old one until the copy is made)
  prefill    the prompts' cache (P of the P + C positions), their attention mask (bool, and SDPA's
             additive copy in e B; eager: the additive mask and the fp32 probabilities and their e-byte
             copy of every head), the residual stream and one layer's MLP at its widest (hidden + 3 x
             intermediate, as the reference forward's), + QLoRA's dequantized weight
e is the compute dtype's bytes (bf16 on a GPU under autocast, fp32 on a CPU). The decode moment counts
the cache at P + C; the prefill's larger transients count only where they exceed the completions'
share of the cache, so the phase is max(decode, prefill) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.context import Context
from planner.types import Term, gib


@dataclass(frozen=True)
class Rollout:
    """One generate() call's moments, bytes."""

    rows: int  # sequences sampled at once: rollout_prompts x num_generations
    kv_cache: int  # the KV cache at P + C
    prompt_cache: int  # the KV cache of the prompts alone (the prefill's)
    sampling: int  # the sampling buffers over [rows, vocab] at a decode step
    layer_key: int  # one layer's key at P + C (the cache's cat copies it)
    decode_layer: int  # a decode step's largest per-layer moment: repeated k/v, the cat, a dequant
    prefill: int  # the prefill's transients beside the prompts' cache

    @property
    def decode(self) -> int:
        return max(self.sampling, self.decode_layer)

    @property
    def transient(self) -> int:
        """What the phase holds beyond the full KV cache at its peak: max(decode, prefill) less the cache."""
        return max(self.decode, self.prompt_cache + self.prefill - self.kv_cache)

    @property
    def largest_buffer(self) -> int:
        """The largest single transient (planner.allocator's hole): a sampling buffer, a layer's key
        or its repeated k and v."""
        return max(self.sampling // 4, self.layer_key, self.decode_layer)


def key_bytes(c: Context) -> int:
    """Bytes per cached key value: rotary models rotate k with cos and sin in the residual stream's dtype
    (transformers casts them to the hidden states'), which promotes an autocast key to it (an fp32 model
    under bf16 autocast caches fp32 keys, bf16 values: measured on CPU); learned positions leave it e."""
    return max(c.res_b, c.act_b) if c.arch.position_embeddings == 0 else c.act_b


def kv_cache_bytes(c: Context, rows: int, seq_len: int) -> int:
    """K and v of every layer for `rows` sequences of `seq_len` positions: values in the compute dtype,
    keys in key_bytes (the same on a GPU whose weights are half precision: 2 x e)."""
    a = c.arch
    return a.num_layers * a.num_kv_heads * a.head_dim * (key_bytes(c) + c.act_b) * rows * seq_len


def prompt_tokens(c: Context) -> int:
    """The longest prompt: the data's when its shape is known (c.seq_len is then its longest prompt plus
    max_completion_tokens), else every prompt max_prompt_tokens long."""
    return c.seq_len - c.spec.max_completion_tokens


def rollout(c: Context) -> Rollout:
    spec, a, e = c.spec, c.arch, c.act_b
    rows = spec.rl.rollout_sequences  # rollout_prompts prompts x num_generations answers each
    length, prompt = c.seq_len, prompt_tokens(c)
    # the logits (e B) and 4 B each: their fp32 copy, softmax's probabilities, multinomial's draws and,
    # at temperature != 1, the scaled copy
    per_entry = e + 12 + (4 if spec.temperature != 1.0 else 0)
    layer_key = rows * a.num_kv_heads * a.head_dim * length * key_bytes(c)
    gqa = a.num_heads != a.num_kv_heads
    repeated = rows * a.num_heads * a.head_dim * length * (key_bytes(c) + e) if gqa else 0
    dequant = a.largest_linear_numel * e if spec.method == "qlora" else 0
    tokens = rows * prompt
    if spec.attn_implementation == "eager":
        mask = rows * prompt * prompt * e
        attention = rows * a.num_heads * prompt * prompt * (4 + 2 * e)  # scores, fp32 probs, their copy
    else:
        mask = rows * prompt * prompt * (1 + e)
        attention = 0
    mlp = tokens * e * (a.hidden_size + 3 * a.intermediate_size)
    return Rollout(
        rows=rows,
        kv_cache=kv_cache_bytes(c, rows, length),
        prompt_cache=kv_cache_bytes(c, rows, prompt),
        sampling=rows * a.vocab_size * per_entry,
        layer_key=layer_key,
        decode_layer=max(layer_key, repeated, dequant),
        prefill=mask + tokens * a.hidden_size * c.res_b + max(mlp + dequant, attention),
    )


def rollout_terms(c: Context) -> list[Term]:
    """The rollout phase as two lines: the KV cache (the formula) and the largest transient beside it."""
    spec, a = c.spec, c.arch
    r = rollout(c)
    n, prompts = spec.num_generations, spec.rl.rollout_prompts
    k_b = key_bytes(c)
    per_value = f"2 (k, v) x {c.act_b} B" if k_b == c.act_b else f"({k_b} B keys + {c.act_b} B values)"
    cache = Term(
        name="rollout KV cache",
        bytes=r.kv_cache,
        note=(
            f"generate()'s cache for {prompts} prompts x {n} generations = {r.rows} sequences of up to "
            f"{c.seq_len} tokens ({prompt_tokens(c)} prompt + "
            f"{spec.max_completion_tokens} completion tokens): {a.num_layers} layers x {a.num_kv_heads} "
            f"kv heads x head_dim {a.head_dim} x {per_value} per position, "
            "while the step samples (eval mode, no grad), before it trains"
        ),
    )
    if r.transient == r.decode:
        if r.sampling >= r.decode_layer:
            why = (
                f"sampling buffers over {r.rows} rows x vocab {a.vocab_size:,}: the logits, their fp32 copy"
                + (", temperature's scaled copy" if spec.temperature != 1.0 else "")
                + ", softmax's probabilities and multinomial's draws"
            )
        else:
            why = (
                "the last decode step's largest layer moment: its k and v repeated to every query head, its "
                "key's cat or QLoRA's dequantized weight"
            )
    else:
        why = (
            f"the prefill of {r.rows} x {prompt_tokens(c)} prompt tokens: attention mask, residual "
            f"stream and a layer's MLP ({gib(r.prefill)}), beyond the completions' share of the cache"
        )
    return [cache, Term(name="rollout transients", bytes=r.transient, note=why)]
