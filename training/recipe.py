"""The training recipe, read top to bottom: setup -> train -> finish (a torchtune recipe, litgpt's fit).

setup(config, stop) builds all a run needs into a State (device, FSDP, tokenizer, data, model,
optimizer, the newest checkpoint resumed, metrics writer) and writes the start record. train(state) is
the loop: a step, its record, evaluation and early stopping, checkpoints, a stop request. finish(state)
writes the adapter, the merged export if asked, and the done record.

The objective (spec.objective; training.objectives: sft, dpo, grpo) decides how the data are read, what
a step and an evaluation do, and which items give the sample prompts; the recipe calls it and is the
same for all. A reference policy (dpo, grpo with beta > 0) is carried by setup's model (training.model).

Under torchrun every rank runs all three; rank 0 alone writes files, but for each rank's shard of a
checkpoint (training.checkpoint_shards). The collectives (a step, evaluation, a checkpoint, the stop vote,
the adapter's gather) come on every rank in the same order, because every decision below depends only
on the position and the spec, the same on all ranks.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from core.run_protocol import (
    CheckpointRecord,
    DoneRecord,
    EvalRecord,
    RunConfig,
    SamplesRecord,
    StartRecord,
    StepRecord,
    StoppedRecord,
)
from core.spec import JobSpec
from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, MERGED_DIR, METRICS_FILE
from training import (
    batches,
    checkpoint,
    compiled,
    distributed,
    evaluate,
    export,
    memory,
    metrics,
    model,
    objectives,
    quota,
    samples,
)
from training.batches import Step
from training.step import Parts, Position, StepResult, lr_at, make_optimizer

Example = Any  # what a step's rows index: an example (sft), a preference pair (dpo), a prompt (grpo)

log = logging.getLogger("ftune.training")


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


@dataclass
class State:
    """Everything setup built; train and finish advance `pos` and write through `writer`."""

    config: RunConfig
    parts: Parts
    objective: objectives.Objective
    items: list[Example]
    val_items: list[Example]
    pad_id: int
    total_steps: int
    pos: Position
    writer: metrics.MetricsWriter
    tracker: memory.PeakMemory
    stop: StopFlag
    saved: set[int] = field(default_factory=set)  # steps whose checkpoint is on disk
    tokenizer: Any = None
    prompts: list[samples.Prompt] = field(default_factory=list)  # spec.sample_prompts, tokenized
    epoch: int = -1  # the epoch whose steps are in `steps`
    steps: list[Step] = field(default_factory=list)  # that epoch's global batches

    @property
    def spec(self) -> JobSpec:
        return self.parts.spec

    @property
    def out(self) -> Path:
        return Path(self.config.output_dir)


def _start(config: RunConfig) -> tuple[torch.device, bool]:
    """Seeds, picks the device (and joins FSDP's process group when launched under torchrun)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = config.spec
    seed_everything(spec.seed)
    device = model.pick_device()
    sharded = distributed.launched()
    if sharded:
        distributed.check_shardable(spec)
        device = distributed.init(device)
        if not distributed.is_main():
            log.setLevel(logging.WARNING)  # one rank's progress is enough
    where = f"{device} (CPU threads: {torch.get_num_threads()})" if device.type == "cpu" else device
    log.info("job %s: %s on %s, base %s", config.job_id, spec.method, where, config.model_dir)
    memory.reset_cuda_peaks(device)  # this run's peak from its loading on, also in a busy process
    return device, sharded


def _load_parts(config: RunConfig, device: torch.device, sharded: bool) -> Parts:
    """The model (with its adapter, CUDA paths, compiled layers and FSDP shards) and its optimizer."""
    spec = config.spec
    precision = model.precision_for(spec, device, model.bf16_supported(device))
    if sharded and precision.scaled:
        raise ValueError("fp16 loss scaling (a GPU without bf16) is not supported under FSDP (num_gpus > 1)")
    torch.manual_seed(spec.seed)  # LoRA init: the same on every rank, which then keeps its slice
    # Under FSDP a LoRA base is loaded on the CPU: fully_shard moves each unit's slice to the device, so
    # no GPU ever holds the whole model. bitsandbytes quantizes on the device it loads to, so QLoRA
    # loads there. (Only the CPU case is tested here.)
    on = torch.device("cpu") if sharded and spec.method == "lora" else device
    init = Path(config.init_adapter_dir) if config.init_adapter_dir else None  # spec.init_from's adapter
    net = model.load_model(spec, Path(config.model_dir), on, init_adapter=init)
    log.info("CUDA paths: %s", model.use_cuda_paths(net, device, autocast=precision.dtype is not None))
    log.info("compiled: %s", compiled.compile_layers(net, spec, device, sharded, config.compile_layers))
    if sharded:
        distributed.shard(net, device)
        log.info("FSDP over %d processes", distributed.world_size())
    params = [p for _, p in model.trainable_parameters(net)]
    scaler = torch.amp.GradScaler(device.type) if precision.scaled else None
    return Parts(spec, net, make_optimizer(spec, params), params, device, precision.autocast, scaler)


def _tokenize_samples(state: State, sharded: bool) -> None:
    """spec.sample_prompts, tokenized into state.prompts; never the reason a run fails."""
    spec = state.spec
    if spec.sample_prompts and sharded:
        log.warning("no before/after samples under FSDP (num_gpus > 1): see training.samples")
    elif spec.sample_prompts:
        try:
            state.prompts = samples.prompts_for(
                state.config,
                state.tokenizer,
                state.val_items or state.items,
                objectives.objective_class(spec).sample_prompts,
            )
            log.info("%d sample prompts", len(state.prompts))
        except Exception:  # samples are a view of the run: never the reason it fails
            log.warning("no before/after samples: their prompts could not be rendered", exc_info=True)


def setup(config: RunConfig, stop: StopFlag) -> State:
    spec = config.spec
    device, sharded = _start(config)

    tokenizer = model.load_tokenizer(Path(config.model_dir))
    items, val_items, dropped, token_stats = load_splits(config, tokenizer)
    # What the planner counts activations and logits with; only the start record (rank 0's) uses it.
    shape = memory.batch_shape(spec, items, val_items) if distributed.is_main() else None
    if shape is not None:
        token_stats |= shape.token_stats()
    log.info(
        "dataset: %d training and %d validation examples or pairs (%d dropped: over max_seq_len with "
        "over_length=drop, or nothing to train on); tokens per example %s",
        len(items), len(val_items), dropped, token_stats,
    )  # fmt: skip

    parts = _load_parts(config, device, sharded)
    total = batches.total_steps(spec, [x.length for x in items])

    if distributed.is_main():
        quota.discard_partial(Path(config.output_dir))  # an earlier attempt's half-written files
    latest = checkpoint.latest_checkpoint(Path(config.output_dir) / CHECKPOINTS_DIR)
    pos = checkpoint.load_checkpoint(latest, parts) if latest else Position()
    if latest:
        log.info("resumed from %s", latest)
    path = Path(config.output_dir) / METRICS_FILE
    writer = metrics.MetricsWriter(path) if distributed.is_main() else metrics.NullWriter()
    predicted = memory.predicted_peaks(spec, Path(config.model_dir), device, shape)
    writer.write(
        StartRecord(
            total_steps=total,
            num_examples=len(items),
            num_validation_examples=len(val_items),
            dropped_examples=dropped,
            token_stats=token_stats,
            trainable_params=sum(p.numel() for p in parts.params),
            resumed_from_step=pos.step,
            predicted_peak_bytes=predicted.allocated,
            predicted_reserved_bytes=predicted.reserved,
        )
    )
    state = State(
        config=config,
        parts=parts,
        objective=objectives.build(objectives.Context(config, parts, pad_id(tokenizer), tokenizer)),
        items=items,
        val_items=val_items,
        pad_id=pad_id(tokenizer),
        total_steps=total,
        pos=pos,
        writer=writer,
        tracker=memory.PeakMemory(device),
        stop=stop,
    )
    if latest:
        state.saved.add(pos.step)
    state.tokenizer = tokenizer
    _tokenize_samples(state, sharded)
    return state


def train(state: State) -> bool:
    """Optimizer steps until total_steps or an early stop (True), or until a stop request (False:
    the state is checkpointed and a stopped record written). Checkpoints every checkpoint_every_steps
    steps, at each epoch end and at the end."""
    spec, pos, parts = state.spec, state.pos, state.parts
    parts.model.train()
    if pos.stopped_early:  # resumed from the checkpoint an early stop left
        return True
    if pos.step == 0 and state.val_items and state.objective.evaluates_at_start:
        run_evaluation(state)  # the baseline its later evaluations are read against
    ran = False
    while pos.step < state.total_steps:
        if stop_requested(state):
            return stopped(state, save=ran)  # nothing to save when this process has not stepped

        # Step: the next global batch of the epoch, split across micro-batches and ranks.
        steps = epoch_steps(state, pos.epoch)
        lr = lr_at(spec, pos.step, state.total_steps)
        start = time.perf_counter()
        key = (spec.seed, pos.epoch)  # the epoch's dropout masks
        with state.tracker.step(memory.model_state_tensors(parts.model, parts.optimizer)):
            step = steps[pos.step_in_epoch]
            result = state.objective.train_step(state.items, step, lr=lr, dropout_key=key, step_no=pos.step)
        seconds = time.perf_counter() - start
        epoch_ended = advance(pos, result, seconds, len(steps))
        ran = True

        # Record.
        record_step(state, result, seconds, len(steps))

        # Evaluate, and stop early when evaluations stop improving.
        if state.val_items and evaluate.is_eval_step(spec, pos.step, state.total_steps, epoch_ended):
            run_evaluation(state)
            if evaluate.should_stop_early(spec, pos):
                log.info(
                    "early stop: %d evaluations without a better eval loss", pos.evals_without_improvement
                )
                pos.stopped_early = True
                save_checkpoint(state)
                return True

        # Checkpoint.
        every = spec.checkpoint_every_steps
        if pos.step >= state.total_steps or epoch_ended or (every and pos.step % every == 0):
            save_checkpoint(state)
    if stop_requested(state):  # asked during the last step: stop, rather than spend time exporting
        return stopped(state, save=True)
    return True


def finish(state: State) -> None:
    """The samples (if asked), the adapter (and merged model, if asked) written, then the done record."""
    record_samples(state, "end")
    spec, pos, out = state.spec, state.pos, state.out
    adapter_dir = out / ADAPTER_DIR
    final_loss = pos.losses[-1] if pos.losses else None
    net = state.parts.model
    quota.check_final(state.config, state.parts)  # collective: within the job's storage allowance
    weights = {n: distributed.full_tensor(p) for n, p in model.trainable_parameters(net)}  # collective
    merged_dir = None
    if distributed.is_main():
        card = export.model_card(state.config, final_loss=final_loss, pos=pos, peak=state.tracker.peak_bytes)
        export.save_adapter(net, weights, adapter_dir, spec.base_model, card)
        if spec.export == "merged":
            dtype = model.base_dtype(spec, Path(state.config.model_dir))
            merged_dir = export.export_merged(
                Path(state.config.model_dir), adapter_dir, out / MERGED_DIR, dtype
            )
            log.info("merged model at %s", merged_dir)
    distributed.barrier()
    state.writer.write(
        DoneRecord(
            step=pos.step,
            final_loss=final_loss,
            adapter_dir=str(adapter_dir),
            stopped_early=pos.stopped_early,
            best_eval_loss=pos.best_eval_loss,
            merged_dir=str(merged_dir) if merged_dir else None,
        )
    )
    state.writer.close()
    log.info("done: %d steps, final loss %s, adapter at %s", pos.step, final_loss, adapter_dir)


# The loop's parts, in the order the loop uses them.


def stop_requested(state: State) -> bool:
    """Collective: every rank stops after the same step, whichever rank got the SIGTERM."""
    return distributed.any_rank(state.stop.is_set())


def stopped(state: State, save: bool) -> bool:
    if save:
        save_checkpoint(state)  # a no-op when the last step was just saved
    log.info("stopped at step %d", state.pos.step)
    state.writer.write(StoppedRecord(step=state.pos.step))
    state.writer.close()
    return False


def epoch_steps(state: State, epoch: int) -> list[Step]:
    """The global batches of `epoch`, computed once per epoch (a pure function of the spec)."""
    if state.epoch != epoch:
        lengths = [x.length for x in state.items]
        state.epoch, state.steps = epoch, batches.epoch_steps(state.spec, lengths, epoch)
    return state.steps


def advance(pos: Position, result: StepResult, seconds: float, steps_in_epoch: int) -> bool:
    """Move `pos` past a step; returns whether the step ended its epoch."""
    pos.step += 1
    pos.tokens_seen += result.tokens
    pos.losses.append(result.loss)
    pos.elapsed_s += seconds
    pos.step_in_epoch += 1
    if pos.step_in_epoch < steps_in_epoch:
        return False
    pos.epoch, pos.step_in_epoch = pos.epoch + 1, 0
    return True


def record_step(state: State, r: StepResult, seconds: float, steps_in_epoch: int) -> None:
    pos, peak = state.pos, state.tracker.peak_bytes
    speed, eta = (
        metrics.tokens_per_s(r.tokens, seconds),
        metrics.eta_s(pos.elapsed_s, pos.step, state.total_steps),
    )
    state.writer.write(
        StepRecord(
            step=pos.step,
            total_steps=state.total_steps,
            epoch=round(pos.epoch + pos.step_in_epoch / steps_in_epoch, 4),
            loss=r.loss,
            lr=r.lr,
            grad_norm=r.grad_norm,
            tokens=r.tokens,
            target_tokens=r.target_tokens,
            tokens_per_s=speed,
            elapsed_s=round(pos.elapsed_s, 3),
            eta_s=eta,
            peak_mem_bytes=peak,
            peak_reserved_bytes=state.tracker.reserved_bytes,
            **r.fields,  # the objective's own: sft token accuracy; dpo rewards, log-probs; grpo rl
        )
    )
    reserved = state.tracker.reserved_bytes
    log.info(
        "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s peak %.1f MiB%s eta %ss%s",
        pos.step, state.total_steps, r.loss, r.lr, r.grad_norm, speed or 0, peak / 2**20,
        f" (reserved {reserved / 2**20:.1f} MiB)" if reserved is not None else "", eta, r.note,
    )  # fmt: skip


def run_evaluation(state: State) -> None:
    """Collective under FSDP (the forward gathers the shards): evaluate, track the best, record."""
    pos = state.pos
    ev = state.objective.evaluate(state.val_items, pos.step)
    if ev.loss is not None:  # grpo has no loss to compare: no best, no early stop
        evaluate.record_eval(pos, ev.loss, state.spec.early_stopping_min_delta)
    state.writer.write(
        EvalRecord(step=pos.step, eval_loss=ev.loss, best_eval_loss=pos.best_eval_loss, **ev.fields)
    )
    shown = "n/a" if ev.loss is None else f"{ev.loss:.4f}"
    log.info("eval at step %d: loss %s %s", pos.step, shown, ev.note)
    if state.spec.sample_at_eval:
        record_samples(state, "eval")


def record_samples(state: State, at: Literal["eval", "end"]) -> None:
    """Before/after samples of the spec's prompts (training.samples); none asked, or under FSDP: none."""
    if not state.prompts:
        return
    parts, limit = state.parts, state.spec.sample_max_tokens
    try:
        items = samples.generate_samples(
            parts.model, state.tokenizer, state.prompts, limit, parts.device, parts.autocast
        )
    except Exception:  # e.g. out of memory for the KV cache, which the plan does not count
        log.warning("no before/after samples at step %d", state.pos.step, exc_info=True)
        return
    state.writer.write(SamplesRecord(step=state.pos.step, at=at, items=items))
    log.info("samples at step %d (%s): %d prompts", state.pos.step, at, len(items))


def save_checkpoint(state: State) -> None:
    """Collective: the whole state after pos.step steps, once per step."""
    step = state.pos.step
    if step in state.saved:
        return
    quota.check_checkpoint(state.config, state.parts, step)  # within the job's storage allowance
    path = checkpoint.save_checkpoint(state.out / CHECKPOINTS_DIR, state.parts, state.pos, state.total_steps)
    state.saved.add(step)
    state.writer.write(CheckpointRecord(step=step, path=str(path)))
    log.info("checkpoint %s", path)


# Setup's helpers.


def load_splits(config: RunConfig, tokenizer: object) -> tuple[list[Example], list[Example], int, dict]:
    """(training examples or pairs, validation ones, how many were dropped (too long under
    over_length=drop, or nothing to train on), token statistics of the training file)."""
    from training.data import DatasetError

    spec = config.spec
    load, tokenizer = objectives.dataset_reader(spec, Path(config.model_dir), tokenizer)
    items, dropped, stats = load(Path(config.dataset_path), tokenizer, spec, config.column_mapping)
    if spec.validation_dataset_id:
        if not config.validation_path:
            raise DatasetError("the spec names a validation dataset but the run has no path for it")
        path = Path(config.validation_path)
        val, _, _ = load(path, tokenizer, spec, config.validation_column_mapping)
        return items, val, dropped, stats
    train_items, val = evaluate.split_validation(items, spec.validation_fraction, spec.seed)
    return train_items, val, dropped, stats


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pad_id(tokenizer: object) -> int:
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None:
            return int(tid)
    return 0
