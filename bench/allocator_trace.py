"""ftune's engine run on shape-only (fake) tensors, every tensor storage's birth and death recorded in order:
the trace bench/allocator_rules.py replays. Used by bench/planner_allocator.py."""

from __future__ import annotations

import math
import sys
import weakref
from itertools import count
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from gpu_check import SHAPE  # noqa: E402  # the model's shape: the 1.1B Llama of the GPU check
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


# -- the trace ---------------------------------------------------------------------------------------
class Tracer(TorchDispatchMode):
    """Every new tensor storage an op makes (alloc) and when its last reference dies (free), in order.

    A storage dies when its last tensor does; tensors autograd saves as outputs hold the storage through
    C++ references without a Python object, so a storage whose tracked tensors are gone but which is still
    alive (a StorageWeakRef) waits in `lingering`, checked at every op, until it really dies."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int, int]] = []  # (1, id, bytes) alloc, (0, id, 0) free
        self.marks: dict[int, str] = {}
        self.keys: dict[int, list[Any]] = {}  # storage -> [id, tracked tensors, weak ref]
        self.lingering: dict[int, tuple[Any, int]] = {}
        self.objs: set[int] = set()
        self.pinned: set[int] = set()  # storages made before tracing (weights): never freed here
        self.ids = count()
        self.hooks: list[Any] = []  # (predicate(func, args), add(tracer, func, args) -> ids freed after func)

    def alloc(self, nbytes: int) -> int:
        i = next(self.ids)
        self.events.append((1, i, int(nbytes)))
        return i

    def free(self, i: int) -> None:
        self.events.append((0, i, 0))

    def mark(self, name: str) -> None:
        self.marks[len(self.events)] = name

    def _poll(self) -> None:
        if self.lingering:
            for k in [k for k, (ref, _) in self.lingering.items() if ref.expired()]:
                self.free(self.lingering.pop(k)[1])

    def track(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        k = s._cdata
        if k in self.pinned or id(t) in self.objs:
            return
        entry = self.keys.get(k)
        if entry is None:
            old = self.lingering.pop(k, None)
            if old is not None and not old[0].expired():
                entry = self.keys[k] = [old[1], 0, old[0]]
            else:
                if old is not None:
                    self.free(old[1])
                entry = self.keys[k] = [self.alloc(s.nbytes()), 0, StorageWeakRef(s)]
        entry[1] += 1
        self.objs.add(id(t))
        weakref.finalize(t, self._dead, k, id(t))

    def _dead(self, k: int, oid: int) -> None:
        self.objs.discard(oid)
        entry = self.keys.get(k)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.keys[k]
            if entry[2].expired():
                self.free(entry[0])
            else:
                self.lingering[k] = (entry[2], entry[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self._poll()
        extra = [add(self, func, args) for when, add in self.hooks if when(func, args)]
        out = func(*args, **kwargs)
        self._poll()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        for ids in extra:
            for i in ids:
                self.free(i)
        return out


def cuda_kernel_buffers(tracer: Tracer, heads: int, head_dim: int) -> None:
    """Buffers CUDA kernels allocate through torch that their fake (meta) implementations do not.
    bitsandbytes' gemm_4bit above 1,536 rows (the CUDA backend's dequantize + F.linear fallback): the
    double-quant absmax dequantized (fp32) and offset, and the dequantized weight. FlashAttention-2's
    varlen backward (flash_api.cpp mha_varlen_bwd): softmax_d, the fp32 dq accumulator over
    tokens + 128 rows per sequence, and dk, dv for every query head under GQA."""

    def gemm4(t: Tracer, func: Any, args: Any) -> list[int]:
        a, shape_b = args[0], args[2]
        if a.numel() // a.shape[-1] <= 1536:
            return []
        blocks = math.ceil(shape_b[0] * shape_b[1] / 64)
        return [t.alloc(blocks * 4), t.alloc(blocks * 4), t.alloc(shape_b[0] * shape_b[1] * a.element_size())]

    def varlen_backward(t: Tracer, func: Any, args: Any) -> list[int]:
        q, k, cu = args[1], args[2], args[6]
        rows = q.shape[0] + 128 * (cu.numel() - 1)
        rounded = -(-head_dim // 32) * 32
        ids = [t.alloc(heads * rows * 4), t.alloc(rows * heads * rounded * 4)]
        if k.shape[1] != heads:
            ids += [t.alloc(k.shape[0] * heads * head_dim * q.element_size()) for _ in range(2)]
        return ids

    tracer.hooks += [
        (lambda func, args: "gemm_4bit" in str(func), gemm4),
        (lambda func, args: "varlen_attn_backward" in str(func), varlen_backward),
    ]


# -- the engine on fake tensors ------------------------------------------------------------------------
def take_cuda_paths(gqa: bool = True) -> None:
    """The engine's CUDA branches on fake CPU tensors. `gqa`: torch's varlen attention takes enable_gqa
    (2.12 on); without it the engine repeats k and v to every query head (training.packing._varlen_call)."""
    from transformers import AttentionInterface

    from training import dropout, packing

    cpu_autocast = torch.is_autocast_enabled
    # peft's 4-bit LoRA layer asks torch.is_autocast_enabled() (CUDA's) whether to cast its input
    torch.is_autocast_enabled = lambda *a: cpu_autocast(*a) if a else cpu_autocast("cpu")  # type: ignore[assignment]

    def example_dropout(self: Any, x: torch.Tensor) -> torch.Tensor:  # ExampleDropout's CUDA branch
        if not self.training or self.p == 0 or self.layout is None:
            return x
        mask = torch.full(x.shape, True, dtype=torch.bool, device=x.device)
        tokens, features = x.shape[0] * x.shape[1], x.shape[2]
        budget = x.numel() * x.element_size()  # training.dropout.keep_mask's chunks
        step = max(1, min(dropout.CHUNK, budget // 16) // features)
        for a in range(0, tokens, step):  # each chunk's int64 hash and its shifted copy, freed at once
            ids = [TRACER.alloc(min(step, tokens - a) * features * 8) for _ in range(2)]
            for i in ids:
                TRACER.free(i)
        return dropout._Masked.apply(x, mask, 1.0 / (1.0 - self.p))

    dropout.ExampleDropout.forward = example_dropout  # type: ignore[method-assign]
    from torch.nn.attention.varlen import varlen_attn

    if gqa:
        kernel = packing._varlen_call(varlen_attn)
    else:

        def without_gqa(
            q: Any,
            k: Any,
            v: Any,
            cu_q: Any,
            cu_k: Any,
            max_q: int,
            max_k: int,
            *,
            return_aux: Any = None,
            scale: Any = None,
            window_size: Any = (-1, -1),
        ) -> Any:
            return varlen_attn(
                q, k, v, cu_q, cu_k, max_q, max_k, return_aux=return_aux, scale=scale, window_size=window_size
            )

        kernel = packing._varlen_call(without_gqa)

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        cu_seq_lens_q: Any = None,
        max_length_q: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # packing.varlen_kernel on a GPU: half-precision queries, or fp32 ones (RoPE's fp32 cos/sin in an fp32
        # residual stream) under autocast, cast to its dtype
        dtype = query.dtype
        if dtype == torch.float32 and cpu_autocast("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
        if dtype in (torch.float16, torch.bfloat16) and dropout == 0.0:
            q, k, v = (x.to(dtype) for x in (query, key, value))
            return kernel(q, k, v, cu_seq_lens_q, max_length_q, scaling), None
        return packing.per_example_attention(query, key, value, BOUNDS[0], dropout, scaling), None

    AttentionInterface.register("trace_packed", attention)


class _Bounds(list):  # type: ignore[type-arg]
    """A packed row's example bounds (cu_seq_lens) as per_example_attention reads them (.tolist()), on the
    host: the fake tensors hold no values."""

    def tolist(self) -> list[int]:
        return list(self)


BOUNDS: list[Any] = [None]
TRACER: Tracer


def build(spec: Any, layers: int, fake: Any) -> Any:
    """The model as training.model.load_model makes it on a GPU, built on meta and made fake CPU tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from training import dropout, fused, lora_add
    from training.demo import DemoSize
    from training.model import enable_checkpointing, skip_adapter_input_casts

    qlora = spec.method == "qlora"
    # the demo checkpoint is fp32; QLoRA loads bf16, and so does LoRA asked for bf16 weights
    dtype = torch.bfloat16 if qlora or spec.torch_dtype == "bfloat16" else torch.float32
    size = DemoSize()
    config = LlamaConfig(
        vocab_size=size.vocab_size,
        hidden_size=SHAPE["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"],
        intermediate_size=SHAPE["intermediate_size"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="trace_packed",
        dtype=dtype,
    )
    with torch.device("meta"):
        torch.set_default_dtype(dtype)
        model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if qlora:
        import bitsandbytes as bnb

        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, lin in list(parent.named_children()):
                    if not isinstance(lin, torch.nn.Linear):
                        continue
                    q = bnb.nn.Linear4bit(
                        lin.in_features,
                        lin.out_features,
                        bias=False,
                        compute_dtype=torch.bfloat16,
                        compress_statistics=True,
                        quant_type="nf4",
                        device="meta",
                    )
                    w = torch.empty(lin.out_features, lin.in_features, dtype=torch.bfloat16, device="meta")
                    q.weight = bnb.nn.Params4bit(
                        w, requires_grad=False, compress_statistics=True, quant_type="nf4", module=q
                    )._quantize("meta")
                    setattr(parent, name, q)
        model.is_loaded_in_4bit = True  # as transformers marks it: peft then wraps with its 4-bit LoRA layer
    for p in model.parameters():
        p.requires_grad_(False)
    if spec.gradient_checkpointing:
        enable_checkpointing(model)
    lora = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    # the fused norms and gates the recipe installs on a GPU, eagerly as there;
    # the class check first on a real norm (meta and fake tensors have no values to compare)
    fused.install(type(model.base_model.model.model.norm)(8))
    assert fused.install(model)["mlps"] == layers
    dropout.install(model)
    skip_adapter_input_casts(model)  # as training.recipe does under autocast on a GPU
    lora_add.install(model)  # as training.model.load_model does
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        return fake.fake_tensor_converter.from_meta_and_device(fake, t, torch.device("cpu"))

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            new = torch.nn.Parameter(to_fake(p.data), requires_grad=p.requires_grad)
            qs = getattr(p, "quant_state", None)
            if qs is not None:
                for obj in (qs, qs.state2):
                    for attr in ("absmax", "code", "offset"):
                        v = getattr(obj, attr, None)
                        if isinstance(v, torch.Tensor) and v.device.type == "meta":
                            setattr(obj, attr, to_fake(v))
                new.quant_state, new.bnb_quantized, mod.quant_state = qs, True, qs  # type: ignore[attr-defined]
            mod._parameters[name] = new
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = to_fake(b)
        if isinstance(getattr(mod, "original_inv_freq", None), torch.Tensor):
            mod.original_inv_freq = mod.inv_freq
    return model


def load(tracer: Tracer, model: torch.nn.Module) -> None:
    """Loading, first in the trace: every parameter and buffer in module order; a 4-bit linear's bf16
    weight and fp32 absmax exist while it is quantized, then are freed."""
    seen: set[int] = set()

    def keep(t: torch.Tensor) -> None:
        k = t.untyped_storage()._cdata
        if k not in seen:
            seen.add(k)
            tracer.pinned.add(k)
            tracer.alloc(t.untyped_storage().nbytes())

    for mod in model.modules():
        for p in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            qs = getattr(p, "quant_state", None)
            if qs is None:
                keep(p)
                continue
            numel = int(torch.Size(qs.shape).numel())
            temporary = [tracer.alloc(numel * 2), tracer.alloc(math.ceil(numel / 64) * 4)]
            for t in (p, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code):
                keep(t)
            for i in temporary:
                tracer.free(i)


def micro_batches(spec: Any, steps: int, tokenizer_dir: Path) -> list[list[dict[str, Any]]]:
    """The run's micro-batches, step by step, as training.recipe makes them (host tensors)."""
    from core.run_protocol import RunConfig
    from training import batches, dropout, model, recipe
    from training.step import make_batch

    config = RunConfig(
        job_id="allocator",
        spec=spec,
        model_dir=str(tokenizer_dir),
        dataset_path=str(ROOT / "examples" / "alpaca_small.jsonl"),
        output_dir="/nonexistent",
    )
    tokenizer = model.load_tokenizer(tokenizer_dir)
    items = recipe.load_splits(config, tokenizer)[0]
    lengths = [x.length for x in items]
    out: list[list[dict[str, Any]]] = []
    epoch = 0
    while len(out) < steps:
        for step in batches.epoch_steps(spec, lengths, epoch):
            split = batches.split_step(spec, {i: items[i].length for row in step for i in row}, step)
            mbs = []
            for idx in split:
                b = make_batch(spec, items, idx, recipe.pad_id(tokenizer))
                b["layout"] = dropout.layout(spec, items, idx, (spec.seed, epoch))
                b["bounds"] = _Bounds(b["cu_seq_lens_q"].tolist())
                mbs.append(b)
            out.append(mbs)
            if len(out) == steps:
                break
        epoch += 1
    return out


def trace(spec: Any, data: list[list[dict[str, Any]]], layers: int) -> Tracer:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from training import dropout
    from training.loss import token_losses

    global TRACER
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = build(spec, layers, fake)
    tracer = TRACER = Tracer()
    cuda_kernel_buffers(tracer, SHAPE["num_heads"], SHAPE["hidden_size"] // SHAPE["num_heads"])
    with fake:
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        # torch's default on CUDA: foreach AdamW (the planner's step temporaries)
        optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, foreach=True)
        load(tracer, model)
        with tracer:
            for n, mbs in enumerate(data):
                targets = sum(len(b["target_labels"]) for b in mbs)
                for b in mbs:
                    BOUNDS[0] = b["bounds"]
                    tracer.mark(f"step {n}")
                    batch = {k: v for k, v in b.items() if k not in ("layout", "bounds")}
                    with dropout.placed(model, b["layout"]):
                        losses, _ = token_losses(
                            model,
                            batch,
                            torch.device("cpu"),
                            lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                        )
                        loss = losses.sum() / targets
                        del losses
                        loss.backward()
                        del loss
                grads = [p.grad for p in params if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                del grads
                torch.nn.utils.clip_grads_with_norm_(params, spec.max_grad_norm, norm)
                del norm
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return tracer
