"""The judge model that score_model and label_model graders ask: an injected callable, so the service can
point it at its own chat completions or at an operator's OpenAI-compatible endpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatReply:
    """The judge's first choice. `refusal`: the model declined (OpenAI's message.refusal)."""

    text: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refusal: str | None = None
    finish_reason: str | None = None


# chat(model, messages, params) -> ChatReply. `params` are chat-completions request fields (temperature,
# top_p, seed, max_completion_tokens, reasoning_effort, response_format); raise on any failure to answer.
ChatFn = Callable[[str, list[dict[str, Any]], dict[str, Any]], ChatReply]


class ChatError(Exception):
    """The endpoint did not answer with a chat completion (network, HTTP status, body)."""


class OpenAICompatibleChat:
    """POST {base_url}/chat/completions, as the openai SDK does with the same base_url (".../v1").
    `structured_outputs=False` leaves response_format out, for servers that answer text only (the graders
    read a bare number or label too)."""

    def __init__(
        self, base_url: str, api_key: str | None, timeout: float, *, structured_outputs: bool = True
    ) -> None:
        import httpx  # here, not at module level: `core` stays quick to import

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout)
        self._structured_outputs = structured_outputs
        self._http_error = httpx.HTTPError

    def __call__(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any]) -> ChatReply:
        body = {"model": model, "messages": messages, **params}
        if not self._structured_outputs:
            body.pop("response_format", None)
        try:
            response = self._client.post("chat/completions", json=body)
        except self._http_error as exc:
            raise ChatError(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ChatError(f"HTTP {response.status_code}: {response.text[:500]}")
        try:
            completion = response.json()
            choice = completion["choices"][0]
            message = choice["message"]
            usage = completion.get("usage") or {}
            return ChatReply(
                text=message.get("content"),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                refusal=message.get("refusal"),
                finish_reason=choice.get("finish_reason"),
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ChatError(f"not a chat completion: {response.text[:500]}") from exc

    def close(self) -> None:
        self._client.close()


def openai_compatible_chat(
    base_url: str, api_key: str | None, timeout: float, *, structured_outputs: bool = True
) -> OpenAICompatibleChat:
    """A ChatFn for an OpenAI-compatible server (OpenAI, vLLM, ftune's own /v1); close() when done."""
    return OpenAICompatibleChat(base_url, api_key, timeout, structured_outputs=structured_outputs)
