"""The engine's HTTP surface, shaped like vLLM's OpenAI server (`vllm serve --enable-lora`).

  python -m inference.server --host 127.0.0.1 --port 8001 [--max-adapters 8] [--max-waiting 32]
                             [--timeout-seconds 120] [--generation-seconds 120] [--memory-bytes N]
                             [--adapter-root DIR] [--max-batch-tokens 2048] [--max-running 32]
                             [--sequential] [--insecure-no-key]

GET /health, GET /v1/models, POST /v1/chat/completions (OpenAI's shapes, SSE when stream), and vLLM's
POST /v1/load_lora_adapter {"lora_name", "lora_path", "base_model"?} and /v1/unload_lora_adapter
{"lora_name"} (200 with a plain-text line, as vLLM answers). Errors are OpenAI's error object.
Base models come from the catalog (FTUNE_MODELS_DIR, FTUNE_HF_CACHE_DIR), as everywhere in ftune.

With FTUNE_INFERENCE_API_KEY set (as vLLM's --api-key), every route but GET /health wants
`Authorization: Bearer <key>` (401 otherwise). Without it the engine refuses to start, unless told
--insecure-no-key, and then only on a loopback host. A request generates for at most --generation-seconds
(FTUNE_INFERENCE_GENERATION_SECONDS) of wall clock, all its choices together; the text so far is the answer,
finish_reason "length" (what OpenAI clients know as cut short). A client that goes away, streaming or
not, stops its generation at the next token.

Requests decode together (continuous batching, inference.batcher): a request joins the running batch at
the next step, rows of different adapters share it, and each leaves as soon as it ends. The batch's KV
cache is bounded by --max-batch-tokens (FTUNE_INFERENCE_MAX_BATCH_TOKENS) and --max-running rows
(FTUNE_INFERENCE_MAX_RUNNING); beyond them requests wait in the line. --sequential runs one request at a
time, each alone start to end, as the engine did before batching (a baseline for bench/inference.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from core.catalog import Catalog
from core.errors import FtuneError, status_for
from inference.batcher import Batcher, Chat
from inference.engine import Engine, seed_everything
from inference.errors import EngineError
from inference.scheduler import DONE, Scheduler, Ticket
from inference.schemas import ChatRequest, LoadAdapter, UnloadAdapter
from inference.tool_calls import Call, CallReader, ToolFormat
from training.decoding.engine import Completion

log = logging.getLogger("ftune.inference")


class RequireKey:
    """Every HTTP route but GET /health wants `Authorization: Bearer <key>`; 401 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._allowed(scope):
            error = EngineError(401, "invalid_api_key", "a valid Authorization: Bearer key is required")
            refusal = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its body is read: the next message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    engine: Engine,
    *,
    max_waiting: int = 32,
    timeout_seconds: float = 120.0,
    generation_seconds: float = 120.0,
    api_key: str = "",
    sequential: bool = False,
) -> FastAPI:
    executor = None if sequential else Batcher(engine)
    one_by_one = partial(_one_by_one, generation_seconds=generation_seconds)
    scheduler = Scheduler(max_waiting=max_waiting, timeout_seconds=timeout_seconds, executor=executor)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()

    app = FastAPI(title="ftune inference engine", lifespan=lifespan)
    app.state.engine, app.state.scheduler = engine, scheduler
    if api_key:
        app.add_middleware(RequireKey, key=api_key)

    _answer_errors(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    _model_routes(app, engine)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        body.refuse_unsupported()
        target = engine.resolve(body.model)
        sampling, shape = body.sampling(), body.shape()
        messages = body.image_messages() if engine.reads_images(target) else body.chat_messages()
        if sequential:
            ticket = scheduler.submit(one_by_one(engine, body, Chat(target, messages, sampling, shape=shape)))
        else:
            ticket = scheduler.submit(
                Chat(target, messages, sampling, body.n, body.seed, generation_seconds, shape)
            )
        return await answered(request, body, ticket, scheduler)

    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object: the engine's own, a domain error, a body that does not parse."""

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, e: EngineError) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(FtuneError)
    async def _ftune_error(_: Request, e: FtuneError) -> JSONResponse:
        status = status_for(e, "engine")
        return JSONResponse(EngineError(status, e.code, e.message, param=e.param).body(), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(EngineError(400, "invalid_value", message, param=param).body(), status_code=400)


def _model_routes(app: FastAPI, engine: Engine) -> None:
    """GET /v1/models, and vLLM's adapter registration."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": now,
                "owned_by": "ftune",
                "root": m.name,
                "parent": None,
            }
            for m in engine.base_models()
        ]
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": now,
                "owned_by": "ftune",
                "root": a.name,  # never the adapter's path on this machine
                "parent": a.base,
            }
            for a in engine.adapters()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapter) -> PlainTextResponse:
        engine.register(body.lora_name, body.lora_path, body.base_model)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapter) -> PlainTextResponse:
        engine.unregister(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _one_by_one(
    engine: Engine, body: ChatRequest, chat: Chat, generation_seconds: float
) -> Callable[[Ticket], None]:
    """A request's work in the sequential engine (--sequential): its choices one after another, each
    decoded alone; all of them within the generation deadline."""

    def work(ticket: Ticket) -> None:
        deadline = time.monotonic() + generation_seconds  # for all the request's choices together
        prepared = engine.start(chat.target, chat.messages, chat.sampling, chat.shape)
        ticket.emit(("ready", len(prepared.prompt), prepared.tool_format))
        if body.seed is not None:
            seed_everything(body.seed)
        for i in range(body.n):

            def delta(text: str, i: int = i) -> None:
                ticket.emit(("delta", i, text))

            if time.monotonic() < deadline:
                done = engine.generate(prepared, delta, ticket.cancelled, deadline)
            else:
                done = Completion()  # no time left for this choice: empty, cut short ("length")
            ticket.emit(("finish", i, done))
            if ticket.cancelled.is_set():
                return
        if time.monotonic() >= deadline:
            log.warning(
                "a request for %s was cut at its %g s generation deadline", body.model, generation_seconds
            )

    return work


async def answered(request: Request, body: ChatRequest, ticket: Ticket, scheduler: Scheduler) -> Response:
    """The ticket's answer (JSON, or a stream), or 499 when the client goes away before it is ready: then
    the request leaves the line, or its generation stops at the next token."""

    async def answer() -> Response:
        await scheduler.wait_start(ticket)
        _, prompt_tokens, tool_format = await _next(ticket)
        reply = Reply(body, prompt_tokens, tool_format)
        if not body.stream:
            return JSONResponse(await reply.collect(ticket))
        return StreamingResponse(  # a client gone mid-stream: Reply.stream withdraws the ticket
            reply.stream(ticket, scheduler),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    answering, gone = asyncio.ensure_future(answer()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answering, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        dropped = not answering.done()
        if dropped:
            answering.cancel()  # takes effect when the task next runs: it is not done yet
            scheduler.withdraw(ticket)
    if dropped:
        await asyncio.gather(answering, return_exceptions=True)  # its end, whatever it is, is moot
        log.info("a client of %s went away before its answer; generation stopped", body.model)
        return Response(status_code=499)  # nobody reads it
    try:
        return answering.result()
    except BaseException:
        scheduler.withdraw(ticket)
        raise


async def _next(ticket: Ticket) -> tuple:
    """The next event of a ticket; an error event is raised (before a stream starts: as its HTTP status)."""
    event = await ticket.events.get()
    if event is DONE:
        raise EngineError(500, "engine_error", "the engine ended the request without an answer")
    if event[0] == "error":
        raise event[1]
    return event


class Reply:
    """The completion's OpenAI shapes, from the ticket's events (deltas and finishes per choice). With
    tools, each choice's text is read for calls (inference.tool_calls): content and `tool_calls`, finish
    "tool_calls"; a stream sends each call whole once it has closed."""

    def __init__(self, body: ChatRequest, prompt_tokens: int, tool_format: ToolFormat | None = None) -> None:
        self.body = body
        self.prompt_tokens = prompt_tokens
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.readers = {i: CallReader(tool_format.template) for i in range(body.n)} if tool_format else {}
        self.calls: dict[int, list[Call]] = {i: [] for i in range(body.n)}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def pieces(self, i: int, text: str | None) -> list[tuple[str, Any]]:
        """A choice's new text (None: its end) as ("content", text) and ("call", Call) pieces."""
        reader = self.readers.get(i)
        if reader is None:
            return [("content", text)] if text else []
        out = reader.feed(text) if text is not None else reader.finish()
        self.calls[i] += [call for kind, call in out if kind == "call"]
        return out

    def finish_reason(self, i: int, done: Completion) -> str:
        return "tool_calls" if self.calls[i] and done.finish_reason == "stop" else done.finish_reason

    async def collect(self, ticket: Ticket) -> dict[str, Any]:
        choices: dict[int, dict[str, Any]] = {}
        texts: dict[int, str] = {}
        tokens = 0
        while (event := await ticket.events.get()) is not DONE:
            if event[0] == "error":
                raise event[1]
            if event[0] == "delta":
                texts[event[1]] = texts.get(event[1], "") + event[2]
            if event[0] == "finish":
                i, done = event[1], event[2]
                tokens += done.tokens
                choices[i] = {
                    "index": i,
                    "message": self.message(i, done.text),
                    "logprobs": None,
                    "finish_reason": self.finish_reason(i, done),
                }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.body.model,
            "choices": [choices[i] for i in sorted(choices)],
            "usage": self.usage(tokens),
        }

    def message(self, i: int, text: str) -> dict[str, Any]:
        if i not in self.readers:
            return {"role": "assistant", "content": text}
        pieces = self.pieces(i, text) + self.pieces(i, None)
        content = "".join(p for kind, p in pieces if kind == "content").strip()
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if self.calls[i]:
            message["tool_calls"] = [call.openai() for call in self.calls[i]]
        return message

    async def stream(self, ticket: Ticket, scheduler: Scheduler) -> AsyncIterator[str]:
        with_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        tokens, sent = 0, False
        try:
            for i in range(self.body.n):
                yield self._chunk(with_usage, i, {"role": "assistant", "content": ""})
            while (event := await ticket.events.get()) is not DONE:
                if event[0] == "delta":
                    for delta in self._deltas(event[1], event[2]):
                        yield self._chunk(with_usage, event[1], delta)
                elif event[0] == "finish":
                    tokens += event[2].tokens
                    for delta in self._deltas(event[1], None):
                        yield self._chunk(with_usage, event[1], delta)
                    yield self._chunk(with_usage, event[1], {}, self.finish_reason(event[1], event[2]))
                elif event[0] == "error":
                    yield f"data: {json.dumps(event[1].body())}\n\n"
            if with_usage:
                yield self._data({**self._head(), "choices": [], "usage": self.usage(tokens)})
            yield "data: [DONE]\n\n"
            sent = True
        finally:
            scheduler.withdraw(ticket)  # a client that went away stops generation at the next token
            if not sent:
                log.info("a client of %s went away mid-stream; generation stopped", self.body.model)

    def _deltas(self, i: int, text: str | None) -> list[dict[str, Any]]:
        """A choice's new text (None: its end) as stream deltas: content, or one whole tool call."""
        before = len(self.calls.get(i, ()))
        out = []
        for kind, piece in self.pieces(i, text):
            if kind == "content":
                out.append({"content": piece})
            else:
                out.append({"tool_calls": [piece.openai(index=before)]})
                before += 1
        return out

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body.model,
        }

    def _chunk(self, with_usage: bool, index: int, delta: dict, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
        if with_usage:
            chunk["usage"] = None
        return self._data(chunk)

    @staticmethod
    def _data(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-adapters", type=int, default=8, help="LoRA adapters resident per base model")
    p.add_argument("--max-waiting", type=int, default=32, help="requests waiting beyond it get 429")
    p.add_argument("--timeout-seconds", type=float, default=120.0, help="a wait longer than this gets 504")
    p.add_argument(
        "--generation-seconds",
        type=float,
        default=None,
        help="a request generates for at most this long (default FTUNE_INFERENCE_GENERATION_SECONDS)",
    )
    p.add_argument("--memory-bytes", type=int, default=None, help="bound on base + adapters + buffers")
    p.add_argument("--adapter-root", type=Path, default=None, help="accept lora_path only under this dir")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="KV cache bound of the running batch: rows x their longest prompt + max_tokens "
        "(default FTUNE_INFERENCE_MAX_BATCH_TOKENS)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="rows (choices) decoding together at most (default FTUNE_INFERENCE_MAX_RUNNING)",
    )
    p.add_argument(
        "--sequential", action="store_true", help="one request at a time, start to end (no batching)"
    )
    p.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="serve without FTUNE_INFERENCE_API_KEY: anyone who reaches the port may use it (loopback only)",
    )
    return p.parse_args(argv)


def refusal(host: str, api_key: str, insecure_no_key: bool) -> str | None:
    """Why the engine must not start with this host and key (None: it may). Without a key it serves
    anyone who reaches it: only when told so, and only on a loopback host."""
    if api_key:
        return None
    if not insecure_no_key:
        return (
            "FTUNE_INFERENCE_API_KEY is not set, so the engine would serve anyone who reaches it. Set it to "
            "a long random string (the API and the workers send the same), or pass --insecure-no-key to "
            "serve without one on a loopback host."
        )
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return (
            f"--insecure-no-key serves only on a loopback host (127.0.0.1, ::1), not on {host}: "
            "set FTUNE_INFERENCE_API_KEY to serve on other addresses."
        )
    return None


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from core.settings import Settings

    args = parse_args(argv)
    settings = Settings()
    if why := refusal(args.host, settings.inference_api_key, args.insecure_no_key):
        print(f"error: {why}", file=sys.stderr)
        raise SystemExit(2)
    # ftune's lines (a dropped client, a cut generation) beside uvicorn's (`ftune inference` set them up)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(
        Catalog(settings.models_dir, settings.hf_cache_dir),
        max_adapters=args.max_adapters,
        memory_bytes=args.memory_bytes,
        adapter_root=args.adapter_root.resolve() if args.adapter_root else None,
        max_batch_tokens=args.max_batch_tokens or settings.inference_max_batch_tokens,
        max_running=args.max_running or settings.inference_max_running,
    )
    app = create_app(
        engine,
        max_waiting=args.max_waiting,
        timeout_seconds=args.timeout_seconds,
        generation_seconds=args.generation_seconds or settings.inference_generation_seconds,
        api_key=settings.inference_api_key,
        sequential=args.sequential,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
