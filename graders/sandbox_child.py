"""The sandboxed grader process: the code that graders/sandbox_cage.py execs, inside the cage, as
`python -I -S -c <this file> CONFIG`.

Standard library only, and never imported by ftune. It reads {"source", "calls"} from stdin, locks itself
down with an audit hook, runs grade() once per call and writes one JSON line per call to the protocol fd
as soon as it is done, so a batch killed half-way keeps the rewards it has. See sandbox.py for which layer
stops what.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import stat
import sys
from collections.abc import Callable
from typing import Any

NOBODY = 65534
DETAILS_CHARS = 1000

# What graders commonly use, imported before the lock so that they need no file access afterwards.
PREIMPORTS = (
    "math", "json", "re", "string", "collections", "statistics", "difflib", "itertools", "functools",
    "operator", "unicodedata", "random", "decimal", "fractions", "heapq", "bisect", "datetime", "typing",
)  # fmt: skip
# Foreign calls, spawning, subinterpreters (audit hooks are per interpreter), test helpers. Sockets can be
# imported (email, http import socket) but not made: the "socket.*" events below.
BLOCKED_MODULES = frozenset(
    (
        "ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "subprocess", "multiprocessing",
        "_multiprocessing", "pty", "_xxsubinterpreters", "_xxinterpchannels", "_testcapi",
        "_testinternalcapi", "_testmultiphase", "_testimportmultiple",
    )
)  # fmt: skip
BLOCKED_EVENTS = frozenset(
    (
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
        "signal.pthread_kill", "subprocess.Popen", "sys._current_frames",
        "sys._current_exceptions", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "sys.settrace", "sys.setprofile", "sys.remote_exec", "_thread.start_new_thread",
    )
)  # fmt: skip
BLOCKED_PREFIXES = ("socket.", "ctypes.", "cffi.", "_winapi.", "winreg.", "webbrowser.")
# Events whose leading string arguments are paths that must stay in the working directory.
WRITE_PATH_EVENTS = frozenset(
    (
        "os.remove", "os.rename", "os.chmod", "os.chown", "os.mkdir", "os.rmdir", "os.symlink", "os.link",
        "os.truncate", "os.utime", "os.chflags", "os.lchflags", "os.lchmod", "os.mkfifo", "os.mknod",
        "os.setxattr", "os.removexattr", "os.chdir", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
        "shutil.copytree", "shutil.move", "shutil.rmtree", "shutil.make_archive", "shutil.unpack_archive",
    )
)  # fmt: skip
READ_PATH_EVENTS = frozenset(("os.listdir", "os.scandir", "os.listxattr", "os.getxattr", "glob.glob"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Changing a function: its __code__, __defaults__, ... (refused for the guard's own functions).
ATTRIBUTE_EVENTS = frozenset(("object.__setattr__", "object.__delattr__", "object.__getattr__"))


def serve(config: dict[str, Any]) -> None:
    """Run the batch on stdin, one result line per call on the protocol fd (the original stdout)."""
    payload = json.loads(sys.stdin.buffer.read())
    os.close(0)
    proto = os.dup(1)
    os.dup2(2, 1)  # the grader's prints go to stderr, never into the protocol
    for name in PREIMPORTS:
        __import__(name)
    workdir = os.path.realpath(os.getcwd())
    if os.geteuid() == 0:  # root without namespaces: nobody, so NPROC holds and root's files are out of reach
        os.chown(workdir, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    readable = tuple(os.path.realpath(p) for p in sys.path if os.path.isabs(p))
    _emit(proto, {"sandbox": {"isolated": config["isolated"], "uid": os.getuid(), "why": config["why"]}})
    sys.addaudithook(_guard(workdir, readable))  # held by the interpreter alone: no name refers to it
    calls: list[tuple[dict[str, Any], dict[str, Any]]] = payload["calls"]
    try:
        namespace: dict[str, Any] = {"__name__": "grader"}
        exec(compile(payload["source"], "<grader>", "exec"), namespace)
        grade = namespace.get("grade")
        if not callable(grade):
            raise TypeError("the source defines no function grade(sample, item)")
    except BaseException as exc:
        for i in range(len(calls)):
            _emit(proto, {"i": i, "error": _describe(exc)})
        return
    for i, (sample, item) in enumerate(calls):
        try:
            reward = _number(grade(sample, item))
        except BaseException as exc:
            _emit(proto, {"i": i, "error": _describe(exc)})
        else:
            _emit(proto, {"i": i, "reward": reward})


def _number(value: object) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"grade returned {type(value).__name__}, not a number")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"grade returned {result}, not a finite number")
    return result


def _describe(exc: BaseException) -> str:
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # a hostile __str__
        text = type(exc).__name__
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<grader>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return (text if line is None else f"{text} (line {line})")[:DETAILS_CHARS]


def _emit(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _guard(workdir: str, readable: tuple[str, ...]) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook: refuses what a grader never needs (sandbox.py, layer 4). A closure that looks up no
    global name: the C functions and types it calls and the sets it checks are bound here, before the
    grader runs, so patching __main__, os, posixpath or builtins changes nothing it does; no name refers to
    it, and setting, deleting or reading an attribute of it or its helpers (their __code__) is refused. Not
    a boundary on its own (CPython can be crashed from inside): python graders are admitted only where the
    probe proved the cage's namespaces; this narrows what reaches them and gives graders clear errors."""
    resolve, stat_of, is_dir, denied, failed = _resolver(), os.stat, stat.S_ISDIR, PermissionError, OSError
    str_, bytes_, int_, kind_of, subclass = str, bytes, int, type, issubclass
    encoding = sys.getfilesystemencoding()
    modules, events, prefixes = BLOCKED_MODULES, BLOCKED_EVENTS, BLOCKED_PREFIXES
    writes_at, reads_at, write_flags = WRITE_PATH_EVENTS, READ_PATH_EVENTS, WRITE_FLAGS
    attributes = ATTRIBUTE_EVENTS
    work, roots = (workdir,), (workdir, *readable)

    def text(path: Any) -> str | None:
        """The path as an exact str, read with the C methods of str and bytes. None for anything else: an
        fd, or an object in an event raised from Python (glob, shutil), whose system calls are checked
        again with str paths (CPython's own events carry paths already converted to str or bytes)."""
        kind = kind_of(path)
        if subclass(kind, str_):
            return str_.__str__(path)
        if subclass(kind, bytes_):
            return bytes_.decode(path, encoding, "surrogateescape")
        return None

    def within(event: str, path: Any, allowed: tuple[str, ...]) -> str | None:
        """The resolved path (None for one that text() leaves alone), if it lies under one of allowed."""
        name = text(path)
        if name is None:
            return None
        real = resolve(name)
        for root in allowed:
            if real == root or real.startswith(root + "/"):
                return real
        raise denied(f"sandbox: {event} outside the working directory: {name}")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (
                kind_of(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
            ) or (kind_of(flags) is int_ and flags & write_flags)
            real = within(event, path, work if writes else roots)
            if real is not None and not (real == workdir or real.startswith(workdir + "/")):
                # A directory fd from outside would make every dir_fd= call (os.open's included, whose
                # event carries no dir_fd) a way around the path checks.
                try:
                    mode_bits = stat_of(real).st_mode
                except failed:
                    mode_bits = 0
                if is_dir(mode_bits):
                    raise denied(f"sandbox: opening the directory {real} is not allowed")
        elif event == "import":
            if (text(args[0]) or "").partition(".")[0] in modules:
                raise denied(f"sandbox: import of {args[0]} is not allowed")
        elif event in events or event.startswith(prefixes):
            raise denied(f"sandbox: {event} is not allowed")
        elif event in writes_at:
            for arg in args:
                within(event, arg, work)
        elif event in reads_at and args:
            within(event, args[0] if args[0] is not None else ".", roots)
        elif event in attributes and args:
            for mine in guarded:
                if args[0] is mine:
                    raise denied("sandbox: the guard cannot be changed")

    guarded = (hook, text, within, resolve)
    return hook


def _resolver() -> Callable[[str], str]:
    """os.path.realpath (not strict) made of C functions alone, bound now (see _guard)."""
    lstat, readlink, getcwd, is_link = os.lstat, os.readlink, os.getcwd, stat.S_ISLNK
    denied, failed = PermissionError, OSError

    def resolve(path: str) -> str:
        pending = (path if path.startswith("/") else getcwd() + "/" + path).split("/")[::-1]
        done, links = "", 0
        while pending:
            name = pending.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                done = done[: done.rfind("/")]
                continue
            here = done + "/" + name
            try:
                mode = lstat(here).st_mode
            except failed:  # not there (yet): kept as written
                mode = 0
            if not is_link(mode):
                done = here
                continue
            links += 1
            if links > 40:
                raise denied(f"sandbox: too many levels of symbolic links in {path}")
            target = readlink(here)
            if target.startswith("/"):
                done = ""
            pending += target.split("/")[::-1]
        return done or "/"

    return resolve


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
