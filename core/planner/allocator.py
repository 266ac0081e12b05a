"""Device memory beyond the tensors in use (allocated_bytes): the CUDA context and the caching allocator's
margin, both in the total, and the cached blocks the allocator keeps reserved but would free (and retry)
before an OOM, reported beside the total."""

from __future__ import annotations

from core.planner.context import Context
from core.planner.forward_backward import loss_buffer_bytes
from core.planner.gpus import Gpu, MiB
from core.planner.types import Term

CUDA_CONTEXT_BYTES = 500 * MiB  # CUDA context + cuBLAS workspace, outside torch's allocator
FRAGMENTATION = 0.08  # caching-allocator margin over the bytes in use (reserved vs allocated)


def overhead_terms(c: Context, used: int) -> list[Term]:
    """The last terms of the breakdown, over `used` (the bytes in use at the peak)."""
    return [
        Term(
            name="CUDA context",
            bytes=0 if c.cpu else CUDA_CONTEXT_BYTES,
            note="none on a CPU" if c.cpu else "CUDA context + cuBLAS workspace, ~500 MiB",
        ),
        Term(
            name="allocator fragmentation",
            bytes=int(used * FRAGMENTATION),
            note=(f"{FRAGMENTATION:.0%} of the bytes in use (caching allocator: reserved vs allocated)"),
        ),
    ]


def cached_bytes(c: Context, gpu: Gpu, total: int) -> tuple[int, int]:
    """Plan.loss_segments_bytes and Plan.varlen_cache_bytes for a plan of `total` bytes."""
    e = c.act_b
    # Reserved beyond allocated with fixed shapes too. Each vocab-sized buffer is a cudaMalloc segment of
    # its own (nothing cached is that large when it is first made) and freed blocks merge only inside their
    # segment. An fp32 loss over half-precision logits makes, in forward, the logits (e B per vocab entry),
    # [their shifted contiguous copy (e)], the fp32 copy (4) and the log-probs (4); in backward, with the
    # log-probs still held, two 4 B gradients: one reuses the fp32 copy's segment, the other fits in no
    # e-byte segment and maps a new one. From the next step on the same segments serve every step, so
    # reserved stays above allocated by the logits' (and the shifted copy's) segments. Not with a loss in
    # the logits' dtype (every buffer the same size) nor fp32 logits.
    shifted = 2 if c.runtime.loss_shift_copy else 1
    loss_segments = (
        shifted * c.logit_tokens * c.arch.vocab_size * e if not c.cpu and c.runtime.loss_fp32 and e < 4 else 0
    )
    # Reserved (not allocated) memory on data whose lengths vary from batch to batch. The caching allocator
    # keeps freed blocks and only merges free neighbours inside one segment. The vocab-sized loss buffers
    # (logits, their fp32 copy, log-probs, their gradients: the largest single tensors of a step, one per
    # buffer, hundreds of MiB to GiBs) of a batch shorter than the longest cannot hold the longest batch's,
    # so the longest batch maps new segments beside them: max_memory_reserved exceeds the padded plan by
    # about one earlier batch's loss buffers (counted at this plan's size, an assumption: the earlier
    # batch's length is not known; it holds when many batches are near the longest). Smaller tensors
    # (per-layer activations) are served from split cached blocks. Capped by the device: a failed
    # cudaMalloc frees the cached blocks and retries, so this never causes an OOM and stays out of
    # total_bytes and the verdict.
    room = max(0, gpu.memory_bytes - total)  # reserved never exceeds the device
    loss_segments = min(loss_segments, room)
    varlen_cache = 0 if c.cpu else min(loss_buffer_bytes(c), room - loss_segments)
    return loss_segments, varlen_cache
