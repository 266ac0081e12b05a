"""bench/gpu_vs_trl.py's reference side: TRL's SFTTrainer trained on ftune's very tokens, and measured.

`trl_entry` runs in a process of its own (`gpu_vs_trl.py --trl-entry JOB_JSON`, started by gpu_vs_trl's
`start_run`): it builds TRL's trainer (LoRA, SFTConfig, packed or padded, length-grouped where padded),
times each step between torch.cuda.synchronize() calls, counts the real input tokens and the slots, and
writes trl_result.json. `trl_row` turns that file into the run's row of gpu_vs_trl's table. `cuda_peaks`,
`outcome` and `speed` are shared with gpu_vs_trl's ftune side, so both rows are filled alike.

Imported by bench/gpu_vs_trl.py, which puts the repository root and bench/ on sys.path first (core,
training, peft, trl and torch are imported inside the functions).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

# -- both sides ----------------------------------------------------------------------------------------------


def cuda_peaks() -> dict[str, int | None]:
    import torch

    if not torch.cuda.is_available():
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def outcome(steps_done: int, losses: list[float], peaks: dict[str, int | None]) -> dict[str, Any]:
    """The part of a run's row both engines fill alike: steps done, the first and the last step's loss
    (`losses` in step order), the allocator's peaks (`cuda_peaks`; {} where the run left none)."""
    return {
        "steps_done": steps_done,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "max_allocated_bytes": peaks.get("allocated"),
        "max_reserved_bytes": peaks.get("reserved"),
    }


def speed(tokens: int, slots: int | None, seconds: float, steps: int) -> dict[str, Any]:
    return {
        "timed_steps": steps,
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_step": tokens / steps,
        "ms_per_step": 1000 * seconds / steps,
        "padding_share": (1 - tokens / slots) if slots else (0.0 if slots is not None else None),
    }


# -- TRL's SFTTrainer, in its own process -------------------------------------------------------------------


def trl_entry(job_json: str) -> int:
    """Train with TRL's SFTTrainer in this process; write per-step times, tokens, losses and peaks."""
    job = json.loads(Path(job_json).read_text())
    out = Path(job["output_dir"])
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from core.spec import JobSpec
    from training.data import load_for_training
    from training.model import load_tokenizer

    spec = JobSpec.model_validate(job["spec"])
    cuda = torch.cuda.is_available()
    model_dir = Path(job["model_dir"])
    tokenizer = load_tokenizer(model_dir)
    items, _, _ = load_for_training(Path(job["dataset_path"]), tokenizer, spec)  # ftune's very tokens
    data = Dataset.from_dict({"input_ids": [t.input_ids for t in items], "labels": [t.labels for t in items]})

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=getattr(torch, spec.torch_dtype),
        attn_implementation=spec.attn_implementation,
        local_files_only=True,
    )
    model.config.use_cache = False
    if cuda:
        model.to("cuda")
    lora = LoraConfig(
        r=spec.lora_r,
        lora_alpha=int(spec.lora_alpha),
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    fields = TrainingArguments.__dataclass_fields__
    sampler: dict[str, Any] = {}
    if not spec.packing:  # length-grouped, as ftune's padded batches are (the field's name varies)
        if "train_sampling_strategy" in fields:
            sampler["train_sampling_strategy"] = "group_by_length"
        elif "group_by_length" in fields:
            sampler["group_by_length"] = True
    config = SFTConfig(
        output_dir=str(out / "trl"),
        max_steps=spec.max_steps,
        per_device_train_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        seed=spec.seed,
        bf16=cuda,
        fp16=False,
        use_cpu=not cuda,
        gradient_checkpointing=bool(spec.gradient_checkpointing),
        gradient_checkpointing_kwargs={"use_reentrant": False} if spec.gradient_checkpointing else None,
        max_length=spec.max_seq_len,
        packing=spec.packing,
        packing_strategy="bfd",
        padding_free=spec.packing,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **sampler,
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class CountingSFTTrainer(SFTTrainer):
        """SFTTrainer, counting the real input tokens and the slots (padding included) it trains on."""

        tokens = 0
        slots = 0

        def training_step(self, model, inputs, *args, **kwargs):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            self.tokens += int(mask.sum()) if mask is not None else ids.numel()
            self.slots += ids.numel()
            return super().training_step(model, inputs, *args, **kwargs)

    steps: list[dict[str, Any]] = []
    losses: dict[int, float] = {}

    class Clock(TrainerCallback):
        begin = 0.0
        tokens = slots = 0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.tokens, self.slots = trainer.tokens, trainer.slots
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            end = time.perf_counter()
            steps.append(
                {
                    "step": state.global_step,
                    "seconds": end - self.begin,
                    "end": end,
                    "tokens": trainer.tokens - self.tokens,
                    "slots": trainer.slots - self.slots,
                }
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    trainer = CountingSFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer.train()
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    base = trainer.model.get_base_model()
    result = {
        "lora_dtypes": sorted({str(p.dtype) for p in trained}),
        "trainable_params": sum(p.numel() for p in trained),
        "gradient_checkpointing": bool(getattr(base, "is_gradient_checkpointing", False)),
        "steps": steps,
        "losses": {str(k): v for k, v in losses.items()},
        "peaks": cuda_peaks(),
        "attn": getattr(trainer.model.config, "_attn_implementation", None),
        "sampler": sampler or None,
        "examples": len(items),
        "train_rows": len(trainer.train_dataset),
    }
    (out / "trl_result.json").write_text(json.dumps(result))
    return 0


# -- its row, as the parent sees it ------------------------------------------------------------------------


def trl_row(out: Path, packing: bool) -> dict:
    path = out / "trl_result.json"
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    steps = res["steps"]
    losses = {int(k): v for k, v in res["losses"].items()}
    row: dict[str, Any] = {
        "attn": res["attn"]
        + (" (block mask from position_ids)" if packing and res["attn"] == "sdpa" else ""),
        "sampler": res["sampler"],
        "lora_dtypes": res["lora_dtypes"],
        "trainable_params": res["trainable_params"],
        "gradient_checkpointing": res["gradient_checkpointing"],
        "train_rows": res["train_rows"],
        **outcome(len(steps), [losses[k] for k in sorted(losses)], res["peaks"]),
    }
    timed = [s for s in steps if s["step"] >= 2]
    if timed:
        tokens = sum(s["tokens"] for s in timed)
        row |= speed(tokens, sum(s["slots"] for s in timed), sum(s["seconds"] for s in timed), len(timed))
        first = next((s for s in steps if s["step"] == 1), None)
        if first is not None and timed[-1]["end"] > first["end"]:
            row["loop_tokens_per_s"] = tokens / (timed[-1]["end"] - first["end"])
    return row
