"""Streaming uploads: the body goes to a temp file and through the validator chunk by chunk.

Nothing is buffered whole, and an upload over the limit is refused (413) as soon as it crosses it,
so the disk never holds more than the limit. Accepts multipart/form-data (curl -F file=@data.jsonl)
or a raw body (curl --data-binary @data.jsonl -H 'content-type: application/x-ndjson').
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from core.errors import InvalidInput, PayloadTooLarge, RequestTimeout

FILE_FIELD = "file"
DEFAULT_FILENAME = "upload.jsonl"
# Everything in a multipart body but the file (other fields, part headers), all parts together: without
# a total, a chunked body of many named fields would grow in memory with no end.
MAX_FORM_FIELD_BYTES = 64 * 1024
MIN_BYTES_PER_SECOND = 1024  # averaged over the whole upload, once it is older than the idle timeout
RAW_TYPES = {
    "application/x-ndjson",
    "application/jsonl",
    "application/json-lines",
    "application/octet-stream",
    "text/plain",
    "application/json",
}


def upload_doc(
    fields: dict[str, dict[str, Any]], required: list[str], other_content: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The OpenAPI request body of an upload route (its openapi_extra; the route reads the body itself):
    a multipart form of the file and `fields`, and any `other_content` types it also takes."""
    form = {"type": "object", "properties": {FILE_FIELD: {"type": "string", "format": "binary"}, **fields}}
    content = {"multipart/form-data": {"schema": {**form, "required": required}}, **(other_content or {})}
    return {"requestBody": {"content": content, "required": True}}


@dataclass
class Upload:
    filename: str = DEFAULT_FILENAME
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)


class FileSink:
    """Writes file bytes to `path` and hands them to `feed`, refusing to go past `max_bytes`."""

    def __init__(self, path: Path, feed: Callable[[bytes], None], max_bytes: int) -> None:
        self.f = path.open("wb")
        self.feed = feed
        self.max_bytes = max_bytes
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise PayloadTooLarge(
                f"upload exceeds the limit of {self.max_bytes} bytes",
                param=FILE_FIELD,
                details={"max_bytes": self.max_bytes},
            )
        self.f.write(data)
        self.feed(data)

    def close(self) -> None:
        self.f.close()


async def _chunks(request: Request, idle_timeout: float) -> AsyncIterator[bytes]:
    """The body's chunks. Dropped (408): a client that sends nothing for idle_timeout seconds, and one
    that, past idle_timeout, averages under MIN_BYTES_PER_SECOND (a drip-feed would hold a slot forever).
    The average is over the time spent waiting for the client: not the time its chunks took to check (a
    row's image URLs may be fetched then), during which its bytes wait in the socket's buffers."""
    stream = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    elapsed, received = 0.0, 0
    while True:
        start = loop.time()
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_timeout)
        except StopAsyncIteration:
            return
        except TimeoutError as e:
            raise RequestTimeout(f"upload stalled: no data for {idle_timeout:g} s", param=FILE_FIELD) from e
        received += len(chunk)
        elapsed += loop.time() - start
        if elapsed > idle_timeout and received < elapsed * MIN_BYTES_PER_SECOND:
            raise RequestTimeout(f"upload too slow: {received} bytes in {elapsed:.0f} s", param=FILE_FIELD)
        yield chunk


async def receive(request: Request, sink: FileSink, idle_timeout: float = 60) -> Upload:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > sink.max_bytes + MAX_FORM_FIELD_BYTES:
        raise PayloadTooLarge(
            f"upload of {length} bytes exceeds the limit of {sink.max_bytes} bytes",
            param=FILE_FIELD,
            details={"max_bytes": sink.max_bytes},
        )
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    ctype_s = ctype.decode().lower()
    if ctype_s == "multipart/form-data":
        return await _receive_multipart(request, sink, params.get(b"boundary"), idle_timeout)
    if ctype_s in RAW_TYPES or not ctype_s:
        upload = Upload(filename=clean_filename(request.query_params.get("filename")))
        async for chunk in _chunks(request, idle_timeout):
            await run_in_threadpool(sink.write, chunk)
        upload.size = sink.size
        return upload
    raise InvalidInput(
        f"unsupported content type {ctype_s!r}: send multipart/form-data with a 'file' field "
        "or a raw application/x-ndjson body",
        code="unsupported_media_type",
    )


class _FormParts:
    """The multipart parser's callbacks: the file part's bytes go to `pending` (written off the event loop
    by the caller), the other fields to `upload.fields`, and every byte that is not the file is counted
    against MAX_FORM_FIELD_BYTES."""

    def __init__(self, boundary: bytes, upload: Upload) -> None:
        self.upload = upload
        self.part: dict[str, Any] = {}
        self.pending: list[bytes] = []  # file bytes parsed from the current chunk
        self.saw_file = False
        self.overhead = 0  # bytes of part headers and non-file fields so far
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self.part_begin,
                "on_header_field": self.header_field,
                "on_header_value": self.header_value,
                "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished,
                "on_part_data": self.part_data,
                "on_part_end": self.part_end,
            },
        )

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data

    def count(self, n: int) -> None:
        self.overhead += n
        if self.overhead > MAX_FORM_FIELD_BYTES:
            raise PayloadTooLarge(
                f"the form fields and part headers exceed {MAX_FORM_FIELD_BYTES} bytes",
                param=self.part.get("name") or None,
                details={"max_form_bytes": MAX_FORM_FIELD_BYTES},
            )

    def part_begin(self) -> None:
        self.part.clear()
        self.part.update(headers={}, field=b"", value=b"", data=[])

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.count(end - start)
        self.part["field"] += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.count(end - start)
        self.part["value"] += data[start:end]

    def header_end(self) -> None:
        self.part["headers"][self.part["field"].lower()] = self.part["value"]
        self.part["field"], self.part["value"] = b"", b""

    def headers_finished(self) -> None:
        _, opts = parse_options_header(self.part["headers"].get(b"content-disposition", b""))
        self.part["name"] = opts.get(b"name", b"").decode(errors="replace")
        self.part["is_file"] = self.part["name"] == FILE_FIELD
        if self.part["is_file"]:
            self.saw_file = True
            if opts.get(b"filename"):
                self.upload.filename = clean_filename(opts[b"filename"].decode(errors="replace"))

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.get("is_file"):
            self.pending.append(data[start:end])
            return
        self.count(end - start)
        self.part["data"].append(data[start:end])

    def part_end(self) -> None:
        if not self.part.get("is_file") and self.part.get("name"):
            self.upload.fields[self.part["name"]] = b"".join(self.part["data"]).decode(errors="replace")


async def _receive_multipart(
    request: Request, sink: FileSink, boundary: bytes | None, idle_timeout: float
) -> Upload:
    if not boundary:
        raise InvalidInput("multipart upload without a boundary", code="invalid_multipart")
    upload = Upload()
    form = _FormParts(boundary, upload)
    try:
        async for chunk in _chunks(request, idle_timeout):
            form.parser.write(chunk)
            if form.pending:
                await run_in_threadpool(sink.write, form.take_pending())
        form.parser.finalize()
    except MultipartParseError as e:  # a broken body is the client's error, not a 500
        raise InvalidInput(f"malformed multipart body: {e}", code="invalid_multipart") from e
    if form.pending:
        await run_in_threadpool(sink.write, form.take_pending())
    if not form.saw_file:
        raise InvalidInput(
            "multipart upload has no 'file' field (use curl -F file=@data.jsonl)",
            param=FILE_FIELD,
            code="missing_file",
        )
    upload.size = sink.size
    return upload


def clean_filename(raw: str | None) -> str:
    """The client's file name, kept as a label only (paths come from ids): its last component,
    printable characters, at most 255; "..", "." or nothing become the default name."""
    name = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()[:255]
    return DEFAULT_FILENAME if name in ("", ".", "..") else name


def parse_column_mapping(raw: str | None) -> dict[str, str] | None:
    if not raw:
        return None
    try:
        mapping = json.loads(raw)
    except ValueError as e:
        raise InvalidInput("column_mapping must be a JSON object", param="column_mapping") from e
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise InvalidInput("column_mapping must map strings to strings", param="column_mapping")
    return mapping
