"""atomic_dir under crashes: a child process replaces a directory and is killed before its k-th
filesystem change, for every k, and the directory must then hold the complete old or new contents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core import storage
from core.storage import atomic_dir

CRASHED = 17
OLD = {"adapter.safetensors": "old weights", "adapter_config.json": "old config"}
NEW = {"adapter.safetensors": "new weights", "adapter_config.json": "new config", "README.md": "new"}

# The child arms an audit hook (no patching) that exits, as a kill would, before its k-th change to
# the filesystem (looking up renameat2 counts as one: the exchange follows at once). In "rename" mode
# libc has no renameat2, as on macOS or an old libc.
CHILD = """
import os, sys
from pathlib import Path
from core.storage import atomic_dir

target, crash_at, mode, crash_code = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
new = dict(arg.split("=", 1) for arg in sys.argv[5:])
CHANGES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir"}
seen = 0

def hook(event, args):
    global seen
    exchange = event == "ctypes.dlsym" and args[1] == "renameat2"
    if exchange and mode == "rename":
        raise AttributeError("renameat2")
    writes = event == "open" and args[2] is not None and args[2] & (os.O_WRONLY | os.O_RDWR)
    if event in CHANGES or writes or exchange:
        seen += 1
        if seen == crash_at:
            os._exit(crash_code)

sys.addaudithook(hook)
with atomic_dir(target) as tmp:
    for name, text in new.items():
        (tmp / name).write_text(text)
"""


def _fill(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)


def _contents(path: Path) -> dict[str, str] | None:
    if not path.is_dir():
        return None
    return {p.name: p.read_text() for p in path.iterdir()}


def _replace_in_child(target: Path, crash_at: int, mode: str) -> int:
    args = [f"{name}={text}" for name, text in NEW.items()]
    cmd = [sys.executable, "-c", CHILD, str(target), str(crash_at), mode, str(CRASHED), *args]
    return subprocess.run(cmd, cwd=Path(__file__).parents[2], timeout=60).returncode


@pytest.mark.parametrize("mode", ["exchange", "rename"])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_directory(tmp_path: Path, mode: str) -> None:
    crash_points, outcomes, recovered = 0, [], 0
    for crash_at in range(1, 100):
        target = tmp_path / f"crash-{crash_at}" / "adapter"
        _fill(target, OLD)
        code = _replace_in_child(target, crash_at, mode)
        if mode == "rename":  # between its two renames only the aside dir exists, until recovered
            recovered += not target.exists()
            storage.recover_dir(target)
        assert _contents(target) in (OLD, NEW), f"crash before change {crash_at}: {_contents(target)}"
        outcomes.append("new" if _contents(target) == NEW else "old")
        leftovers = {p.name for p in target.parent.iterdir()} - {"adapter"}
        assert not any(name.startswith(".old-") for name in leftovers), leftovers
        if code == 0:
            assert _contents(target) == NEW
            break
        assert code == CRASHED
        crash_points += 1
        with atomic_dir(target) as tmp:  # the next write after a crash works and cleans up
            (tmp / "x").write_text("next")
        assert _contents(target) == {"x": "next"}
    assert crash_points >= 6 and outcomes[-2:] == ["new", "new"], (crash_points, outcomes)
    assert recovered == (1 if mode == "rename" else 0)


def test_a_failing_block_leaves_the_old_directory(tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    _fill(target, OLD)
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "adapter.safetensors").write_text("half")
        raise RuntimeError("training died")
    assert _contents(target) == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_first_write_creates_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "jobs" / "j" / "adapter"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    assert _contents(target) == {"a": "1"}
