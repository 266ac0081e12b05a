"""This worker's training fork server (training.forkserver): a warm process that forks each single-process
run instead of the worker starting `python -m training.run` afresh, which spends ~5 s of CPU importing
torch, transformers and peft before its first line.

`fork` hands a run to the server and returns the child as supervise watches any: its pid, `poll()`,
`send_signal()`. The worker starts the server (`start`) with its first run, which waits for the server's
imports (`wait`) rather than doing them itself, and again after it died. `fork` returns None, and the
caller starts a fresh process, when the server is not serving: starting, declined (its reason is logged
once: on a CUDA machine, see training.forkserver), or dead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from core.process import alive, child_env
from training import forkserver  # standard library and core only at import: for its name, never called

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300  # how long a run waits for a starting server: its imports take seconds, or many more
REPLY_TIMEOUT_S = 30  # the pid comes back as soon as the server has forked


class ForkedRun:
    """A run the server forked, as supervise sees a subprocess. The server reports its exit code; if the
    server ends first the code is lost, and the run (no longer anyone's child) reads as killed once it
    has ended."""

    def __init__(self, conn: socket.socket, pid: int, reply: bytes = b"") -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._conn.setblocking(False)  # poll() never waits
        self._reply = reply  # what came after the pid's line

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._read_exit()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _read_exit(self) -> int | None:
        ended = False  # the server closed the connection
        while b"\n" not in self._reply and not ended:
            try:
                data = self._conn.recv(4096)
            except BlockingIOError:
                return None  # still running
            except OSError:
                data = b""
            self._reply += data
            ended = not data
        if b"\n" in self._reply:
            self._conn.close()
            return int(json.loads(self._reply.split(b"\n", 1)[0])["exit"])
        if alive(self.pid):  # the server ended without telling: wait for the run itself to end
            return None
        self._conn.close()
        log.warning("run %d ended after its fork server; its exit code is unknown", self.pid)
        return -signal.SIGKILL  # as subprocess reports a killed process


class ForkServer:
    def __init__(self, command: list[str] | None = None) -> None:
        """`command`: the server's, without its socket path (tests stand in for it)."""
        self.command = command or [sys.executable, "-m", forkserver.__name__]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._ready = False
        self._declined = False
        self._answered = threading.Event()  # the server said whether it serves

    @property
    def pid(self) -> int | None:
        """The server's process id, if one was started."""
        return self._proc.pid if self._proc is not None else None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a starting server to say whether it serves; True once it has."""
        return self._answered.wait(timeout)

    def ready(self) -> bool:
        """Whether it said it serves."""
        with self._lock:
            return self._ready

    def start(self) -> None:
        """Start the server (its imports go on in the background); a no-op while one runs or after one
        declined."""
        with self._lock:
            if self._declined or (self._proc is not None and self._proc.poll() is None):
                return
            self._remove_dir()  # of a server that died
            self._dir = Path(tempfile.mkdtemp(prefix="ftune-fork-"))  # 0700; short enough for AF_UNIX
            self._ready = False
            self._answered.clear()
            self._proc = subprocess.Popen(
                [*self.command, str(self._dir / "socket")],
                stdin=subprocess.PIPE,  # its EOF (our end) stops it
                stdout=subprocess.PIPE,
                env=child_env(PYTHONUNBUFFERED="1"),
            )
            proc = self._proc
        threading.Thread(target=self._await_ready, args=(proc,), daemon=True).start()

    def _await_ready(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until its imports are done, or it ended
        try:
            answer = json.loads(line) if line else {"ready": False, "why": f"it exited ({proc.wait()})"}
        except ValueError:
            answer = {"ready": False, "why": f"it said {line[:200]!r}"}
        with self._lock:
            if proc is not self._proc:
                return
            self._ready = bool(answer.get("ready"))
            if not self._ready:
                self._declined = True
                log.warning("training fork server: not used (%s); each run starts afresh", answer.get("why"))
                self._remove_dir()
            else:
                log.info("training fork server ready (pid %d)", proc.pid)
            self._answered.set()

    def fork(self, run_json: Path, log_path: Path, env: Mapping[str, str]) -> ForkedRun | None:
        """Fork `run_json`'s run with its output appended to `log_path`; None: start it afresh instead
        (the server is starting, has declined, or could not fork; one that died is started again)."""
        with self._lock:
            serving = self._ready and self._proc is not None and self._proc.poll() is None
            path = self._dir / "socket" if serving and self._dir else None
        if path is None:
            self.start()
            return None
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.connect(str(path))
            request = {"run_json": str(run_json), "log": str(log_path), "env": dict(env), "cwd": os.getcwd()}
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while b"\n" not in reply:
                data = conn.recv(4096)
                if not data:
                    raise ConnectionError("the server closed the connection")
                reply += data
            line, rest = reply.split(b"\n", 1)
            pid = int(json.loads(line)["pid"])
        except (OSError, ValueError, KeyError) as e:
            conn.close()
            log.warning("training fork server did not fork a run (%s); starting it afresh", e)
            return None
        return ForkedRun(conn, pid, rest)

    def close(self) -> None:
        """Stop the server (runs it forked carry on: they watch this worker, not it)."""
        with self._lock:
            proc, self._proc, self._ready = self._proc, None, False
            self._remove_dir()
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
