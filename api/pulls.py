"""Hub pulls started from the API (POST /models/pull): core.hub.pull in a thread, its progress in memory.

A pull can take minutes, longer than a request should wait, so the request starts it and the dashboard
polls. The record is per API process, on purpose (no table for a rare operator action): a restart forgets
it, and another replica neither lists it nor answers 409 for it; core.hub's file lock still keeps two
pulls of one repo from writing together (the second fails with pull_in_progress), and a pull started again
continues from the files already down.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from core.errors import Conflict, FtuneError, NotFound
from core.hub import DEFAULT_MAX_FILE_BYTES, PulledModel, PullProgress, pull

log = logging.getLogger(__name__)
KEEP_FINISHED = 50  # finished pulls listed; older ones are forgotten

PullFn = Callable[..., PulledModel]


@dataclass
class Pull:
    id: str
    repo: str
    revision: str | None
    started_at: datetime
    progress: PullProgress = field(default_factory=PullProgress)
    state: Literal["running", "succeeded", "failed"] = "running"
    finished_at: datetime | None = None
    result: PulledModel | None = None
    error: FtuneError | None = None


class HubPulls:
    """The pulls of this API process, newest first; at most one running per repo (409 for a second)."""

    def __init__(
        self, models_dir: Path, pull_fn: PullFn = pull, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    ) -> None:
        self.models_dir = models_dir
        self.max_file_bytes = max_file_bytes  # FTUNE_HUB_MAX_FILE_BYTES
        self._pull = pull_fn
        self._lock = threading.Lock()
        self._pulls: dict[str, Pull] = {}  # insertion order: oldest first

    def start(self, repo: str, revision: str | None) -> Pull:
        with self._lock:
            if any(p.repo == repo and p.state == "running" for p in self._pulls.values()):
                raise Conflict(f"{repo} is being pulled already", code="pull_in_progress", param="repo")
            p = Pull(uuid.uuid4().hex, repo, revision, datetime.now(UTC))
            self._pulls[p.id] = p
            self._forget_old()
        threading.Thread(target=self._run, args=(p,), name=f"hub-pull-{p.id[:8]}", daemon=True).start()
        return p

    def get(self, pull_id: str) -> Pull:
        with self._lock:
            if (p := self._pulls.get(pull_id)) is None:
                raise NotFound(f"no pull {pull_id!r} in this API process", code="pull_not_found")
            return p

    def list(self) -> list[Pull]:
        with self._lock:
            return list(reversed(self._pulls.values()))

    def _run(self, p: Pull) -> None:
        def say(line: str) -> None:
            log.info("pull %s: %s", p.repo, line)

        error: FtuneError | None = None
        try:
            p.result = self._pull(
                p.repo,
                self.models_dir,
                revision=p.revision,
                say=say,
                progress=p.progress,
                max_file_bytes=self.max_file_bytes,
            )
        except FtuneError as e:
            log.warning("pull %s failed (%s): %s", p.repo, e.code, e.message)
            error = e
        except Exception:  # a bug, not the Hub: the log has it, the record says so without the trace
            log.exception("pull %s failed", p.repo)
            error = FtuneError("internal error while pulling", code="internal_error")
        # the state last: a reader that sees it finished sees the rest of the record too
        p.error, p.finished_at = error, datetime.now(UTC)
        p.state = "succeeded" if error is None else "failed"

    def _forget_old(self) -> None:
        finished = [i for i, p in self._pulls.items() if p.state != "running"]
        for pull_id in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._pulls[pull_id]
