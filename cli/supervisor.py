"""Keeps `ftune up`'s children running: a child that dies is started again after a backoff that doubles
with each crash in a row (0.5 s, 1 s, 2 s ... up to 30 s); one that crashes CRASH_LIMIT times within
CRASH_WINDOW_S is given up on, with a log line saying so, instead of looping forever. A child that has
run for CRASH_WINDOW_S since its last start counts as healthy again.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

CRASH_LIMIT = 5
CRASH_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0

Spawn = Callable[[], subprocess.Popen[bytes]]


class Child:
    def __init__(
        self, name: str, spawn: Spawn, clock: Callable[[], float] = time.monotonic, essential: bool = False
    ) -> None:
        self.name = name
        self.spawn = spawn
        self.clock = clock
        self.essential = essential  # giving up on it stops the whole service (the API)
        self.crashes: deque[float] = deque()
        self.restart_at: float | None = None
        self.given_up = False
        self.proc: subprocess.Popen[bytes] | None = spawn()
        self.restarts = 0

    def backoff(self) -> float:
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(self.crashes) - 1))

    def check(self) -> None:
        """Notice a death (schedule a restart or give up) and restart when the backoff has passed."""
        now = self.clock()
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.proc = None
            while self.crashes and now - self.crashes[0] > CRASH_WINDOW_S:
                self.crashes.popleft()
            self.crashes.append(now)
            if len(self.crashes) >= CRASH_LIMIT:
                self.given_up = True
                _log(
                    f"{self.name} exited with code {code}, {len(self.crashes)} times within "
                    f"{CRASH_WINDOW_S:.0f} s: crash loop, not restarting it"
                )
                return
            self.restart_at = now + self.backoff()
            _log(f"{self.name} exited with code {code}; restarting in {self.backoff():.1f} s")
        if self.proc is None and not self.given_up and self.restart_at is not None and now >= self.restart_at:
            self.proc = self.spawn()
            self.restart_at = None
            self.restarts += 1
            _log(f"{self.name} restarted (pid {self.proc.pid}, restart {self.restarts})")


def _log(message: str) -> None:
    print(f"ftune up: {message}", file=sys.stderr, flush=True)
