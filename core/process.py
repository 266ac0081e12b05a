"""Children that stop when the worker process that started them ends, set up by the child itself.

The worker starts training (and token statistics) from a thread of a threaded Celery worker. A
preexec_fn there is not fork-safe, and PR_SET_PDEATHSIG, whether asked for in a preexec_fn or by the
child, fires when the forking *thread* ends rather than the process, and reaches only a direct child
(not torchrun's ranks). So the worker names itself in FTUNE_WORKER_PID (child_env) and the child
watches that process (stop_with_worker): once it has ended, the child sends itself SIGTERM, on which
training checkpoints and stops as on a cancel.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Mapping

WORKER_PID_ENV = "FTUNE_WORKER_PID"
POLL_SECONDS = 0.5  # only where pidfd_open is missing (not Linux)


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child that should stop when this process ends."""
    return {**(os.environ if base is None else base), **extra, WORKER_PID_ENV: str(os.getpid())}


def stop_with_worker(sig: int = signal.SIGTERM) -> bool:
    """Call first thing in a child: `sig` reaches this process once the worker named in FTUNE_WORKER_PID
    has ended (at once if it has already). False, and nothing watched, when started by hand."""
    raw = os.environ.get(WORKER_PID_ENV, "")
    if not raw.isdigit():
        return False
    pid = int(raw)
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)  # readable once the process has ended; immune to pid reuse after this
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return True
    except (AttributeError, OSError):
        fd = None
    watcher = threading.Thread(target=_watch, args=(pid, fd, sig), name="stop-with-worker", daemon=True)
    watcher.start()
    return True


def _watch(pid: int, fd: int | None, sig: int) -> None:
    if fd is not None:
        select.select([fd], [], [])
    else:
        while alive(pid):
            time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), sig)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (an unreaped zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:  # an unreaped zombie has ended
        return f.read().rsplit(") ", 1)[1][:1] != "Z"
    return True
