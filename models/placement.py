"""Placement: which workers a job can run on (its plan re-made on each worker's devices), and why a job
that no live worker can run is waiting, or a multi-node job that too few of them have room for now.

A job fits a worker when the worker has enough devices for num_gpus, bf16 if the job asks for it on a
GPU, and the plan on the worker's smallest device (its RAM on a CPU worker) fits. A job whose model or
architecture cannot be read is not held back here: the worker claims it and fails it with a clear error.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.arch import Architecture, load_architecture
from core.catalog import Catalog
from core.errors import FtuneError
from core.queues import class_queue
from core.spec import JobSpec
from core.states import JobStatus
from models import nodes as nodes_db
from models import workers as workers_db
from models.tables import Job, JobEvent, Worker
from models.transitions import add_event
from planner import BatchShape, Plan
from planner.feasibility import plan_on, worker_device

GiB = 2**30
WAITING = "waiting"  # the event kind that records a job's waiting reason when it changes
MAX_VERDICTS = 10_000  # a long-lived Placer forgets them all past this (they are cheap to make again)


@dataclass(frozen=True)
class Verdict:
    fits: bool
    plan: Plan | None  # the plan on that worker's device; None when it could not be made
    why: str = ""  # when it does not fit
    need_bytes: int | None = None  # device memory the plan needs: its total plus the driver's reserve


def devices_key(devices: list[dict[str, Any]]) -> str:
    return class_queue(devices)


class Placer:
    """Plans jobs on devices, caching architectures and verdicts (a job's spec never changes)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._arch: dict[str, Architecture | None] = {}
        self._verdicts: dict[tuple[str, str, bool], Verdict] = {}

    def _architecture(self, base_model: str) -> Architecture | None:
        if base_model not in self._arch:
            try:
                self._arch[base_model] = load_architecture(self.catalog.get(base_model).path)
            except (FtuneError, OSError, ValueError):
                self._arch[base_model] = None
        return self._arch[base_model]

    def verdict(self, job: Job, devices: list[dict[str, Any]]) -> Verdict:
        """The job planned on `devices`: from its data's largest micro-batch once its token statistics
        are ready, else for the worst case (every micro-batch max_seq_len tokens)."""
        shape = BatchShape.from_token_stats(job.token_stats)
        key = (job.id, devices_key(devices), shape is not None)
        if key not in self._verdicts:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = self._judge(JobSpec.model_validate(job.spec), devices, shape)
        return self._verdicts[key]

    def fits(self, job: Job, devices: list[dict[str, Any]]) -> bool:
        return self.verdict(job, devices).fits

    def _judge(self, spec: JobSpec, devices: list[dict[str, Any]], shape: BatchShape | None) -> Verdict:
        try:
            gpu = worker_device(devices, spec.num_gpus)
        except FtuneError:  # a declared device the planner does not know
            return Verdict(False, None, "unknown device")
        if gpu is None:
            return Verdict(False, None, f"needs {spec.num_gpus} devices, has {len(devices)}")
        if spec.mixed_precision == "bf16" and gpu.kind != "cpu" and not gpu.bf16_supported:
            return Verdict(False, None, f"needs bf16, {gpu.name} has none")
        arch = self._architecture(spec.base_model)
        if arch is None:
            return Verdict(True, None)
        try:
            plan = plan_on(spec, arch, gpu, shape=shape)
        except FtuneError as e:
            return Verdict(True, None, e.message)
        need = plan.total_bytes + gpu.reserve_bytes
        why = "" if plan.fits else f"needs {need / GiB:.1f} GiB per device"
        return Verdict(plan.fits, plan, why, need)


def alive_workers(session: Session) -> list[Worker]:
    return [w for w in workers_db.fleet(session) if workers_db.is_alive(w)]


def fitting_workers(placer: Placer, job: Job, workers: list[Worker]) -> list[Worker]:
    return [w for w in workers if placer.fits(job, w.devices)]


def waiting_reason(placer: Placer, job: Job, fleet: list[Worker], *, free: Collection[str]) -> str | None:
    """Why a queued job cannot start now, or None when it can: no live worker can run it, or (a job of
    num_nodes nodes, placed on that many workers at once) fewer than num_nodes of those that can have
    room now. `free`: the workers with room (models.nodes.with_room)."""
    alive = [w for w in fleet if workers_db.is_alive(w)]
    fit = fitting_workers(placer, job, alive)
    if fit:
        return _gang_reason(placer, job, fit, free)
    spec = JobSpec.model_validate(job.spec)
    needs = [v.need_bytes for w in fleet if (v := placer.verdict(job, w.devices)).need_bytes]
    per_device = f">= {min(needs) / GiB:.1f} GiB per device" if needs else ""
    devices = f"{spec.num_gpus} devices" if spec.num_gpus > 1 else ""
    want = " and ".join(x for x in (devices, per_device) if x) or "its devices"
    down = len(fitting_workers(placer, job, fleet))
    note = f"; {down} that fit not alive" if down else ""
    return f"waiting for a worker with {want}, 0 alive of {len(alive)}{note}"


def _gang_reason(placer: Placer, job: Job, fit: list[Worker], free: Collection[str]) -> str | None:
    """A multi-node job's reason, given the live workers it fits: how many of them have room now and
    what is missing. None for a one-node job, or when enough have room."""
    want = nodes_db.num_nodes(job)
    room = sum(1 for w in fit if w.id in free)
    if want == 1 or room >= want:
        return None
    gpus = JobSpec.model_validate(job.spec).num_gpus
    needs = [v.need_bytes for w in fit if (v := placer.verdict(job, w.devices)).need_bytes]
    size = f" of >= {min(needs) / GiB:.1f} GiB" if needs else ""
    each = f"{gpus} device{'s' if gpus > 1 else ''}{size}"
    busy = len(fit) - room
    reason = f"needs {want} workers with {each} each, at once; {room} {_has(room)} room now"
    reason += f", {busy} {'is' if busy == 1 else 'are'} busy" if busy else ""
    if len(fit) < want:
        reason += f"; {want - len(fit)} more must join the fleet ({len(fit)} alive fit)"
    return reason


def _has(n: int) -> str:
    return "has" if n == 1 else "have"


def note_waiting(session: Session, job: Job, reason: str | None) -> bool:
    """Record a waiting reason as an event when it differs from the last one recorded. True if added."""
    if reason is None or job.status != JobStatus.QUEUED:
        return False
    last = session.scalar(
        select(JobEvent.message)
        .where(JobEvent.job_id == job.id, JobEvent.kind.in_((WAITING, "started")))
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    if last == reason:
        return False
    add_event(session, job_id=job.id, kind=WAITING, message=reason, data={"level": "warning"})
    return True
