"""bench/gpu_vs_trl.py's opponents: TRL's SFTTrainer (as configured by default, and at its fastest) and
Unsloth, each trained on ftune's very tokens, and measured alike.

`trl_entry` runs in a process of its own (`gpu_vs_trl.py --trl-entry JOB_JSON`, started by gpu_vs_trl's
`start_run`): it builds the opponent's trainer (LoRA or QLoRA, SFTConfig, packed or padded, length-grouped
where padded), times each step between torch.cuda.synchronize() calls, counts the real input tokens and the
slots, and writes trl_result.json: what it ran (`config`: the SFTConfig fields that matter, as set; `used`:
each optional component and its version; `notes`: each one asked for and not used, with the reason).
`trl_row` turns that file into the run's row of gpu_vs_trl's table. `cuda_peaks`, `outcome`, `speed` and
`compile_counts` are shared with gpu_vs_trl's ftune side, so both rows are filled alike.

The job's `variant` (gpu_vs_trl's Run.variant) says which opponent:
  {}                   TRL as configured by default for the job (the rows of 2026-11-26..28): SDPA, LoRA
                       weights fp32 (peft's default), packed rows padding-free (BFD), no Liger, no compile
  liger                SFTConfig(use_liger_kernel=True) where liger-kernel imports and CUDA is there:
                       transformers patches the model's RMSNorm, SwiGLU and rotary embedding with Liger's
                       Triton kernels (TRL 1.16 forces Liger's fused linear cross-entropy off: its own
                       chunked LM head computes the loss)
  compile              SFTConfig(torch_compile=True) on CUDA: Trainer compiles the whole (peft) model,
                       inductor, default mode
  attn "varlen"        the best padding-free attention installed (`varlen_attention`): flash_attention_3,
                       flash_attention_2 (TRL's documented kernels for padding-free), transformers' hub
                       kernel kernels-community/flash-attn2 where its files are already cached (no network
                       here), else flex_attention (torch's own: a block-sparse document mask that
                       transformers builds from position_ids), else SDPA; the row says which ran and why
  lora_bf16            the LoRA weights in bf16, the base's dtype: the PeftModel built here with
                       get_peft_model(..., autocast_adapter_dtype=False) and handed to SFTTrainer (TRL
                       allows a PeftModel; it has no switch of its own). QLoRA's adapters are bf16 anyway:
                       SFTTrainer casts them for a quantized base
  unsloth              Unsloth: `import unsloth` first, FastLanguageModel.from_pretrained (load_in_4bit for
                       QLoRA: Unsloth's nf4 with double quantisation, as ftune's) and get_peft_model
                       (use_gradient_checkpointing="unsloth" where checkpointing is on), then TRL's
                       SFTTrainer as Unsloth patches it, packed and padding-free. It needs TRL <= 1.15 and
                       datasets < 5 (its pins; TRL 1.15 needs datasets >= 4.7): bench/gpu_session.sh puts
                       them, with Unsloth, first on its PYTHONPATH (UNSLOTH_SITE). If it does not import,
                       unavailable.json says why and the row reads "unavailable: <reason>"

Imported by bench/gpu_vs_trl.py, which puts the repository root and bench/ on sys.path first (core,
training, peft, trl, unsloth and torch are imported inside the functions).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

# -- both sides ----------------------------------------------------------------------------------------------


def cuda_peaks() -> dict[str, int | None]:
    import torch

    if not torch.cuda.is_available():
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def outcome(steps_done: int, losses: list[float], peaks: dict[str, int | None]) -> dict[str, Any]:
    """The part of a run's row both engines fill alike: steps done, the losses in step order (the first and
    the last apart), the allocator's peaks (`cuda_peaks`; {} where the run left none)."""
    return {
        "steps_done": steps_done,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
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


def compile_counts() -> dict[str, Any]:
    """What torch.compile made in this process: graphs, recompiles and graph breaks (with their first
    reasons): a compiled run's speed means little if its graphs broke or compiled again per batch."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": [reason.splitlines()[0][:200] for reason in list(breaks)[:3]],
    }


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- which opponent ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """What an opponent's run asks for (the module docstring); each is used only where it can be, and the
    row says what was."""

    liger: bool = False
    compile: bool = False
    attn: str = ""  # "": the job's (spec.attn_implementation); "varlen": `varlen_attention`; or a name
    lora_bf16: bool = False
    unsloth: bool = False

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v}


def varlen_attention(cuda: bool) -> tuple[str, str]:
    """(attn_implementation, why): the fastest padding-free attention this machine has, in the order TRL's
    docs give for padding-free training (FlashAttention 3, 2), then the hub kernel transformers falls back
    to, then torch's flex attention, then SDPA (transformers' block mask from position_ids)."""
    if not cuda:
        return "sdpa", "no CUDA: flash and flex attention not tried on a CPU"
    import transformers.utils as tu

    for name, check in (("flash_attention_3", "is_flash_attn_3_available"),
                        ("flash_attention_2", "is_flash_attn_2_available")):  # fmt: skip
        available = getattr(tu, check, None)
        if available is not None and available():
            return name, f"{name}: flash-attn installed"
    missing = "flash-attn not installed (no wheel on PyPI; this machine can neither build nor download one)"
    if importlib.util.find_spec("kernels") is not None:
        try:  # offline: only a kernel already in the local hub cache loads
            from kernels import get_kernel

            get_kernel("kernels-community/flash-attn2")
            return "kernels-community/flash-attn2", f"{missing}; the hub kernel is cached here"
        except Exception as exc:  # any failure: not available here
            missing += f"; kernels-community/flash-attn2 not loadable offline ({type(exc).__name__})"
    else:
        missing += "; the `kernels` package (hub kernels) not installed"
    flex = getattr(tu, "is_torch_flex_attn_available", None)
    if flex is not None and flex():
        return "flex_attention", f"{missing}: torch's flex attention, a block-sparse mask per packed sequence"
    return "sdpa", f"{missing}; flex attention unavailable: SDPA with a block mask from position_ids"


# -- the opponent, in its own process ------------------------------------------------------------------------


def trl_entry(job_json: str) -> int:
    """Train the job's opponent in this process; write per-step times, tokens, losses and peaks."""
    job = json.loads(Path(job_json).read_text())
    variant = Variant(**job.get("variant", {}))
    if variant.unsloth:
        return unsloth_entry(job, variant)
    return _trl(job, variant)


def _trl(job: dict[str, Any], variant: Variant) -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from core.spec import JobSpec

    spec = JobSpec.model_validate(job["spec"])
    cuda = torch.cuda.is_available()
    used: dict[str, Any] = {}
    notes: list[str] = []
    attn = spec.attn_implementation
    if variant.attn == "varlen":
        attn, why = varlen_attention(cuda)
        used["attention_choice"] = why
    elif variant.attn:
        attn = variant.attn
    kwargs: dict[str, Any] = {"attn_implementation": attn, "local_files_only": True}
    if spec.method == "qlora":  # ftune's quantisation (training.model.load_model), on the opponent's side
        cdtype = torch.bfloat16 if cuda else torch.float32
        kwargs |= {
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=cdtype,
            ),
            "dtype": cdtype,
            "device_map": {"": 0 if cuda else "cpu"},
        }  # fmt: skip
    else:
        kwargs["dtype"] = getattr(torch, spec.torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], **kwargs)
    model.config.use_cache = False
    if cuda and spec.method != "qlora":
        model.to("cuda")
    lora = LoraConfig(
        r=spec.lora_r,
        lora_alpha=int(spec.lora_alpha),
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_config: Any = lora
    if variant.lora_bf16:
        if spec.method == "qlora":
            notes.append("lora_bf16: nothing to do (SFTTrainer casts QLoRA's adapters to bf16 itself)")
        else:  # TRL takes a PeftModel; autocast_adapter_dtype=False keeps the adapters in the base's dtype
            model = get_peft_model(model, lora, autocast_adapter_dtype=False)
            peft_config = None
            used["lora_weights"] = "get_peft_model(autocast_adapter_dtype=False): the base's dtype"
    liger = False
    if variant.liger:
        from transformers.utils import is_liger_kernel_available

        if not cuda:
            notes.append("use_liger_kernel: skipped (no CUDA: Liger's kernels are Triton GPU kernels)")
        elif not is_liger_kernel_available():
            notes.append("use_liger_kernel: skipped (liger-kernel not installed)")
        else:
            liger = True
            used["liger_kernel"] = version_of("liger-kernel")
    compiled = False
    if variant.compile:
        if cuda:
            compiled = True
            used["torch_compile"] = f"inductor, default mode, torch {torch.__version__}"
        else:
            notes.append("torch_compile: skipped (no CUDA: inductor on a CPU takes minutes for this smoke)")
    extra = {"use_liger_kernel": liger, "torch_compile": compiled}
    return _train(job, spec, model, peft_config, extra, used, notes, attn)


def unsloth_entry(job: dict[str, Any], variant: Variant) -> int:
    """Unsloth's FastLanguageModel and its patched SFTTrainer; "unavailable" where it does not import."""
    out = Path(job["output_dir"])
    late = [m for m in ("transformers", "trl", "peft") if m in sys.modules]
    try:
        import unsloth  # noqa: F401  # first: it patches transformers, trl and peft as they import
        from unsloth import FastLanguageModel
    except BaseException as exc:  # ImportError, or Unsloth's own refusal (no GPU, versions)
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]
        (out / "unavailable.json").write_text(json.dumps({"reason": reason, "imported_before": late}))
        print(f"unsloth unavailable: {reason}", flush=True)
        return 3
    import torch

    from core.spec import JobSpec

    spec = JobSpec.model_validate(job["spec"])
    cuda = torch.cuda.is_available()
    checkpointing = "unsloth" if spec.gradient_checkpointing else False  # its default is "unsloth": said
    model, _ = FastLanguageModel.from_pretrained(
        model_name=job["model_dir"],
        max_seq_length=spec.max_seq_len,
        dtype=torch.bfloat16 if cuda else torch.float32,
        load_in_4bit=spec.method == "qlora",
        load_in_8bit=False,
        full_finetuning=False,
        use_gradient_checkpointing=checkpointing,
    )
    targets = spec.lora_target_modules
    if targets == "all-linear":  # Unsloth's own list: every linear of a Llama block
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = FastLanguageModel.get_peft_model(
        model,
        r=spec.lora_r,
        lora_alpha=int(spec.lora_alpha),
        lora_dropout=spec.lora_dropout,
        target_modules=targets,
        bias="none",
        use_gradient_checkpointing=checkpointing,
        random_state=spec.seed,
        max_seq_length=spec.max_seq_len,
    )
    used = {
        "unsloth": version_of("unsloth"),
        "unsloth_zoo": version_of("unsloth_zoo"),
        "use_gradient_checkpointing": checkpointing,
        "load_in_4bit": spec.method == "qlora",
    }
    # checkpointing is Unsloth's (get_peft_model above): SFTConfig's stays off
    extra = {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": None}
    attn = getattr(model.config, "_attn_implementation", None) or "unsloth's"
    return _train(job, spec, model, None, extra, used, [], attn)


def _train(
    job: dict[str, Any],
    spec,  # core.spec.JobSpec
    model,
    peft_config,
    extra: dict[str, Any],
    used: dict[str, Any],
    notes: list[str],
    attn: str,
) -> int:
    """SFTTrainer on ftune's tokens with the job's settings (`extra`: the variant's SFTConfig fields),
    timed; writes trl_result.json."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from training.data import load_for_training
    from training.model import load_tokenizer

    out = Path(job["output_dir"])
    cuda = torch.cuda.is_available()
    model_dir = Path(job["model_dir"])
    tokenizer = load_tokenizer(model_dir)
    items, _, _ = load_for_training(Path(job["dataset_path"]), tokenizer, spec)  # ftune's very tokens
    data = Dataset.from_dict({"input_ids": [t.input_ids for t in items], "labels": [t.labels for t in items]})

    fields = TrainingArguments.__dataclass_fields__
    sampler: dict[str, Any] = {}
    if not spec.packing:  # length-grouped, as ftune's padded batches are (the field's name varies)
        if "train_sampling_strategy" in fields:
            sampler["train_sampling_strategy"] = "group_by_length"
        elif "group_by_length" in fields:
            sampler["group_by_length"] = True
    settings: dict[str, Any] = {
        "max_steps": spec.max_steps,
        "per_device_train_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "learning_rate": spec.learning_rate,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch",
        "seed": spec.seed,
        "bf16": cuda,
        "fp16": False,
        "use_cpu": not cuda,
        "gradient_checkpointing": bool(spec.gradient_checkpointing),
        "gradient_checkpointing_kwargs": {"use_reentrant": False} if spec.gradient_checkpointing else None,
        "max_length": spec.max_seq_len,
        "packing": spec.packing,
        "packing_strategy": "bfd",
        "padding_free": spec.packing,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **sampler,
        **extra,
    }
    known = SFTConfig.__dataclass_fields__
    for name in [k for k in settings if k not in known]:  # an older TRL (Unsloth's) may lack a field
        notes.append(f"{name}: not a field of this TRL's SFTConfig, left out")
        del settings[name]
    config = SFTConfig(output_dir=str(out / "trl"), **settings)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    class CountingSFTTrainer(SFTTrainer):  # type: ignore[misc, valid-type]
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
        tokens = slots = made = 0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.tokens, self.slots, self.made = trainer.tokens, trainer.slots, graphs()
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
                    "compiled": graphs() > self.made,  # torch.compile made a graph in this step
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
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    base = trainer.model.get_base_model()
    if extra.get("use_liger_kernel"):  # what Liger patched (its forwards bound onto the modules), not asked
        patched = [m for m in base.modules() if str(getattr(m.forward, "__module__", "")).startswith("liger")]
        used["liger_patched_modules"] = len(patched)
    shown = ("packing", "packing_strategy", "padding_free", "use_liger_kernel", "torch_compile", "bf16",
             "gradient_checkpointing", "gradient_checkpointing_kwargs", "optim", "max_length",
             "per_device_train_batch_size", "loss_type", "train_sampling_strategy",
             "group_by_length")  # fmt: skip
    result = {
        "lora_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trained}),
        "trainable_params": sum(p.numel() for p in trained),
        "gradient_checkpointing": bool(getattr(base, "is_gradient_checkpointing", False)),
        "steps": steps,
        "losses": {str(k): v for k, v in losses.items()},
        "peaks": cuda_peaks(),
        "attn": getattr(base.config, "_attn_implementation", None) or attn,
        "sampler": sampler or None,
        "examples": len(items),
        "train_rows": len(trainer.train_dataset),
        "config": {k: getattr(config, k) for k in shown if hasattr(config, k)},
        "used": used,
        "notes": notes,
        "versions": {d: version_of(d) for d in ("trl", "transformers", "peft", "torch", "bitsandbytes")},
        "compiled": compile_counts(),
    }
    (out / "trl_result.json").write_text(json.dumps(result, default=str))
    return 0


# -- its row, as the parent sees it ------------------------------------------------------------------------


def trl_row(out: Path, packing: bool, warmup: int = 1) -> dict:
    """The run's row from its trl_result.json: timed over the steps after the first `warmup`, leaving out
    any later step in which torch.compile made a graph (each such step is counted in
    `compile_steps_left_out`: an allowance the opponent gets, ftune's rows do not)."""
    if (out / "unavailable.json").exists():
        why = json.loads((out / "unavailable.json").read_text())["reason"]
        return {"unavailable": why, "skipped": True, "error": f"unavailable: {why}"}
    path = out / "trl_result.json"
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    steps = res["steps"]
    losses = {int(k): v for k, v in res["losses"].items()}
    attn = res["attn"]
    if packing and attn == "sdpa":
        attn += " (block mask from position_ids)"
    row: dict[str, Any] = {
        "attn": attn,
        "sampler": res["sampler"],
        "lora_dtypes": res["lora_dtypes"],
        "trainable_params": res["trainable_params"],
        "gradient_checkpointing": res["gradient_checkpointing"],
        "train_rows": res["train_rows"],
        "opponent": {k: res.get(k) for k in ("config", "used", "notes", "versions")},
        **outcome(len(steps), [losses[k] for k in sorted(losses)], res["peaks"]),
    }
    if res.get("compiled", {}).get("graphs"):
        row["compiled"] = res["compiled"]
    after = [s for s in steps if s["step"] > warmup]
    timed = [s for s in after if not s.get("compiled")]
    row["compile_steps_left_out"] = len(after) - len(timed)
    if timed:
        tokens = sum(s["tokens"] for s in timed)
        row |= speed(tokens, sum(s["slots"] for s in timed), sum(s["seconds"] for s in timed), len(timed))
        first = next((s for s in steps if s["step"] == warmup), None)
        if first is not None and after[-1]["end"] > first["end"]:
            row["loop_tokens_per_s"] = sum(s["tokens"] for s in after) / (after[-1]["end"] - first["end"])
    return row
