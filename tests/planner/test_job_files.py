"""A job's files in the storage quota (planner.job_files): what admission reserves, and the room check
training makes before each write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.arch import Architecture, load_architecture
from core.spec import JobSpec
from planner import job_files
from planner.job_files import StorageQuotaExceeded

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@pytest.fixture
def arch(tmp_path: Path) -> Architecture:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return load_architecture(tmp_path)


def spec(**fields: object) -> JobSpec:
    return JobSpec.model_validate({"base_model": "tiny", "dataset_id": "ds000001", **fields})


def test_a_checkpoint_is_the_adapter_and_its_adamw_state_and_each_kept_one_counts(arch: Architecture) -> None:
    long = {"max_steps": 1000, "checkpoint_every_steps": 1}
    three, ten = (job_files.project(spec(keep_checkpoints=k, **long), arch, 100) for k in (3, 10))
    trainable = arch.lora_params("all-linear", 16)
    assert three.trainable == trainable
    # fp32 weights (4 B) + AdamW m and v (8 B) + RNG, state.json (every step's loss)
    assert three.checkpoint_bytes == trainable * 12 + job_files.checkpoint_slack(1000)
    # the newest N, and the next one while it is written (before the oldest goes)
    assert (three.checkpoints, ten.checkpoints) == (4, 11)
    assert ten.total - three.total == 7 * (three.checkpoint_bytes + trainable * 4)  # + a serving layout each
    with_validation = job_files.project(spec(keep_checkpoints=3, validation_fraction=0.1, **long), arch, 100)
    assert with_validation.checkpoints == 5  # + the best by eval loss
    eight_bit = job_files.project(spec(optimizer="adamw_8bit", **long), arch, 100)
    assert eight_bit.checkpoint_bytes < three.checkpoint_bytes


def test_a_sharded_checkpoint_counts_the_weights_in_the_shards_and_each_rank_s_header(
    arch: Architecture,
) -> None:
    long = {"max_steps": 1000, "checkpoint_every_steps": 1}
    one = job_files.project(spec(**long), arch, 100)
    for gpus, nodes in ((2, 1), (4, 2)):
        fsdp = job_files.project(spec(num_gpus=gpus, num_nodes=nodes, **long), arch, 100)
        tensors = 2 * 7 * 2  # lora A and B of the 7 linears of 2 layers (all-linear)
        headers = job_files.shard_headers_bytes(tensors, gpus * nodes)
        assert fsdp.checkpoint_bytes == one.checkpoint_bytes + one.trainable * 4 + headers


def test_a_short_run_counts_only_the_checkpoints_it_can_save(arch: Architecture) -> None:
    # 8 examples, 4 a step: 2 steps (3 at most), one checkpoint at the end: keep_checkpoints cannot fill
    files = job_files.project(spec(keep_checkpoints=100), arch, 8)
    assert files.steps == 3 and files.checkpoints == 0 + 1 + 2  # epoch end, the end, an early stop


def test_a_merged_export_counts_the_model_and_its_archive(arch: Architecture) -> None:
    adapter, merged = (job_files.project(spec(export=e), arch, 8) for e in ("adapter", "merged"))
    assert adapter.merged_bytes == 0
    # the base in its dtype (config.json names none: float32), twice: merged/ and merged.tar.gz
    assert merged.merged_bytes == 2 * (arch.total_params * 4 + job_files.MERGED_SLACK)
    assert merged.total - adapter.total == merged.merged_bytes
    half = job_files.project(spec(export="merged", torch_dtype="bfloat16"), arch, 8)
    assert half.merged_bytes == 2 * (arch.total_params * 2 + job_files.MERGED_SLACK)


def test_samples_count_each_set(arch: Architecture) -> None:
    none = job_files.project(spec(max_steps=10), arch, 8)
    end = job_files.project(spec(max_steps=10, sample_prompts=4), arch, 8)
    assert end.log_bytes - none.log_bytes == 4 * job_files.SAMPLE_B * 2


def test_keep_checkpoints_is_bounded() -> None:
    assert spec(keep_checkpoints=100).keep_checkpoints == 100
    with pytest.raises(ValidationError, match="keep_checkpoints"):
        spec(keep_checkpoints=101)


def test_check_room_refuses_a_write_past_the_allowance_and_touches_nothing(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000001" / "adapter.safetensors").write_bytes(b"x" * 600)
    (tmp_path / "metrics.jsonl").write_bytes(b"y" * 100)
    job_files.check_room(tmp_path, None, 10**12, "anything")  # no allowance: no bound
    job_files.check_room(tmp_path, 1000, 300, "the checkpoint at step 2")  # 700 + 300 fit
    with pytest.raises(StorageQuotaExceeded) as e:
        job_files.check_room(tmp_path, 1000, 301, "the checkpoint at step 2")
    message = str(e.value)
    assert "the checkpoint at step 2 would take 301 bytes" in message and "700 of the 1,000 bytes" in message
    assert "keep_checkpoints" in message and str(tmp_path) not in message
    assert job_files.dir_bytes(tmp_path) == 700  # nothing written or removed


def test_a_finished_job_counts_its_directory_and_a_serving_layout_per_kept_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"a" * 50)
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "state.json").write_bytes(b"s" * 10)
    served = tmp_path / "checkpoint-adapters" / "step-00000002"
    served.mkdir(parents=True)
    (served / "adapter_model.safetensors").write_bytes(b"a" * 50)
    assert job_files.dir_bytes(tmp_path) == 50 + 20 + 50
    assert job_files.stored_bytes(tmp_path) == 50 + 20 + 50 + 50  # step 1 may be served yet
    assert job_files.stored_bytes(tmp_path / "gone") == 0
