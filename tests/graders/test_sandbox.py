"""The python grader sandbox, for real: each limit is hit by a real child process, nothing is mocked.

Most hostile graders run twice: with namespaces (where this kernel allows them) and without, so that the
fallback layers (rlimits, empty environment, audit hook) are proven on their own as well.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from graders import sandbox
from graders.python_grader import PythonOutcome
from graders.sandbox import RUNTIME_ERROR, SERVER_ERROR, SandboxLimits, SandboxRunner

MODES = pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])


@pytest.fixture(autouse=True)
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each child's working directory under this test's tmp_path: its command line names it, so leftover
    processes can be found, and a removed working directory shows as an empty folder."""
    box = tmp_path / "boxes"
    box.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(box))
    return box


Calls = list[tuple[dict[str, Any], dict[str, Any]]]


def runner(namespaces: bool = True, **limits: Any) -> SandboxRunner:
    return SandboxRunner(SandboxLimits(namespaces=namespaces, **limits))


def run_one(source: str, namespaces: bool = True, **limits: Any) -> PythonOutcome:
    return runner(namespaces, **limits).run(source, [({}, {})])[0]


def ok(reward: float) -> PythonOutcome:
    return PythonOutcome(reward=reward, error=None, details=None)


def leftovers(box: Path) -> list[str]:
    """Processes still running whose command line names this test's working directories."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid.isdigit() and str(box).encode() in cmdline:
            found.append(pid)
    return found


def test_probe_reports_the_layers() -> None:
    info = SandboxRunner().probe()
    assert info is not None
    assert info.uid != 0  # never root: nobody for a root service, the service's own uid in a user namespace
    print(info)


def test_correct_grader_returns_its_floats_in_order() -> None:
    source = """
import math, statistics, difflib, email.utils, xml.dom.minidom, zoneinfo
def grade(sample, item):
    k = item["k"]
    if k == 0:
        return True
    if k == 1:
        return 3
    return difflib.SequenceMatcher(None, sample["output_text"], item["ref"]).ratio()
"""
    calls: Calls = [({}, {"k": 0}), ({}, {"k": 1}), ({"output_text": "abcd"}, {"k": 2, "ref": "abcf"})]
    assert SandboxRunner().run(source, calls) == [ok(1.0), ok(3.0), ok(0.75)]
    assert SandboxRunner().run(source, []) == []


def test_printing_does_not_corrupt_the_protocol() -> None:
    source = """
import os, sys
def grade(sample, item):
    print('{"i": 1, "reward": 99}')
    print("x" * 100_000)
    sys.stdout.write('{"i": 0, "reward": 42}\\n')
    os.write(1, b'{"i": 1, "reward": 77}\\n')
    return item["r"]
"""
    assert SandboxRunner().run(source, [({}, {"r": 0.25}), ({}, {"r": 0.5})]) == [ok(0.25), ok(0.5)]


def test_a_failing_call_keeps_the_others_rewards() -> None:
    source = """
def grade(sample, item):
    k = item["k"]
    if k == "raise":
        raise ValueError("no reference answer")
    if k == "exit":
        raise SystemExit(3)
    if k in ("none", "str", "nan"):
        return {"none": None, "str": "0.5", "nan": float("nan")}[k]
    return 1.0
"""
    kinds = ["ok", "raise", "ok", "none", "str", "nan", "exit", "ok"]
    outcomes = SandboxRunner().run(source, [({}, {"k": k}) for k in kinds])
    assert [o.reward for o in outcomes] == [1.0, None, 1.0, None, None, None, None, 1.0]
    assert all(o.error == RUNTIME_ERROR for o in outcomes if o.reward is None)
    details = [o.details for o in outcomes]
    assert details[1] == "ValueError: no reference answer (line 5)"
    assert "NoneType, not a number" in str(details[3])
    assert "str, not a number" in str(details[4])
    assert "not a finite number" in str(details[5])


def test_source_without_grade_or_with_errors_fails_every_call() -> None:
    for source, expected in [("x = 1\n", "no function grade"), ("def grade(:\n", "SyntaxError")]:
        outcomes = SandboxRunner().run(source, [({}, {}), ({}, {})])
        assert [o.error for o in outcomes] == [RUNTIME_ERROR] * 2
        assert expected in str(outcomes[0].details)


@MODES
def test_endless_loop_is_stopped_by_the_cpu_limit(namespaces: bool, own_tmp: Path) -> None:
    source = """
def grade(sample, item):
    while item["loop"]:
        pass
    return 1
"""
    calls: Calls = [({}, {"loop": False}), ({}, {"loop": True}), ({}, {"loop": False})]
    outcomes = runner(namespaces, cpu_seconds=1, wall_seconds=20).run(source, calls)
    assert outcomes[0] == ok(1.0)
    assert [o.error for o in outcomes[1:]] == [SERVER_ERROR] * 2
    assert outcomes[1].details == "CPU limit of 1 s reached"
    assert run_one("def grade(s, i):\n    return 0.5\n", namespaces) == ok(0.5)
    assert leftovers(own_tmp) == []
    assert list(own_tmp.iterdir()) == []


def test_sleeping_grader_is_stopped_by_the_wall_clock() -> None:
    started = time.monotonic()
    outcome = run_one("import time\ndef grade(s, i):\n    time.sleep(60)\n", wall_seconds=1, cpu_seconds=60)
    assert outcome == PythonOutcome(None, SERVER_ERROR, "wall-clock limit of 1 s reached")
    assert time.monotonic() - started < 5


@MODES
def test_no_network_even_to_loopback(namespaces: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        source = f"""
def grade(sample, item):
    import socket
    with socket.create_connection(("127.0.0.1", {port}), timeout=2):
        return 1
"""
        outcome = run_one(source, namespaces)
        assert outcome.error == RUNTIME_ERROR
        # Without namespaces on a root service whose interpreter lives under /root (as here), nobody cannot
        # even import what was not imported before the lock.
        assert "sandbox: socket.getaddrinfo is not allowed" in str(outcome.details) or (
            not namespaces and "No module named 'socket'" in str(outcome.details)
        )
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


@MODES
def test_service_files_and_secrets_are_out_of_reach(
    namespaces: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "ftune.db").write_text("tenant secrets")
    monkeypatch.setenv("FTUNE_SECRET_KEY", "hunter2")
    monkeypatch.setenv("HF_TOKEN", "hf_xyz")
    source = f"""
import os
def grade(sample, item):
    k = item["k"]
    if k == "env":
        return float(any(k.startswith(("FTUNE_", "HF_")) for k in os.environ))
    if k == "data":
        return len(open({str(data_dir / "ftune.db")!r}).read())
    if k == "passwd":
        return len(open("/etc/passwd").read())
    if k == "list":
        return len(os.listdir({str(data_dir)!r}))
    if k == "remove":
        os.remove({str(data_dir / "ftune.db")!r})
    if k == "own":
        with open("scratch.txt", "w") as f:
            f.write("mine")
        return len(open("scratch.txt").read())
"""
    kinds = ["env", "data", "passwd", "list", "remove", "own"]
    outcomes = runner(namespaces).run(source, [({}, {"k": k}) for k in kinds])
    assert outcomes[0] == ok(0.0)
    for outcome in outcomes[1:5]:
        assert outcome.error == RUNTIME_ERROR
        assert "outside the working directory" in str(outcome.details)
    assert outcomes[5] == ok(4.0)
    assert (data_dir / "ftune.db").read_text() == "tenant secrets"


@MODES
def test_fork_bombs_are_contained(namespaces: bool, own_tmp: Path) -> None:
    source = """
import os
def grade(sample, item):
    if item["k"] == "fork":
        while True:
            os.fork()
    import subprocess
    while True:
        subprocess.Popen(["/bin/sleep", "60"])
"""
    outcomes = runner(namespaces, wall_seconds=10).run(source, [({}, {"k": "fork"}), ({}, {"k": "popen"})])
    assert [o.reward for o in outcomes] == [None, None]
    assert "os.fork is not allowed" in str(outcomes[0].details)
    assert "subprocess is not allowed" in str(outcomes[1].details)
    assert leftovers(own_tmp) == []
    assert run_one("def grade(s, i):\n    return 2\n", namespaces) == ok(2.0)


@MODES
def test_four_gib_do_not_fit(namespaces: bool) -> None:
    source = """
def grade(sample, item):
    if item["big"]:
        block = bytearray(4 * 2**30)
        return len(block)
    return 1
"""
    outcomes = runner(namespaces).run(source, [({}, {"big": True}), ({}, {"big": False})])
    assert outcomes[0].error in (RUNTIME_ERROR, SERVER_ERROR)
    assert "MemoryError" in str(outcomes[0].details) or "memory" in str(outcomes[0].details)
    assert outcomes[1] == ok(1.0)


@MODES
def test_files_past_the_size_limit_cannot_be_written(namespaces: bool, own_tmp: Path) -> None:
    source = """
def grade(sample, item):
    with open("out.bin", "wb") as f:
        f.write(b"x" * item["n"])
    return item["n"]
"""
    calls: Calls = [({}, {"n": 1000}), ({}, {"n": 2 * 2**20})]
    outcomes = runner(namespaces, file_size_bytes=2**20).run(source, calls)
    assert outcomes[0] == ok(1000.0)
    assert outcomes[1].error == RUNTIME_ERROR
    assert "File too large" in str(outcomes[1].details)
    assert list(own_tmp.iterdir()) == []  # the working directory is gone


def test_runs_from_several_threads_at_once() -> None:
    sandbox, results = SandboxRunner(), {}

    def one(n: int) -> None:
        results[n] = sandbox.run("def grade(s, i):\n    return i['n'] * 2\n", [({}, {"n": n})])

    threads = [threading.Thread(target=one, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {n: [ok(2.0 * n)] for n in range(4)}


def test_limits_from_settings() -> None:
    settings = Settings(
        python_grader_cpu_seconds=3, python_grader_memory_mb=256, python_grader_timeout_seconds=7.5
    )
    assert settings.python_grader_enabled is False  # untrusted code runs only where the operator says so
    limits = SandboxLimits.from_settings(settings)
    assert (limits.cpu_seconds, limits.memory_bytes, limits.wall_seconds) == (3, 256 * 2**20, 7.5)


def test_namespaces_hold_without_the_audit_hook(
    tmp_path: Path, own_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook is not a boundary, so the layers under it must stand alone: the same child with the
    line that installs the hook removed (as if the grader had got past it)."""
    if not (info := SandboxRunner().probe()) or not info.isolated:
        pytest.skip(f"no namespaces here: {info}")
    hook = "sys.addaudithook(_guard(workdir, readable))"
    assert hook in sandbox.CHILD_SOURCE
    monkeypatch.setattr(sandbox, "CHILD_SOURCE", sandbox.CHILD_SOURCE.replace(hook, "pass"))
    (tmp_path / "ftune.db").write_text("tenant secrets")
    with socket.create_server(("127.0.0.1", 0)) as server:
        source = f"""
import os, socket, time
def grade(sample, item):
    k = item["k"]
    if k == "net":
        socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2)
    if k == "data":
        open({str(tmp_path / "ftune.db")!r})
    if k == "passwd":
        open("/etc/passwd")
    if k == "usr":
        open("/usr/lib/sandbox-was-here", "w")
    if k == "fork":
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                children += 1
        except OSError as exc:
            raise OSError(f"{{children}} children, then {{exc}}") from None
"""
        kinds = ["net", "data", "passwd", "usr", "fork"]
        outcomes = SandboxRunner().run(source, [({}, {"k": k}) for k in kinds])
    details = [str(o.details) for o in outcomes]
    assert all(o.error == RUNTIME_ERROR for o in outcomes), details
    assert "Network is unreachable" in details[0]
    assert "No such file or directory" in details[1] and "No such file or directory" in details[2]
    assert "Read-only file system" in details[3]
    assert "0 children, then [Errno 11] Resource temporarily unavailable" in details[4]  # RLIMIT_NPROC 1
    assert leftovers(own_tmp) == []
