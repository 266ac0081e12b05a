"""`python -m training.run <run.json>`: train one job, resuming from its newest checkpoint.

Exit codes: 0 done (output_dir/adapter/ written), 1 failed (output_dir/error.json written),
3 stopped by SIGTERM after finishing the current step and saving a checkpoint (nothing more written).
Progress goes to stderr; metrics to output_dir/metrics.jsonl. No API, Celery or database imports.

Under `torchrun --nproc_per_node N -m training.run run.json` each process is one FSDP rank (see
training.distributed); rank 0 alone writes metrics, checkpoints and the adapter. torchrun reports any
non-zero exit of its workers as 1, so a stop is also recorded in metrics.jsonl ({"type": "stopped"}).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Protocol

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 3
log = logging.getLogger("ftune.training")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.run <run.json>", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the network, even by accident
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    from core.run_protocol import RunConfig

    config = RunConfig.model_validate_json(Path(argv[0]).read_text())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return run(config, stop)


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


def run(config, stop: StopFlag | None = None) -> int:
    """Train `config` (a core.run_protocol.RunConfig) until done or `stop` is set; returns the exit code."""
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

    from training.data import DatasetError

    if isinstance(e, DatasetError):
        return "invalid_dataset", str(e)
    # CPU allocation failures are plain RuntimeErrors from c10's allocator.
    cpu_oom = isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or cpu_oom:
        return "out_of_memory", f"out of memory: {e}"
    return "training_error", f"{type(e).__name__}: {e}"


def _train(config, stop: StopFlag) -> int:
    from training import distributed

    try:
        return _train_on(config, stop, distributed.launched())
    finally:
        distributed.cleanup()


def _train_on(config, stop: StopFlag, sharded: bool) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, MERGED_DIR, METRICS_FILE
    from training import checkpoint, distributed, evaluate, export, loop, memory, metrics, model

    hf_logging.disable_progress_bar()
    spec, out = config.spec, Path(config.output_dir)
    seed_everything(spec.seed)
    device = model.pick_device()
    if sharded:
        check_shardable(spec)
        device = distributed.init(device)
        if not distributed.is_main():
            log.setLevel(logging.WARNING)  # one rank's progress is enough
    log.info("job %s: %s on %s, base %s", config.job_id, spec.method, device, config.model_dir)

    tokenizer = model.load_tokenizer(Path(config.model_dir))
    items, val_items, dropped, token_stats = load_splits(config, tokenizer)
    log.info(
        "dataset: %d training and %d validation examples (%d dropped: over max_seq_len with "
        "over_length=drop, or nothing to train on); tokens per example %s",
        len(items), len(val_items), dropped, token_stats,
    )  # fmt: skip

    torch.manual_seed(spec.seed)  # LoRA init: the same on every rank, which then keeps its slice
    # Under FSDP a LoRA base is loaded on the CPU: fully_shard moves each unit's slice to the device, so
    # no GPU ever holds the whole model. bitsandbytes quantizes on the device it loads to, so QLoRA
    # loads there. (Only the CPU case is tested here.)
    on = torch.device("cpu") if sharded and spec.method == "lora" else device
    net = model.load_model(spec, Path(config.model_dir), on)
    if sharded:
        distributed.shard(net, device)
        log.info("FSDP over %d processes", distributed.world_size())
    params = [p for _, p in model.trainable_parameters(net)]
    fp16 = spec.mixed_precision == "fp16"
    t = loop.Trainer(
        spec=spec,
        model=net,
        optimizer=loop.make_optimizer(spec, params),
        params=params,
        items=items,
        pad_id=_pad_id(tokenizer),
        device=device,
        total_steps=loop.total_steps(spec, [len(x.input_ids) for x in items]),
        autocast=lambda: model.autocast_for(spec, device),
        scaler=torch.amp.GradScaler(device.type) if fp16 else None,
    )

    ckpt_root = out / CHECKPOINTS_DIR
    latest = checkpoint.latest_checkpoint(ckpt_root)
    pos = checkpoint.load_checkpoint(latest, t) if latest else loop.Position()
    if latest:
        log.info("resumed from %s", latest)
    writer = metrics.MetricsWriter(out / METRICS_FILE) if distributed.is_main() else metrics.NullWriter()
    writer.write(
        {
            "type": "start",
            "total_steps": t.total_steps,
            "num_examples": len(items),
            "num_validation_examples": len(val_items),
            "dropped_examples": dropped,
            "token_stats": token_stats,
            "trainable_params": sum(p.numel() for p in params),
            "resumed_from_step": pos.step,
            "predicted_peak_bytes": predicted_peak_bytes(spec, Path(config.model_dir), device),
        }
    )
    tracker = memory.PeakMemory(device)
    saved = {pos.step} if latest else set()

    def on_step(r: loop.StepResult, p: loop.Position, seconds: float) -> bool:
        rec = metrics.step_record(
            step=p.step,
            total_steps=t.total_steps,
            epoch=p.epoch + p.batch_index / len(t.epoch_order(p.epoch)),
            loss=r.loss,
            lr=r.lr,
            grad_norm=r.grad_norm,
            tokens=r.tokens,
            step_seconds=seconds,
            elapsed_s=p.elapsed_s,
            peak_mem_bytes=tracker.peak_bytes,
        )
        writer.write({**rec, "target_tokens": r.target_tokens})
        log.info(
            "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s peak %.1f MiB eta %ss",
            p.step, t.total_steps, r.loss, r.lr, r.grad_norm, rec["tokens_per_s"] or 0,
            tracker.peak_bytes / 2**20, rec["eta_s"],
        )  # fmt: skip
        if not val_items or not evaluate.is_eval_step(spec, p.step, t.total_steps, r.epoch_ended):
            return False
        ev = evaluate.evaluate(net, val_items, spec.micro_batch_size, t.pad_id, device, t.autocast)
        evaluate.record_eval(p, ev.loss, spec.early_stopping_min_delta)
        writer.write(
            {
                "type": "eval",
                "step": p.step,
                "eval_loss": ev.loss,
                "eval_token_accuracy": ev.token_accuracy,
                "eval_tokens": ev.target_tokens,
                "best_eval_loss": p.best_eval_loss,
            }
        )
        log.info("eval at step %d: loss %.4f token accuracy %.3f", p.step, ev.loss, ev.token_accuracy)
        if evaluate.should_stop_early(spec, p):
            log.info("early stop: %d evaluations without a better eval loss", p.evals_without_improvement)
            return True
        return False

    def on_checkpoint(p: loop.Position) -> None:
        if p.step in saved:
            return
        path = checkpoint.save_checkpoint(ckpt_root, t, p)
        saved.add(p.step)
        writer.write({"type": "checkpoint", "step": p.step, "path": str(path)})
        log.info("checkpoint %s", path)

    def measure():
        return tracker.step(memory.model_state_tensors(net, t.optimizer))

    def should_stop() -> bool:
        return distributed.any_rank(stop.is_set())  # every rank stops after the same step

    finished = loop.train(t, pos, on_step, on_checkpoint, should_stop, measure)
    if not finished:
        log.info("stopped at step %d; exiting with code %d", pos.step, EXIT_STOPPED)
        writer.write({"type": "stopped", "step": pos.step})
        writer.close()
        return EXIT_STOPPED

    adapter_dir = out / ADAPTER_DIR
    final_loss = pos.losses[-1] if pos.losses else None
    weights = {n: distributed.full_tensor(p) for n, p in model.trainable_parameters(net)}
    if distributed.is_main():
        save_adapter(
            net, weights, adapter_dir, config, final_loss=final_loss, pos=pos, peak=tracker.peak_bytes
        )
    done = {"type": "done", "step": pos.step, "final_loss": final_loss, "adapter_dir": str(adapter_dir)}
    done.update(stopped_early=pos.stopped_early, best_eval_loss=pos.best_eval_loss)
    if spec.export == "merged" and distributed.is_main():
        dtype = model.base_dtype(spec, Path(config.model_dir))
        merged = export.export_merged(Path(config.model_dir), adapter_dir, out / MERGED_DIR, dtype)
        done["merged_dir"] = str(merged)
        log.info("merged model at %s", merged)
    distributed.barrier()
    writer.write(done)
    writer.close()
    log.info("done: %d steps, final loss %s, adapter at %s", pos.step, final_loss, adapter_dir)
    return EXIT_OK


def load_splits(config, tokenizer) -> tuple[list, list, int, dict]:
    """(training examples, validation examples, examples dropped (too long under over_length=drop, or
    nothing to train on), token statistics of the training file)."""
    from training import data, evaluate

    spec = config.spec
    items, dropped, stats = data.load_for_training(
        Path(config.dataset_path), tokenizer, spec, config.column_mapping
    )
    if spec.validation_dataset_id:
        if not config.validation_path:
            raise data.DatasetError("the spec names a validation dataset but the run has no path for it")
        path = Path(config.validation_path)
        val, _, _ = data.load_for_training(path, tokenizer, spec, config.validation_column_mapping)
        return items, val, dropped, stats
    train, val = evaluate.split_validation(items, spec.validation_fraction, spec.seed)
    return train, val, dropped, stats


def predicted_peak_bytes(spec, model_dir: Path, device) -> int | None:
    """The planner's allocated bytes for this spec on the device this run uses: what the tracker
    measures (max_memory_allocated on CUDA, live tensor bytes on a CPU), stored next to it."""
    import torch

    from core.arch import load_architecture
    from core.planner.feasibility import device_gpu, plan_on

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev = {"kind": "cuda", "name": props.name, "memory_bytes": props.total_memory}
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        dev = {"kind": "cpu", "name": "cpu", "memory_bytes": ram}
    try:
        return plan_on(spec, load_architecture(model_dir), device_gpu(dev)).allocated_bytes
    except Exception:  # a model the planner does not know must not stop training
        log.warning("no memory prediction for this run", exc_info=True)
        return None


def check_shardable(spec) -> None:
    """What FSDP here does not support, refused before any work (admission refuses it too)."""
    from core.planner.sharding import fsdp_problem

    problem = fsdp_problem(spec.model_copy(update={"num_gpus": 2}))  # also a 1-GPU spec under torchrun
    if problem:
        raise ValueError(problem[1])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def save_adapter(net, weights: dict, adapter_dir: Path, config, *, final_loss, pos, peak: int) -> None:
    """peft's safetensors adapter + adapter_config.json + a model card, renamed into place.

    `weights` are the whole trainable tensors by name (gathered from all ranks under FSDP)."""
    from core.storage import atomic_dir

    with atomic_dir(adapter_dir) as tmp:
        net.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        cfg_path = tmp / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = config.spec.base_model  # a name, not this server's path
        cfg_path.write_text(json.dumps(cfg, indent=2))
        (tmp / "README.md").write_text(model_card(config, final_loss=final_loss, pos=pos, peak=peak))


def model_card(config, *, final_loss, pos, peak: int) -> str:
    import bitsandbytes
    import peft
    import torch
    import transformers

    spec = config.spec
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }
    final = {
        "steps": pos.step,
        "final_loss": final_loss,
        "first_loss": pos.losses[0] if pos.losses else None,
        "tokens_seen": pos.tokens_seen,
        "train_seconds": round(pos.elapsed_s, 1),
        "peak_mem_bytes": peak,
        "best_eval_loss": pos.best_eval_loss,
        "stopped_early": pos.stopped_early,
    }
    return "\n".join(
        [
            f"# LoRA adapter for {spec.base_model}",
            "",
            f"Trained by ftune, job `{config.job_id}`, method `{spec.method}`, seed {spec.seed}.",
            "",
            f"Dataset `{spec.dataset_id}`, sha256 `{file_sha256(Path(config.dataset_path))}`.",
            "",
            "```python",
            "from peft import PeftModel",
            f"model = PeftModel.from_pretrained(base_model, 'path/to/this/dir')  # base: {spec.base_model}",
            "```",
            "",
            "## Spec",
            "```json",
            json.dumps(spec.model_dump(mode="json"), indent=2),
            "```",
            "## Final metrics",
            "```json",
            json.dumps(final, indent=2),
            "```",
            "## Library versions",
            "```json",
            json.dumps(versions, indent=2),
            "```",
            "",
        ]
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
