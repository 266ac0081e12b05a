"""The judge model that score_model and label_model graders ask: an injected callable, so the service can
point it at its own chat completions or at an operator's OpenAI-compatible endpoint.

A judge that fails is told to the tenant as a summary (its HTTP status and a fixed message): its body,
its address and its words go to the log only, since they may name the operator's key, account or hosts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# What a judge's HTTP error status tells the tenant (anything else: by its class, 4xx or 5xx).
STATUS_SUMMARIES = {
    400: "the judge refused the request",
    401: "the judge refused the operator's key",
    403: "the judge refused the operator's key",
    404: "the judge has no such model, or not for this tenant",
    408: "the judge did not answer in time",
    413: "the judge found the request too large",
    429: "the judge is busy or over its rate limit",
    504: "the judge did not answer in time",
}


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
    """The endpoint did not answer with a chat completion; the message is a summary a tenant may read."""


def summary(status: int) -> str:
    """The tenant's words for a judge's HTTP error status."""
    fallback = "the judge failed" if status >= 500 else "the judge refused the request"
    return f"the judge answered HTTP {status}: {STATUS_SUMMARIES.get(status, fallback)}"


class OpenAICompatibleChat:
    """POST {base_url}/chat/completions, as the openai SDK does with the same base_url (".../v1").
    `structured_outputs=False` leaves response_format out, for servers that answer text only (the graders
    read a bare number or label too). `headers` go with every request."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float,
        *,
        structured_outputs: bool = True,
        headers: dict[str, str] | None = None,
    ) -> None:
        import httpx  # here, not at module level: `core` stays quick to import

        sent = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=base_url.rstrip("/") + "/", headers=sent | (headers or {}), timeout=timeout
        )
        self._structured_outputs = structured_outputs
        self._http_error, self._timeout = httpx.HTTPError, httpx.TimeoutException

    def __call__(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any]) -> ChatReply:
        body = {"model": model, "messages": messages, **params}
        if not self._structured_outputs:
            body.pop("response_format", None)
        try:
            response = self._client.post("chat/completions", json=body)
        except self._http_error as exc:
            log.warning("judge at %s: %r", self._client.base_url, exc)
            if isinstance(exc, self._timeout):
                raise ChatError("the judge did not answer in time") from exc
            raise ChatError(f"the judge could not be reached ({type(exc).__name__})") from exc
        if response.status_code != 200:
            log.warning(
                "judge at %s answered %s: %s",
                self._client.base_url,
                response.status_code,
                response.text[:500],
            )
            raise ChatError(summary(response.status_code))
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
            log.warning(
                "judge at %s answered no chat completion: %s", self._client.base_url, response.text[:500]
            )
            raise ChatError("the judge's answer is not a chat completion") from exc

    def close(self) -> None:
        self._client.close()


def openai_compatible_chat(
    base_url: str, api_key: str | None, timeout: float, *, structured_outputs: bool = True
) -> OpenAICompatibleChat:
    """A ChatFn for an OpenAI-compatible server (OpenAI, vLLM, ftune's own /v1); close() when done."""
    return OpenAICompatibleChat(base_url, api_key, timeout, structured_outputs=structured_outputs)
