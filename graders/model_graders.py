"""score_model and label_model: a judge model reads the templated messages and answers a score or a label.

Like OpenAI, each asks for structured output: {"steps": [{"description", "conclusion"}], "result": ...}
(a number for score_model, one of the labels for label_model). A server that answers plain text still works:
a reply that is a bare number, or exactly one label, is read too. score_model clamps the number into its
range (OpenAI "truncates" it there). What the judge says decides the error: no reply (the endpoint failed,
or no chat is configured) model_grader_server_error, with a summary of why (never the judge's own words:
graders.chat); a refusal model_grader_refusal_error; a reply with no score or label
model_grader_parse_error. All score 0. The operator's bounds on the judge: graders.judge."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from graders.base import GradeContext, Grader, Item, Sample, Scored
from graders.chat import ChatError, ChatReply
from graders.errors import GraderError
from graders.fields import JsonFields, number
from graders.messages import Message, parse_messages
from graders.results import GradeFailure, TokenUsage

# OpenAI's sampling_params for graders, and the chat-completions field each becomes.
SAMPLING_PARAMS = {
    "max_completions_tokens": "max_completion_tokens",
    "reasoning_effort": "reasoning_effort",
    "seed": "seed",
    "temperature": "temperature",
    "top_p": "top_p",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _response_format(name: str, result: dict[str, Any]) -> dict[str, Any]:
    step = {
        "type": "object",
        "properties": {"description": {"type": "string"}, "conclusion": {"type": "string"}},
        "required": ["description", "conclusion"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": step}, "result": result},
        "required": ["steps", "result"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def _ask(
    ctx: GradeContext,
    model: str,
    messages: tuple[Message, ...],
    params: dict[str, Any],
    sample: Sample,
    item: Item,
) -> tuple[ChatReply, dict[str, TokenUsage]]:
    rendered = [message.render(sample, item) for message in messages]
    if ctx.chat is None:
        raise GradeFailure("model_grader_server_error", "no judge model is configured for model graders")
    try:
        reply = ctx.chat(model, rendered, params)
    except ChatError as exc:  # its message is a summary for the tenant (graders.chat)
        raise GradeFailure("model_grader_server_error", str(exc)[:1000]) from exc
    except Exception as exc:  # any other failure to answer: its words may name the operator's setup
        details = f"the judge failed to answer ({type(exc).__name__})"
        raise GradeFailure("model_grader_server_error", details) from exc
    prompt, completion = reply.prompt_tokens, reply.completion_tokens
    usage = {
        model: {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    }
    if reply.refusal:
        raise GradeFailure("model_grader_refusal_error", reply.refusal, usage)
    return reply, usage


def _reply_json(text: str) -> Any:
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    try:
        return json.loads(fenced.group(1) if fenced else stripped)
    except ValueError:
        return None


def read_score(text: str | None) -> float | None:
    """The judge's number: {"result": x} or a bare number; None when there is none."""
    if text is None:
        return None
    reply = _reply_json(text)
    value = reply.get("result") if isinstance(reply, dict) else reply
    if value is None and _NUMBER.fullmatch(text.strip()):
        value = float(text.strip())
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def read_label(text: str | None, labels: tuple[str, ...]) -> str | None:
    """The judge's label: {"result": label} or the reply being just a label (quotes allowed)."""
    if text is None:
        return None
    reply = _reply_json(text)
    value = reply.get("result") if isinstance(reply, dict) else reply
    if not isinstance(value, str):
        value = text.strip().strip("\"'")
    return value if value in labels else None


def _sampling_params(fields: JsonFields) -> dict[str, Any]:
    if not fields.has("sampling_params"):
        return {}
    params = JsonFields(fields.obj["sampling_params"], fields.at("sampling_params"))
    params.only(SAMPLING_PARAMS)
    out: dict[str, Any] = {}
    for key, value in params.obj.items():
        if value is None:
            continue
        if key == "reasoning_effort":
            out[key] = params.choice(key, REASONING_EFFORTS, "invalid_grader")
        elif key in ("max_completions_tokens", "seed"):
            if isinstance(value, bool) or not isinstance(value, int) or (key != "seed" and value < 1):
                raise GraderError(
                    "invalid_grader", f"{params.at(key)} must be a positive integer", params.at(key)
                )
            out[key] = value
        else:
            out[key] = params.number(key)
    return out


@dataclass(frozen=True)
class ScoreModelGrader(Grader):
    type: ClassVar[str] = "score_model"
    concurrent: ClassVar[bool] = True
    name: str
    input: tuple[Message, ...]
    model: str
    range: tuple[float, float] = (0.0, 1.0)
    sampling_params: dict[str, Any] | None = None
    pass_threshold: float | None = None  # evals' field: accepted and echoed, no part in the reward

    @classmethod
    def from_json(cls, fields: JsonFields, default_name: str) -> ScoreModelGrader:
        fields.only(("type", "name", "input", "model", "range", "sampling_params", "pass_threshold"))
        bounds = (0.0, 1.0)
        if fields.has("range"):
            value, param = fields.obj["range"], fields.at("range")
            if not isinstance(value, list) or len(value) != 2:
                raise GraderError("invalid_grader", f"{param} must be two numbers [low, high]", param)
            bounds = (number(value[0], f"{param}.0"), number(value[1], f"{param}.1"))
            if bounds[0] >= bounds[1]:
                raise GraderError("invalid_grader", f"{param}: low must be below high", param)
        return cls(
            name=fields.string("name", default_name),
            input=parse_messages(fields.required("input"), fields.at("input")),
            model=fields.string("model"),
            range=bounds,
            sampling_params=_sampling_params(fields) if fields.has("sampling_params") else None,
            pass_threshold=fields.number("pass_threshold") if fields.has("pass_threshold") else None,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "name": self.name,
            "input": [message.to_json() for message in self.input],
            "model": self.model,
            "range": list(self.range),
        }
        if self.sampling_params is not None:
            out["sampling_params"] = dict(self.sampling_params)
        if self.pass_threshold is not None:
            out["pass_threshold"] = self.pass_threshold
        return out

    def score(self, sample: Sample, item: Item, ctx: GradeContext) -> Scored:
        params = {SAMPLING_PARAMS[k]: v for k, v in (self.sampling_params or {}).items()}
        params["response_format"] = _response_format("score", {"type": "number"})
        reply, usage = _ask(ctx, self.model, self.input, params, sample, item)
        value = read_score(reply.text)
        if value is None:
            raise GradeFailure("model_grader_parse_error", f"no score in {str(reply.text)[:200]!r}", usage)
        low, high = self.range
        return Scored(min(max(value, low), high), {"result": value}, usage)


@dataclass(frozen=True)
class LabelModelGrader(Grader):
    """1 when the judge's label is one of `passing_labels`, else 0. Only inside a multi grader (OpenAI)."""

    type: ClassVar[str] = "label_model"
    concurrent: ClassVar[bool] = True
    name: str
    input: tuple[Message, ...]
    model: str
    labels: tuple[str, ...]
    passing_labels: tuple[str, ...]

    @classmethod
    def from_json(cls, fields: JsonFields, default_name: str) -> LabelModelGrader:
        fields.only(("type", "name", "input", "model", "labels", "passing_labels"))
        labels = _labels(fields, "labels")
        passing = _labels(fields, "passing_labels")
        outside = [label for label in passing if label not in labels]
        if outside:
            param = fields.at("passing_labels")
            raise GraderError("invalid_grader", f"{param}: {outside[0]!r} is not one of labels", param)
        return cls(
            name=fields.string("name", default_name),
            input=parse_messages(fields.required("input"), fields.at("input")),
            model=fields.string("model"),
            labels=labels,
            passing_labels=passing,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": [message.to_json() for message in self.input],
            "model": self.model,
            "labels": list(self.labels),
            "passing_labels": list(self.passing_labels),
        }

    def score(self, sample: Sample, item: Item, ctx: GradeContext) -> Scored:
        params = {"response_format": _response_format("label", {"type": "string", "enum": list(self.labels)})}
        reply, usage = _ask(ctx, self.model, self.input, params, sample, item)
        label = read_label(reply.text, self.labels)
        if label is None:
            raise GradeFailure("model_grader_parse_error", f"no label in {str(reply.text)[:200]!r}", usage)
        return Scored(1.0 if label in self.passing_labels else 0.0, {"label": label}, usage)


def _labels(fields: JsonFields, key: str) -> tuple[str, ...]:
    value, param = fields.required(key), fields.at(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise GraderError("invalid_grader", f"{param} must be a non-empty list of non-empty strings", param)
    if len(set(value)) != len(value):
        raise GraderError("invalid_grader", f"{param} repeats a label", param)
    return tuple(value)
