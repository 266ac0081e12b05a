"""The job state machine: the states and the only transitions allowed between them.

models.transitions.transition() is the one way a job's status changes; it refuses anything not listed
here (a programming error, not a race) and makes every allowed change a compare-and-set.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"  # a pause was asked for; the run checkpoints after its current step and stops
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
# A worker's attempt owns the job (holds a lease, heartbeats, writes its outcome) in these states.
OWNED = frozenset({JobStatus.RUNNING, JobStatus.PAUSING})

_ = JobStatus
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # claimed by a worker; paused before it started; cancelled
    _.QUEUED: frozenset({_.RUNNING, _.PAUSED, _.CANCELLED}),
    # -> queued: a retry after a lost worker, a crash or a worker shutdown (resumes from its checkpoint)
    _.RUNNING: frozenset({_.SUCCEEDED, _.FAILED, _.CANCELLED, _.QUEUED, _.PAUSING}),
    # -> paused: the run stopped at a checkpoint (or its worker was lost); it may still end otherwise first
    _.PAUSING: frozenset({_.PAUSED, _.SUCCEEDED, _.FAILED, _.CANCELLED}),
    # -> queued: resumed, it continues from its checkpoint exactly as after a lost worker
    _.PAUSED: frozenset({_.QUEUED, _.CANCELLED}),
    _.SUCCEEDED: frozenset(),
    _.FAILED: frozenset(),
    _.CANCELLED: frozenset(),
}
del _


class IllegalTransition(Exception):
    """A transition the state machine does not have: a bug in the caller, never a user's error."""

    def __init__(self, src: JobStatus, dst: JobStatus) -> None:
        super().__init__(f"job status cannot go from {src} to {dst}")
        self.src, self.dst = src, dst


def can_transition(src: JobStatus, dst: JobStatus) -> bool:
    return dst in TRANSITIONS[src]


def check_transition(src: JobStatus, dst: JobStatus) -> None:
    if not can_transition(src, dst):
        raise IllegalTransition(src, dst)
