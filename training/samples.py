"""Before/after samples: greedy completions of a few prompts by the base model and by the tuned one.

Which prompts (spec.sample_prompts):
- a list: the prompts as given. A string is rendered as the training data renders a prompt: as one user
  turn through the chat template for chat and instruction data, as raw text (BOS + text) for
  prompt_completion and text data; a list of messages always through the chat template.
- a number N: the prompts of the first N examples of the validation split that have one (the same
  split as evaluation: validation_dataset_id's file, or validation_fraction's seeded hold-out); without a
  validation split, of the training file's first N examples. A chat or instruction example's prompt is
  its messages before its last assistant turn, a prompt_completion's its prompt; a text example has no
  prompt and is passed over. dpo: the pairs' prompts, as training tokenized them.

Each prompt is tokenized exactly as training tokenizes it (training.data: message by message, then the
assistant turn's generation prompt), keeps its last max_seq_len tokens, and is completed greedily with
at most sample_max_tokens new tokens: once with the adapter disabled (peft's disable_adapter(): the
base) and once with it. Generation (the decoding engine, training.decoding) runs in eval mode under
no_grad, one prompt at a time (no padding, so a completion is exactly what a plain generate() of that
prompt gives: it ends at the model's end tokens, its generation config's), and the RNG state is
restored afterwards, so a run that samples trains exactly like one that does not. A failure to sample
(say, out of memory for the KV cache, which the plan does not count) is logged by the recipe, and the
run goes on without samples.

Under FSDP (num_gpus > 1) there are no samples: decoding on fully_shard'ed modules would have every
rank run each decoding step in lockstep, which a data-dependent stopping point makes fragile; the run
logs why and trains as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.data.examples import Example, Message, is_conversational, read_examples
from core.run_protocol import RunConfig, SampleItem
from core.spec import JobSpec, SampleMessage
from training.chat_template import template_message
from training.data import (
    DatasetError,
    _encode,
    _render,
    _suffix,
    fit_to_length,
    render_chat_pieces,
    template_for,
    tokenize_example,
)
from training.decoding.engine import Row, decode, eos_ids
from training.decoding.sampling import Sampling
from training.evaluate import split_validation

log = logging.getLogger("ftune.training")
CHAT_FORMATS = ("chat", "instruction")


@dataclass(frozen=True)
class Prompt:
    shown: str | list[dict[str, str]]  # what the samples record shows: the text, or the messages
    ids: list[int]  # tokenized as training tokenizes it, the generation prompt included


# Which prompts.


def prompts_for(
    config: RunConfig,
    tokenizer: Any,
    items: Sequence[Any] = (),
    take: Callable[[Sequence[Any], int, Any], list[Prompt] | None] | None = None,
) -> list[Prompt]:
    """The run's sample prompts (see the module doc); [] when spec.sample_prompts is 0. `take`: the
    objective's sample_prompts (training.objectives), which takes a number of them from `items` (dpo,
    grpo: the validation split, else the training one) or gives None: from the dataset file's examples."""
    spec = config.spec
    given = spec.sample_prompts
    if isinstance(given, list):
        chat = is_conversational(Path(config.dataset_path), config.column_mapping)
        return [given_prompt(p, tokenizer, chat, spec.max_seq_len) for p in given]
    if not given:
        return []
    from_items = take(items, given, tokenizer) if take else None
    return from_items if from_items is not None else example_prompts(config, tokenizer, given)


def given_prompt(p: str | list[SampleMessage], tokenizer: Any, chat: bool, max_seq_len: int) -> Prompt:
    if isinstance(p, str):
        if not chat:
            return Prompt(p, raw_prompt_ids(p, tokenizer)[-max_seq_len:])
        messages = [Message(role="user", content=p)]
        return Prompt(p, chat_prompt_ids(messages, tokenizer)[-max_seq_len:])
    messages = [Message(role=m.role, content=m.content) for m in p]
    shown = [{"role": m.role, "content": m.content} for m in p]
    return Prompt(shown, chat_prompt_ids(messages, tokenizer)[-max_seq_len:])


def example_prompts(config: RunConfig, tokenizer: Any, n: int) -> list[Prompt]:
    """The prompts of the first n examples of the validation split (else the training file) that have one."""
    spec = config.spec
    examples: Iterable[Example]
    if spec.validation_dataset_id and config.validation_path:
        path, mapping = Path(config.validation_path), config.validation_column_mapping
        examples = kept_examples(path, mapping, tokenizer, spec)
    else:
        examples = kept_examples(Path(config.dataset_path), config.column_mapping, tokenizer, spec)
        if spec.validation_fraction:
            # The same hold-out as training's load_splits: the same kept examples, fraction and seed
            # (the one case that reads the whole file; otherwise reading stops at the n-th prompt).
            _, examples = split_validation(list(examples), spec.validation_fraction, spec.seed)
    prompts: list[Prompt] = []
    for e in examples:
        prompt = example_prompt(e, tokenizer, spec.max_seq_len)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts


def kept_examples(
    path: Path, mapping: dict[str, str] | None, tokenizer: Any, spec: JobSpec
) -> Iterator[Example]:
    """The file's examples that training keeps (training.data.fit_to_length), in file order."""
    for e in read_examples(path, mapping):
        whole = tokenize_example(e, tokenizer, None, spec.train_on_inputs)
        try:
            fit_to_length([whole], spec.max_seq_len, spec.over_length)
        except DatasetError:
            continue  # dropped by training: too long under over_length=drop, or nothing to train on
        yield e


def example_prompt(e: Example, tokenizer: Any, max_seq_len: int) -> Prompt | None:
    """A dataset example's prompt: what comes before its last reply; None for a text example."""
    if e.format in CHAT_FORMATS:
        last = max((i for i, m in enumerate(e.messages) if m.role == "assistant"), default=None)
        if not last:
            return None
        messages = list(e.messages[:last])
        shown = [{"role": m.role, "content": m.content} for m in messages]
        return Prompt(shown, chat_prompt_ids(messages, tokenizer, e.tools)[-max_seq_len:])
    first_target = next((i for i, m in enumerate(e.messages) if m.weight == 1), 0)
    text = "".join(m.content for m in e.messages[:first_target])
    if not first_target or not text:
        return None
    return Prompt(text, raw_prompt_ids(text, tokenizer)[-max_seq_len:])


def pair_prompts(pairs: Sequence[Any], tokenizer: Any, n: int) -> list[Prompt]:
    """dpo: the prompts of the first n pairs, as training tokenized them (objectives.dpo.pairs.Pair)."""
    out = []
    for pair in pairs[:n]:
        ids = list(pair.chosen.input_ids[: pair.prompt_len])
        out.append(Prompt(tokenizer.decode(ids, skip_special_tokens=True), ids))
    return out


# How a prompt is tokenized: as training.data tokenizes the inputs before a reply.


def chat_prompt_ids(
    messages: Sequence[Message], tokenizer: Any, tools: Sequence[Any] | None = None
) -> list[int]:
    """The messages' pieces, then the assistant turn's generation prompt (render_chat_pieces' input
    piece of an assistant message), so the ids are those a training example has before its reply.
    `tools`: the row's tool definitions, rendered as training renders them."""
    ids = [i for piece, _ in render_chat_pieces(messages, tokenizer, tools) for i in piece]
    template = template_for(tokenizer, tools)
    dicts = [template_message(m) for m in messages]
    done = _render(tokenizer, template, dicts, add_generation_prompt=False, tools=tools)
    with_prompt = _render(tokenizer, template, dicts, add_generation_prompt=True, tools=tools)
    generation_prompt = _suffix(with_prompt, done)
    return ids + (_encode(tokenizer, generation_prompt) if generation_prompt else [])


def raw_prompt_ids(text: str, tokenizer: Any) -> list[int]:
    """BOS + the text: a prompt_completion example's inputs (training.data._raw_pieces)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + _encode(tokenizer, text)


# Generation.


def generate_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> list[SampleItem]:
    """Each prompt's greedy completion by the base (the adapter disabled) and by the tuned model."""
    was_training = model.training
    model.eval()
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=rng_devices), autocast():
            items = []
            for p in prompts:
                with model.disable_adapter():  # type: ignore[operator]  # peft's PeftModel
                    base = complete(model, p.ids, max_new_tokens, tokenizer)
                tuned = complete(model, p.ids, max_new_tokens, tokenizer)
                items.append(SampleItem(prompt=p.shown, base=base, tuned=tuned))
            return items
    finally:
        model.train(was_training)


def complete(model: Any, ids: list[int], max_new_tokens: int, tokenizer: Any) -> str:
    """The greedy continuation of `ids` (at most max_new_tokens), decoded without special tokens."""
    new = greedy_ids(model, ids, max_new_tokens, tokenizer)
    return str(tokenizer.decode(new, skip_special_tokens=True))


@torch.no_grad()
def greedy_ids(model: Any, ids: list[int], max_new_tokens: int, tokenizer: Any) -> list[int]:
    """The new token ids of a greedy decoding of `ids`: at most max_new_tokens, up to an end token."""
    row = Row(sampling=Sampling(max_tokens=max_new_tokens, temperature=0), stops=eos_ids(model, tokenizer))
    decode(model, [ids], [row])
    return row.tokens
