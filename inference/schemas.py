"""Request bodies of the engine's endpoints: OpenAI's chat completion request and vLLM's adapter calls.

Messages are read as uploads read them (core.data): contents as strings or text parts (image parts only
for a vision-language base, checked as uploads' are; else 400 unsupported_content), an assistant's
`tool_calls` (or legacy `function_call`) with JSON-string arguments, `tool` messages with the
`tool_call_id` they answer, `tools` (or legacy `functions`) with valid JSON-schema parameters; a problem
is a 400 naming the field. Fields OpenAI defines that the engine does not act on (e.g. `user`,
`metadata`) are accepted and ignored, as OpenAI-compatible servers do; the ones that would change the
answer and are not supported (logprobs, penalties other than 0) are refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.chat_limits import MAX_N, MAX_STOP_CHARS, MAX_STOPS
from core.data.conversation import ROLES
from core.data.images import IMAGE_KINDS, count_images
from core.data.messages import Message, row_tools, to_messages
from core.data.parts import content_text
from core.data.problems import LineProblem
from core.data.tools import check_calls, check_tools
from inference.errors import invalid
from inference.structured import Shape
from training.decoding.sampling import Sampling


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension (extra_body): generate exactly max_tokens
    tools: list[Any] | None = None
    functions: list[Any] | None = None  # the legacy form of tools
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None  # the legacy form of tool_choice
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # refused unless left at OpenAI's default (the engine does not implement them)
    logprobs: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes up to {MAX_STOPS} non-empty strings of up to {MAX_STOP_CHARS} characters"
            )
        return v

    def refuse_unsupported(self) -> None:
        if self.logprobs:
            raise invalid("logprobs are not supported by this engine", "logprobs", "unsupported_parameter")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise invalid(f"{name} is not supported by this engine", name, "unsupported_parameter")

    def shape(self) -> Shape:
        """What the answer must be (its tools, how they may be called, its JSON); 400 naming the field."""
        given = {"tools": self.tools, "functions": self.functions}
        try:
            check_tools(given, strict=True)
        except LineProblem as p:
            raise invalid(p.message, p.field, p.code) from None
        tools = [dict(t) for t in row_tools(given) or ()]
        choice = self.tool_choice
        if choice is None and self.function_call is not None:  # the legacy form: "auto", "none", {"name"}
            fc = self.function_call
            choice = {"type": "function", "function": fc} if isinstance(fc, dict) else fc
        return Shape.of(tools, choice, self.parallel_tool_calls, self.response_format)

    def image_messages(self) -> list[dict[str, Any]]:
        """The messages checked for a vision-language base: image parts checked (they decode, within the
        upload's limits) and kept, for its processor (training.vision); 400 naming the field."""
        try:
            count_images(self.messages)
            return [_checked(m, i, images=True) for i, m in enumerate(self.messages)]
        except LineProblem as p:
            raise invalid(p.message, p.field, p.code) from None

    def chat_messages(self) -> list[Message]:
        """The messages as the chat template gets them ("developer" is "system"); 400 naming the field."""
        try:
            return list(to_messages([_checked(m, i) for i, m in enumerate(self.messages)]))
        except LineProblem as p:
            raise invalid(p.message, p.field, p.code) from None
        except StopIteration:  # a legacy `function` message after no function_call of that name
            raise invalid(
                "a function message answers no function_call", "messages", "unknown_tool_call_id"
            ) from None

    def sampling(self) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return Sampling(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(stops),
            ignore_eos=self.ignore_eos,
        )


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model: str | None = None


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


def _checked(m: dict[str, Any], i: int, images: bool = False) -> dict[str, Any]:
    """One message checked as an upload's are, its content as text (`images`: a vision-language base's,
    image parts checked and kept); "developer" becomes "system"."""
    at = f"messages[{i}]"
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ROLES:
        raise LineProblem("invalid_role", f"must be one of developer, {', '.join(ROLES)}", f"{at}.role")
    required = role not in ("assistant", "tool", "function")
    content = m.get("content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", None) and not (images and kind in IMAGE_KINDS):  # never dropped unread
            why = "this model reads text" if kind in IMAGE_KINDS else "ftune's models read text and images"
            raise LineProblem(
                "unsupported_content",
                f"is a {kind!r} part: {why}; send text parts",
                f"{at}.content[{j}]",
            )
    text = content_text(content, f"{at}.content", strict=False, required=required, images=images)
    out = {**m, "role": role, "content": content if images and isinstance(content, list) else text}
    if role == "assistant":
        check_calls(m, at, None, strict=False, any_name=True)
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise LineProblem("missing_field", "is required", f"{at}.tool_call_id")
    if role == "function" and not isinstance(m.get("name"), str):
        raise LineProblem("missing_field", "is required", f"{at}.name")
    return out
