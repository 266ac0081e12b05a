"""Architecture counts against real tiny transformers models and peft's LoRA wrapping."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from core.arch import from_config, load_architecture
from core.errors import InvalidInput, Unsupported

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {**SMALL, "num_key_value_heads": 2}),
    "llama_bias_tied": (
        "LlamaConfig",
        {**SMALL, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "mistral_head_dim": ("MistralConfig", {**SMALL, "num_key_value_heads": 1, "head_dim": 24}),
    "qwen2": ("Qwen2Config", {**SMALL, "num_key_value_heads": 2}),
    "qwen2_tied": ("Qwen2Config", {**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**SMALL, "num_key_value_heads": 2, "head_dim": 32}),
    "gemma": ("GemmaConfig", {**SMALL, "num_key_value_heads": 1, "head_dim": 16}),
    "gemma2": ("Gemma2Config", {**SMALL, "num_key_value_heads": 2, "head_dim": 32}),
    "gemma3_text": ("Gemma3TextConfig", {**SMALL, "num_key_value_heads": 2, "head_dim": 16}),
    "phi3": ("Phi3Config", {**SMALL, "num_key_value_heads": 2}),
    "gpt2": ("GPT2Config", {"vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 40}),
    "gpt2_inner": ("GPT2Config", {"vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 72}),
    "gpt_neox": ("GPTNeoXConfig", {**SMALL}),
    "gpt_neox_untied_nobias": ("GPTNeoXConfig", {**SMALL, "attention_bias": False}),
    "falcon_mqa": (
        "FalconConfig",
        {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    "falcon_new": (
        "FalconConfig",
        {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
         "new_decoder_architecture": True, "num_kv_heads": 2, "bias": True, "ffn_hidden_size": 100},
    ),
    "falcon_sequential": (
        "FalconConfig",
        {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "multi_query": False, "parallel_attn": False, "tie_word_embeddings": False},
    ),
}  # fmt: skip


def _build(case: str):
    cls, kwargs = CASES[case]
    config = getattr(transformers, cls)(**kwargs, **IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return config, model


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", sorted(CASES))
def test_param_counts_match_real_models(case: str) -> None:
    config, model = _build(case)
    for as_json in (config.to_dict(), config.to_diff_dict()):  # full dict, and only non-default keys
        arch = from_config(json.loads(json.dumps(as_json)))
        assert arch.total_params == _numel(model), case
        emb = model.get_input_embeddings().weight.numel()
        assert arch.vocab_size * arch.hidden_size == emb
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert arch.tie_word_embeddings == tied
        assert arch.lm_head_params == (0 if tied else model.get_output_embeddings().weight.numel())


@pytest.mark.parametrize(
    ("case", "targets"),
    [
        ("llama", "all-linear"),
        ("llama", ["q_proj", "v_proj"]),
        ("llama", ["self_attn.o_proj", "down_proj", "lm_head"]),
        ("llama", ["layers.1.mlp.up_proj", "embed_tokens"]),
        ("mistral_head_dim", "all-linear"),
        ("qwen3", "all-linear"),
        ("gemma2", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("phi3", "all-linear"),
        ("phi3", ["qkv_proj"]),
        ("gpt2", "all-linear"),
        ("gpt2", ["c_attn"]),
        ("gpt_neox", "all-linear"),
        ("gpt_neox", ["query_key_value", "dense"]),
        ("falcon_new", "all-linear"),
        ("falcon_mqa", ["query_key_value"]),
        ("qwen2_tied", "all-linear"),
    ],
)
@pytest.mark.parametrize("r", [1, 8])
def test_lora_counts_match_peft(case: str, targets, r: int) -> None:
    config, model = _build(case)
    arch = from_config(config.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=targets, lora_dropout=0.0))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert arch.lora_params(targets, r) == trainable


def test_unmatched_or_norm_targets_are_refused() -> None:
    arch = from_config(_build("llama")[0].to_dict())
    with pytest.raises(InvalidInput):
        arch.lora_params(["c_attn"], 8)
    with pytest.raises(InvalidInput):
        arch.lora_params(["q_proj", "input_layernorm"], 8)


def test_load_architecture_reads_only_config_json(tmp_path: Path) -> None:
    config, model = _build("qwen2")
    config.save_pretrained(tmp_path)
    arch = load_architecture(tmp_path)
    assert arch.total_params == _numel(model)
    assert arch.num_kv_heads == 2 and arch.head_dim == 16 and arch.model_type == "qwen2"
    assert json.loads(arch.model_dump_json())["vocab_size"] == 96


def test_config_dtype_and_errors(tmp_path: Path) -> None:
    arch = from_config({"model_type": "llama", **SMALL, "torch_dtype": "bfloat16"})
    assert arch.config_dtype == "bfloat16"
    assert from_config({"model_type": "llama", **SMALL, "dtype": "float16"}).config_dtype == "float16"
    with pytest.raises(Unsupported):
        from_config({"model_type": "t5"})
    with pytest.raises(InvalidInput):
        from_config({"model_type": "llama", "hidden_size": "big"})
    with pytest.raises(InvalidInput):
        load_architecture(tmp_path)


def test_llama2_7b_published_size() -> None:
    """Llama-2-7B config.json -> 6,738,415,616 parameters (the count of the released checkpoint)."""
    arch = from_config(
        {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
    )  # fmt: skip
    assert arch.total_params == 6_738_415_616
