"""The sandboxed grader process: the code that core/graders/sandbox.py runs as `python -I -S -c <this file>`.

Standard library only, and never imported by ftune: its source is handed to a fresh interpreter, twice.
`enter` (argv: enter CONFIG) builds the cage: new namespaces where the kernel allows them, limits, a
lesser uid, then replaces itself (exec) with `serve` (argv: serve CONFIG) in an interpreter that never
loaded ctypes. `serve` reads {"source", "calls"} from stdin, locks itself down with an audit hook, runs
grade() once per call and writes one JSON line per call to the protocol fd as soon as it is done, so a
batch killed half-way keeps the rewards it has. See sandbox.py for which layer stops what.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import resource
import signal
import sys
from typing import Any

NOBODY = 65534
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18,
)  # fmt: skip
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# The host's system directories bound read-only into the new root: the interpreter, its shared libraries
# and the loader; symlinks (merged /usr) are copied as symlinks.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache")
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
        "sys.settrace", "sys.setprofile", "sys.remote_exec",
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


# --- enter: the cage -------------------------------------------------------------------------------------


def enter(config: dict[str, Any]) -> None:
    """Isolate (when asked and allowed), limit, then exec `serve`. Never returns."""
    executable = os.path.realpath(sys.executable)  # resolved on the host's filesystem, before any pivot
    os.umask(0o022)  # the new root's directories must be traversable by nobody
    why = "disabled by the operator"
    isolated = False
    if config["namespaces"]:
        try:
            why = _isolate(config["root"], config["scratch_bytes"])
            isolated = True
        except OSError as exc:  # the kernel or its policy refuses: fall back to the other layers
            why = f"namespaces unavailable or incomplete: {exc}"
    if isolated:
        libc = _libc()
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace into the waiters, which hold capabilities
        init = os.fork()  # the PID namespace's init: a waiter, as init ignores signals it has no handler for
        if init:
            _relay(init, as_init=False)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.geteuid() == 0:
            _drop_to(NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # setuid reset it
        grader = os.fork()
        if grader:
            _relay(grader, as_init=True)
    _limit(config)
    code = sys.orig_argv[sys.orig_argv.index("-c") + 1]
    served = {**config, "isolated": isolated, "why": why}
    os.execve(executable, [executable, "-I", "-S", "-c", code, "serve", json.dumps(served)], {})


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _isolate(root: str, scratch_bytes: int) -> str:
    """New namespaces and a minimal filesystem at `root`: a size-bounded tmpfs holding /work, /tmp and the
    system directories bound read-only. A root parent needs no user namespace (and its interpreter may sit
    where nobody cannot reach, e.g. /root/.pyenv); anyone else gets one mapping only itself."""
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags | (0 if uid == 0 else CLONE_NEWUSER)), "unshare")
    if uid != 0:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount private")
    size = f"size={scratch_bytes},mode=0755".encode()
    _check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size), "mount tmpfs")
    prefix = os.path.realpath(sys.base_prefix)
    binds = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    if not any(prefix == p or prefix.startswith(p + "/") for p in binds):
        binds.append(prefix)
    for path in binds:
        target = root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.mkdir(target, 0o755)
        else:
            open(target, "w").close()
        _check(libc.mount(path.encode(), target.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
        # A remount keeps the flags the kernel locked on the original mount (nosuid, nodev, ...).
        locked = _mount_flags(path)
        remount = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | locked
        _check(libc.mount(None, target.encode(), None, remount, None), f"read-only {path}")
    for path, mode in (("/work", 0o700), ("/tmp", 0o700)):
        os.mkdir(root + path, mode)
        if uid == 0:
            os.chown(root + path, NOBODY, NOBODY)
    _pivot(root)
    return "namespaces: mount, pid, net, ipc, uts" + ("" if uid == 0 else ", user")


def _mount_flags(path: str) -> int:
    flags = os.statvfs(path).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME),
    )  # fmt: skip
    return sum(ms for st, ms in pairs if flags & st)


def _pivot(root: str) -> None:
    """Make `root` the whole filesystem: pivot_root onto itself, then detach the old root (unlike chroot,
    nothing of the host stays reachable, even for a process that later gains capabilities)."""
    libc = _libc()
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach old root")
    os.chdir("/work")


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # from root: every capability goes with it


def _relay(child: int, *, as_init: bool) -> None:
    """Wait for the child and end as it ended. The namespace's init cannot signal itself, so it passes a
    signal on as the shell does (exit status 128 + signal) and the outer waiter turns that back."""
    for fd in (0, 1):
        os.close(fd)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if as_init:
        os._exit(128 - code if code < 0 else code)
    if code > 128:
        code = 128 - code
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP keep their default anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _limit(config: dict[str, Any]) -> None:
    """rlimits, hard = soft so the grader cannot raise them again (CPU: one second apart, so that the
    soft limit's SIGXCPU names the cause). NPROC counts threads too."""
    cpu = config["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for which, value in (
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))


# --- serve: the grader -----------------------------------------------------------------------------------


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
        _drop_to(NOBODY)
    readable = tuple(os.path.realpath(p) for p in sys.path if os.path.isabs(p))
    _emit(proto, {"sandbox": {"isolated": config["isolated"], "uid": os.getuid(), "why": config["why"]}})
    sys.addaudithook(_Guard(workdir, readable))
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


class _Guard:
    """The audit hook: refuses what a grader never needs. Not a boundary on its own (Python code can crash
    the interpreter, and CPython's own docs say hooks cannot contain hostile code); the layers of enter()
    are the boundary, this narrows what reaches them and gives clear errors."""

    def __init__(self, workdir: str, readable: tuple[str, ...]) -> None:
        self.workdir = (workdir,)
        self.readable = (workdir, *readable)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            real = self._within(event, path, self.workdir if writes else self.readable)
            if real is not None and not real.startswith(self.workdir[0]) and os.path.isdir(real):
                # A directory fd from outside would make every dir_fd= call (os.open's included, whose
                # event carries no dir_fd) a way around the path checks.
                raise PermissionError(f"sandbox: opening the directory {real} is not allowed")
        elif event == "import":
            if args[0].partition(".")[0] in BLOCKED_MODULES:
                raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
        elif event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in WRITE_PATH_EVENTS:
            for arg in args:
                if isinstance(arg, str | bytes | os.PathLike):
                    self._within(event, arg, self.workdir)
        elif event in READ_PATH_EVENTS and args:
            self._within(event, args[0] if args[0] is not None else ".", self.readable)

    @staticmethod
    def _within(event: str, path: Any, roots: tuple[str, ...]) -> str | None:
        """The resolved path (None for an fd this process already holds), if it lies under one of roots."""
        if isinstance(path, int):
            return None
        real = os.path.realpath(os.fsdecode(path))
        if not any(real == root or real.startswith(root + os.sep) for root in roots):
            raise PermissionError(f"sandbox: {event} outside the working directory: {os.fsdecode(path)}")
        return real


def main() -> None:
    stage, config = sys.argv[1], json.loads(sys.argv[2])
    if stage == "enter":
        enter(config)
    else:
        serve(config)


if __name__ == "__main__":
    main()
