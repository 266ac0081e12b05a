"""Rows with tools through the base model's own chat template (transformers' apply_chat_template with its
`tools=` argument): the loss is on the assistant's tool calls, the legacy form trains as the tools form,
and a template that cannot render tools is refused by name, never trained on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from core.data.examples import read_examples, read_preferences, to_example
from core.spec import JobSpec
from tests.training.conftest import DATASET_ID
from tests.training.util import write_jsonl
from training.chat_template import template_message
from training.data import IGNORE, DatasetError, tokenize_example, tokenize_file
from training.objectives.dpo.pairs import tokenize_pair
from training.rollouts import load_for_training as load_prompts
from training.template_check import model_problem

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# What the demo template rendered before it rendered tools: ChatML that knows only role and content.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / f"{name}.jsonl").read_text().splitlines()]


def trained(tok: Any, ids: list[int], labels: list[int]) -> str:
    return str(tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE]))


def masked(tok: Any, ids: list[int], labels: list[int]) -> str:
    return str(tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE]))


def whole_rendering(tok: Any, row: dict[str, Any]) -> list[int]:
    """The row as the template renders it in one call with its tools: what the pieces must add up to."""
    example = to_example(row, "chat")
    text = tok.apply_chat_template(
        [template_message(m) for m in example.messages], tools=list(example.tools or []), tokenize=False
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


CALL = (
    '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, USA", '
    '"format": "celsius"}}\n</tool_call>'
)


def test_the_loss_is_on_the_assistants_tool_call_and_answer(tokenizer: Any) -> None:
    row = rows("openai_tools")[1]  # the guide's row with the call's result and the answer
    t = tokenize_example(to_example(row, "chat"), tokenizer, None)
    assert t.input_ids == whole_rendering(tokenizer, row)  # every token belongs to one piece
    assert trained(tokenizer, t.input_ids, t.labels) == (
        f"{CALL}<|im_end|>\nIt is 21 degrees celsius in San Francisco, CA<|im_end|>\n"
    )
    inputs = masked(tokenizer, t.input_ids, t.labels)
    assert '<tools>\n{"type": "function", "function": {"name": "get_current_weather"' in inputs
    assert inputs.endswith(
        "<|im_start|>user\n<tool_response>\n21.0\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tool_call_turn_with_weight_0_is_not_trained(tokenizer: Any) -> None:
    row = copy.deepcopy(rows("openai_tools")[1])
    row["messages"][1]["weight"] = 0
    t = tokenize_example(to_example(row, "chat"), tokenizer, None)
    assert (
        trained(tokenizer, t.input_ids, t.labels)
        == "It is 21 degrees celsius in San Francisco, CA<|im_end|>\n"
    )
    assert CALL in masked(tokenizer, t.input_ids, t.labels)


def test_parallel_calls_and_a_run_of_results_render_as_one_call_of_the_template(tokenizer: Any) -> None:
    row = rows("openai_tools")[-1]  # two calls, two results in one user turn (as Qwen2.5 renders them)
    t = tokenize_example(to_example(row, "chat"), tokenizer, None)
    assert t.input_ids == whole_rendering(tokenizer, row)
    assert trained(tokenizer, t.input_ids, t.labels).count("<tool_call>") == 2
    assert "</tool_response>\n<tool_response>" in masked(tokenizer, t.input_ids, t.labels)


def test_the_legacy_functions_form_trains_exactly_as_the_tools_form(tokenizer: Any, tmp_path: Path) -> None:
    legacy = tokenize_file(EXAMPLES / "openai_functions.jsonl", tokenizer)
    tools = tokenize_file(EXAMPLES / "openai_tools.jsonl", tokenizer)
    assert legacy == tools[:20]  # the last two rows call in parallel, which the legacy form cannot say


def test_content_parts_train_as_the_joined_string(tokenizer: Any) -> None:
    for row in rows("openai_content_parts"):
        as_strings = copy.deepcopy(row)
        for m in as_strings["messages"]:
            if isinstance(m["content"], list):
                m["content"] = "".join(p["text"] for p in m["content"])
        assert tokenize_example(to_example(row, "chat"), tokenizer, None) == tokenize_example(
            to_example(as_strings, "chat"), tokenizer, None
        )


def test_a_template_that_cannot_render_tools_is_refused_saying_what_it_drops(tokenizer: Any) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = PLAIN_TEMPLATE
    example = next(read_examples(EXAMPLES / "openai_tools.jsonl"))
    with pytest.raises(DatasetError) as e:
        tokenize_example(example, plain, None)
    assert str(e.value) == (
        "the base model's chat template cannot render tools: it drops the tool definitions (tools) and "
        "the assistant's tool calls"
    )
    plain.chat_template = None  # ftune's ChatML fallback
    with pytest.raises(
        DatasetError, match=r"has no chat template \(ftune's default, ChatML, renders no tools\)"
    ):
        tokenize_example(example, plain, None)
    # Rows without tools still train on it.
    assert tokenize_example(
        next(read_examples(EXAMPLES / "openai_content_parts.jsonl")), plain, None
    ).num_targets


def test_model_problem_asks_the_models_own_files(tiny_model: Path, tmp_path: Path) -> None:
    assert model_problem(str(tiny_model)) is None
    from training.model import load_tokenizer

    plain = load_tokenizer(tiny_model)
    plain.chat_template = PLAIN_TEMPLATE
    plain.save_pretrained(tmp_path / "plain")
    assert model_problem(str(tmp_path / "plain")) == (
        "drops the tool definitions (tools) and the assistant's tool calls"
    )


def test_preference_pairs_render_the_tools_into_the_prompt_and_train_the_call(
    tokenizer: Any, tmp_path: Path
) -> None:
    tool_row = rows("openai_tools")[0]
    row = {
        "input": {"messages": tool_row["messages"][:1], "tools": tool_row["tools"]},
        "preferred_output": [tool_row["messages"][1]],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot look that up."}],
    }
    [pair] = read_preferences(write_jsonl(tmp_path / "pairs.jsonl", [row]))
    whole = tokenize_pair(pair, tokenizer)
    assert "<tools>" in tokenizer.decode(whole.prompt)
    assert tokenizer.decode(whole.chosen) == f"{CALL}<|im_end|>\n"
    assert whole.prompt + whole.chosen == whole_rendering(tokenizer, tool_row)


def test_reinforcement_prompts_render_their_tools(tokenizer: Any, tmp_path: Path) -> None:
    tool_row = rows("openai_tools")[0]
    row = {"messages": tool_row["messages"][:1], "tools": tool_row["tools"], "answer": "get_current_weather"}
    path = write_jsonl(tmp_path / "rft.jsonl", [row, {"messages": tool_row["messages"][:1], "answer": "x"}])
    grader = {"type": "string_check", "name": "g", "operation": "eq", "input": "{{sample.output_text}}"}
    grader["reference"] = "{{item.answer}}"
    spec = JobSpec.model_validate(
        {
            "base_model": "tiny",
            "dataset_id": DATASET_ID,
            "objective": "grpo",
            "max_seq_len": 1024,
            "grader": grader,
        }
    )
    [with_tools, without], dropped, _ = load_prompts(path, tokenizer, spec)
    assert dropped == 0 and "<tools>" in tokenizer.decode(with_tools.input_ids)
    assert with_tools.input_ids[-len(without.input_ids) + 1 :] == without.input_ids[1:]  # BOS, then tools


def test_token_statistics_count_the_rendered_tools(tiny_model: Path) -> None:
    from training.token_stats import compute

    spec = JobSpec.model_validate(
        {"base_model": "tiny", "dataset_id": DATASET_ID, "max_seq_len": 1024, "micro_batch_size": 2}
    )
    stats = compute(tiny_model, EXAMPLES / "openai_tools.jsonl", None, spec)
    from training.model import load_tokenizer

    tok = load_tokenizer(tiny_model)
    lengths = sorted(len(whole_rendering(tok, r)) for r in rows("openai_tools"))
    assert (stats["count"], stats["max"], stats["p50"]) == (22, lengths[-1], lengths[11])
    assert stats["max"] > 600  # the definitions are most of each row
