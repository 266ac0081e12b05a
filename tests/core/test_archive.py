"""core.archive: the same members whether the archive is written as a file or streamed."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from core.archive import checkpoint_members, flat_files, stream_tar_gz, write_tar_gz


def _tree(root: Path) -> Path:
    src = root / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "b.json").write_text("{}")
    (src / "a.safetensors").write_bytes(b"\0" * 100)
    (src / "sub" / "c.txt").write_text("c")
    return src


def _names_and_bytes(tar: tarfile.TarFile) -> list[tuple[str, bytes | None]]:
    out = []
    for m in tar.getmembers():
        f = tar.extractfile(m) if m.isfile() else None
        out.append((m.name, f.read() if f else None))
    return out


def test_flat_files_are_sorted_and_leave_subdirectories_out(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    assert [name for _, name in flat_files(src, "x/")] == ["x/a.safetensors", "x/b.json"]


def test_a_written_and_a_streamed_archive_hold_the_same_members(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    written = write_tar_gz(tmp_path / "out.tar.gz", flat_files(src, "x/"))
    streamed = b"".join(stream_tar_gz(flat_files(src, "x/")))
    with tarfile.open(written) as a, tarfile.open(fileobj=io.BytesIO(streamed)) as b:
        assert _names_and_bytes(a) == _names_and_bytes(b)
        assert [n for n, _ in _names_and_bytes(a)] == ["x/a.safetensors", "x/b.json"]


def test_a_directory_member_brings_everything_below_it(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    with tarfile.open(write_tar_gz(tmp_path / "dir.tar.gz", [(src, src.name)])) as tar:
        names = tar.getnames()
    assert names == ["ckpt", "ckpt/a.safetensors", "ckpt/b.json", "ckpt/sub", "ckpt/sub/c.txt"]


def test_a_checkpoint_archive_holds_its_ranks_shards_and_no_other_subfolder(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    (src / "shards").mkdir()
    (src / "shards" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"\1" * 10)
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream_tar_gz(checkpoint_members(src, "x/"))))) as tar:
        names = [n for n, _ in _names_and_bytes(tar)]
    assert names == [
        "x/a.safetensors",
        "x/b.json",
        "x/shards",
        "x/shards/shard-00001-model-00001-of-00001.safetensors",
    ]
