"""Load a local base model (plain or 4-bit NF4) and attach a LoRA adapter.

Never trusts remote code and never touches the network. The frozen base keeps its storage dtype;
the LoRA weights (and so their gradients and optimizer states) are fp32.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from core.spec import JobSpec


def pick_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def base_dtype(spec: JobSpec, model_dir: Path) -> torch.dtype:
    """spec.torch_dtype, where "auto" is the dtype the checkpoint's config.json declares."""
    if spec.torch_dtype != "auto":
        return getattr(torch, spec.torch_dtype)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, declared) if isinstance(declared, str) else declared


def compute_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmuls are fast on GPUs; on CPUs fp32 is both faster and exact.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


def load_model(spec: JobSpec, model_dir: Path, device: torch.device):
    """The base model with a fresh LoRA adapter; only the adapter's parameters require grad.

    LoRA initialisation draws from torch's global RNG, so seed it before calling.
    """
    if spec.method not in ("lora", "qlora"):
        raise ValueError(f"method {spec.method!r} is planned only and cannot be trained")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from training.packing import attn_implementation

    kwargs: dict = {
        "local_files_only": True,
        "trust_remote_code": False,
        # Packed batches need attention per example (training.packing).
        "attn_implementation": attn_implementation(spec.attn_implementation, spec.packing),
    }
    if spec.method == "qlora":
        cdtype = compute_dtype(device)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=cdtype,
        )
        kwargs["dtype"] = cdtype  # the layers that stay unquantized (norms, embeddings, lm_head)
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    else:
        kwargs["dtype"] = base_dtype(spec, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if spec.method == "lora":
        model.to(device)
    else:
        keep_one_4bit_layout(model)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    if spec.gradient_checkpointing:
        # Non-reentrant checkpointing needs no input grads and works with frozen embeddings.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return attach_lora(model, spec)


def keep_one_4bit_layout(model) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight into an inference layout the
    first time it runs in eval mode without grad, and keeps it: evaluation would change every later
    training step's numerics. Training keeps the layout it was loaded with."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def attach_lora(model, spec: JobSpec):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters, in a stable order (the optimizer's and the checkpoint's)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def autocast_for(spec: JobSpec, device: torch.device) -> AbstractContextManager:
    """Mixed precision of the forward pass: "auto" is bf16 on a GPU and off on a CPU."""
    mode = spec.mixed_precision
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "no"
    if mode == "no":
        return nullcontext()
    dtype = torch.bfloat16 if mode == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
