"""The two ends of an import: the source's OpenAI-compatible API and ftune's /v1, both through the official
`openai` SDK. Keys come from the environment (or, for a local ftune, the admin key file `ftune up` keeps)
and are never written anywhere."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import openai

from cli.openai_import.options import Options
from core.settings import Settings


class SetupError(Exception):
    """The import cannot start (a key missing, a bad flag): said to the user, exit status 2."""


@dataclass(frozen=True)
class Endpoints:
    source: openai.OpenAI
    dest: openai.OpenAI
    source_url: str
    dest_url: str
    # The source's address, hashed: with a source id it names the create in ftune (idempotency_key).
    fingerprint: str

    @property
    def dest_root(self) -> str:
        """ftune's own routes (POST /plan) sit beside /v1."""
        url = self.dest_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def idempotency_key(self, kind: str, source_id: str) -> dict[str, str]:
        """The header that makes copying `source_id` happen once in ftune, whatever ran before."""
        return {"Idempotency-Key": f"ftune-import:{self.fingerprint}:{kind}:{source_id}"}

    def reason(self, e: openai.APIError) -> str:
        """An API's refusal in a line, naming the side that refused and its code."""
        body = e.body if isinstance(e.body, dict) else {}
        message = body.get("message") or e.message
        code = body.get("code") or e.code
        url = str(e.request.url) if e.request is not None else ""
        side = "ftune" if url.startswith(self.dest_root + "/") else "the source"
        status = getattr(e, "status_code", None)
        said = f"{side} answered {status}" if status else f"{side} could not be reached"
        return f"{said} ({code}): {message}" if code else f"{said}: {message}"

    def close(self) -> None:
        self.source.close()
        self.dest.close()


def _dest_url(options: Options, settings: Settings) -> str:
    if options.to_base_url:
        return options.to_base_url.rstrip("/")
    host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::", "") else settings.api_host
    return f"http://{host}:{settings.api_port}/v1"


def _dest_key(options: Options, settings: Settings) -> str:
    if key := os.environ.get(options.to_key_env, "").strip():
        return key
    from cli.up import LOCAL_KEY_FILE

    path = settings.data_dir / LOCAL_KEY_FILE
    if path.is_file() and (key := path.read_text().strip()):
        return key
    raise SetupError(f"no ftune API key: set {options.to_key_env} (or run `ftune up`, which makes {path})")


def fingerprint(base_url: str) -> str:
    return hashlib.sha256(base_url.rstrip("/").lower().encode()).hexdigest()[:16]


def connect(options: Options, settings: Settings) -> Endpoints:
    source_key = os.environ.get(options.from_key_env, "").strip()
    if not source_key:
        raise SetupError(f"no source API key: set {options.from_key_env} (or name another: --from-key-env)")
    source_url = options.from_base_url.rstrip("/")
    dest_url = _dest_url(options, settings)
    if fingerprint(source_url) == fingerprint(dest_url):
        raise SetupError(f"the source and the destination are the same API ({dest_url})")
    return Endpoints(
        source=openai.OpenAI(api_key=source_key, base_url=source_url),
        dest=openai.OpenAI(api_key=_dest_key(options, settings), base_url=dest_url),
        source_url=source_url,
        dest_url=dest_url,
        fingerprint=fingerprint(source_url),
    )
