"""Runs tenants' python graders (`def grade(sample, item) -> float`): untrusted code, in a child process.

One child per batch of calls (a training step pays one interpreter start, not one per sample); it writes
one result line per call as soon as it has it, so a child killed half-way keeps the rewards it produced.
The child's code is graders/sandbox_cage.py, which builds the cage, then execs
graders/sandbox_child.py in it, which runs the grader. Its layers, outermost first:

1. A separate process with nothing inherited: an empty environment (no FTUNE_* secrets, no HF_TOKEN), only
   stdin/stdout/stderr open, a fresh temporary working directory removed afterwards, its own session,
   killed as a group at the wall-clock deadline, and (with namespaces) with the service should that die.
2. Namespaces: a new network namespace (no interfaces: no socket reaches anything, loopback included), a
   new mount namespace whose root is a size-bounded tmpfs holding only /work, /tmp and the system
   directories (/usr, the loader, the interpreter's installation) bound read-only, entered with pivot_root
   and the old root detached (no ftune files, no data dir, no /etc, /proc or /dev), a new PID namespace
   (the grader sees and signals no other process, and all that runs in it dies with its init, a waiter),
   new IPC and UTS namespaces. A root service runs the grader as uid nobody; any other service gets a user
   namespace that maps only its own uid, and the grader keeps no capability after its exec. Where the
   kernel refuses them (Docker's default seccomp profile, so the shipped docker-compose) no grader runs:
   every call fails, python_grader_unavailable and why in its details; and admission refuses python
   graders there first (graders.policy), from `why_unavailable()`, this probe taken once per process.
3. rlimits, hard = soft: CPU seconds, address space (RLIMIT_AS), file size (FSIZE), no core files, and
   NPROC 1: the kernel counts the processes and threads of the grader's uid (in its user namespace, or
   all of nobody's), the grader among them, so it can start none: no `setsid` child outlives the run or
   signals another grader, and the per-process CPU and memory caps bound all that the grader runs.
4. An audit hook installed before the grader's code runs (sys.addaudithook): refuses making sockets,
   spawning (fork, exec, subprocess, posix_spawn, threads), signals, ctypes/cffi and the modules behind
   them, subinterpreters (which would run without the hook), writes and directory changes outside the
   working directory, reads outside it and the interpreter's import path, gc introspection. Common modules
   (math, json, re, statistics, difflib, ...) are imported before the lock; other standard-library imports
   still work (read-only). The hook is a closure that looks up no global name and that no name refers to:
   patching __main__, os, posixpath or builtins changes nothing it does, and changing its own functions is
   refused. It is still NOT a security boundary (CPython can be crashed or tricked from inside, as its
   docs say): it narrows what reaches layers 2-3 and gives graders clear errors.

`SandboxLimits.namespaces` off (tests of the other layers) leaves layers 1, 3 and 4: no boundary, as a
grader past the hook would read what nobody reads (world-readable host files), reach 127.0.0.1 (an
unpassworded Redis, a Postgres) and signal other graders, which is why python graders run only where
namespaces are proven. No cgroup: with NPROC 1 the grader is one process, bounded by its rlimits; a cgroup
would add its kernel memory (the tmpfs scratch is bounded by its size), but needs a delegated cgroup v2
subtree with the memory controller, which neither this machine (hugetlb only) nor Docker's default gives.
Where this was built (Linux 6.18, a container running as root with full capabilities) all four layers
were active, and the user-namespace path ran as uid 65534; tests/core/no_namespaces.py reproduces a
kernel that refuses namespaces with a seccomp filter. tests/graders/test_sandbox_escapes.py: the issue's one
line that switched the old hook off, a `setsid` child and 16 forked children, with and without the hook.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.settings import Settings
from graders.python_grader import PythonOutcome

RUNTIME_ERROR = "python_grader_runtime_error"
SERVER_ERROR = "python_grader_server_error"
UNAVAILABLE = "python_grader_unavailable"  # the code of a grader refused where the sandbox cannot isolate
CAGE_SOURCE = (Path(__file__).parent / "sandbox_cage.py").read_text()  # run first: builds the cage
CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()  # exec'd in it: runs the grader
STDERR_TAIL = 300  # characters of the child's stderr quoted when it died


@dataclass(frozen=True)
class SandboxLimits:
    """Per batch of calls (one child process)."""

    cpu_seconds: int = 10
    memory_bytes: int = 512 * 2**20  # address space: the interpreter itself maps about 30 MiB
    file_size_bytes: int = 16 * 2**20
    wall_seconds: float = 30.0
    max_output_bytes: int = 2**20  # the result lines together; past it the child is killed
    scratch_bytes: int = 64 * 2**20  # the tmpfs root under namespaces (/work and /tmp), in RAM
    # False: no namespaces, the other layers alone (tests of those layers). True, and the kernel refuses
    # them: no grader runs (every call fails, python_grader_unavailable in its details).
    namespaces: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> SandboxLimits:
        return cls(
            cpu_seconds=settings.python_grader_cpu_seconds,
            memory_bytes=settings.python_grader_memory_mb * 2**20,
            wall_seconds=settings.python_grader_timeout_seconds,
        )


@dataclass(frozen=True)
class SandboxInfo:
    """What the child got: isolated means layer 2 (namespaces) is active."""

    isolated: bool
    uid: int
    why: str


class SandboxRunner:
    """graders.python_grader.PythonRunner in a sandboxed child process. Thread-safe: no shared state."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def run(self, source: str, calls: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[PythonOutcome]:
        if not calls:
            return []
        return self._run(source, calls)[0]

    def probe(self) -> SandboxInfo | None:
        """Start one child and report its layers (None: it did not start)."""
        return self._run("def grade(sample, item):\n    return 0\n", [({}, {})])[1]

    def _run(
        self, source: str, calls: list[tuple[dict[str, Any], dict[str, Any]]]
    ) -> tuple[list[PythonOutcome], SandboxInfo | None]:
        limits = self.limits
        payload = json.dumps({"source": source, "calls": calls}, default=str).encode()
        workdir = tempfile.mkdtemp(prefix="ftune-grader-")
        config = {
            "root": workdir,
            "namespaces": limits.namespaces,
            "scratch_bytes": limits.scratch_bytes,
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "file_size_bytes": limits.file_size_bytes,
            "parent": os.getpid(),
        }
        argv = [sys.executable, "-I", "-S", "-c", CAGE_SOURCE, json.dumps(config), CHILD_SOURCE]
        try:
            # No preexec_fn (not fork-safe in a threaded worker): the child limits itself before exec.
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env={}, cwd=workdir, close_fds=True, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:  # out of processes or memory on the host: this batch fails, not the caller
                return _outcomes(b"", len(calls), f"the sandbox did not start: {exc}")
            try:
                out, err, stopped = _exchange(proc, payload, limits)
            finally:
                if (
                    proc.returncode is None
                ):  # stopped, or an error: kill the group while its pid is still ours
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        outcomes, info = _outcomes(out, len(calls), stopped or _death(proc.returncode, err, limits))
        if info is not None and limits.namespaces and not info.isolated:  # the child ran no grader
            outcomes = [PythonOutcome(None, SERVER_ERROR, f"{UNAVAILABLE}: {info.why}")] * len(calls)
        return outcomes, info


def why_unavailable() -> str | None:
    """Why python graders cannot run in this process (None: they can): the sandbox must isolate them in
    namespaces, as the probe shows. Probed once per process, on first need (one child, about 0.1 s); a
    probe whose child did not start is not kept, the next call probes again."""
    try:
        info = _isolation()
    except OSError as exc:
        return str(exc)
    return None if info.isolated else info.why


@functools.cache
def _isolation() -> SandboxInfo:
    info = SandboxRunner().probe()
    if info is None:
        raise OSError("the sandbox's probe did not start")
    return info


def _exchange(
    proc: subprocess.Popen[bytes], payload: bytes, limits: SandboxLimits
) -> tuple[bytes, bytes, str]:
    """Feed stdin, read stdout (bounded) and stderr (its tail) until both close or a limit is hit; then wait
    for the exit within the deadline. Returns (stdout, stderr tail, why stopped; "" when it ended itself)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + limits.wall_seconds
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    sent, stopped = 0, ""
    with sel:
        while sel.get_map() and not stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = f"wall-clock limit of {limits.wall_seconds:g} s reached"
                break
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        sent += os.write(key.fd, payload[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        sent = len(payload)
                    if sent >= len(payload):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is proc.stdout:
                    out += chunk
                    if len(out) > limits.max_output_bytes:
                        stopped = f"output limit of {limits.max_output_bytes} bytes exceeded"
                else:
                    err = (err + chunk)[-4 * STDERR_TAIL :]
    if not stopped:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            stopped = f"wall-clock limit of {limits.wall_seconds:g} s reached"
    return bytes(out), bytes(err), stopped


def _death(returncode: int | None, err: bytes, limits: SandboxLimits) -> str:
    """Why a child that ended by itself left calls unanswered."""
    tail = err.decode(errors="replace")[-STDERR_TAIL:].strip()
    if returncode is not None and returncode < 0:
        if -returncode == signal.SIGXCPU:
            return f"CPU limit of {limits.cpu_seconds} s reached"
        if (
            -returncode == signal.SIGKILL
        ):  # CPU's hard limit (a grader that ignored SIGXCPU) or the OOM killer
            return f"killed (SIGKILL): past the CPU limit of {limits.cpu_seconds} s, or out of host memory"
        return f"killed by signal {signal.Signals(-returncode).name}"
    if "MemoryError" in tail:
        return f"out of memory (limit {limits.memory_bytes} bytes)"
    return f"exited with status {returncode}" + (f": {tail}" if tail else "")


def _outcomes(out: bytes, n: int, why: str) -> tuple[list[PythonOutcome], SandboxInfo | None]:
    """One outcome per call from the child's lines; lines that do not parse are ignored (only the grader's
    own results could be garbled by it), calls without a line failed on the server side."""
    found: dict[int, PythonOutcome] = {}
    info: SandboxInfo | None = None
    for line in out.split(b"\n"):
        try:
            record: Any = json.loads(line)
            if "sandbox" in record:
                box = record["sandbox"]
                info = SandboxInfo(bool(box["isolated"]), int(box["uid"]), str(box["why"]))
                continue
            i = record["i"]
            if not isinstance(i, int) or not 0 <= i < n or i in found:
                continue
            if "reward" in record:
                found[i] = PythonOutcome(reward=float(record["reward"]), error=None, details=None)
            else:
                found[i] = PythonOutcome(reward=None, error=RUNTIME_ERROR, details=str(record["error"]))
        except (ValueError, TypeError, KeyError):
            continue
    lost = PythonOutcome(reward=None, error=SERVER_ERROR, details=why or "the grader process ended early")
    return [found.get(i, lost) for i in range(n)], info
