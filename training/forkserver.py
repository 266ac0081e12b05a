"""Training runs forked from a warm process: `python -m training.forkserver <socket path>`.

A fresh `python -m training.run` spends ~5 s of CPU importing torch, transformers and peft before its first
line (2 cores, 2026-11-27). This server imports them once, then forks each run a worker asks for. The child
is that run as a fresh process would be: `training.run.main` in a session of its own, its output in the
job's log, the environment and directory the worker gives it. The worker's side is worker.forking, which
starts a fresh process instead whenever this server cannot serve.

Forking is safe only while the parent holds no CUDA state (a child of a process that initialised CUDA
cannot use it), and while no thread pool has run: this server imports and never computes, and it declines
to serve if CUDA was initialised or its driver library loaded during the imports. On a CUDA machine it
declines (an H200 with torch 2.11+cu130, 2026-11-28: "CUDA was initialised while importing") and jobs start
fresh there.

The protocol, JSON lines. The server's first line on stdout: {"ready": true} or {"ready": false, "why":
...}. Then one connection to the socket per run: the worker sends {"run_json", "log", "env", "cwd"}, the
server answers {"pid": N} once forked and {"exit": code} when the child has ended (negative: killed by
that signal, as subprocess reports it), then closes. The server ends when its stdin reaches EOF (the
worker that started it has ended); children carry on, each watching the worker itself
(core.process.stop_with_worker).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

from core.run_protocol import EXIT_USAGE
from training import run

REQUEST_TIMEOUT_S = 10.0  # a worker sends its request at once; a silent connection is dropped


# What a run imports, in this order: the llama module is the demo's and most bases' family; the engine and
# its objectives last.
WARM_IMPORTS = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
    "training.recipe",
    "training.objectives.dpo",
    "training.objectives.grpo",
)


def warm() -> str | None:
    """Import what a run imports; returns why forking would be unsafe, naming the import that made it so
    (on an H200, 2026-11-28: "CUDA was initialised while importing", before imports were named), or None."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)
        why = _cuda_touched()
        if why:
            return f"{why} while importing {name}"
    return None


def _cuda_touched() -> str | None:
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised"
    with open("/proc/self/maps") as maps:
        if any("libcuda.so" in line for line in maps):
            return "CUDA's driver library was loaded (a fork could inherit its state)"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.forkserver <socket path>", file=sys.stderr)
        return EXIT_USAGE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle; its end ends us
    run.process_defaults()  # before the imports: some are read at import (HF_HUB_OFFLINE)
    try:
        why = warm()
    except Exception as e:  # a broken install: the worker falls back to fresh processes, which say why
        why = f"importing failed: {type(e).__name__}: {e}"
    if why is not None:
        print(json.dumps({"ready": False, "why": why}), flush=True)
        return 0
    serve(argv[0])
    return 0


def serve(path: str) -> None:
    """Fork a run per connection to `path` until stdin closes; says it is ready once it listens."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen()
    print(json.dumps({"ready": True}), flush=True)
    wake_r, wake_w = os.pipe()  # SIGCHLD's wake-up: a handler may not write to sockets safely
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs: dict[int, socket.socket] = {}  # child pid -> the connection its exit goes to
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    pid = _fork(conn, [selector, listener, wake_r, wake_w, *runs.values()])
                    if pid is not None:
                        runs[pid] = conn
                elif key.fileobj == wake_r:
                    while _drained(wake_r):
                        pass
                    _reap(runs)
                elif not os.read(sys.stdin.fileno(), 4096):
                    return


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _fork(conn: socket.socket, inherited: list[Any]) -> int | None:
    """Read one request from `conn` and fork its run; the child's pid, None for a bad request.
    `inherited`: what the child closes first (sockets, the selector, raw descriptors)."""
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        request = json.loads(conn.makefile("rb").readline())
    except (OSError, ValueError) as e:
        print(f"fork server: dropped a request ({e})", file=sys.stderr, flush=True)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)  # before its descriptor closes
            for item in [conn, *inherited]:
                if isinstance(item, int):
                    os.close(item)
                else:
                    item.close()
            code = _child(request)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _send(conn, {"pid": pid})
    return pid


def _child(request: dict[str, Any]) -> int:
    """Become the run `request` asks for, as `python -m training.run` started by the worker would be."""
    os.setsid()  # a session of its own: a Ctrl-C on the terminal reaches the worker, not the trainer
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the OpenMP runtime read it when this server loaded it
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [run.__file__, request["run_json"]]
    return run.main([request["run_json"]])


def _reap(runs: dict[int, socket.socket]) -> None:
    """Tell each ended child's worker its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = runs.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the worker has gone; its child watches it and stops
        conn.sendall(json.dumps(message).encode() + b"\n")


if __name__ == "__main__":
    sys.exit(main())
