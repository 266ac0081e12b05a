"""The webhooks API under a hostile tenant, in-process on a real migrated database: destinations that reach
into ftune's own network refused at registration (each address form), endpoints deleted and their secrets
rotated by their owner only, at most so many a tenant, deliveries read back by their owner only, and secrets
sealed in the database."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import startup
from core.secretbox import SecretBox
from core.settings import Settings
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tables import Webhook, WebhookEvent, utcnow
from tests.rows import succeeded_job

PUBLIC = "http://93.184.215.14/hooks"  # a public address, numeric: nothing to resolve, nothing is sent


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_webhooks_per_tenant": 3, "webhook_timeout_seconds": 0.5})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/hooks",
        "http://[::1]/hooks",
        "http://169.254.169.254/latest/meta-data/",  # the cloud metadata service
        "http://10.0.0.1/hooks",
        "http://192.168.1.10/hooks",
        "http://172.16.0.1/hooks",
        "http://127.0.0.1:8001/v1/chat/completions",  # the inference engine's port
        "http://0x7f000001/hooks",
        "http://2130706433/hooks",
        "http://0177.0.0.1/hooks",
        "http://127.1/hooks",
        "http://localhost:8000/hooks",  # a name that resolves to loopback
        "http://[::ffff:127.0.0.1]/hooks",  # IPv4-mapped IPv6
        "http://[::ffff:a9fe:a9fe]/hooks",  # 169.254.169.254, mapped
        "http://[fe80::1]/hooks",
        "http://[fd00::1]/hooks",
        "http://0.0.0.0/hooks",
        "http://[::]/hooks",
        "http://224.0.0.1/hooks",
        "http://240.0.0.1/hooks",
        "https://100.64.0.1/hooks",  # carrier-grade NAT: not global
    ],
)
def test_destinations_inside_are_refused_at_registration(client: TestClient, url: str) -> None:
    r = client.post("/webhooks", json={"url": url})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("webhook_url_not_allowed", "url")
    assert "not allowed" in error["message"]
    assert client.get("/webhooks").json() == []


def test_a_host_that_does_not_resolve_is_refused(client: TestClient) -> None:
    r = client.post("/webhooks", json={"url": "http://no-such-host.invalid/hooks"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "webhook_url_not_allowed"


def test_the_operator_may_allow_private_destinations(app: FastAPI, client: TestClient) -> None:
    app.state.services.settings = app.state.services.settings.model_copy(
        update={"webhook_allow_private": True}
    )
    r = client.post("/webhooks", json={"url": "http://127.0.0.1:9/hooks"})
    assert r.status_code == 201, r.text


def test_delete_is_for_the_owner_and_stops_events(
    app: FastAPI, client: TestClient, other_client: TestClient
) -> None:
    hook = client.post("/webhooks", json={"url": PUBLIC}).json()
    job_id = _finished_job(app, hook["id"])
    assert other_client.delete(f"/webhooks/{hook['id']}").status_code == 404  # another tenant's: not found

    r = client.delete(f"/webhooks/{hook['id']}")
    assert r.status_code == 204, r.text
    assert client.get("/webhooks").json() == []
    assert client.delete(f"/webhooks/{hook['id']}").status_code == 404
    assert client.post(f"/webhooks/{hook['id']}/rotate-secret").status_code == 404
    with app.state.services.sessions() as s:
        [event] = s.query(WebhookEvent).filter_by(job_id=job_id).all()
        assert event.gave_up_at is not None and event.next_attempt_at is None  # never sent now
        assert webhooks_db.due(s, now=utcnow() + timedelta(days=1)) == []
        raw = s.execute(text("SELECT secret FROM webhooks WHERE id = :id"), {"id": hook["id"]}).scalar()
        assert raw == ""  # its secret is gone


def test_at_most_so_many_endpoints_a_tenant(client: TestClient, other_client: TestClient) -> None:
    ids = [client.post("/webhooks", json={"url": f"{PUBLIC}/{i}"}).json()["id"] for i in range(3)]
    r = client.post("/webhooks", json={"url": PUBLIC})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "webhook_limit_reached"
    assert r.json()["error"]["details"] == {"limit": 3}
    assert other_client.post("/webhooks", json={"url": PUBLIC}).status_code == 201  # per tenant
    assert client.delete(f"/webhooks/{ids[0]}").status_code == 204
    assert client.post("/webhooks", json={"url": PUBLIC}).status_code == 201  # room again


def test_rotation_shows_the_new_secret_once_to_the_owner(
    app: FastAPI, client: TestClient, other_client: TestClient
) -> None:
    created = client.post("/webhooks", json={"url": PUBLIC}).json()
    assert other_client.post(f"/webhooks/{created['id']}/rotate-secret").status_code == 404
    r = client.post(f"/webhooks/{created['id']}/rotate-secret")
    assert r.status_code == 200, r.text
    rotated = r.json()
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != created["secret"]
    grace = rotated["previous_secret_expires_at"]
    assert grace is not None
    [listed] = client.get("/webhooks").json()
    assert "secret" not in listed and listed["previous_secret_expires_at"] == grace
    with app.state.services.sessions() as s:
        box = SecretBox.from_settings(app.state.services.settings)
        target = webhooks_db.target(s, _finished_job_event(app, created["id"]), box=box)
        assert target.secrets == [rotated["secret"], created["secret"]]  # both sign during the grace period


def test_deliveries_are_read_by_their_owner_newest_first(
    app: FastAPI, client: TestClient, other_client: TestClient
) -> None:
    hook = client.post("/webhooks", json={"url": PUBLIC}).json()
    event_id = _finished_job_event(app, hook["id"])
    with session_scope(app.state.services.sessions) as s:
        for attempt, status in ((1, 500), (2, None), (3, 204)):
            assert webhooks_db.claim(
                s, event_id=event_id, attempts=attempt - 1, now=utcnow(), lease_seconds=1
            )
            webhooks_db.record_attempt(
                s,
                event_id=event_id,
                attempt=attempt,
                started_at=utcnow(),
                status_code=status,
                error=None if status else "refused: 10.0.0.1, a private address, is not allowed",
                retry_at=utcnow(),
            )
    url = f"/webhooks/{hook['id']}/deliveries"
    assert other_client.get(url).status_code == 404
    page = client.get(url, params={"limit": 2}).json()
    assert [(d["attempt"], d["status_code"]) for d in page["data"]] == [(3, 204), (2, None)]
    assert page["data"][1]["error"].startswith("refused:") and page["data"][0]["event_id"] == event_id
    assert page["data"][0]["event_type"] == "fine_tuning.job.succeeded" and page["has_more"]
    rest = client.get(url, params={"limit": 2, "after": page["next_cursor"]}).json()
    assert [d["attempt"] for d in rest["data"]] == [1] and not rest["has_more"]
    assert client.get(url, params={"after": "x"}).status_code == 422


def test_secrets_are_not_stored_in_plain_text(app: FastAPI, client: TestClient) -> None:
    created = client.post("/webhooks", json={"url": PUBLIC}).json()
    rotated = client.post(f"/webhooks/{created['id']}/rotate-secret").json()
    with app.state.services.sessions() as s:
        row = s.execute(
            text("SELECT secret, previous_secret FROM webhooks WHERE id = :id"), {"id": created["id"]}
        ).one()
    for raw in row:
        assert raw.startswith("enc1:") and "whsec_" not in raw
    for secret in (created["secret"], rotated["secret"]):
        key = secret.removeprefix("whsec_")
        assert key not in row[0] and key not in row[1]


def test_secrets_stored_in_plain_text_before_are_sealed_when_the_api_starts(
    app: FastAPI, client: TestClient
) -> None:
    """Rows written before secrets were sealed hold a plain whsec_...: the API's start seals them (the same
    secret, as a delivery reads it); a deleted endpoint's cleared secret is left as it is."""
    created = client.post("/webhooks", json={"url": PUBLIC}).json()
    rotated = client.post(f"/webhooks/{created['id']}/rotate-secret").json()
    gone = client.post("/webhooks", json={"url": PUBLIC}).json()
    assert client.delete(f"/webhooks/{gone['id']}").status_code == 204
    services = app.state.services
    query = text("SELECT secret, previous_secret FROM webhooks WHERE id = :id")
    with session_scope(services.sessions) as s:  # as a row from before 0004 holds them
        s.execute(
            text("UPDATE webhooks SET secret = :new, previous_secret = :old WHERE id = :id"),
            {"new": rotated["secret"], "old": created["secret"], "id": created["id"]},
        )
    startup(services)
    box = SecretBox.from_settings(services.settings)
    with services.sessions() as s:
        secret, previous = s.execute(query, {"id": created["id"]}).one()
        assert secret.startswith("enc1:") and previous.startswith("enc1:")
        assert webhooks_db.unseal(box, secret, webhook_id=created["id"]) == rotated["secret"]
        assert webhooks_db.unseal(box, previous, webhook_id=created["id"]) == created["secret"]
        assert tuple(s.execute(query, {"id": gone["id"]}).one()) == ("", None)
    with session_scope(services.sessions) as s:
        assert webhooks_db.seal_plain_secrets(s, lambda: box) == 0  # nothing left to seal


def _finished_job(app: FastAPI, webhook_id: str) -> str:
    """A job of the endpoint's tenant that just succeeded (so its event is in the outbox): its id."""
    with session_scope(app.state.services.sessions) as s:
        hook = s.get(Webhook, webhook_id)
        assert hook is not None
        job_id = succeeded_job(s, hook.tenant_id)
    return job_id


def _finished_job_event(app: FastAPI, webhook_id: str) -> str:
    job_id = _finished_job(app, webhook_id)
    with app.state.services.sessions() as s:
        [event] = s.query(WebhookEvent).filter_by(job_id=job_id, webhook_id=webhook_id).all()
        return event.id


def test_a_host_whose_lookup_hangs_is_refused_at_the_deadline(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant's nameserver never answers (the system resolver replaced by a double that blocks for its
    names): 400 at the lookup's deadline (FTUNE_WEBHOOK_TIMEOUT_SECONDS), the API thread free again."""
    release = threading.Event()

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        release.wait(30)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        start = time.monotonic()
        r = client.post("/webhooks", json={"url": "https://hooks.hang.test/ftune"})
        assert time.monotonic() - start < 2
    finally:
        release.set()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("webhook_url_not_allowed", "url")
    assert error["message"] == "hooks.hang.test did not resolve within 0.5 s"
