"""What every section of the memory model counts with, derived once per plan: the dtypes (names and bytes
per value) of weights, activations, trainable parameters and optimizer states, the trainable parameters
and the tokens of a micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from core.arch import Architecture, LinearModule
from core.arch.lora import expert_lora
from core.errors import InvalidInput
from core.spec import JobSpec
from planner.gpus import Gpu
from planner.memory import DTYPE_BYTES
from planner.types import BatchShape, Runtime


def autocast_dtype(mixed_precision: str, *, cuda: bool, bf16_supported: bool) -> str | None:
    """The one mixed-precision rule of the engine (training.model) and the planner: "auto" is bf16
    autocast on a GPU that has bf16, fp16 autocast with loss scaling on one that has not (T4, V100),
    and none on a CPU; "bf16" and "fp16" are taken as asked; "no" (and None returned) is no autocast."""
    if mixed_precision == "auto":
        return half_dtype(bf16_supported) if cuda else None
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision)


def half_dtype(bf16_supported: bool) -> str:
    """A GPU's 16-bit compute dtype (QLoRA computes in it): bf16 where the GPU has it, else fp16."""
    return "bfloat16" if bf16_supported else "float16"


def compute_dtype(spec: JobSpec, arch: Architecture, gpu: Gpu) -> str:
    """What autocast casts to (autocast_dtype); without autocast, the storage dtype."""
    cuda, bf16 = gpu.kind != "cpu", gpu.bf16_supported
    return autocast_dtype(spec.mixed_precision, cuda=cuda, bf16_supported=bf16) or storage_dtype(spec, arch)


def storage_dtype(spec: JobSpec, arch: Architecture | None) -> str:
    """torch_dtype "auto" loads what config.json says (transformers' rule), float32 when it says nothing."""
    if spec.torch_dtype != "auto":
        return spec.torch_dtype
    return (arch.config_dtype if arch else None) or "float32"


@dataclass(frozen=True)
class Context:
    """One plan's inputs and the values derived from them that more than one section of the model uses."""

    spec: JobSpec
    arch: Architecture
    runtime: Runtime
    cpu: bool  # a CPU worker's RAM: no CUDA context, no caching allocator
    full: bool  # method "full": every parameter is trained
    lora: tuple[tuple[LinearModule, int], ...]  # linears peft wraps, each with its number of layers
    trainable: int  # trainable parameters
    tokens: int  # per micro-batch (dpo: both sides): the data's largest, else all padded to max_seq_len
    seq_len: int  # the widest sequence of that micro-batch (eager attention's probabilities scale with it)
    logit_tokens: int  # positions the lm_head and loss run on: the scored ones (the data's; grpo: the
    #                   completions), else all
    shape: BatchShape | None  # the data's largest micro-batch, None: the worst case
    shard: str  # note suffix of the terms FSDP divides over the GPUs
    store: str  # dtype of the base weights in memory
    store_b: int
    compute: str  # what autocast casts to
    compute_b: int
    half_model: bool  # the framework runs the whole model in half precision, without autocast
    fp32_upcast: bool  # QLoRA's unquantized layers cast to fp32 (Runtime.kbit_fp32_upcast)
    autocast: bool
    act_b: int  # bytes per activation value
    res_b: int  # bytes per value of the residual stream between blocks: the embeddings' dtype, which adding a
    #            block's (autocast) output keeps; fp32 under kbit_fp32_upcast
    fused_loss: bool  # the chunked loss head (training.loss) serves this model; False: the plain one
    lora_act_b: int  # bytes per value the LoRA branch saves when it differs from act_b, else 0
    trainable_b: int  # bytes per trainable parameter, and per gradient (it has its parameter's dtype)
    master_b: int  # bytes per fp32 master copy of a trainable parameter, 0: none
    state_b: int  # bytes per AdamW state value


# Families whose config applies logit soft-capping by default (gemma2: final_logit_softcapping 30.0); the
# engine's chunked head does not serve those (training.loss takes the plain path).
SOFTCAPPED = ("gemma2",)


def fused_loss(
    spec: JobSpec, arch: Architecture, runtime: Runtime, lora: tuple[tuple[LinearModule, int], ...]
) -> bool:
    """Whether the loss head is the chunked one: the framework has it (Runtime.fused_loss) and the model
    allows it (training.loss.head_losses): a frozen lm_head (not full fine-tuning, not a LoRA target) and
    no logit soft-capping."""
    head_trained = spec.method == "full" or any(m.name == "lm_head" for m, _ in lora)
    return runtime.fused_loss and not head_trained and arch.model_type not in SOFTCAPPED


def plan_context(
    spec: JobSpec, arch: Architecture, gpu: Gpu, runtime: Runtime, shape: BatchShape | None = None
) -> Context:
    n = spec.num_gpus
    method = spec.method
    cpu = gpu.kind == "cpu"
    # the engine loads QLoRA's unquantized layers (and dequantizes) in its device dtype (training.model)
    qlora_store = "float32" if cpu else half_dtype(gpu.bf16_supported)
    store = qlora_store if method == "qlora" else storage_dtype(spec, arch)
    cdt = compute_dtype(spec, arch, gpu)
    half_model = runtime.half_model_master and cdt != "float32"
    if half_model:
        store = cdt  # the framework casts the whole model to its half dtype and runs it without autocast
    sb = DTYPE_BYTES[store]
    amp = autocast_dtype(spec.mixed_precision, cuda=not cpu, bf16_supported=gpu.bf16_supported)
    autocast = amp is not None and cdt != "float32" and not half_model
    ce = DTYPE_BYTES[cdt]  # what autocast casts to
    e = ce if autocast else sb
    lora_b = 0
    if method == "qlora" and cpu:
        # on a CPU the engine loads QLoRA in fp32 and bitsandbytes computes in fp32: the activations stay
        # fp32; autocast only casts the LoRA branch
        e, lora_b = 4, (ce if autocast else 0)
    if half_model:
        lora_b = e  # the adapters are half precision too: lora_A reads (and saves) a half-precision input
    full = method == "full"
    lora = () if full else tuple(arch.lora_targets(spec.lora_target_modules))
    stacks = expert_lora(arch, lora)
    if stacks and spec.lora_dropout > 0:
        raise InvalidInput(
            f"LoRA on expert weights ({', '.join(stacks)}) needs lora_dropout 0: peft wraps a stacked "
            "expert parameter (lora.ParamWrapper) without dropout",
            param="lora_dropout",
        )
    if full:
        trainable, trainable_b = arch.total_params, sb
        master = 4 if (spec.master_weights and sb < 4) else 0
        state_b = 4 if (master or sb == 4) else sb
    else:
        trainable = sum(spec.lora_r * (m.in_features + m.out_features) * k for m, k in lora)
        # peft keeps adapters in fp32; a half model's framework casts them and keeps fp32 master copies
        trainable_b = sb if half_model else 4
        master, state_b = (4 if half_model else 0), 4
    worst = spec.batch.worst_case_tokens  # every sequence max_seq_len long (dpo: a pair is two)
    # the engine scores the targets only: grpo's are the completions, at most max_completion_tokens each
    scored = spec.batch.micro_sequences * spec.max_completion_tokens if spec.rl.enabled else worst
    return Context(
        spec=spec,
        arch=arch,
        runtime=runtime,
        cpu=cpu,
        full=full,
        lora=lora,
        trainable=trainable,
        # never more than the worst case: a shape from other settings' statistics cannot raise it
        tokens=min(shape.tokens, worst) if shape else worst,
        seq_len=min(shape.seq_len, spec.max_seq_len) if shape else spec.max_seq_len,
        logit_tokens=min(shape.targets, scored) if shape else scored,
        shape=shape,
        shard=f" / {n} GPUs (FSDP shard)" if n > 1 else "",
        store=store,
        store_b=sb,
        compute=cdt,
        compute_b=ce,
        half_model=half_model,
        fp32_upcast=method == "qlora" and runtime.kbit_fp32_upcast,
        autocast=autocast,
        act_b=e,
        res_b=4 if (method == "qlora" and runtime.kbit_fp32_upcast) else sb,
        fused_loss=fused_loss(spec, arch, runtime, lora),
        lora_act_b=lora_b,
        trainable_b=trainable_b,
        master_b=master,
        state_b=state_b,
    )
