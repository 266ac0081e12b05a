"""The cage of the sandboxed grader: the code graders/sandbox.py runs first, as
`python -I -S -c <this file> CONFIG GRADER_CODE` (GRADER_CODE: sandbox_child.py's source).

Standard library only, and never imported by ftune. It builds the cage: new namespaces (asked for and
refused by the kernel: it writes why, the sandbox line with isolated false, and runs nothing), limits, a
lesser uid, then replaces itself (exec) with the grader process, `python -I -S -c GRADER_CODE CONFIG`, an
interpreter that never loaded ctypes. See sandbox.py for which layer stops what.
"""

from __future__ import annotations

import contextlib
import json
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


def enter(config: dict[str, Any], code: str) -> None:
    """Isolate (unless told not to), limit, then exec the grader process (`code`). Never returns. Where
    namespaces were asked for and the kernel refuses them, it writes why and runs no grader."""
    executable = os.path.realpath(sys.executable)  # resolved on the host's filesystem, before any pivot
    os.umask(0o022)  # the new root's directories must be traversable by nobody
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the service gone: the whole tree goes
    if os.getppid() != config["parent"]:
        os._exit(1)
    why = "namespaces switched off (SandboxLimits.namespaces): the other layers alone"
    isolated = False
    if config["namespaces"]:
        try:
            why = _isolate(config["root"], config["scratch_bytes"])
            isolated = True
        except OSError as exc:  # the kernel or its policy refuses: no cage, no grader
            why = f"namespaces unavailable or incomplete: {exc}"
            line = {"sandbox": {"isolated": False, "uid": os.geteuid(), "why": why}}
            os.write(1, (json.dumps(line) + "\n").encode())  # one short write to a pipe: whole
            os._exit(0)
    if isolated:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace into the waiters, which hold capabilities
        init = os.fork()  # the PID namespace's init: a waiter, as init ignores signals it has no handler for
        if init:
            _relay(init, as_init=False)
        if os.geteuid() == 0:
            _drop_to(NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # setuid reset it
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        grader = os.fork()
        if grader:
            _relay(grader, as_init=True)
    _limit(config)
    served = {**config, "isolated": isolated, "why": why}
    os.execve(executable, [executable, "-I", "-S", "-c", code, json.dumps(served)], {})


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
    soft limit's SIGXCPU names the cause). NPROC 1: the kernel counts the processes and threads of the
    grader's uid, the grader among them, so it can start none, and its CPU and address-space caps are the
    caps of everything it runs."""
    cpu = config["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for which, value in (
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, 1),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))


if __name__ == "__main__":
    enter(json.loads(sys.argv[1]), sys.argv[2])
