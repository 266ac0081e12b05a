"""Sharded FSDP checkpoints for real (2 gloo ranks under torchrun): each rank writes its own slices of the
weights and of AdamW's state (training.checkpoint_shards), none of them the whole, nothing pickled, and a
run resumed from such a checkpoint on 2 ranks ends bit for bit where the uninterrupted run ended."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from core.storage import CHECKPOINTS_DIR
from planner.job_files import SHARD_HEADER_B
from tests.training.test_fsdp import FSDP, adapter, finish, launch, losses, records
from tests.training.util import qa_rows
from training.checkpoint import ADAPTER, OPTIMIZER, STATE, checkpoint_name
from training.checkpoint_shards import SHARDS_DIR, shard_files

pytestmark = pytest.mark.slow


def header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and its size in bytes."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), size


def test_each_rank_writes_its_shard_and_a_resume_from_them_is_exact(make_config, tmp_path: Path) -> None:
    config = make_config(qa_rows(18), name="sharded", epochs=2, checkpoint_every_steps=1, **FSDP)
    out = Path(config.output_dir)
    rc, log = finish(launch(config, tmp_path))
    assert rc == 0, log
    assert sorted(losses(out)) == list(range(1, 7))

    mid = out / CHECKPOINTS_DIR / checkpoint_name(4)  # mid-epoch 2 (3 steps an epoch)
    state = json.loads((mid / STATE).read_text())
    assert state["shards"] == 2 and not (mid / OPTIMIZER).exists()
    files = sorted(p.name for p in (mid / SHARDS_DIR).iterdir())
    assert files == shard_files(2)  # one per rank, and no pickled .metadata beside them
    assert all(p.suffix in {".safetensors", ".json"} for p in mid.rglob("*") if p.is_file())

    whole = load_file(mid / ADAPTER)  # rank 0's consolidated adapter, for serving and init_from
    moments = {f"optimizer.{n}.{k}": w.numel() for n, w in whole.items() for k in ("exp_avg", "exp_avg_sq")}
    slices: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for name in files:
        head, size = header(mid / SHARDS_DIR / name)
        info = json.loads(head["__metadata__"]["DCP_SHARDING_INFO"])
        with safe_open(mid / SHARDS_DIR / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                slices.setdefault(key, []).append((info[key]["saved_offsets"], f.get_tensor(key)))
        per_tensor = size / len(whole)
        print(f"{name}: header {size} B, {per_tensor:.0f} B per LoRA tensor (bound {SHARD_HEADER_B})")
        assert per_tensor < SHARD_HEADER_B
        mine = sum(math.prod(head[k]["shape"]) for k in head if k in moments)
        assert 0 < mine < sum(moments.values())  # its part of AdamW's moments, not all of them
    # The ranks' slices of each moment and weight, put together, are the whole: nothing lost or doubled.
    for key, numel in moments.items():
        assert sum(t.numel() for _, t in slices[key]) == numel, key
    for name, w in whole.items():
        parts = sorted(slices[f"weights.{name}"], key=lambda s: s[0])
        assert [off[0] for off, _ in parts] == [0, parts[0][1].shape[0]]
        assert torch.equal(torch.cat([t for _, t in parts]), w), name

    # Resumed on 2 ranks from the step-4 shards in a fresh job directory: the same steps, bit for bit.
    resumed = config.model_copy(update={"output_dir": str(tmp_path / "resumed")})
    ckpts = Path(resumed.output_dir) / CHECKPOINTS_DIR
    shutil.copytree(mid, ckpts / mid.name)
    rc, log = finish(launch(resumed, tmp_path))
    assert rc == 0, log
    again = Path(resumed.output_dir)
    assert [r["resumed_from_step"] for r in records(again, "start")] == [4]
    assert losses(again) == {s: v for s, v in losses(out).items() if s > 4}
    a, b = adapter(again), adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
