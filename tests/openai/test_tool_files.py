"""The official openai SDK uploads OpenAI's published function-calling and content-part files (examples/,
written by examples/openai_examples.py) to a real server: they are `processed`, each malformed tool row is
refused with its code and line, a base model whose chat template cannot render tools is refused at
admission by name, and a job fine-tunes the demo model on them through the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.openai.conftest import EXAMPLES, SUPERVISED, Server, Stack, wait_for

Tenant = tuple[openai.OpenAI, httpx.Client]
OPENAI_FILES = ("openai_tools.jsonl", "openai_functions.jsonl", "openai_content_parts.jsonl")


def upload(sdk: openai.OpenAI, name: str, data: bytes | None = None) -> Any:
    body = data if data is not None else (EXAMPLES / name).read_bytes()
    return sdk.files.create(file=(name, body), purpose="fine-tune")


@pytest.mark.parametrize("name", OPENAI_FILES)
def test_openais_published_files_are_processed(tenant: Tenant, name: str) -> None:
    sdk, native = tenant
    created = upload(sdk, name)
    assert (created.status, created.status_details) == ("processed", None)
    assert sdk.files.content(created.id).read() == (EXAMPLES / name).read_bytes()
    report = native.get(f"/datasets/{created.id}").json()["report"]
    assert (report["format"], report["kind"]) == ("chat", "sft")
    assert report["stats"]["with_tools"] == (0 if "content_parts" in name else report["num_examples"])


def rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines()]


def test_each_malformed_tool_row_has_its_code_and_line_and_nothing_is_queued(tenant: Tenant) -> None:
    sdk, native = tenant
    good = rows("openai_tools.jsonl")
    bad_arguments, unknown_tool, unknown_id, bad_schema = (json.loads(json.dumps(good[1])) for _ in range(4))
    bad_arguments["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"location": "Paris"}
    unknown_tool["messages"][1]["tool_calls"][0]["function"]["name"] = "get_time"
    unknown_id["messages"][2]["tool_call_id"] = "call_nobody_made"
    bad_schema["tools"][0]["function"]["parameters"]["properties"]["format"]["enum"] = "celsius"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/danbo.jpg"}}
    with_image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What cheese?"}, image]},
                               {"role": "assistant", "content": "Danbo"}]}  # fmt: skip
    lines = [good[0], bad_arguments, good[2], unknown_tool, unknown_id, bad_schema, with_image, good[3]]
    created = upload(sdk, "bad_tools.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in lines))
    assert created.status == "error"
    details = created.status_details or ""
    expected = [
        (2, "invalid_tool_arguments", "messages[1].tool_calls[0].function.arguments"),
        (4, "unknown_tool", "messages[1].tool_calls[0].function.name"),
        (5, "unknown_tool_call_id", "messages[2].tool_call_id"),
        (6, "invalid_tool_schema", "tools[0].function.parameters.properties.format.enum"),
        (7, "image_url_not_fetched", "messages[0].content[1].image_url.url"),
    ]
    assert details.startswith("invalid file, 5 problem(s): ")
    for line, code, field in expected:
        assert f'line {line}: field "{field}"' in details and f"[{code}]" in details
    report = native.get(f"/datasets/{created.id}").json()["report"]
    assert [(p["line"], p["code"], p["field"]) for p in report["problems"]] == expected

    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(model="tiny", training_file=created.id, method=SUPERVISED)
    assert (e.value.code, e.value.param) == ("dataset_invalid", "training_file")
    assert list(sdk.fine_tuning.jobs.list()) == []


# What the demo template rendered before it rendered tools: ChatML that knows only role and content.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_cannot_render_tools_is_refused_at_admission_naming_the_model(
    tenant: Tenant, server: Server
) -> None:
    from training.demo import TINY, build_demo_model
    from training.model import load_tokenizer

    model = build_demo_model(server.data_dir.parent / "models", name="plain-chat", size=TINY)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = PLAIN_TEMPLATE
    tokenizer.save_pretrained(model)
    sdk, native = tenant
    tools_file = upload(sdk, "openai_tools.jsonl")
    legacy_file = upload(sdk, "openai_functions.jsonl")
    for file in (tools_file, legacy_file):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.fine_tuning.jobs.create(model="plain-chat", training_file=file.id, method=SUPERVISED)
        assert (e.value.code, e.value.param) == ("template_cannot_render_tools", "model")
        assert f"base model 'plain-chat' cannot train on dataset '{file.id}': " in e.value.message
        assert (
            "chat template drops the tool definitions (tools) and the assistant's tool calls"
            in e.value.message
        )
    r = native.post("/jobs", json={"base_model": "plain-chat", "dataset_id": tools_file.id})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "template_cannot_render_tools")
    assert r.json()["error"]["details"]["base_model"] == "plain-chat"
    assert list(sdk.fine_tuning.jobs.list()) == []  # nothing queued
    # The content-part file has no tools: that model trains it.
    parts = upload(sdk, "openai_content_parts.jsonl")
    job = sdk.fine_tuning.jobs.create(model="plain-chat", training_file=parts.id, method=SUPERVISED)
    assert job.status in ("validating_files", "queued")
    sdk.fine_tuning.jobs.cancel(job.id)


@pytest.mark.slow
def test_a_job_fine_tunes_the_demo_model_on_openais_function_calling_rows(stack: Stack) -> None:
    sdk, native, _ = stack.tenant()
    with sdk, native:
        tools_file = upload(sdk, "openai_tools.jsonl")
        assert upload(sdk, "openai_functions.jsonl").status == "processed"
        assert tools_file.status == "processed"
        settings = {"max_steps": 8, "max_seq_len": 768, "lora_r": 8, "lora_dropout": 0.0, "seed": 3}
        settings |= {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "packing": False}
        job = sdk.fine_tuning.jobs.create(
            model="ftune-demo", training_file=tools_file.id, method=SUPERVISED, extra_body=settings
        )
        done = wait_for(sdk, job.id, {"succeeded"}, timeout=600)
        assert done.fine_tuned_model is not None and done.trained_tokens
        native_job = native.get(f"/jobs/{job.id}").json()
        stats = native_job["token_stats"]
        # Every row is rendered whole with its tools (the definitions are most of its tokens), none cut.
        assert (stats["status"], stats["count"], stats["over_max_seq_len"], stats["dropped"]) == (
            "ready",
            22,
            0,
            0,
        )
        assert stats["max"] > 600
        losses = [s["loss"] for s in native.get(f"/jobs/{job.id}/metrics").json()["data"]]
        assert len(losses) == 8 and losses[-1] < losses[0], losses
