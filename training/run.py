"""`python -m training.run <run.json>`: train one job, resuming from its newest checkpoint.

The process around training.recipe (setup -> train -> finish): the command line, SIGTERM, error
classification and the exit codes of core.run_protocol: EXIT_OK done (output_dir/adapter/ written),
EXIT_FAILED (output_dir/error.json written), EXIT_STOPPED by SIGTERM after finishing the current step
and saving a checkpoint (nothing more written). Progress goes to stderr; metrics to
output_dir/metrics.jsonl. No API, Celery or database imports.

Under `torchrun --nproc_per_node N -m training.run run.json` each process is one FSDP rank (see
training.distributed); rank 0 alone writes metrics, checkpoints and the adapter. torchrun reports any
non-zero exit of its workers as 1, so a stop is also recorded in metrics.jsonl ({"type": "stopped"}).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from core.process import stop_with_worker
from core.run_protocol import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, RunConfig

if TYPE_CHECKING:
    from training.recipe import StopFlag

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_STOPPED", "classify_error", "main", "process_defaults", "run"]
log = logging.getLogger("ftune.training")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.run <run.json>", file=sys.stderr)
        return EXIT_USAGE
    process_defaults()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    config = RunConfig.model_validate_json(Path(argv[0]).read_text())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_with_worker()  # a worker that dies stops its training as a cancel would: checkpoint, exit 3
    return run(config, stop)


def process_defaults() -> None:
    """The environment a training process keeps unless told otherwise; set before torch or transformers
    import (training.forkserver sets it before its imports too)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the network, even by accident
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # CUDA's caching allocator, before its first allocation: expandable segments grow one mapping instead
    # of reserving a new segment whenever a size does not fit a cached block, so batches of varying shape
    # (and QLoRA's per-layer dequantised weights) do not strand reserved memory. The planner's total
    # assumes it; set PYTORCH_CUDA_ALLOC_CONF to choose otherwise.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def run(config: RunConfig, stop: StopFlag | None = None) -> int:
    """Train `config` until done or `stop` is set; returns the exit code."""
    from core.storage import ERROR_FILE, atomic_write_text

    stop = stop or threading.Event()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ERROR_FILE).unlink(missing_ok=True)  # from an earlier attempt of this job
    try:
        return _train(config, stop)
    except Exception as e:
        code, message = classify_error(e)
        log.error("training failed (%s)\n%s", code, traceback.format_exc())
    atomic_write_text(out / ERROR_FILE, json.dumps({"code": code, "message": message[:2000]}))
    return EXIT_FAILED


def classify_error(e: BaseException) -> tuple[str, str]:
    """The stable code and message error.json reports for a failure."""
    import torch

    from planner.job_files import CODE, StorageQuotaExceeded
    from training.data import DatasetError

    if isinstance(e, DatasetError):
        return "invalid_dataset", str(e)
    if isinstance(e, StorageQuotaExceeded):  # the job's files would pass their allowance (training.quota)
        return CODE, str(e)
    # CPU allocation failures are plain RuntimeErrors from c10's allocator.
    cpu_oom = isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or cpu_oom:
        return "out_of_memory", f"out of memory: {e}"
    return "training_error", f"{type(e).__name__}: {e}"


def _train(config: RunConfig, stop: StopFlag) -> int:
    from training import distributed, recipe

    try:
        state = recipe.setup(config, stop)
        if not recipe.train(state):
            return EXIT_STOPPED
        recipe.finish(state)
        return EXIT_OK
    finally:
        distributed.cleanup()


def exit_now(code: int) -> None:
    """Under torchrun (several ranks), leave without the interpreter's teardown: gloo's threads may still
    hold collective work that FSDP's state references, and destroying that during finalisation aborts
    the rank (SIGABRT, "terminate called without an active exception") after a run that succeeded, which
    torchrun reports as a failure. Metrics are flushed record by record, checkpoints and the adapter are
    written atomically, so nothing is lost by skipping it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_now(main())
