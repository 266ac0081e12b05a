"""POST /v1/chat/completions: OpenAI's chat completions for base models and the caller's `ft:` models.

ftune checks what is cheap and what only it knows (the key, the caller's right to the model, bounds on
the request), registers a fine-tuned model's adapter with the inference engine (api/inference_client.py),
then forwards the body unchanged and passes the engine's answer back as it comes: JSON, or server-sent
events for `stream: true`. The engine's errors (404 model_not_found, 429 engine_overloaded with
Retry-After, 504 engine_timeout, 400) keep their status and OpenAI-shaped body; an engine that cannot be
reached is 503 inference_unavailable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from api.auth import PrincipalDep
from api.deps import Services, ServicesDep
from api.inference_client import Adapter, EngineError, InferenceClient
from api.openai.errors import AUTHED, OpenAIErrorResponse, OpenAIRoute, documented, error_response
from core import ft_names
from core.errors import FtuneError, NotFound, Unavailable
from models import served
from models.tenants import Principal

log = logging.getLogger(__name__)

ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {
    503: {"model": OpenAIErrorResponse, "description": "No inference engine, or it cannot be reached"},
    504: {"model": OpenAIErrorResponse, "description": "The inference engine did not answer in time"},
}
router = APIRouter(
    tags=["openai: chat"], route_class=OpenAIRoute, responses=documented(*AUTHED, 404) | ENGINE_ERRORS
)

# Bounds checked before anything reaches the engine (which checks the context length itself).
MAX_N = 16
MAX_TOKENS = 32768
PASSED_HEADERS = ("retry-after",)  # of an engine's error answer, e.g. 429's


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... go to the engine as sent

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None


class ChatCompletionRequest(BaseModel):
    """What ftune checks; the engine gets the body as sent, every other field included."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool | None = None


def model_not_found(model: str, why: str = "") -> NotFound:
    return NotFound(
        f"The model `{model}` does not exist or you do not have access to it.{why}",
        code="model_not_found",
        param="model",
    )


def resolve(services: Services, model: str, principal: Principal) -> Adapter | None:
    """The adapter a `ft:` name of the caller's tenant serves, or None for a base model in the catalog."""
    if not model.startswith("ft:"):
        try:
            services.catalog.get(model)
        except FtuneError:
            raise model_not_found(model) from None
        return None
    parsed = ft_names.parse(model)
    if parsed is not None and parsed.step is not None:
        raise model_not_found(
            model, " Checkpoints' models are not served yet; use the job's fine_tuned_model."
        )
    with services.sessions() as s:
        found = served.find(s, model, principal.tenant_id)
    path = services.storage.adapter_dir(found.job_id) if found is not None else None
    if found is None or path is None or not path.is_dir():
        raise model_not_found(model)
    return Adapter(name=found.name, path=path, base_model=found.base_model)


def engine_of(request: Request, services: Services) -> InferenceClient:
    """The app's one client of the engine (its connection pool and the adapters it registered)."""
    client: InferenceClient | None = getattr(request.app.state, "inference", None)
    url = services.settings.inference_url
    if not url:
        raise Unavailable(
            "no inference engine is configured: set FTUNE_INFERENCE_URL (ftune up starts one)",
            code="inference_unavailable",
        )
    if client is None or client.base_url != url.rstrip("/"):
        client = request.app.state.inference = InferenceClient(url)
    return client


def unreachable(engine: InferenceClient, exc: httpx.HTTPError) -> Unavailable:
    log.warning("inference engine at %s: %r", engine.base_url, exc)
    return Unavailable(
        f"the inference engine at {engine.base_url} cannot be reached ({type(exc).__name__}); "
        "try again shortly",
        code="inference_unavailable",
    )


def failed(engine: InferenceClient, exc: httpx.HTTPError) -> JSONResponse:
    """504 engine_timeout for an engine that took too long, else 503 inference_unavailable."""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        log.warning("inference engine at %s timed out: %r", engine.base_url, exc)
        return error_response(504, "the inference engine did not answer in time", "engine_timeout")
    error = unreachable(engine, exc)
    return error_response(503, error.message, error.code)


def passed_on(response: httpx.Response, body: bytes) -> JSONResponse:
    """The engine's error answer with its status; OpenAI's shape when the engine wrote another one."""
    headers = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
    try:
        content = json.loads(body)
    except ValueError:
        content = None
    if isinstance(content, dict) and isinstance(content.get("error"), dict):
        return JSONResponse(content, response.status_code, headers=headers)
    # e.g. an older vLLM's {"object": "error", "message", "type", "code": 404}, or plain text
    message = content.get("message") if isinstance(content, dict) else body.decode(errors="replace")
    code = "model_not_found" if response.status_code == 404 else f"engine_{response.status_code}"
    return error_response(
        response.status_code, str(message or "inference engine error")[:2000], code, None, headers
    )


async def send(engine: InferenceClient, adapter: Adapter | None, body: bytes) -> httpx.Response:
    """The engine's open answer; an adapter the engine forgot (404) is registered again, once."""
    if adapter is not None:
        await engine.ensure_adapter(adapter)
    response = await engine.open_chat(body)
    if response.status_code == 404 and adapter is not None:
        await response.aclose()
        engine.forget(adapter.name)
        await engine.ensure_adapter(adapter)
        response = await engine.open_chat(body)
    return response


async def relay(engine: InferenceClient, response: httpx.Response) -> AsyncIterator[bytes]:
    """The engine's events as they come; a stream cut short ends with an error event and [DONE]."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        error = unreachable(engine, exc)
        detail = {"message": error.message, "type": "server_error", "param": None, "code": error.code}
        yield f"\n\ndata: {json.dumps({'error': detail})}\n\ndata: [DONE]\n\n".encode()


@router.post("/chat/completions")
async def create_chat_completion(
    request: Request, body: ChatCompletionRequest, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """`client.chat.completions.create(model=..., messages=[...])`, with `stream=True` too."""
    adapter = await run_in_threadpool(resolve, services, body.model, principal)
    engine = engine_of(request, services)
    raw = await request.body()
    try:
        response = await send(engine, adapter, raw)
    except EngineError as exc:
        return passed_on(exc.response, exc.response.content)
    except httpx.HTTPError as exc:
        return failed(engine, exc)
    if response.status_code >= 400:
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return passed_on(response, content)
    if body.stream:
        media_type = response.headers.get("content-type", "text/event-stream")
        return StreamingResponse(
            relay(engine, response),
            response.status_code,
            media_type=media_type,
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(response.aclose),
        )
    try:
        content = await response.aread()
    except httpx.HTTPError as exc:
        return failed(engine, exc)
    finally:
        await response.aclose()
    media_type = response.headers.get("content-type", "application/json")
    return Response(content, response.status_code, media_type=media_type)
