"""The planner's allocated and reserved bytes vs PyTorch's CUDA caching allocator replayed on traced steps,
on a CPU: the gpu_check configs without a GPU.

    .venv/bin/python bench/planner_allocator.py [--configs lora,qlora] [--layers 22] [--steps 8]

Each config (bench/gpu_check.py's: the 1.1B Llama shape, alpaca_small packed 4 x 1024, micro-batches of
2,233-4,076 tokens over 8 steps) runs the engine's own code (training.loss's chunked head,
training.packing's attention, training.dropout's masks, peft and bitsandbytes' layers, non-reentrant
checkpointing, foreach AdamW) on fake tensors (torch._subclasses.FakeTensorMode: shapes only, no compute, no
memory), with the engine's CUDA branches taken (bf16 autocast, the varlen flash kernel, bool dropout masks,
bitsandbytes' dequantize-then-matmul above 1,536 rows) and the CUDA kernels' own buffers added (flash
attention's backward accumulators). Every tensor storage's birth and death is recorded in order, then
replayed through a re-implementation of c10/cuda/CUDACachingAllocator.cpp's rules: 512 B rounding, best fit
by size and address, free neighbours merged, nothing returned; by default with expandable segments, as
training.run sets them (one segment per pool, 20 MiB pages in the large pool and 2 MiB in the small one
mapped at its end when no cached block fits, every split kept), with --classic torch's default segments (2
MiB ones for requests up to 1 MiB, 20 MiB ones up to 10 MiB, larger ones rounded to 2 MiB; a block split
when more than 1 MiB (small pool: 512 B) is left). The weights are loaded first (QLoRA: each linear's bf16
weight and fp32 absmax made and freed as it is quantized). The replay's max allocated and max reserved are
what torch.cuda reports, plus the cuBLAS workspaces the trace does not see (in the plan; so is the CUDA
context, outside the allocator).

Checked against one H200 (torch 2.11, whose varlen attention has no enable_gqa: --no-gqa;
bench/results/h200-2026-11-26, run 2): replayed allocated and reserved 16.01 / 16.36 GiB (lora),
5.39 / 5.52 (lora+ckpt), 1.62 / 1.81 (qlora), 10.94 / 11.27 (qlora-no-ckpt) vs measured 16.01 / 16.32,
5.39 / 5.54, 1.62 / 1.81, 10.94 / 11.29: within 0.3%. An earlier version of this trace, of the
engine before its chunked head and varlen attention, replayed with torch's default segments, matched that
engine's H200 peaks within 2.5% (allocated 15.43 / 5.37 / 1.60 / 10.37 GiB and reserved 16.51 / 5.60 / 2.10 /
15.47 for lora, lora+ckpt, qlora, qlora-no-ckpt vs 15.43 / 5.37 / 1.62 / 10.39 and 16.49 / 5.60 / 2.08 /
15.50), QLoRA's 5.1 GiB of fragmentation without checkpointing included.
Prints, per config: the plan admission makes (micro_batch_size x max_seq_len tokens), the engine's plan from
its data's largest micro-batch, and the replay, with the signed errors of the plan's allocated and reserved,
and of its total (reserved + the CUDA context) against the replay's reserved.
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
import tempfile
import time
import warnings
import weakref
from itertools import count
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

MiB, GiB = 2**20, 2**30
# c10/cuda/CUDACachingAllocator.cpp
SMALL, SMALL_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE, LARGE_BUFFER, MIN_BLOCK = (
    MiB,
    2 * MiB,
    10 * MiB,
    2 * MiB,
    20 * MiB,
    512,
)
SHAPE = {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4, "intermediate_size": 5632}
CONFIGS: dict[str, dict[str, Any]] = {
    "lora": {"method": "lora", "gradient_checkpointing": False},
    "lora+ckpt": {"method": "lora", "gradient_checkpointing": True},
    "qlora": {"method": "qlora", "gradient_checkpointing": True},
    "qlora-no-ckpt": {"method": "qlora", "gradient_checkpointing": False},
}


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


# -- the allocator -----------------------------------------------------------------------------------
class _Block:
    __slots__ = ("allocated", "next", "prev", "ptr", "size", "small")

    def __init__(self, size: int, ptr: int, small: bool) -> None:
        self.size, self.ptr, self.small = size, ptr, small
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False


class CachingAllocator:
    """c10/cuda/CUDACachingAllocator.cpp's DeviceCachingAllocator on one stream, without expandable
    segments, max_split_size or garbage collection (the defaults)."""

    def __init__(self) -> None:
        self.pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # free (size, ptr, id)
        self.blocks: dict[int, _Block] = {}
        self.live: dict[int, _Block] = {}
        self.next_ptr = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def _cache(self, b: _Block) -> None:
        self.blocks[id(b)] = b
        bisect.insort(self.pools[b.small], (b.size, b.ptr, id(b)))

    def _uncache(self, b: _Block) -> None:
        pool = self.pools[b.small]
        pool.pop(bisect.bisect_left(pool, (b.size, b.ptr, id(b))))

    def malloc(self, key: int, n: int) -> None:
        size = MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            b = self.blocks[pool.pop(i)[2]]
        else:
            segment = (
                SMALL_BUFFER
                if small
                else LARGE_BUFFER
                if size < MIN_LARGE_ALLOC
                else -(-size // ROUND_LARGE) * ROUND_LARGE
            )
            b = _Block(segment, self.next_ptr, small)
            self.next_ptr += segment + (1 << 40)
            self.reserved += segment
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL:
            r = _Block(rest, b.ptr + size, small)
            r.prev, r.next = b, b.next
            if b.next:
                b.next.prev = r
            b.next, b.size = r, size
            self._cache(r)
        b.allocated = True
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.live[key] = b

    def free(self, key: int) -> None:
        b = self.live.pop(key)
        b.allocated = False
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and not other.allocated:
                self._uncache(other)
                if other is b.prev:
                    b.ptr, b.prev = other.ptr, other.prev
                    if b.prev:
                        b.prev.next = b
                else:
                    b.next = other.next
                    if b.next:
                        b.next.prev = b
                b.size += other.size
        self._cache(b)


class ExpandableAllocator:
    """The same allocator with expandable_segments:True (training.run sets it): one segment per pool whose
    physical pages (20 MiB in the large pool, 2 MiB in the small) are mapped at its end as needed. A
    request takes the smallest cached block that holds it, preferring any to the block at the mapped end
    (which could grow); when none does, the end block grows (new pages mapped after it, rounded to pages);
    every split is kept (512 B). Pages are unmapped only under memory pressure, so reserved is the highest
    end the pool reached."""

    def __init__(self) -> None:
        self.pools = {True: _Pool(SMALL_BUFFER), False: _Pool(LARGE_BUFFER)}
        self.live: dict[int, tuple[_Pool, int, int]] = {}
        self.allocated = self.peak_allocated = 0

    @property
    def reserved(self) -> int:
        return sum(p.mapped for p in self.pools.values())

    @property
    def peak_reserved(self) -> int:
        return sum(p.peak for p in self.pools.values())

    def malloc(self, key: int, n: int) -> None:
        size = MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK
        pool = self.pools[size <= SMALL]
        self.live[key] = (pool, pool.take(size), size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        pool, addr, size = self.live.pop(key)
        pool.give(addr, size)
        self.allocated -= size


class _Pool:
    """One expandable segment: free blocks by (size, address) and by address; [0, mapped) is mapped."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.mapped = self.peak = 0
        self.by_size: list[tuple[int, int]] = []  # free (size, addr)
        self.by_addr: dict[int, int] = {}  # free addr -> size
        self.ends: dict[int, int] = {}  # free end addr -> start addr

    def _add(self, addr: int, size: int) -> None:
        bisect.insort(self.by_size, (size, addr))
        self.by_addr[addr] = size
        self.ends[addr + size] = addr

    def _drop(self, addr: int) -> int:
        size = self.by_addr.pop(addr)
        del self.ends[addr + size]
        self.by_size.pop(bisect.bisect_left(self.by_size, (size, addr)))
        return size

    def take(self, size: int) -> int:
        i = bisect.bisect_left(self.by_size, (size, -1))
        tail = self.ends.get(self.mapped)  # the free block at the mapped end, if any
        for j in range(i, len(self.by_size)):
            if self.by_size[j][1] != tail:
                addr = self.by_size[j][1]
                break
        else:  # only the end block, grown as needed
            addr = tail if tail is not None else self.mapped
            have = self._drop(tail) if tail is not None else 0
            if have < size:
                grow = -(-(size - have) // self.page) * self.page
                self.mapped += grow
                self.peak = max(self.peak, self.mapped)
                have += grow
            self._add(addr, have)
        have = self._drop(addr)
        if have > size:
            self._add(addr + size, have - size)
        return addr

    def give(self, addr: int, size: int) -> None:
        start = self.ends.get(addr)
        if start is not None:  # a free block just before
            size += self._drop(start)
            addr = start
        if addr + size in self.by_addr:  # a free block just after
            size += self._drop(addr + size)
        self._add(addr, size)


def replay(
    events: list[tuple[int, int, int]], expandable: bool = True
) -> CachingAllocator | ExpandableAllocator:
    a: CachingAllocator | ExpandableAllocator = ExpandableAllocator() if expandable else CachingAllocator()
    for kind, i, nbytes in events:
        if kind and nbytes:
            a.malloc(i, nbytes)
        elif not kind and i in a.live:
            a.free(i)
    return a


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
        for spans in self.layout.rows:
            for _start, n, _seed in spans:  # each example's rand (fp32) and comparison (bool), freed at once
                ids = [TRACER.alloc(n * x.shape[2] * 4), TRACER.alloc(n * x.shape[2])]
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

    from training import dropout
    from training.demo import DemoSize
    from training.model import enable_checkpointing

    qlora = spec.method == "qlora"
    dtype = torch.bfloat16 if qlora else torch.float32  # the demo checkpoint is fp32; QLoRA loads bf16
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
    dropout.install(model)
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
    items = recipe.examples(recipe.load_splits(config, tokenizer)[0])
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gpu", default="H200", help="the GPU the plans are made for")
    parser.add_argument(
        "--no-gqa",
        action="store_true",
        help="torch's varlen attention without enable_gqa (before 2.12): k and v repeated",
    )
    parser.add_argument(
        "--classic",
        action="store_true",
        help="replay without expandable segments (PYTORCH_CUDA_ALLOC_CONF set otherwise)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from core.arch import from_config
    from core.planner import BatchShape
    from core.planner.allocator import workspace_terms
    from core.planner.context import plan_context
    from core.planner.feasibility import plan_on
    from core.planner.gpus import resolve_gpu
    from core.planner.types import FTUNE
    from core.spec import JobSpec
    from training.demo import DemoSize, build_demo_model

    take_cuda_paths(gqa=not args.no_gqa)
    gpu = resolve_gpu(args.gpu)
    vocab = DemoSize().vocab_size
    arch = from_config(
        {
            "model_type": "llama",
            "hidden_size": SHAPE["hidden_size"],
            "num_hidden_layers": args.layers,
            "num_attention_heads": SHAPE["num_heads"],
            "num_key_value_heads": SHAPE["num_kv_heads"],
            "intermediate_size": SHAPE["intermediate_size"],
            "vocab_size": vocab,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
    )
    print(
        f"{'config':14} {'plan':5} {'allocated':>9} {'replay':>7} {'error':>7} {'reserved':>9} {'replay':>7} "
        f"{'error':>7} {'total':>7} {'vs resv':>7}   s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_demo_model(
            Path(tmp),
            name="tokenizer",
            size=DemoSize(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128),
        )
        for name in args.configs.split(","):
            spec = JobSpec(
                base_model="gpu-check-1b",
                dataset_id="gpucheck01",
                max_steps=args.steps,
                max_seq_len=1024,
                micro_batch_size=4,
                checkpoint_every_steps=0,
                packing=True,
                **CONFIGS[name],
            )
            began = time.monotonic()
            data = micro_batches(spec, args.steps, tok)
            tracer = trace(spec, data, args.layers)
            a = replay(tracer.events, expandable=not args.classic)
            # what the GPU adds inside the allocator that the trace does not see
            cublas = sum(t.bytes for t in workspace_terms(plan_context(spec, arch, gpu, FTUNE), gpu.name))
            measured = (a.peak_allocated + cublas, a.peak_reserved + cublas)
            tokens = max(int(b["input_ids"].numel()) for mbs in data for b in mbs)
            scored = max(len(b["target_labels"]) for mbs in data for b in mbs)
            widest = max(b["max_length_q"] for mbs in data for b in mbs)
            shape = BatchShape(tokens=tokens, seq_len=widest, targets=scored)
            for label, plan in (
                ("plan", plan_on(spec, arch, gpu)),
                ("data", plan_on(spec, arch, gpu, shape=shape)),
            ):
                alloc, resv = measured
                print(
                    f"{name:14} {label:5} {plan.allocated_bytes / GiB:9.2f} {alloc / GiB:7.2f} "
                    f"{(plan.allocated_bytes - alloc) / alloc:+7.1%} {plan.reserved_bytes / GiB:9.2f} "
                    f"{resv / GiB:7.2f} {(plan.reserved_bytes - resv) / resv:+7.1%} "
                    f"{plan.total_bytes / GiB:7.2f} {(plan.total_bytes - resv) / resv:+7.1%}   "
                    f"{time.monotonic() - began:.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
