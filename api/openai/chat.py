"""POST /v1/chat/completions: OpenAI's chat completions for base models and the caller's `ft:` models.

ftune checks what is cheap and what only it knows (the key, the caller's right to the model, bounds on
the request), registers a fine-tuned model's adapter with the inference engine (api/inference_client.py),
then forwards the request and passes the engine's answer back as it comes: JSON, or server-sent events for
`stream: true`. What goes to the engine is the request as ftune's schema read it (ChatCompletionRequest:
the fields ftune supports, re-serialised), never the caller's bytes: messages with content parts, tool
calls and tool results, `tools` / `tool_choice` / `parallel_tool_calls` (and the legacy `functions` /
`function_call`) and `response_format`, which the engine checks against the model and enforces
(inference.structured). Where the operator enables image fetching, an image part's http(s) URL is fetched
here and sent on inlined as a data: URL (api/openai/chat_images.py). The engine's errors (404
model_not_found, 429 engine_overloaded with Retry-After, 504 engine_timeout, 400) keep their status and
OpenAI-shaped body; an engine that cannot be reached is 503 inference_unavailable, without its address.
The judge of model graders (its key FTUNE_GRADER_MODEL_API_KEY) asks as the tenant whose grader it judges
(api.auth.get_chat_principal): that tenant's `ft:` models, chat slots and request rate.

Under a hostile tenant: its requests wait their turn in a fair queue (api/chat_queue.py: round robin
between tenants, shares while they compete); past FTUNE_CHAT_MAX_QUEUED_PER_TENANT waiting, 429 with
Retry-After; n x max_tokens at most FTUNE_CHAT_MAX_TOTAL_TOKENS, stop strings
as OpenAI bounds them, vLLM's ignore_eos only with FTUNE_CHAT_ALLOW_IGNORE_EOS; a client that goes away
(streaming or not) closes the engine's request, which stops its generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from api.auth import ChatPrincipalDep
from api.deps import Services, ServicesDep
from api.inference_client import Adapter, EngineError, InferenceClient
from api.openai.chat_images import inline_images, remote_parts
from api.openai.errors import AUTHED, OpenAIErrorResponse, OpenAIRoute, documented, error_response
from api.sse import HeldStream
from core.chat_limits import MAX_N, MAX_STOP_CHARS, MAX_STOPS
from core.checkpoint_adapter import NotServable, peft_view
from core.errors import Conflict, FtuneError, InvalidInput, NotFound, Unavailable
from core.settings import Settings
from models import served
from models.tenants import Principal

log = logging.getLogger(__name__)

ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {
    429: {"model": OpenAIErrorResponse, "description": "Too many chat requests of this organization at once"},
    503: {"model": OpenAIErrorResponse, "description": "No inference engine, or it cannot be reached"},
    504: {"model": OpenAIErrorResponse, "description": "The inference engine did not answer in time"},
}
router = APIRouter(
    tags=["openai: chat"], route_class=OpenAIRoute, responses=documented(*AUTHED, 404) | ENGINE_ERRORS
)

# Bounds checked before anything reaches the engine (which checks the context length itself).
MAX_TOKENS = 32768
MAX_TOOLS = 128  # OpenAI's bound on a request's tools
UNSUPPORTED = ("logprobs", "frequency_penalty", "presence_penalty")  # refused unless at their defaults
PASSED_HEADERS = ("retry-after",)  # of an engine's error answer, e.g. 429's
UNAVAILABLE = "the inference engine is unavailable; try again shortly"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None  # refused by a text-only model (400 unsupported_content)


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | Any = None  # a JSON string; the engine says what else is wrong with it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: str | None = None
    function: Function | None = None


class ChatMessage(BaseModel):
    """A message as OpenAI takes it; the engine checks what is inside (parts, calls, the ids they answer)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Function | None = None  # the legacy form of tool_calls


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class ChatCompletionRequest(BaseModel):
    """The fields ftune supports; the engine gets these as read here (other fields are dropped, as
    OpenAI-compatible servers ignore fields they do not know)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's extension: exactly max_tokens (FTUNE_CHAT_ALLOW_IGNORE_EOS)
    # tools and structured outputs: the engine checks them against the model (inference.structured)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    functions: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's, not implemented: refused unless left at their defaults (check()), never forwarded
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        each = [value] if isinstance(value, str) else list(value or ())
        if len(each) <= MAX_STOPS and all(0 < len(stop) <= MAX_STOP_CHARS for stop in each):
            return value
        raise ValueError(f"up to {MAX_STOPS} non-empty strings of up to {MAX_STOP_CHARS} characters")

    def check(self, settings: Settings) -> None:
        """The operator's bounds, and what ftune does not implement: 400 naming the parameter."""
        for name in UNSUPPORTED:
            if getattr(self, name):
                raise InvalidInput(f"{name} is not supported", code="unsupported_parameter", param=name)
        if self.ignore_eos and not settings.chat_allow_ignore_eos:
            raise InvalidInput(
                "ignore_eos is not allowed on this server", code="invalid_request", param="ignore_eos"
            )
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        tokens, n, cap = getattr(self, field), self.n or 1, settings.chat_max_total_tokens
        if tokens is not None and n * tokens > cap:
            raise InvalidInput(
                f"{field}: n x {field} ({n} x {tokens}) is over this server's limit of {cap} tokens",
                code="invalid_request",
                param=field,
            )

    def forwarded(self) -> bytes:
        """What the engine gets: the supported fields as read, re-serialised."""
        keep = set(type(self).model_fields) - set(UNSUPPORTED)
        body = self.model_dump(include=keep, exclude_unset=True, exclude_none=True)
        return json.dumps(body).encode()


def model_not_found(model: str, why: str = "") -> NotFound:
    return NotFound(
        f"The model `{model}` does not exist or you do not have access to it.{why}",
        code="model_not_found",
        param="model",
    )


def reads_images(services: Services, base_model: str) -> bool:
    """Whether the base model reads images: only then are a request's image URLs fetched (a text-only
    model's engine refuses any image part, 400 unsupported_content, and nothing is fetched for it)."""
    try:
        return "image" in services.catalog.get(base_model).modality
    except FtuneError:  # gone since it was resolved: the engine answers for it
        return False


def resolve(services: Services, model: str, principal: Principal) -> Adapter | None:
    """The adapter a `ft:` name of the caller's tenant serves, or None for a base model in the catalog. A
    checkpoint's model (`...:ckpt-step-<n>`, kept on disk) serves that checkpoint's adapter, laid out as
    PEFT's directory beside the job's files the first time it is asked for (core.checkpoint_adapter)."""
    if not model.startswith("ft:"):
        try:
            services.catalog.get(model)
        except FtuneError:
            raise model_not_found(model) from None
        return None
    storage = services.storage
    with services.sessions() as s:
        found = served.find(s, model, principal.tenant_id, storage)
    final = storage.adapter_dir(found.job_id) if found is not None else None
    if found is None or final is None or not final.is_dir():
        raise model_not_found(model)
    if found.checkpoint is None or found.step is None:
        return Adapter(name=found.name, path=final, base_model=found.base_model)
    try:
        path = peft_view(found.checkpoint, final, storage.checkpoint_adapter_dir(found.job_id, found.step))
    except FileNotFoundError:  # pruned or deleted since it was found
        raise model_not_found(model) from None
    except NotServable as e:
        log.error("checkpoint model %s cannot be served: %s", model, e)
        raise Conflict(
            f"the checkpoint of `{model}` does not match its job's adapter and cannot be served",
            code="checkpoint_not_servable",
            param="model",
        ) from None
    return Adapter(name=found.name, path=path, base_model=found.base_model)


def engine_of(request: Request, services: Services) -> InferenceClient:
    """The app's one client of the engine (its connection pool and the adapters it registered)."""
    client: InferenceClient | None = getattr(request.app.state, "inference", None)
    url, key = services.settings.inference_url, services.settings.inference_api_key
    if not url:
        raise Unavailable(
            "no inference engine is configured: set FTUNE_INFERENCE_URL (ftune up starts one)",
            code="inference_unavailable",
        )
    if client is None or (client.base_url, client.api_key) != (url.rstrip("/"), key):
        client = request.app.state.inference = InferenceClient(url, key)
    return client


def unavailable(engine: InferenceClient, why: object) -> JSONResponse:
    """503 inference_unavailable; the engine's address and the reason go to the log, not to the tenant."""
    log.warning("inference engine at %s: %s", engine.base_url, why)
    return error_response(503, UNAVAILABLE, "inference_unavailable")


def failed(engine: InferenceClient, exc: httpx.HTTPError) -> JSONResponse:
    """504 engine_timeout for an engine that took too long, else 503 inference_unavailable."""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        log.warning("inference engine at %s timed out: %r", engine.base_url, exc)
        return error_response(504, "the inference engine did not answer in time", "engine_timeout")
    return unavailable(engine, repr(exc))


def passed_on(engine: InferenceClient, response: httpx.Response, body: bytes) -> JSONResponse:
    """The engine's error answer with its status; OpenAI's shape when the engine wrote another one. What is
    the engine's business stays in the log: a refused key (401/403) or a failure of its own (500) is 503."""
    if response.status_code in (401, 403) or response.status_code in (500, 502):
        return unavailable(engine, f"answered {response.status_code}: {body[:500]!r}")
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


def not_loaded(engine: InferenceClient, adapter: Adapter, response: httpx.Response) -> JSONResponse:
    """The engine refused to load an adapter: its words name server paths, so they go to the log."""
    if response.status_code >= 500 or response.status_code in (401, 403):
        return unavailable(engine, f"refused {adapter.name}: {response.status_code} {response.text[:500]}")
    log.warning("inference engine refused %s: %s %s", adapter.name, response.status_code, response.text[:500])
    try:
        code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = "adapter_not_loaded"
    message = f"the inference engine could not load the model `{adapter.name}` ({code})"
    return error_response(response.status_code, message, code, "model")


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
        log.warning("inference engine at %s broke a stream: %r", engine.base_url, exc)
        detail = {
            "message": UNAVAILABLE,
            "type": "server_error",
            "param": None,
            "code": "inference_unavailable",
        }
        yield f"\n\ndata: {json.dumps({'error': detail})}\n\ndata: [DONE]\n\n".encode()


async def answer(
    request: Request, body: ChatCompletionRequest, services: Services, principal: Principal
) -> Response:
    """The engine's answer: whole (JSON), or a HeldStream that closes the engine's response at its end."""
    adapter = await run_in_threadpool(resolve, services, body.model, principal)
    base_model = adapter.base_model if adapter else body.model
    remote = remote_parts(body)
    if bool(remote) and await run_in_threadpool(reads_images, services, base_model):
        await run_in_threadpool(inline_images, body, remote, services.settings, principal.tenant_id)
    engine = engine_of(request, services)
    try:
        response = await send(engine, adapter, body.forwarded())
    except EngineError as exc:
        assert adapter is not None  # only registration raises it
        return not_loaded(engine, adapter, exc.response)
    except httpx.HTTPError as exc:
        return failed(engine, exc)
    if response.status_code >= 400:
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return passed_on(engine, response, content)
    if body.stream:
        return HeldStream(
            relay(engine, response),
            response.status_code,
            media_type=response.headers.get("content-type", "text/event-stream"),
            headers={"Cache-Control": "no-cache"},
            finish=response.aclose,  # a client gone mid-stream drops the engine's request too
        )
    try:
        content = await response.aread()
    except httpx.HTTPError as exc:
        return failed(engine, exc)
    finally:
        await response.aclose()  # also when the client went away (cancelled): the engine stops
    return Response(content, response.status_code, media_type=response.headers.get("content-type"))


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/chat/completions")
async def create_chat_completion(
    request: Request, body: ChatCompletionRequest, services: ServicesDep, principal: ChatPrincipalDep
) -> Response:
    """`client.chat.completions.create(model=..., messages=[...])`, with `stream=True` too. The judge of
    model graders asks as the grading tenant (api.auth.get_chat_principal)."""
    body.check(services.settings)
    # Its turn among the tenants' requests (api/chat_queue.py); a client gone while it waits leaves the line.
    release = await services.chats.take(principal.tenant_id, lambda: client_gone(request))
    if release is None:
        log.info("a client of tenant %s went away while its chat request waited", principal.tenant_id)
        return Response(status_code=499)  # nobody reads it
    # Until the engine answers (all of it when not streaming) the client is watched: one that goes away
    # cancels the engine's request (its connection closes), so the engine stops generating for it.
    answering = asyncio.ensure_future(answer(request, body, services, principal))
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({answering, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        release()
        raise
    finally:
        gone.cancel()
        if not answering.done():
            answering.cancel()
    if not answering.done() or answering.cancelled():
        release()
        log.info("a client of tenant %s went away before its chat answer", principal.tenant_id)
        return Response(status_code=499)  # nobody reads it
    try:
        result = answering.result()
    except BaseException:
        release()
        raise
    if not isinstance(result, HeldStream):
        release()
        return result
    close = result.finish

    async def finish() -> None:
        try:
            await close()
        finally:
            release()

    result.finish = finish
    return result
