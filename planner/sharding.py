"""What a multi-GPU (FSDP) job may ask for: one rule, applied at admission and by the engine.

FSDP2 turns each parameter into a sharded DTensor. torch's AdamW steps DTensors; bitsandbytes' 8-bit
optimizers have no DTensor sharding rule ("optimizer_update_32bit does not have a sharding strategy"),
and fp16 loss scaling would need the inf checks all-reduced over ranks (a sharded grad scaler).
LoRA and QLoRA both shard: bitsandbytes' Linear4bit keeps its quantisation state on the module, so
its packed 4-bit weight shards like any other tensor (tested on CPU with gloo).
"""

from __future__ import annotations

from core.spec import JobSpec


def ranks_spec(spec: JobSpec) -> JobSpec:
    """The spec one rank is planned with: a job of num_nodes nodes shards over num_gpus x num_nodes ranks,
    so each of its devices holds what one device of a one-node job of that many GPUs holds (its
    communicators and per-step slices included); the per-node device count is checked by placement."""
    if spec.num_nodes == 1:
        return spec
    return spec.model_copy(update={"num_gpus": spec.placement.world_size, "num_nodes": 1})


def fsdp_problem(spec: JobSpec) -> tuple[str, str] | None:
    """(param, reason) if the spec cannot run with num_gpus > 1, else None."""
    if not spec.placement.sharded:
        return None
    if spec.optimizer != "adamw":
        return "optimizer", (
            f"optimizer {spec.optimizer!r} cannot shard its state under FSDP (num_gpus > 1); use adamw, "
            "whose states FSDP already divides by num_gpus"
        )
    if spec.mixed_precision == "fp16":
        return "mixed_precision", "fp16 loss scaling is not supported under FSDP (num_gpus > 1); use bf16"
    if spec.objective == "grpo":
        return "num_gpus", (
            "objective 'grpo' runs on one GPU: its rollouts are not sharded yet (num_gpus 1; a larger "
            "micro_batch_size or num_generations uses the one GPU more)"
        )
    return None
