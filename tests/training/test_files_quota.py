"""Training keeps the job's files within the allowance reserved in its tenant's storage quota
(RunConfig.files_allowance_bytes, training.quota): a checkpoint that would pass it fails the run with
storage_quota_exceeded before anything is written or pruned, and the earlier checkpoints stay whole.
Real training of the tiny model, in-process (training.run.run)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from core.run_protocol import RunConfig, read_error
from core.storage import ADAPTER_DIR, CHECKPOINT_ADAPTERS_DIR, CHECKPOINTS_DIR, ERROR_FILE, MERGED_DIR
from planner import job_files
from training.checkpoint import FILES, checkpoint_name, latest_checkpoint, list_checkpoints, prune
from training.run import EXIT_FAILED, EXIT_OK, run


def _steps(out: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_checkpoints(out / CHECKPOINTS_DIR)]


def test_a_checkpoint_past_the_allowance_fails_the_run_and_keeps_the_earlier_ones(
    make_config: Callable[..., RunConfig],
) -> None:
    config = make_config(max_steps=3, checkpoint_every_steps=1, keep_checkpoints=10)
    out = Path(config.output_dir)
    assert run(config) == EXIT_OK  # no allowance: no bound
    assert _steps(out) == [1, 2, 3]
    # Back to the state after step 1, then resume with room for one more checkpoint, not two.
    for step in (2, 3):
        shutil.rmtree(out / CHECKPOINTS_DIR / checkpoint_name(step))
    shutil.rmtree(out / ADAPTER_DIR)
    one = job_files.dir_bytes(out / CHECKPOINTS_DIR / checkpoint_name(1))
    allowance = job_files.dir_bytes(out) + job_files.CHECKPOINT_SLACK + one + one // 2
    for partial in (out / CHECKPOINTS_DIR / ".tmp-step-00000002-x", out / ".tmp-adapter-x"):
        partial.mkdir()  # what a killed attempt left half-written: discarded, not counted
        (partial / "optimizer.safetensors").write_bytes(b"0" * allowance)
    limited = config.model_copy(update={"files_allowance_bytes": allowance})

    assert run(limited) == EXIT_FAILED
    error = read_error(out / ERROR_FILE)
    assert error is not None and error[0] == "storage_quota_exceeded", error
    assert "the checkpoint at step 3 would take" in error[1] and "keep_checkpoints" in error[1]
    assert _steps(out) == [1, 2]  # step 2's fitted; step 3's was never begun, nothing was pruned
    assert latest_checkpoint(out / CHECKPOINTS_DIR) == out / CHECKPOINTS_DIR / checkpoint_name(2)
    for step in (1, 2):
        assert all((out / CHECKPOINTS_DIR / checkpoint_name(step) / f).is_file() for f in FILES)
    assert not list(out.glob(".tmp-*")) and not list((out / CHECKPOINTS_DIR).glob(".tmp-*"))
    assert not (out / ADAPTER_DIR).exists()
    assert job_files.dir_bytes(out) <= allowance


def test_a_merged_export_past_the_allowance_fails_the_run_before_it_is_written(
    make_config: Callable[..., RunConfig],
) -> None:
    config = make_config(max_steps=1, checkpoint_every_steps=0, export="merged")
    out = Path(config.output_dir)
    # Room for the checkpoint and the adapter, not for the merged model and its archive (each at least
    # the 64 MiB the projection allows for a model's config and tokenizer files)
    allowance = 64 * 2**20
    assert run(config.model_copy(update={"files_allowance_bytes": allowance})) == EXIT_FAILED
    error = read_error(out / ERROR_FILE)
    assert error is not None and error[0] == "storage_quota_exceeded", error
    assert "the final adapter and the merged model would take" in error[1]
    assert _steps(out) == [1]  # the run's checkpoint stays: resumable, downloadable
    assert not (out / ADAPTER_DIR).exists() and not (out / MERGED_DIR).exists()


def test_pruning_a_checkpoint_removes_its_serving_layout(tmp_path: Path) -> None:
    root = tmp_path / CHECKPOINTS_DIR
    for step in (1, 2, 3):
        (root / checkpoint_name(step)).mkdir(parents=True)
        (tmp_path / CHECKPOINT_ADAPTERS_DIR / checkpoint_name(step)).mkdir(parents=True)
    prune(root, 2)
    assert _steps(tmp_path) == [2, 3]
    served = sorted(p.name for p in (tmp_path / CHECKPOINT_ADAPTERS_DIR).iterdir())
    assert served == [checkpoint_name(2), checkpoint_name(3)]
