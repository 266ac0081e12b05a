"""The python grader sandbox against graders that get past its audit hook, or try to: the guard cannot be
switched off from inside, a grader can start no process (so a `setsid` child cannot outlive the run, and
its caps are the caps of the whole tree), and where the kernel refuses namespaces no grader runs at all.

With namespaces (this machine: Linux, root with every capability) and without (SandboxLimits.namespaces
off, the other layers alone); "the hook removed" is the child's source without the line that installs it.
"""

from __future__ import annotations

import contextlib
import dis
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from graders import sandbox
from graders.python_grader import PythonOutcome
from graders.sandbox import SERVER_ERROR, SandboxLimits, SandboxRunner
from tests.core.no_namespaces import run_refused
from tests.e2e.stack import REPO
from tests.graders.test_sandbox import leftovers

MODES = pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
HOOK_LINE = "sys.addaudithook(_guard(workdir, readable))"


@pytest.fixture(autouse=True)
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each child's working directory under this test's tmp_path, so that its processes can be found."""
    box = tmp_path / "boxes"
    box.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(box))
    return box


@pytest.fixture
def unhooked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child without its audit hook, as if the grader had got past it."""
    assert HOOK_LINE in sandbox.CHILD_SOURCE
    monkeypatch.setattr(sandbox, "CHILD_SOURCE", sandbox.CHILD_SOURCE.replace(HOOK_LINE, "pass"))


def survivors(box: Path) -> list[str]:
    """The processes of this test's sandboxes still running, killed (by id) so that a failure leaves none."""
    found = leftovers(box)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    return found


def run(source: str, kinds: list[str], namespaces: bool, **limits: Any) -> list[PythonOutcome]:
    calls: list[tuple[dict[str, Any], dict[str, Any]]] = [({}, {"k": k}) for k in kinds]
    return SandboxRunner(SandboxLimits(namespaces=namespaces, **limits)).run(source, calls)


# Everything a grader can reach of the guard from inside: the one line, the constants and modules
# the guard used to read at each event, the builtins it calls. Each is tried; what raises is skipped.
TAMPER = """
import builtins, os, posixpath, sys
main = sys.modules["__main__"]
ATTACKS = [
    lambda: setattr(main._Guard, "__call__", lambda s, e, a: None),
    lambda: [setattr(main, name, frozenset()) for name in dir(main) if name.startswith(("BLOCK", "READ"))],
    lambda: setattr(main, "WRITE_PATH_EVENTS", frozenset()),
    lambda: setattr(main, "BLOCKED_PREFIXES", ()),
    lambda: setattr(posixpath, "realpath", lambda path, **kw: os.getcwd()),
    lambda: setattr(os.path, "isdir", lambda path: False),
    lambda: setattr(posixpath, "_joinrealpath", lambda *a: (os.getcwd(), True)),
    lambda: setattr(builtins, "any", lambda it: False),
]
for attack in ATTACKS:
    try:
        attack()
    except Exception:
        pass

def grade(sample, item):
    k = item["k"]
    if k == "read":
        return len(open("/etc/hostname").read())
    if k == "write":
        open(item["outside"], "w").close()
    if k == "list":
        return len(os.listdir("/"))
    if k == "fork":
        os.fork()
    if k == "kill":
        os.kill(1, 0)
    if k == "isinstance":
        builtins.isinstance = lambda obj, kind: False
        open("/etc/hostname")
    return 1
"""


@MODES
def test_the_guard_cannot_be_switched_off_from_inside(namespaces: bool) -> None:
    kinds = ["read", "write", "list", "fork", "kill", "isinstance"]
    outside = Path(f"/tmp/sandbox-was-here-{uuid.uuid4().hex}")  # where nobody could write, past the guard
    calls: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({}, {"k": k, "outside": str(outside)}) for k in kinds
    ]
    try:
        outcomes = SandboxRunner(SandboxLimits(namespaces=namespaces)).run(TAMPER, calls)
        assert not outside.exists()
    finally:
        outside.unlink(missing_ok=True)
    for kind, outcome in zip(kinds, outcomes, strict=True):
        assert outcome.reward is None and "sandbox: " in str(outcome.details), (kind, outcome)


def test_the_guard_reads_no_global_name() -> None:
    """Every name the hook and its helpers use is bound when it is made: patching a module, __main__ or
    builtins changes nothing it does (the test above tries; this says why)."""
    module = compile(sandbox.CHILD_SOURCE, "<child>", "exec")
    factories = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    factories = [c for c in factories if c.co_name in ("_guard", "_resolver")]
    nested = [c for f in factories for c in f.co_consts if isinstance(c, types.CodeType)]
    assert {c.co_name for c in nested} == {"hook", "text", "within", "resolve"}
    for code in nested:
        loads = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        assert not loads, (code.co_name, loads)


# A grader past the hook starts processes: a `setsid` child that sleeps past the run (it would survive a
# kill of the original process group), and 16 children that each burn CPU and memory.
ESCAPES = """
import os, time
def grade(sample, item):
    started, failure = 0, None
    try:
        for _ in range(1 if item["k"] == "setsid" else 16):
            if os.fork() == 0:
                if item["k"] == "setsid":
                    os.setsid()
                    time.sleep(60)
                block = bytearray(200 * 2**20)
                end = time.process_time() + 1
                while time.process_time() < end:
                    pass
                os._exit(len(block) % 7)
            started += 1
    except OSError as exc:
        failure = exc
    for _ in range(started):
        os.wait()  # so that their CPU time counts in the tree's
    if failure:
        raise OSError(f"{started} started, then {failure}")
    return started
"""


@MODES
def test_a_grader_past_the_hook_starts_no_process(namespaces: bool, own_tmp: Path, unhooked: None) -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    outcomes = run(ESCAPES, ["setsid", "fan-out"], namespaces, cpu_seconds=2, wall_seconds=20)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for outcome in outcomes:
        assert outcome.reward is None and "0 started, then" in str(outcome.details), outcome
        assert "Resource temporarily unavailable" in str(outcome.details)
    assert survivors(own_tmp) == []
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu < 2, cpu  # the whole tree's CPU time: two interpreters' start, nobody's burning


SERVICE = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from graders.sandbox import SandboxLimits, SandboxRunner
limits = SandboxLimits(cpu_seconds=60, wall_seconds=120)
SandboxRunner(limits).run("def grade(sample, item):\\n    while True:\\n        pass\\n", [({}, {})])
"""


def cpu_seconds(pid: str) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return int(fields[11]) / os.sysconf("SC_CLK_TCK")  # utime


def test_the_sandbox_dies_with_the_service(own_tmp: Path) -> None:
    """The service killed mid-run (SIGKILL: it cleans nothing up) once its grader is busy in grade(): the
    waiters, the PID namespace's init and the grader go with it, not at the grader's CPU limit."""
    service = subprocess.Popen([sys.executable, "-c", SERVICE, str(own_tmp)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not any(cpu_seconds(pid) > 0.5 for pid in leftovers(own_tmp)):
            assert service.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        service.kill()
        service.wait()
    deadline = time.monotonic() + 5
    while leftovers(own_tmp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert survivors(own_tmp) == []


def test_where_the_kernel_refuses_namespaces_no_grader_runs() -> None:
    """As under Docker's default seccomp profile: the probe says why, and the grader's code never runs
    (a runner asked for namespaces does not fall back to the other layers)."""
    info = run_refused(SandboxRunner().probe)
    assert info is not None and not info.isolated
    assert "unshare" in info.why and "Operation not permitted" in info.why
    source = "def grade(sample, item):\n    return 1\n"
    outcomes = run_refused(lambda: SandboxRunner().run(source, [({}, {}), ({}, {})]))
    for outcome in outcomes:
        assert outcome.reward is None and outcome.error == SERVER_ERROR
        assert str(outcome.details).startswith("python_grader_unavailable: ")
        assert "unshare" in str(outcome.details)
