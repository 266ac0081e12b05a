"""Hold under a hostile tenant: concurrent creates cannot pass the active-job quota together, measurements
at admission and uploads are bounded (429 with Retry-After), parallel uploads cannot overrun the storage
quota, and the small holes: a deleted init_from job, a dataset deleted during admission, server paths in
job errors. Concurrency by threads on the real database (SQLite, and PostgreSQL when reachable)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

import api.routes.datasets as datasets_routes
import models.submission as submission
import models.token_stats as token_stats
from api.main import create_app
from core.data.token_stats import failed
from core.settings import Settings
from core.states import JobStatus
from models import datasets as datasets_db
from models.admission import Admitted
from models.db import session_scope
from models.tables import Job
from tests.api.conftest import ALPACA, RecordingEnqueuer, RecordingTokenStats, jsonl, new_key

SPEC = {"base_model": "tiny", "method": "lora"}


@pytest.fixture
def make_app(settings: Settings) -> Iterator[Callable[..., FastAPI]]:
    """An app on the test's database with some settings changed."""
    apps: list[FastAPI] = []

    def make(**changes: Any) -> FastAPI:
        app = create_app(
            settings.model_copy(update=changes),
            enqueue=RecordingEnqueuer(),
            token_stats=RecordingTokenStats(),
        )
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.services.engine.dispose()


def _client(app: FastAPI, tenant: str) -> TestClient:
    return TestClient(app, headers=new_key(app, tenant))


def _upload(client: TestClient, body: bytes = ALPACA) -> str:
    r = client.post("/datasets", files={"file": ("a.jsonl", body)})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _in_threads(n: int, call: Callable[[int], httpx.Response]) -> list[httpx.Response]:
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = call(i)
        except BaseException as e:  # reported by the caller's assertions
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(isinstance(r, BaseException) or r is None for r in results), results
    return results


def _wait_for(n: int, at_most: float = 20) -> Callable[[], None]:
    """A hook that lets `n` requests meet (or whichever got there in `at_most` s): the interleaving in
    which every request has passed what comes before the hook before any goes on."""
    barrier = threading.Barrier(n, timeout=at_most)

    def meet() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()

    return meet


# -- (4) job creation: the active-job slot, measurements --------------------------------------------------


def test_concurrent_creates_with_one_active_job_allowed_accept_exactly_one(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(max_active_jobs_per_tenant=1)
    with _client(app, "attacker") as client:
        dataset_id = _upload(client)
        meet = _wait_for(4, at_most=3)
        real_admit = submission.admit

        def slow_admit(*args: Any, **kwargs: Any) -> Admitted:  # e.g. a measurement of 10 s
            meet()
            return real_admit(*args, **kwargs)

        monkeypatch.setattr(submission, "admit", slow_admit)
        results = _in_threads(4, lambda i: client.post("/jobs", json={**SPEC, "dataset_id": dataset_id}))
        statuses = sorted(r.status_code for r in results)
        assert statuses == [202, 429, 429, 429], [r.text for r in results]
        refused = [r for r in results if r.status_code == 429]
        assert {r.json()["error"]["code"] for r in refused} == {"too_many_jobs"}
        assert all(r.headers["Retry-After"] for r in refused)
        assert len(client.get("/jobs").json()["data"]) == 1
        # the slot was turned into the job: nothing held back, nothing freed twice
        r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_jobs"


def test_a_refused_job_gives_its_slot_back(make_app: Callable[..., FastAPI]) -> None:
    app = make_app(max_active_jobs_per_tenant=1)
    with _client(app, "acme") as client:
        dataset_id = _upload(client)
        for _ in range(3):
            r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "base_model": "missing"})
            assert r.status_code == 422, r.text
        assert client.post("/jobs", json={**SPEC, "dataset_id": dataset_id}).status_code == 202


class BlockingMeasurement:
    """Admission that always measures, by a computation that waits to be let go: the measurements that
    are running at once can be counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Event()

        def compute(request: Any, stop: threading.Event) -> dict[str, Any]:
            self.started.release()
            assert self.go.wait(30)
            return failed("token_stats_error", "measured nothing")

        def admit_measuring(session: Any, *, spec: Any, measure: Any, **_: Any) -> Admitted:
            assert measure is not None
            measure(spec)
            return Admitted(None)

        monkeypatch.setattr(token_stats, "subprocess_compute", lambda *a, **k: compute)
        monkeypatch.setattr(submission, "admit", admit_measuring)

    def running(self, n: int) -> None:
        for _ in range(n):
            assert self.started.acquire(timeout=20)


def test_measurements_past_the_bound_are_429_with_retry_after(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(admission_max_concurrent_measurements=2)
    blocking = BlockingMeasurement(monkeypatch)
    with contextlib.ExitStack() as stack:
        clients = {t: stack.enter_context(_client(app, t)) for t in ("acme", "globex", "initech")}
        stack.callback(blocking.go.set)  # never leave a request waiting
        datasets = {t: _upload(c) for t, c in clients.items()}

        def create(tenant: str, path: str = "/jobs") -> httpx.Response:
            if path == "/jobs":
                return clients[tenant].post(path, json={**SPEC, "dataset_id": datasets[tenant]})
            return clients[tenant].post(path, json={"model": "tiny", "training_file": datasets[tenant]})

        first = Started(lambda: create("acme"))
        blocking.running(1)
        again = create("acme")  # one measurement per tenant
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "too_many_measurements"
        assert int(again.headers["Retry-After"]) > 0
        v1 = create("acme", "/v1/fine_tuning/jobs")  # the same refusal in OpenAI's shape
        assert v1.status_code == 429, v1.text
        assert v1.json()["error"]["type"] == "rate_limit_error" and v1.headers["Retry-After"]
        second = Started(lambda: create("globex"))
        blocking.running(1)
        third = create("initech")  # two running, the server's bound
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_measurements"
        blocking.go.set()
        assert [t.result().status_code for t in (first, second)] == [202, 202]
        assert create("initech").status_code == 202  # room again


class Started:
    def __init__(self, call: Callable[[], httpx.Response]) -> None:
        self.value: Any = None
        self.thread = threading.Thread(target=self._run, args=(call,))
        self.thread.start()

    def _run(self, call: Callable[[], httpx.Response]) -> None:
        try:
            self.value = call()
        except BaseException as e:
            self.value = e

    def result(self) -> httpx.Response:
        self.thread.join(60)
        assert self.value is not None and not isinstance(self.value, BaseException), self.value
        return self.value


# -- (5) uploads: the storage quota, uploads at once ----------------------------------------------------

ROWS = jsonl(*({"instruction": f"Say {i} " + "x" * 80, "output": str(i)} for i in range(75)))


def test_parallel_uploads_cannot_overrun_the_storage_quota(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert 8_000 < len(ROWS) < 10_000  # three fit in 30,000 bytes, four do not
    app = make_app(max_stored_bytes_per_tenant=30_000, max_concurrent_uploads_per_tenant=4)
    meet = _wait_for(4)
    real_store = datasets_routes.store_dataset

    def store_together(*args: Any) -> Any:  # every upload has passed its room check before any stores
        meet()
        return real_store(*args)

    monkeypatch.setattr(datasets_routes, "store_dataset", store_together)
    with _client(app, "attacker") as client:
        results = _in_threads(4, lambda i: client.post("/datasets", files={"file": (f"{i}.jsonl", ROWS)}))
        statuses = sorted(r.status_code for r in results)
        assert statuses == [201, 201, 201, 413], [r.text for r in results]
        refused = next(r for r in results if r.status_code == 413)
        assert refused.json()["error"]["code"] == "storage_quota_exceeded"
        services = app.state.services
        with services.sessions() as s:
            rows = datasets_db.list_datasets(s, 50, None, None)[0]
        assert sum(d.size_bytes for d in rows) <= 30_000
        stored = list((services.settings.data_dir / "datasets").glob("*"))
        assert sum(p.stat().st_size for p in stored) <= 30_000  # the refused file is not left on disk


class SlowUploads:
    """Uploads that stream slowly: each waits in the route, holding its place, until `go` (10 s at most)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside = threading.Semaphore(0)
        self.go = threading.Event()
        real = datasets_routes.receive_and_validate

        async def slow(*args: Any) -> Any:
            self.inside.release()
            with anyio.move_on_after(10):
                while not self.go.is_set():
                    await anyio.sleep(0.02)
            return await real(*args)

        monkeypatch.setattr(datasets_routes, "receive_and_validate", slow)  # /v1/files' uploads too

    def start(self, client: TestClient, n: int) -> list[Started]:
        post = lambda: client.post("/datasets", files={"file": ("a.jsonl", ALPACA)})  # noqa: E731
        held = [Started(post) for _ in range(n)]
        for _ in held:
            assert self.inside.acquire(timeout=20)
        return held


def _refused_upload(client: TestClient) -> None:
    third = client.post("/datasets", files={"file": ("c.jsonl", ALPACA)})
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "too_many_uploads" and int(third.headers["Retry-After"]) > 0


def test_uploads_at_once_per_tenant_are_limited(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(max_concurrent_uploads_per_tenant=2)
    uploads = SlowUploads(monkeypatch)
    with _client(app, "attacker") as client, _client(app, "neighbour") as neighbour:
        try:
            held = uploads.start(client, 2)
            _refused_upload(client)
            v1 = client.post("/v1/files", files={"file": ("c.jsonl", ALPACA)}, data={"purpose": "fine-tune"})
            assert v1.status_code == 429 and v1.json()["error"]["type"] == "rate_limit_error", v1.text
            other = uploads.start(neighbour, 1)  # another tenant is not held back
        finally:
            uploads.go.set()
        assert [h.result().status_code for h in (*held, *other)] == [201, 201, 201]
        assert client.post("/datasets", files={"file": ("d.jsonl", ALPACA)}).status_code == 201


def test_a_tenants_bounds_hold_across_api_processes(
    make_app: Callable[..., FastAPI], monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Two API processes (two apps, each its own Services) on one database and one real broker: a tenant's
    uploads at once and its request rate count across both, as a fleet behind a load balancer would."""
    bounds = {"max_concurrent_uploads_per_tenant": 2, "rate_limit_per_minute": 5}
    first, second = (make_app(redis_url=redis_url, **bounds) for _ in "ab")
    uploads = SlowUploads(monkeypatch)
    key = new_key(first, "attacker")
    with TestClient(first, headers=key) as on_first, TestClient(second, headers=key) as on_second:
        try:
            held = uploads.start(on_first, 2)
            _refused_upload(on_second)
        finally:
            uploads.go.set()
        assert [h.result().status_code for h in held] == [201, 201]
        assert on_second.post("/datasets", files={"file": ("d.jsonl", ALPACA)}).status_code == 201
        burst = new_key(first, "burst")
        statuses = [c.get("/datasets", headers=burst).status_code for c in (on_first, on_second) * 3]
        assert statuses == [200] * 5 + [429], statuses  # one bucket of 5 a minute for both


# -- (7) small holes ------------------------------------------------------------------------------------


def test_init_from_a_deleted_job_is_refused_at_submission(client: TestClient, dataset_id: str) -> None:
    job_id = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id}).json()["id"]
    services = client.app.state.services  # type: ignore[attr-defined]
    with session_scope(services.sessions) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.SUCCEEDED))
    assert client.delete(f"/jobs/{job_id}").status_code == 200
    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "init_from": job_id})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "init_from_deleted" and error["param"] == "init_from", error
    assert len(client.get("/jobs").json()["data"]) == 1  # nothing stored, no attempts to burn


def test_a_dataset_deleted_during_admission_is_409_not_500(
    client: TestClient, dataset_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    real_admit = submission.admit

    def admit_then_delete(*args: Any, **kwargs: Any) -> Admitted:
        admitted = real_admit(*args, **kwargs)
        with session_scope(services.sessions) as s:  # its owner deletes it meanwhile
            ds = datasets_db.get_live_dataset(s, dataset_id, kwargs["tenant_id"])
            assert ds is not None and datasets_db.delete_unless_in_use(s, ds) == []
        return admitted

    monkeypatch.setattr(submission, "admit", admit_then_delete)
    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "dataset_deleted_during_admission" and error["param"] == "dataset_id"
    assert client.get("/jobs").json()["data"] == []


def test_a_job_error_is_shown_without_server_paths(client: TestClient, dataset_id: str) -> None:
    from core.storage import atomic_write_text
    from worker.outcome import Outcome

    services = client.app.state.services  # type: ignore[attr-defined]
    job_id = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id}).json()["id"]
    with session_scope(services.sessions) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.RUNNING, attempt=1))
    secret = services.storage.job_dir(job_id) / "adapter" / "adapter_config.json"
    message = f"FileNotFoundError: [Errno 2] No such file or directory: '{secret}'"
    services.storage.job_dir(job_id).mkdir(parents=True, exist_ok=True)
    error = {"code": "invalid_dataset", "message": message}
    atomic_write_text(services.storage.error_path(job_id), json.dumps(error))
    outcome = Outcome(services.settings, services.sessions, services.storage, lambda _: True)
    assert outcome.judge(job_id, 1, 1) == "failed"
    job = client.get(f"/jobs/{job_id}").json()
    shown = job["error"]["message"]
    assert str(services.settings.data_dir) not in shown and "/jobs/" not in shown, shown
    assert shown.endswith(".../adapter_config.json'"), shown  # still says what was missing
    events = client.get(f"/jobs/{job_id}/events").json()["data"]
    assert all(str(services.settings.data_dir) not in e["message"] for e in events)
