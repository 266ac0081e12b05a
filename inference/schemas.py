"""Request bodies of the engine's endpoints: OpenAI's chat completion request and vLLM's adapter calls.

Fields OpenAI defines that the engine does not act on (e.g. `user`, `metadata`) are accepted and ignored,
as OpenAI-compatible servers do; the ones that would change the answer and are not supported
(tools, logprobs, penalties other than 0, response_format other than text) are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.chat_limits import MAX_N, MAX_STOP_CHARS, MAX_STOPS
from core.data.examples import Message
from inference.errors import invalid
from training.decoding.sampling import Sampling


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    "only text content parts are supported",
                    f"messages[{index}].content",
                    "unsupported_content",
                )
            parts.append(part["text"])
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
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
    # refused unless left at OpenAI's default (the engine does not implement them)
    tools: list[Any] | None = None
    logprobs: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None

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
        if self.tools:
            raise invalid("tools are not supported by this engine", "tools", "unsupported_parameter")
        if self.logprobs:
            raise invalid("logprobs are not supported by this engine", "logprobs", "unsupported_parameter")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise invalid(f"{name} is not supported by this engine", name, "unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise invalid(
                "only response_format type text is supported", "response_format", "unsupported_parameter"
            )

    def chat_messages(self) -> list[Message]:
        role: dict[str, Any] = {"developer": "system"}
        return [
            Message(role=role.get(m.role, m.role), content=m.text(i)) for i, m in enumerate(self.messages)
        ]

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
