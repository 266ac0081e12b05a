"""Hostile paths in every string a client controls: nothing outside the data dir is read or written.

Paths are derived from ids only, so `../`, absolute, backslashed, URL-encoded and NUL-laden strings
must end as a clean 4xx in the error shape (or, for a file name, which is a label only, be stored
sanitised). A Python audit hook records every file the app opens, lists or changes while it answers.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.settings import Settings
from tests.api.conftest import ALPACA

REPO = Path(__file__).resolve().parents[2]
WATCHED = {"open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.rmdir"}
WATCHED |= {"shutil.rmtree", "os.chmod", "os.symlink", "os.link", "os.truncate", "os.replace"}


class FileWatch:
    """Collects the paths of file events while `on`; the hook itself stays for the process."""

    installed: FileWatch | None = None

    def __init__(self) -> None:
        self.on = False
        self.seen: list[tuple[str, Path]] = []
        self.lock = threading.Lock()

    @classmethod
    def get(cls) -> FileWatch:
        if cls.installed is None:
            cls.installed = FileWatch()
            watch = cls.installed
            sys.addaudithook(lambda event, args: watch.record(event, args))
        return cls.installed

    def record(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.on or event not in WATCHED or not args:
            return
        for arg in args[:2] if event in ("os.rename", "os.replace", "os.symlink", "os.link") else args[:1]:
            if isinstance(arg, (str, bytes, Path)):
                raw = arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)
                with self.lock:
                    self.seen.append((event, Path(raw).absolute()))


@pytest.fixture
def watch() -> Iterator[FileWatch]:
    w = FileWatch.get()
    w.seen.clear()
    yield w
    w.on = False


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid dataset and a model next to (not inside) the data and models dirs: tempting targets."""
    d = tmp_path / "outside"
    (d / "model").mkdir(parents=True)
    (d / "secret.jsonl").write_bytes(ALPACA)
    (d / "model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return d


def payloads(outside: Path) -> list[str]:
    return [
        "../../../../../../etc/passwd",
        "/etc/passwd",
        "..\\..\\..\\windows\\win.ini",
        "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "%252e%252e%252fetc%252fpasswd",
        "..%2f..%2f..%2foutside%2fsecret.jsonl",
        "....//....//etc/passwd",
        "..",
        "~/.ssh/id_rsa",
        "file:///etc/passwd",
        str(outside / "secret.jsonl"),
        str(outside / "model"),
        "../outside/model",
        "../../outside/secret.jsonl",
        "tiny/../../outside/model",
        "a\x00../etc/passwd",
        "0123456789abcdef\x00",
        "\\\\server\\share\\x",
    ]


def _allowed_roots(settings: Settings) -> list[Path]:
    roots = [settings.data_dir, settings.models_dir, Path(sys.prefix), Path(sys.base_prefix), REPO]
    if settings.hf_cache_dir is not None:
        roots.append(settings.hf_cache_dir)
    return [r.resolve() for r in roots]


def _is_error(r: Any, *statuses: int) -> bool:
    if not r.headers.get("content-type", "").startswith("application/json"):
        return False
    body = r.json()
    return r.status_code in statuses and set(body) == {"error"} and set(body["error"]) >= {"code", "message"}


def _requests(p: str, dataset_id: str, job_id: str) -> Iterator[tuple[str, dict[str, Any], tuple[int, ...]]]:
    """(what, request kwargs, statuses allowed) for one payload in every string field the API takes."""
    spec = {"base_model": "tiny", "dataset_id": dataset_id}
    string_fields = ["base_model", "dataset_id", "method", "lr_scheduler", "optimizer"]
    string_fields += ["torch_dtype", "mixed_precision", "attn_implementation"]
    for url in ("/jobs", "/plan"):
        for field in string_fields:
            yield f"{url} {field}", {"method": "post", "url": url, "json": spec | {field: p}}, (422,)
        for modules in ([p], ["q_proj", p], p):
            body = spec | {"lora_target_modules": modules}
            yield f"{url} lora_target_modules", {"method": "post", "url": url, "json": body}, (422,)
        yield f"{url} unknown field", {"method": "post", "url": url, "json": spec | {p: "x"}}, (422,)
    yield "/plan gpu", {"method": "post", "url": "/plan", "json": spec | {"gpu": p}}, (422,)
    mapping_value = json.dumps({"instruction": p})
    mapping_key = json.dumps({p: "instruction"})
    for form in ({"column_mapping": mapping_value}, {"column_mapping": mapping_key}):
        kwargs = {"method": "post", "url": "/datasets", "files": {"file": ("a.jsonl", ALPACA)}, "data": form}
        # A mapping's key is a JSON key name, never a path: it may be accepted.
        yield "/datasets column_mapping", kwargs, (201, 422)
        raw = {"method": "post", "url": "/datasets", "params": form, "content": ALPACA}
        raw["headers"] = {"content-type": "application/x-ndjson"}
        yield "/datasets?column_mapping", raw, (201, 422)
    for name in ("id", "after"):
        for list_url in ("/jobs", "/datasets"):
            if name == "after":
                yield f"{list_url}?after", {"method": "get", "url": list_url, "params": {"after": p}}, (422,)
    yield "/jobs?status", {"method": "get", "url": "/jobs", "params": {"status": p}}, (422,)
    for template in ("/jobs/{}", "/jobs/{}/events", "/jobs/{}/metrics", "/jobs/{}/artifacts"):
        for encoded in (quote(p, safe=""), quote(p, safe="/")):
            yield template, {"method": "get", "url": template.format(encoded)}, (404,)
    for encoded in (quote(p, safe=""), quote(p, safe="/")):
        yield "adapter", {"method": "get", "url": f"/jobs/{encoded}/adapter"}, (404,)
        yield "cancel", {"method": "post", "url": f"/jobs/{encoded}/cancel"}, (404, 405)
        yield "dataset", {"method": "get", "url": f"/datasets/{encoded}"}, (404,)
    # A real job's sub-resources with a traversal after them: the router must not resolve it.
    yield "job/..", {"method": "get", "url": f"/jobs/{job_id}/metrics/{quote(p, safe='')}"}, (404,)


def test_hostile_paths_in_every_string_field(
    client: TestClient, app: FastAPI, settings: Settings, dataset_id: str, outside: Path, watch: FileWatch
) -> None:
    job_id = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()["id"]
    outside_before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    failures = []
    watch.on = True
    try:
        for p in payloads(outside):
            for what, kwargs, statuses in _requests(p, dataset_id, job_id):
                r = client.request(**kwargs)
                if r.request.url.raw_path.decode().split("?")[0] != kwargs["url"]:
                    continue  # the client resolved a literal "/../" itself; the server never saw it
                if r.status_code == 201:
                    continue
                if not _is_error(r, *statuses):
                    failures.append(f"{what} {p!r}: {r.status_code} {r.text[:200]}")
    finally:
        watch.on = False
    assert not failures, "\n".join(failures)
    roots = _allowed_roots(settings)
    strays = {(e, str(path)) for e, path in watch.seen if not any(path.is_relative_to(r) for r in roots)}
    strays = {(e, path) for e, path in strays if not path.startswith(str(Path(settings.database_url[10:])))}
    assert not strays, sorted(strays)[:20]
    assert watch.seen, "the audit hook saw nothing: it is not watching"
    # Nothing outside was touched, and inside the data dir only id-named files exist.
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == outside_before
    for f in settings.data_dir.rglob("*"):
        rel = f.relative_to(settings.data_dir).parts
        assert rel[0] in ("datasets", "jobs", "tmp"), f
        if rel[0] == "datasets" and f.is_file():
            assert len(f.stem) == 32 and f.stem.isalnum() and f.suffix == ".jsonl", f
    assert list((settings.data_dir / "tmp").iterdir()) == []


def test_hostile_file_names_are_labels_only(client: TestClient, settings: Settings, outside: Path) -> None:
    for p in payloads(outside):
        r = client.post("/datasets", files={"file": (p, ALPACA)})
        assert r.status_code == 201, (p, r.text)
        name = r.json()["filename"]
        assert "/" not in name and "\\" not in name and "\x00" not in name and name not in (".", "..")
        stored = settings.data_dir / "datasets" / f"{r.json()['id']}.jsonl"
        assert stored.read_bytes() == ALPACA
        r = client.post(
            "/datasets",
            params={"filename": p},
            content=ALPACA,
            headers={"content-type": "application/x-ndjson"},
        )
        assert r.status_code == 201 and "/" not in r.json()["filename"], (p, r.text)
    assert (outside / "secret.jsonl").read_bytes() == ALPACA
