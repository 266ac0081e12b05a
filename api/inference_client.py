"""ftune's client of the inference engine: an OpenAI-compatible server at FTUNE_INFERENCE_URL.

The engine is ftune's own (`python -m inference.server`, started by `ftune up`) or a vLLM server run with
`--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: one contract, one forwarding path
(docs/inference.md). ftune registers an adapter with `POST /v1/load_lora_adapter` before the first
request that names it, remembers what it registered, and registers again when the engine answers 404 for
it (the engine restarted and forgot). Everything is async: a slow generation never holds the event loop.
With FTUNE_INFERENCE_API_KEY set, every request carries `Authorization: Bearer <key>` (ftune's engine and
vLLM's --api-key want it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx

# A refused or unroutable engine is known quickly; a generation may take long (the engine has its own
# timeout and answers 504 engine_timeout; this read timeout only catches a hung engine).
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Adapter:
    name: str  # the `ft:` name: the engine's lora_name, and the `model` of chat requests
    path: Path  # Storage.adapter_dir(job id): from the id, never from the caller
    base_model: str


def auth_headers(api_key: str) -> dict[str, str]:
    """The engine's key as its requests carry it (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class EngineError(Exception):
    """The engine refused a request (any status >= 400); its answer is passed on to the caller."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"engine answered {response.status_code}")
        self.response = response


class InferenceClient:
    def __init__(
        self, base_url: str, api_key: str = "", transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            transport=transport,
            headers=auth_headers(api_key),
        )
        self._loaded: dict[str, Path] = {}  # lora_name -> the path registered under it
        self._lock = asyncio.Lock()  # one registration at a time: loading is rare and the engine serial

    def forget(self, name: str) -> None:
        self._loaded.pop(name, None)

    async def ensure_adapter(self, adapter: Adapter) -> None:
        """Register the adapter with the engine unless this client already did (idempotent on the engine)."""
        if self._loaded.get(adapter.name) == adapter.path:
            return
        async with self._lock:
            if self._loaded.get(adapter.name) == adapter.path:
                return
            body = {
                "lora_name": adapter.name,
                "lora_path": str(adapter.path),
                "base_model": adapter.base_model,
            }
            r = await self._http.post("/v1/load_lora_adapter", json=body)
            # vLLM refuses a second load of a name with 400 "... has already been loaded": it is there.
            if r.status_code >= 400 and not (r.status_code == 400 and "already been loaded" in r.text):
                raise EngineError(r)
            self._loaded[adapter.name] = adapter.path

    async def open_chat(self, body: bytes) -> httpx.Response:
        """POST a chat body (the API's re-serialised request); the answer is open for streaming (the caller
        closes it: closing it early drops the connection, which stops the engine's generation)."""
        request = self._http.build_request(
            "POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        return await self._http.send(request, stream=True)

    async def aclose(self) -> None:
        await self._http.aclose()
