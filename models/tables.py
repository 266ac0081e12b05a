"""ORM tables. The schema is created and changed only by Alembic (migrations/)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """Stored hashed; the key itself is shown once at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))  # valid | invalid
    format: Mapped[str | None] = mapped_column(String(32))
    num_examples: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(200))
    method: Mapped[str] = mapped_column(String(16))

    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # When the job's message was last handed to the broker; the reaper re-sends stale ones.
    enqueued_at: Mapped[datetime | None]

    # Claiming: a worker moves queued -> running by compare-and-set; attempt fences stale workers.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(default=False)

    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    # Progress relayed from training's metrics.jsonl.
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    eta_seconds: Mapped[float | None] = mapped_column(Float)
    peak_mem_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # The job's files in its tenant's storage quota (planner.job_files, models.job_files): the allowance
    # reserved at admission, counted while the job is not finished; what its directory holds once it is.
    files_allowance_bytes: Mapped[int | None] = mapped_column(BigInteger)
    files_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # core.data.token_stats.TokenStats as JSON: {"status": "pending" | "ready" | "failed", ...}.
    token_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Set for jobs made through /v1/fine_tuning/jobs: OpenAI's suffix and metadata pairs, and the request's
    # hyperparameters and method as resolved (api/openai/hyperparameters.py). Attribute names differ from
    # the columns' because `metadata` is taken on a declarative class.
    suffix: Mapped[str | None] = mapped_column(String(64))
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    openai: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # DELETE /jobs/{id} of a finished job: its files are gone, the record stays for audits and the dashboard.
    deleted_at: Mapped[datetime | None]

    events: Mapped[list[JobEvent]] = relationship(back_populates="job", order_by="JobEvent.id")
    artifacts: Mapped[list[Artifact]] = relationship(back_populates="job", order_by="Artifact.id")


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="events")


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (Index("ix_artifacts_job_id_kind", "job_id", "kind"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))  # adapter | checkpoint
    # Relative to the job directory; built by the server from known names, never from user input.
    relpath: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artifacts")


class Worker(Base):
    """A worker process and the devices it reports; the planner admits jobs against this fleet."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(200))
    # [{"name": "A100-80GB", "memory_bytes": ..., "kind": "cuda" | "cpu"}, ...]
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    current_job_id: Mapped[str | None] = mapped_column(String(64))
    stopped: Mapped[bool] = mapped_column(default=False)


class NodeLease(Base):
    """One node of a running multi-node job (spec num_nodes): the worker that runs it, placed with all the
    job's other nodes in one transaction (models.nodes). The primary key is the worker: a worker holds
    one node at a time, so two jobs can never both hold it."""

    __tablename__ = "node_leases"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)  # 0: the worker that claimed the job (and owns its lease)
    endpoint: Mapped[str] = mapped_column(String(300))  # host:port of rank 0's c10d rendezvous store
    lease_until: Mapped[datetime]


class IdempotencyKey(Base):
    """A client's Idempotency-Key: the first request's outcome is replayed for the same key and body."""

    __tablename__ = "idempotency_keys"

    scope: Mapped[str] = mapped_column(String(100), primary_key=True)  # e.g. "POST /jobs"
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # in_flight | done
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Webhook(Base):
    """A tenant's endpoint for signed job events (Standard Webhooks). The secret signs, so it is stored:
    sealed (core.secretbox, `enc1:...`; a row from before 0004 holds a plain `whsec_...`). After a rotation
    the previous secret signs too, until `previous_secret_expires_at`. A deleted endpoint keeps its row (its
    events and their deliveries refer to it) with its secrets cleared, and gets no more events."""

    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    previous_secret: Mapped[str | None] = mapped_column(String(100))
    previous_secret_expires_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]


class WebhookEvent(Base):
    """The outbox: one row per event and endpoint, written in the transaction that finished the job, so no
    event is lost; delivered (or given up on) by the workers."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the webhook-id header, the same per retry
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Due at; while an attempt is in flight, the time after which another worker may take it over.
    next_attempt_at: Mapped[datetime | None] = mapped_column(index=True)
    delivered_at: Mapped[datetime | None]
    gave_up_at: Mapped[datetime | None]


class WebhookDelivery(Base):
    """One delivery attempt of an event: when, and what the receiver answered (or why it did not)."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
