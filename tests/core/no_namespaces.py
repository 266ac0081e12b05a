"""A kernel that refuses new namespaces, as Docker's default seccomp profile does, for tests of the python
grader sandbox where it cannot isolate: a seccomp filter that fails unshare, setns, mount, umount2 and
pivot_root with EPERM. Seccomp filters are per thread and inherited by every process started after them.

`run_refused(fn)` calls fn in a new thread under the filter (the processes it starts get the filter too; the
test's own process and threads do not). `python -m tests.core.no_namespaces CMD...` execs CMD under it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
RET_ALLOW, RET_EPERM = 0x7FFF0000, 0x00050000 | 1
# seccomp_data: nr at 0, arch at 4. The syscalls that make or enter namespaces, and the mounts of a cage.
ARCHES = {
    "x86_64": (0xC000003E, {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155}),
    "aarch64": (0xC00000B7, {"unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41}),
}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte)]
    _fields_ += [("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def refuse_namespaces() -> None:
    """Install the filter on the calling thread (and what it starts from now on)."""
    arch, numbers = ARCHES[os.uname().machine]
    program = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, arch), (RET_K, 0, 0, RET_ALLOW), (LD_W_ABS, 0, 0, 0)]
    for number in numbers.values():
        program += [(JEQ_K, 0, 1, number), (RET_K, 0, 0, RET_EPERM)]
    program.append((RET_K, 0, 0, RET_ALLOW))
    filters = (SockFilter * len(program))(*(SockFilter(*line) for line in program))
    fprog = SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    no_new_privileges = (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for args in (no_new_privileges, (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog))):
        if libc.prctl(*args) != 0:
            raise OSError(ctypes.get_errno(), "prctl")


def run_refused(fn: Callable[[], T]) -> T:
    """fn() in a thread of its own under the filter; its result, or its exception raised here."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            refuse_namespaces()
            result.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


if __name__ == "__main__":
    refuse_namespaces()
    os.execvp(sys.argv[1], sys.argv[1:])
