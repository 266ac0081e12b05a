"""`ftune up`'s supervision of its children (cli.supervisor) on real processes: a killed child is back
within a second; one that always crashes is restarted with a doubling backoff, then given up on, logged."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from cli import supervisor
from cli.supervisor import CRASH_LIMIT, Child


def _spawn(code: str) -> supervisor.Spawn:
    return lambda: subprocess.Popen([sys.executable, "-c", code])


def test_a_killed_child_is_started_again_within_a_second() -> None:
    child = Child("worker", _spawn("import time; time.sleep(60)"))
    assert child.proc is not None
    first = child.proc.pid
    child.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while child.proc is None or child.proc.pid == first:
        child.check()
        assert time.monotonic() - killed < 5, "not restarted"
        time.sleep(0.05)
    assert time.monotonic() - killed < 1.5 and child.restarts == 1 and child.proc.poll() is None
    child.proc.kill()
    child.proc.wait()


def test_a_crash_loop_backs_off_and_is_given_up_on(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    child = Child("api", _spawn("raise SystemExit(3)"), clock=lambda: now[0], essential=True)
    delays = []
    while not child.given_up:
        assert child.proc is not None
        child.proc.wait()
        child.check()  # notices the exit
        if child.given_up:
            break
        assert child.restart_at is not None
        delays.append(child.restart_at - now[0])
        now[0] = child.restart_at - 0.01
        child.check()
        assert child.proc is None  # not before its backoff
        now[0] = child.restart_at
        child.check()
    assert delays == [0.5, 1.0, 2.0, 4.0][: CRASH_LIMIT - 1]
    assert child.restarts == CRASH_LIMIT - 1
    err = capsys.readouterr().err
    assert f"api exited with code 3, {CRASH_LIMIT} times within 60 s: crash loop, not restarting it" in err
    now[0] += 3600
    child.check()
    assert child.proc is None  # stays given up


def test_crashes_far_apart_are_not_a_loop() -> None:
    now = [0.0]
    child = Child("worker", _spawn("raise SystemExit(1)"), clock=lambda: now[0])
    for _ in range(CRASH_LIMIT + 2):
        assert child.proc is not None
        child.proc.wait()
        child.check()
        assert not child.given_up and child.restart_at == now[0] + 0.5  # first crash of a new window
        now[0] += 61
        child.check()
    assert child.restarts == CRASH_LIMIT + 2
    assert child.proc is not None
    child.proc.wait()
