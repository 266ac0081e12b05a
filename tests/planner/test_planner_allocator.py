"""Planner: the CUDA caching allocator's share of reserved memory (fragmentation, segments)."""

from __future__ import annotations

from core.arch import from_config
from planner import FTUNE, Runtime, estimate
from planner.gpus import GiB, resolve_gpu
from tests.planner.planner_util import LLAMA2_7B, LLAMA3_8B, spec, term


def test_plain_loss_segments_stay_out_of_the_total() -> None:
    """The plain loss head (a framework's, Runtime()): its half-precision logits' segments, which its fp32
    buffers cannot reuse, are reported beside the total. ftune's chunked head has none."""
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")
    job = spec(method="lora", max_seq_len=1024, micro_batch_size=2)
    tokens = 2 * 1024
    plain = estimate(job, arch, gpu, suggest=False, runtime=Runtime())
    shifted = estimate(job, arch, gpu, suggest=False, runtime=Runtime(loss_shift_copy=True))
    assert plain.loss_segments_bytes == tokens * arch.vocab_size * 2  # the bf16 logits' segment
    assert shifted.loss_segments_bytes == 2 * plain.loss_segments_bytes  # + the shifted copy's
    assert shifted.total_bytes == plain.total_bytes == sum(t.bytes for t in plain.breakdown)
    half_loss = estimate(job, arch, gpu, suggest=False, runtime=Runtime(loss_fp32=False))
    assert half_loss.loss_segments_bytes == 0  # every loss buffer the logits' size: segments reused
    assert estimate(job, arch, gpu, suggest=False).loss_segments_bytes == 0  # chunks of one size
    from planner.feasibility import device_gpu, plan_on

    cpu = plan_on(job, arch, device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * GiB}))
    assert cpu.loss_segments_bytes == 0  # no caching allocator on a CPU


def test_reserved_is_allocated_plus_the_allocators_cached_blocks() -> None:
    """total = reserved (max_memory_reserved's prediction) + the CUDA context; reserved = allocated + the
    caching allocator's cached free blocks. ftune's engine runs with expandable segments: the hole its
    largest transient buffer leaves, a little of the rest, the last pages. torch's default segments: a
    share of the bytes in use, and what batches of varying lengths leave cached (none when every batch has
    one shape). A CPU has neither."""
    from planner.allocator import EXPANDABLE_FRAGMENTATION, PAGES
    from planner.context import plan_context
    from planner.feasibility import device_gpu, plan_on
    from planner.forward_backward import churn

    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("H100")
    job = spec(method="qlora", max_seq_len=2048, micro_batch_size=4, gradient_checkpointing=False)
    plan = estimate(job, arch, gpu, suggest=False)
    assert plan.reserved_bytes == plan.total_bytes - term(plan, "CUDA context")
    assert plan.reserved_bytes == plan.allocated_bytes + term(plan, "allocator fragmentation")
    persistent = sum(
        term(plan, n)
        for n in (
            "base weights (NF4)", "unquantized weights", "LoRA adapters", "gradients", "optimizer states",
            "cuBLAS workspaces",
        )
    )  # fmt: skip
    largest = churn(plan_context(job, arch, gpu, FTUNE)).largest_buffer
    dynamic = plan.allocated_bytes - persistent
    assert term(plan, "allocator fragmentation") == largest + int(dynamic * EXPANDABLE_FRAGMENTATION) + PAGES
    assert "allocator: varying batch lengths" not in {t.name for t in plan.breakdown}
    # torch's default segments: QLoRA keeps intermediate-sized tensors and frees none larger, so a longer
    # batch's need new segments beside the earlier ones'
    classic = estimate(job, arch, gpu, suggest=False, runtime=Runtime(fused_loss=True))
    varying = next(t for t in classic.breakdown if t.name == "allocator: varying batch lengths")
    assert varying.bytes > term(classic, "activations") / 4 and "do not fit" in varying.note
    assert classic.allocated_bytes == plan.allocated_bytes - term(plan, "activations") + term(
        classic, "activations"
    )
    fixed = estimate(job, arch, gpu, suggest=False, runtime=Runtime(fused_loss=True, fixed_shapes=True))
    assert "allocator: varying batch lengths" not in {t.name for t in fixed.breakdown}
    assert fixed.allocated_bytes == classic.allocated_bytes and fixed.total_bytes < classic.total_bytes
    assert plan.total_bytes < classic.total_bytes
    cpu = plan_on(job, arch, device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * GiB}))
    assert cpu.reserved_bytes == cpu.allocated_bytes == cpu.total_bytes


def test_a_lora_base_in_fp32_frees_larger_copies_its_kept_tensors_reuse() -> None:
    """LoRA on an fp32 base under bf16 autocast casts o_proj's and down_proj's bf16 inputs to the fp32
    adapters (freed after lora_A): blocks twice the size of the largest kept tensors, which a longer batch's
    kept tensors fit in with torch's default segments; only the step's largest transient buffers are left."""
    arch, gpu = from_config({**LLAMA2_7B, "torch_dtype": "float32"}), resolve_gpu("H100")
    plan = estimate(
        spec(method="lora", max_seq_len=1024), arch, gpu, suggest=False, runtime=Runtime(fused_loss=True)
    )
    varying = next(t for t in plan.breakdown if t.name == "allocator: varying batch lengths")
    assert "fit in blocks" in varying.note and varying.bytes < term(plan, "activations") / 10
