"""`python -m training.token_stats`: a job's token statistics, tokenized exactly as training does.

    python -m training.token_stats --model-dir DIR --dataset FILE --spec SPEC_JSON [--column-mapping JSON]

The spec is the job's JobSpec (the one contract API -> training): max_seq_len, over_length,
train_on_inputs, packing, micro_batch_size, gradient_accumulation_steps, num_gpus, examples_per_step,
seed and validation_fraction shape the result.
Prints one JSON object on stdout: training.data.token_stats's fields (count, p50, p95, max,
over_max_seq_len, over_length) plus max_seq_len, packing, dropped, micro_batches_per_epoch,
steps_per_epoch, examples_per_micro_batch and run_epochs, and exits 0. With objective dpo an example is a
preference pair (training.objectives.dpo.pairs.pair_stats: also prompt_p50/p95/max, completion_p50/p95/max,
truncated and kind "preference"). On an error it prints
{"error": {"code", "message"}} and exits 1. Loads the tokenizer only (no weights), never with remote
code; its launcher (models.token_stats, which says who runs it when) passes paths it resolved from ids,
never a user's. Importing this module is cheap (the standard library only; torch and training's
modules are imported by compute): the launcher imports it for its name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED = 0, 1
NICENESS = 10  # below the API's requests


class StatsError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def compute(
    model_dir: Path, dataset: Path, column_mapping: dict[str, str] | None, spec: Any
) -> dict[str, Any]:
    """The statistics of `dataset` for `spec` (a core.spec.JobSpec) against model_dir's tokenizer."""
    from training import batches, evaluate
    from training.memory import batch_shape

    # dpo's pairs add prompt and completion lengths and the pairs truncated (objectives.dpo.pairs); count,
    # p50, ... describe a pair's longer side (what max_seq_len bounds); grpo's: its prompts; a
    # vision-language base's examples count their image tokens
    load, tokenizer = _reader(spec, model_dir)
    items, dropped, stats = load(dataset, tokenizer, spec, column_mapping)
    # The steps training makes: of the training split (as training.recipe.load_splits makes it).
    train, validation = evaluate.split_validation(items, spec.validation_fraction, spec.seed)
    lengths = [t.length for t in train]
    # Packed epochs can differ by a step or so; the first one stands for all.
    steps = batches.epoch_steps(spec, lengths, 0)
    micro_batches = sum(len(batches.split_step(spec, lengths, s)) for s in steps)
    steps_per_epoch = len(steps)
    shape = batch_shape(spec, train, validation)  # the planner re-plans the job with it
    return {
        **stats,
        "max_seq_len": spec.max_seq_len,
        "packing": spec.packing,
        "dropped": dropped,
        "micro_batches_per_epoch": micro_batches,  # over all ranks
        "steps_per_epoch": steps_per_epoch,
        "examples_per_micro_batch": round(len(train) / micro_batches, 2),
        # A packed step holds many examples, so max_steps can be many more epochs than it looks.
        "run_epochs": round(spec.max_steps / steps_per_epoch, 2) if spec.max_steps else spec.epochs,
        **(shape.token_stats() if shape else {}),
    }


def _reader(spec: Any, model_dir: Path) -> tuple[Any, Any]:
    """training.objectives.dataset_reader: the load and the base's tokenizer (or processor) it reads with."""
    from training.objectives import dataset_reader

    try:
        return dataset_reader(spec, model_dir)
    except (OSError, ValueError) as e:
        # Not the exception text: it names this server's paths.
        reason = f"{type(e).__name__}; see the server log"
        message = f"the base model's tokenizer or processor cannot be loaded ({reason})"
        raise StatsError("tokenizer_error", message) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.token_stats", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--spec", required=True, help="the job's JobSpec as JSON")
    parser.add_argument("--column-mapping", default="null", help="the upload's column mapping as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the network, even by accident
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON answer only
            result = _run(args)
    except StatsError as e:
        traceback.print_exception(e, file=sys.stderr)  # the whole cause, for the server's log
        print(json.dumps({"error": {"code": e.code, "message": e.message[:2000]}}), file=out)
        return EXIT_FAILED
    print(json.dumps(result), file=out)
    return EXIT_OK


def detach_from_requests() -> None:
    """Tokenizing is batch work beside training: lower this process's priority, and stop it when the
    worker that started it ends (core.process)."""
    from core.process import stop_with_worker

    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    stop_with_worker()


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from pydantic import ValidationError

    from core.spec import JobSpec
    from training.data import DatasetError

    try:
        spec = JobSpec.model_validate_json(args.spec)
        mapping = json.loads(args.column_mapping)
    except (ValidationError, ValueError) as e:
        raise StatsError("invalid_spec", str(e)) from e
    try:
        return compute(args.model_dir, args.dataset, mapping, spec)
    except DatasetError as e:
        raise StatsError("invalid_dataset", str(e)) from e
    except StatsError:
        raise
    except Exception as e:
        raise StatsError("token_stats_error", f"{type(e).__name__}: {e}") from e


if __name__ == "__main__":
    detach_from_requests()
    sys.exit(main())
