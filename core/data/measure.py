"""Measuring a dataset's token statistics: `python -m training.token_stats` as a subprocess, with a timeout.

Run by the CPU worker for every new job (worker/token_stats.py) and by admission for a job whose worst
case does not fit (models.admission: its data's real lengths may). The caller never imports training or
torch; paths are resolved from ids by the caller, never taken from users.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.data.token_stats import TokenStats, failed
from core.process import child_env

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how soon a shutdown or the timeout kills a running computation


@dataclass(frozen=True)
class StatsRequest:
    """Everything the computation needs, resolved from ids (the job's row, or a job being admitted)."""

    job_id: str  # for the log: the job's id, or "admission"
    model_dir: Path
    dataset_path: Path
    column_mapping: dict[str, str] | None
    spec_json: str


# Returns the value to store ({"status": "ready", ...} or core.data.token_stats.failed(...)), or None when
# stopped by a shutdown (nothing is stored: the job stays "pending" for training's start to fill).
Compute = Callable[[StatsRequest, threading.Event], dict[str, Any] | None]


def subprocess_compute(timeout_seconds: float) -> Compute:
    """The real computation: `python -m training.token_stats` with a timeout."""

    def compute(request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        cmd = [
            sys.executable, "-m", "training.token_stats",
            "--model-dir", str(request.model_dir),
            "--dataset", str(request.dataset_path),
            "--spec", request.spec_json,
            "--column-mapping", json.dumps(request.column_mapping),
        ]  # fmt: skip
        # No preexec_fn (not fork-safe in a threaded worker): the child ties itself to this process.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
        )
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                out, err = proc.communicate(timeout=POLL_SECONDS)  # retrying loses no output
                break
            except subprocess.TimeoutExpired:
                if stop.is_set() or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    if stop.is_set():
                        return None
                    return failed(
                        "timeout",
                        f"token statistics took longer than {timeout_seconds:g} s; "
                        "they are filled when training starts",
                    )
        return parse_output(request.job_id, proc.returncode, out, err)

    return compute


def parse_output(job_id: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The stored value for the process's answer: its last stdout line is one JSON object."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        err = answer["error"]
        log.warning("job %s: token statistics failed: %s\n%s", job_id, err, stderr[-4000:])
        return failed(str(err.get("code", "token_stats_error")), str(err.get("message", "")))
    if returncode == 0 and isinstance(answer, dict):
        try:
            value = TokenStats.model_validate({**answer, "status": "ready", "source": "job_created"})
            return value.model_dump(mode="json", exclude_none=True)
        except ValidationError:
            log.exception("job %s: token statistics answer of an unexpected shape: %s", job_id, answer)
    else:
        log.warning("job %s: token statistics exited with %d\n%s", job_id, returncode, stderr[-4000:])
    return failed("token_stats_error", f"token statistics exited with code {returncode}; see the worker log")
