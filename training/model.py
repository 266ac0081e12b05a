"""Load a local base model (plain or 4-bit NF4) and attach a LoRA adapter.

Never trusts remote code and never touches the network. The frozen base keeps its storage dtype;
the LoRA weights (and so their gradients and optimizer states) are fp32.
"""

from __future__ import annotations

import copy
import json
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from core.spec import JobSpec
from planner.context import autocast_dtype, half_dtype


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


def bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def compute_dtype(device: torch.device, bf16: bool) -> torch.dtype:
    """QLoRA's compute dtype: the GPU's 16-bit dtype (bf16 where it has it, else fp16); on a CPU fp32,
    which is both faster and exact there. `bf16`: the device supports bf16 (bf16_supported)."""
    if device.type != "cuda":
        return torch.float32
    return getattr(torch, half_dtype(bf16))


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


def load_model(spec: JobSpec, model_dir: Path, device: torch.device, init_adapter: Path | None = None):
    """The base model with a fresh LoRA adapter, or (`init_adapter`, spec.init_from's directory) an
    earlier job's adapter to continue from; only the adapter's parameters require grad.

    LoRA initialisation draws from torch's global RNG, so seed it before calling.
    """
    if spec.method not in ("lora", "qlora"):
        raise ValueError(f"method {spec.method!r} is planned only and cannot be trained")
    from transformers import BitsAndBytesConfig

    from training.packing import ATTN_NAME, attn_implementation, prepare

    kwargs: dict = {
        "local_files_only": True,
        "trust_remote_code": False,
        # Packed batches need attention per example (training.packing).
        "attn_implementation": attn_implementation(spec.attn_implementation, spec.packing),
    }
    from training import vision_model as vision

    if spec.method == "qlora":
        cdtype = compute_dtype(device, bf16_supported(device))
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=cdtype,
            llm_int8_skip_modules=vision.unquantized_modules(model_dir),
        )
        kwargs["dtype"] = cdtype  # the layers that stay unquantized (norms, embeddings, lm_head)
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    else:
        kwargs["dtype"] = base_dtype(spec, model_dir)
    model = vision.auto_model_class(model_dir).from_pretrained(model_dir, **kwargs)
    if spec.method == "lora":
        model.to(device)
    else:
        keep_one_4bit_layout(model)
    model.config.use_cache = False
    if kwargs["attn_implementation"] == ATTN_NAME:
        prepare(device)
    if vision.is_vision_base(model_dir):
        vision.prepare_model(model)
    for p in model.parameters():
        p.requires_grad_(False)
    if spec.gradient_checkpointing:
        enable_checkpointing(model)
    from training import lora_add

    net = attach_trained_lora(model, spec, init_adapter) if init_adapter else attach_lora(model, spec)
    lora_add.install(net)  # each LoRA update added inside its GEMM (training.lora_add)
    return net


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer in backward. Non-reentrant checkpointing needs no input grads and
    works with frozen embeddings. transformers renamed the switch in 5.23 (the old name still works,
    with a deprecation warning, until 6), so the name is detected, not assumed."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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

    from training import dropout

    modules, parameters = peft_targets(model.config, spec.lora_target_modules)
    config = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,  # type: ignore[arg-type]  # peft annotates int; scaling is alpha / r
        lora_dropout=spec.lora_dropout,
        target_modules=modules,
        target_parameters=parameters,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    dropout.install(model)  # masks per example, whatever the split (training.dropout)
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def peft_targets(config, targets: list[str] | str) -> tuple[list[str] | str, list[str] | None]:
    """(target_modules, target_parameters) of the LoraConfig for a job's lora_target_modules on a base of
    this transformers config: the names as they are for a dense model (or one the planner does not read);
    a mixture-of-experts model's exact linears and expert stacks (core.arch.lora.peft_targets)."""
    from core.arch import from_config
    from core.arch.lora import peft_targets as resolve
    from core.errors import FtuneError

    try:
        arch = from_config(config.to_dict())
    except FtuneError:
        return targets, None
    modules, parameters = resolve(arch, targets)  # refuses the router and ambiguous names
    return modules, parameters or None


def attach_trained_lora(model, spec: JobSpec, adapter_dir: Path):
    """An earlier job's adapter, trained on (its shape: r, alpha, target modules; this spec's dropout).
    With a reference (objective dpo, not simpo) the same adapter is loaded a second time as "ref",
    frozen and without dropout: the reference policy (training.reference), on the same base weights."""
    from peft import get_peft_model
    from peft.utils import set_peft_model_state_dict

    from training import dropout
    from training.reference import REF_ADAPTER

    config, weights = read_trained_adapter(adapter_dir)
    if not config.target_parameters:  # a checkpoint's spec names, or a dense model's: as attach_lora's
        targets = config.target_modules
        config.target_modules, config.target_parameters = peft_targets(
            model.config, targets if isinstance(targets, str) else sorted(targets or [])
        )
    ref = copy.deepcopy(config)
    config.lora_dropout = spec.lora_dropout
    config.inference_mode = False
    model = get_peft_model(model, config)
    _load_adapter_weights(model, weights, "default", set_peft_model_state_dict)
    if spec.preference.uses_reference:
        ref.lora_dropout, ref.inference_mode = 0.0, True
        model.add_adapter(REF_ADAPTER, ref)
        _load_adapter_weights(model, weights, REF_ADAPTER, set_peft_model_state_dict)
    for name, p in model.named_parameters():  # the trained adapter alone, whatever add_adapter did
        p.requires_grad_(".lora_" in name and ".default." in name)
    dropout.install(model)
    for name, p in model.named_parameters():
        if ".lora_" in name and p.dtype != torch.float32:  # both adapters in fp32, as attach_lora's
            p.data = p.data.float()
    return model


def skip_adapter_input_casts(model) -> int:
    """Under autocast, let each LoRA layer hand its input to lora_A as it is (peft's
    `cast_input_dtype_enabled`; returns how many layers). peft first casts the input to the adapter's fp32,
    and autocast then casts that copy back to the compute dtype for the matmul: the same values, so the
    same loss and gradients, but each wrapped linear made two more passes over its input, kept its own
    compute-dtype copy for backward, and cast its input's gradient back and forth. Without the cast,
    q/k/v (and gate/up) share the one input the base linears read and o_proj reads the attention output
    the kernel keeps anyway (planner.memory counts this: Runtime.lora_input_cast).
    Only on CUDA: a CPU dropout scales its mask in its input's dtype (training.dropout), which a
    half-precision input would round."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.cast_input_dtype_enabled = False
    return len(layers)


def use_cuda_paths(model, device: torch.device, autocast: bool) -> str:
    """What the engine turns on where it trains on CUDA (and the planner counts there): peft's LoRA input
    casts off under autocast (skip_adapter_input_casts), the fused norms, gates and rotary embeddings
    (training.fused), run eagerly: the norms as ATen's fused RMSNorm kernels where this torch has them
    (training.fused.native_norm). Returns what it did, for the log; nothing on another device.

    Eagerly because compiled they were slower on an H200 (bench/fused_ops.py, 8,192 tokens, forward and
    backward, 2026-11-27): norm 0.93 ms against eager's 0.84 (0.90x), act(gate) * up 1.81 against 0.38
    (0.21x), rotary 1.33 against 0.69 (0.52x), and the 1.1B LoRA's step in bench/gpu_vs_trl.py went from
    ~205 to 263 ms. Run eagerly they keep the same fewer tensors (the planner's Runtime.fused_norm_mlp) at
    0.93, 0.43 and 0.68 ms. Those kernels had been tuned on a 4 x 8 probe (training.fused.compiled); now
    compiled at their first real call, they are not timed on a GPU yet."""
    if device.type != "cuda":
        return "none (not CUDA)"
    from training import fused

    casts = skip_adapter_input_casts(model) if autocast else 0
    norms = (
        "ATen's fused kernels where input and weight share a dtype"
        if fused.HAS_NATIVE_NORM
        else "the formula"
    )
    return f"LoRA input casts off on {casts} layers; fused, eager (norms: {norms}): {fused.install(model)}"


def read_trained_adapter(path: Path):
    """(LoraConfig, peft-named weights) of an adapter to continue from: a job's final adapter (peft's
    adapter_config.json + adapter_model.safetensors), or one of its checkpoints (spec.init_from_step:
    training.checkpoint's adapter.safetensors, named as the model's parameters, and the spec that shaped
    them in state.json)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    if (path / "adapter_model.safetensors").is_file():
        return LoraConfig.from_pretrained(str(path)), load_file(path / "adapter_model.safetensors")
    if (path / "adapter.safetensors").is_file() and (path / "state.json").is_file():
        shape = JobSpec.model_validate(json.loads((path / "state.json").read_text())["spec"])
        config = LoraConfig(
            r=shape.lora_r,
            lora_alpha=shape.lora_alpha,  # type: ignore[arg-type]  # as attach_lora's
            target_modules=shape.lora_target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        # "....q_proj.lora_A.default.weight" as trained -> "....q_proj.lora_A.weight" as peft saves it
        weights = {k.replace(".default.", "."): v for k, v in load_file(path / "adapter.safetensors").items()}
        return config, weights
    raise FileNotFoundError(f"the adapter to continue from (spec.init_from) is gone: {path}")


def _load_adapter_weights(model, weights: dict[str, torch.Tensor], name: str, set_state) -> None:
    result = set_state(model, weights, adapter_name=name)
    missing = [k for k in result.missing_keys if ".lora_" in k and f".{name}." in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the adapter to continue from does not fit this base model (missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]})"
        )


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters, in a stable order (the optimizer's and the checkpoint's)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@dataclass(frozen=True)
class Precision:
    """Mixed precision of the forward pass: the autocast dtype (None: none) and whether the loss is
    scaled (fp16 only: its gradients underflow without it)."""

    device_type: str
    dtype: torch.dtype | None

    @property
    def scaled(self) -> bool:
        return self.dtype == torch.float16

    def autocast(self) -> AbstractContextManager[object]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def precision_for(spec: JobSpec, device: torch.device, bf16: bool) -> Precision:
    """The planner's rule (planner.context.autocast_dtype) on this device: "auto" is bf16 on a
    GPU with bf16, fp16 with a GradScaler on one without, none on a CPU. `bf16`: bf16_supported(device),
    passed in so the rule is testable without such a GPU."""
    name = autocast_dtype(spec.mixed_precision, cuda=device.type == "cuda", bf16_supported=bf16)
    return Precision(device.type, getattr(torch, name) if name else None)
