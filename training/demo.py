"""A small Llama-architecture model built locally, so the whole service runs and is tested offline.

Random weights (fixed seed) and a byte-level BPE tokenizer trained on `demo_corpus.txt`, with a
ChatML-like chat template. Built into a temp dir next to the target and renamed into place, so a
half-built model is never seen and two builders cannot interleave.

The template renders tools as Qwen2.5's (Hermes style) does, the form ftune's serving side parses: the
definitions in a system turn inside <tools></tools>, each call of an assistant turn as
<tool_call>{"name", "arguments"}</tool_call>, and a run of tool results in one user turn of
<tool_response> blocks. Without tools it renders exactly what it rendered before it had them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.storage import atomic_dir

CORPUS = Path(__file__).with_name("demo_corpus.txt")

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_CODA = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_CODA + "<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function or tool_call %}"
    '{{ \'\n<tool_call>\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{ (tool_call.arguments | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 2048


TINY = DemoSize(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=1024, max_position_embeddings=512)  # fmt: skip


def build_demo_model(
    models_dir: Path,
    name: str = "ftune-demo",
    force: bool = False,
    size: DemoSize = DemoSize(),
    seed: int = 1234,
) -> Path:
    """Build (or return the already built) demo model at models_dir/name and return its path."""
    return save_built(
        Path(models_dir) / name, size.vocab_size, lambda tokenizer: _build_model(size, tokenizer, seed), force
    )


def save_built(target: Path, vocab_size: int, build: Callable[[Any], Any], force: bool) -> Path:
    """`target` as built (its tokenizer trained here, then `build(tokenizer)`'s model), written whole or
    not at all; an already built one is kept unless `force`."""
    if (target / "config.json").is_file() and not force:
        return target
    with atomic_dir(target) as tmp:
        tokenizer = _build_tokenizer(vocab_size)
        tokenizer.save_pretrained(tmp)
        build(tokenizer).save_pretrained(tmp)
    return target


def _build_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The tokenizers trainer is deterministic for a fixed input order.
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _build_model(size: DemoSize, tokenizer, seed: int):  # -> LlamaForCausalLM
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids(BOS),
        eos_token_id=ids(EOS),
        pad_token_id=ids(PAD),
        dtype="float32",
    )
    assert len(tokenizer) <= size.vocab_size, "tokenizer larger than the embedding table"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids(BOS), eos_token_id=[ids(EOS), ids(IM_END)], pad_token_id=ids(PAD)
    )
    return model
