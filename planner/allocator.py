"""Device memory beyond the tensors in use (allocated_bytes): the caching allocator's cached free blocks at
its peak, which make max_memory_reserved (reserved_bytes), and the CUDA context outside it; all in the total.

PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp) rounds a request to 512 B and serves it
from the smallest cached free block that holds it (split, the rest stays cached). Freed blocks merge only
with free neighbours, and memory goes back to CUDA only under pressure (a failed allocation) or by
empty_cache, so reserved is a high-water mark. When no cached block fits:
  - with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which ftune's training
    process sets: Runtime.expandable_segments) the pool's one segment maps more pages (20 MiB; 2 MiB for
    requests up to 1 MiB) after the free block at its end. What stays cached at the peak is the holes
    below the last live block: the one the step's largest transient buffer leaves (flash attention's
    backward accumulator, a loss chunk, a LoRA input copy: made where nothing else fitted), a little of
    everything else (EXPANDABLE_FRAGMENTATION of the bytes in use beyond the persistent state) and the
    last pages;
  - with torch's default segments a request gets a segment of its own (at most 1 MiB: 2 MiB segments;
    under 10 MiB: 20 MiB; larger: its size rounded up to 2 MiB). BASE_FRAGMENTATION of the bytes in use
    stays cached at fixed batch shapes (the share bench/planner_accuracy's published runs give), and with
    batches of varying lengths (packed rows hold however many examples fit, padded batches are as wide as
    their longest example) a batch longer than the earlier ones needs blocks larger than every cached one
    for its largest tensors, which take new segments while the earlier batches' stay cached: the largest
    tensors a block keeps for backward, every layer's (checkpointing: one layer's), unless a larger tensor
    the block frees again leaves blocks they fit in; and STRANDED_BUFFERS copies of the step's largest
    transient buffer. Runtime.fixed_shapes (every micro-batch the same shape) leaves the latter out.
Checked by replaying the allocator's rules on allocation traces of ftune's engine (bench/planner_allocator.py:
the gpu_check configs, a 1.1B Llama, packed 4 x 1024, 8 steps of 2,233-4,076 tokens, on fake tensors),
which matched an H200's max_memory_allocated and max_memory_reserved within 2.5% with torch's default
segments (QLoRA without checkpointing: 15.5 GiB reserved for 10.4 GiB allocated) and within 0.3% with
expandable segments (bench/results/h200-2026-11-26: 0.14-0.35 GiB reserved beyond allocated).
"""

from __future__ import annotations

from planner.context import Context
from planner.forward_backward import Churn, churn
from planner.gpus import MiB
from planner.types import Term, gib

# The CUDA context and the kernels loaded, outside torch's allocator: an H200 with torch 2.11 + CUDA 13.0
# showed 769 MiB of device memory in use beyond max_memory_reserved at the end of each of four gpu_check runs.
CUDA_CONTEXT_BYTES = 768 * MiB
# cuBLAS workspaces, allocated through torch's allocator (so in allocated and reserved): one per handle, a
# handle per thread, and backward runs on autograd's own thread: two. torch sizes it 32 MiB on Hopper and
# newer (H100, H200, B200), else 4096 KiB x 2 + 16 KiB x 8 (CUBLAS_WORKSPACE_CONFIG's default).
CUBLAS_WORKSPACES = 2

BASE_FRAGMENTATION = (
    0.08  # torch's default segments: cached free blocks at fixed shapes, a share of the bytes in use
)
STRANDED_BUFFERS = 2  # copies of a step's largest transient buffer that longer batches leave cached
REUSE_RATIO = 1.5  # a freed tensor this much larger than the largest kept ones leaves blocks they fit in
EXPANDABLE_FRAGMENTATION = 0.015  # expandable segments: holes beside the largest buffer's, a share as above
PAGES = 20 * MiB + 2 * MiB  # expandable segments: the large and the small pool's last page, half used


def workspace_terms(c: Context, gpu_name: str) -> list[Term]:
    """Allocations that last the whole run beside the model's own: the cuBLAS workspaces (none on a CPU)."""
    if c.cpu:
        return []
    each = 32 * MiB if gpu_name.upper().startswith(("H", "B")) else 4096 * 1024 * 2 + 16 * 1024 * 8
    return [
        Term(
            name="cuBLAS workspaces",
            bytes=CUBLAS_WORKSPACES * each,
            note=f"{CUBLAS_WORKSPACES} x {each / MiB:g} MiB, through torch's allocator: the forward's and "
            "autograd's thread each have a cuBLAS handle",
        )
    ]


def overhead_terms(c: Context, used: int, persistent: int) -> list[Term]:
    """The last terms of the breakdown, over `used` (the bytes in use at the peak) of which `persistent`
    live through every step: the allocator's cached blocks (reserved - allocated), the CUDA context."""
    context = Term(
        name="CUDA context",
        bytes=0 if c.cpu else CUDA_CONTEXT_BYTES,
        note="none on a CPU" if c.cpu else "CUDA context and kernels, outside torch's allocator, ~500 MiB",
    )
    if c.cpu:
        return [
            Term(name="allocator fragmentation", bytes=0, note="none on a CPU: no caching allocator"),
            context,
        ]
    dynamic = max(0, used - persistent)
    if c.runtime.expandable_segments:
        return [_expandable(c, churn(c), dynamic), context]
    terms = [
        Term(
            name="allocator fragmentation",
            bytes=int(used * BASE_FRAGMENTATION),
            note=(
                f"{BASE_FRAGMENTATION:.0%} of the {gib(used)} in use: cached free blocks between tensors "
                "(torch's default segments, batches of one shape)"
            ),
        )
    ]
    if not c.runtime.fixed_shapes:
        terms.append(_varying_lengths(c, churn(c)))
    return [*terms, context]


def _expandable(c: Context, ch: Churn, dynamic: int) -> Term:
    spread = int(dynamic * EXPANDABLE_FRAGMENTATION)
    return Term(
        name="allocator fragmentation",
        bytes=ch.largest_buffer + spread + PAGES,
        note=(
            "expandable segments: the hole the step's largest transient buffer leaves "
            f"({gib(ch.largest_buffer)}), {EXPANDABLE_FRAGMENTATION:.1%} of the {gib(dynamic)} in use beyond "
            "the persistent state, the pages' rounding"
        ),
    )


def _varying_lengths(c: Context, ch: Churn) -> Term:
    kept = ch.kept_alive if ch.transient_class < REUSE_RATIO * ch.kept_class else 0
    buffers = STRANDED_BUFFERS * ch.largest_buffer
    note = (
        f"segments earlier, shorter batches leave cached: {STRANDED_BUFFERS} x the step's largest transient "
        f"buffer ({gib(ch.largest_buffer)})"
    )
    if kept:
        note += (
            f" + the largest tensors blocks keep for backward ({ch.kept_class:,.0f} B/token each, "
            f"{gib(kept)} at the peak): a longer batch's do not fit the earlier ones' blocks"
        )
    else:
        note += (
            f"; the largest kept tensors ({ch.kept_class:,.0f} B/token) fit in blocks the larger ones a "
            f"block frees leave ({ch.transient_class:,.0f} B/token)"
        )
    return Term(name="allocator: varying batch lengths", bytes=int(kept + buffers), note=note)


def loss_segments_bytes(c: Context, gpu_bytes: int, total: int) -> int:
    """Plan.loss_segments_bytes: the plain loss head's half-precision logits segments, which its fp32
    buffers cannot reuse (reserved beyond the model above, counted beside the total). Each vocab-sized
    buffer is a segment of its own (nothing cached is that large when it is first made) and freed blocks
    merge only inside their segment. An fp32 loss over half-precision logits makes, in forward, the logits
    (e B per vocab entry), [their shifted contiguous copy (e)], the fp32 copy (4) and the log-probs (4); in
    backward, with the log-probs still held, two 4 B gradients: one reuses the fp32 copy's segment, the
    other fits in no e-byte segment and maps a new one. Not with a loss in the logits' dtype (every buffer
    the same size), fp32 logits, or the chunked head (its chunk buffers are the same size every time)."""
    if c.cpu or c.fused_loss or not c.runtime.loss_fp32 or c.act_b >= 4:
        return 0
    shifted = 2 if c.runtime.loss_shift_copy else 1
    return min(shifted * c.logit_tokens * c.arch.vocab_size * c.act_b, max(0, gpu_bytes - total))
