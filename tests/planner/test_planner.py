"""Planner: byte formulas against real tensors, monotonicity, FSDP, data shapes."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest

from core.arch import from_config
from core.errors import InvalidInput
from planner import FTUNE, BatchShape, Runtime, estimate
from planner.gpus import GiB, resolve_gpu
from planner.memory import (
    LOSS_CHUNK_BYTES,
    ActivationSetup,
    chunked_loss_bytes,
    layer_saved_bytes_per_token,
    logits_bytes_per_token,
    loss_chunk_tokens,
    nf4_bytes,
)
from tests.planner.planner_util import LLAMA2_7B, LLAMA3_8B, spec, term, total


# -- byte formulas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4096, 11008), (64, 96), (100, 37), (1000, 1000), (7, 9)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_bytes_equal_bitsandbytes(shape: tuple[int, int], double_quant: bool) -> None:
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = torch.randn(*shape, dtype=torch.bfloat16)
        p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=double_quant)
        p = p._quantize("cpu")
    qs = p.quant_state
    tensors = [p.data, qs.absmax, qs.code] + ([qs.state2.absmax, qs.offset] if qs.nested else [])
    assert sum(t.numel() * t.element_size() for t in tensors) == nf4_bytes(w.numel(), double_quant)


@pytest.mark.parametrize(
    ("method", "targets", "attn", "autocast"),
    [
        ("lora", "all-linear", "sdpa", True),
        ("lora", ["q_proj", "v_proj"], "sdpa", True),
        ("full", None, "sdpa", True),
        ("lora", "all-linear", "eager", True),
        ("full", None, "eager", True),
        ("lora", "all-linear", "sdpa", False),  # fp32: lora_A shares the base linears' inputs
        ("lora", ["q_proj", "o_proj", "down_proj"], "sdpa", False),
    ],
)
def test_saved_tensor_model_matches_autograd(method: str, targets, attn: str, autocast: bool) -> None:
    """Per-layer bytes the planner assumes = bytes autograd really saves (CPU, bf16 autocast or plain
    fp32, no dropout)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    b, s = 3, 37
    cfg = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=88,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )

    def saved(layers: int) -> int:
        config = transformers.LlamaConfig(num_hidden_layers=layers, attn_implementation=attn, **cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            if autocast:
                model = model.to(torch.bfloat16)
            if method == "lora":
                model = peft.get_peft_model(
                    model, peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0)
                )
        seen: dict[int, int] = {}

        def pack(t):
            if t.numel() % (b * s) == 0 and not isinstance(t, torch.nn.Parameter):  # activations only
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(3, 101, (b, s))
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", torch.bfloat16, enabled=autocast),
        ):
            model(input_ids=ids, labels=ids)
        return sum(seen.values())

    per_layer_measured = (saved(3) - saved(2)) / (b * s)
    arch = from_config({"model_type": "llama", "num_hidden_layers": 2, **cfg})
    lora = () if method == "full" else tuple(arch.lora_targets(targets))
    setup = ActivationSetup(
        compute_bytes=2 if autocast else 4,
        autocast=autocast,
        full=method == "full",
        lora=lora,
        lora_r=4,
        lora_dropout=False,
        attn=attn,
        kv_repeated=False,
        seq_len=s,
    )
    predicted, _ = layer_saved_bytes_per_token(arch, setup)
    # the only unmodelled tensors are the RMSNorms' per-token fp32 rsqrt (2 x 4 B per token)
    assert predicted == pytest.approx(per_layer_measured, rel=0.01)


# -- monotonicity and methods -----------------------------------------------------------------------
def test_more_batch_or_sequence_needs_more_memory() -> None:
    for ck in (False, True):
        base = spec(micro_batch_size=2, max_seq_len=1024, gradient_checkpointing=ck)
        assert total(base) < total(base.model_copy(update={"micro_batch_size": 4}))
        assert total(base) < total(base.model_copy(update={"max_seq_len": 2048}))


def test_checkpointing_reduces_activations() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")
    off = estimate(spec(gradient_checkpointing=False), arch, gpu, suggest=False)
    on = estimate(spec(gradient_checkpointing=True), arch, gpu, suggest=False)
    assert term(on, "activations") < term(off, "activations") / 4
    assert on.total_bytes < off.total_bytes


def test_checkpointed_layers_keep_their_input_in_the_residual_streams_dtype() -> None:
    """An fp32 base under bf16 autocast adds each block's bf16 output to an fp32 residual stream, so each
    checkpointed layer keeps an fp32 input (an H200 measured 8.7% more than a plan of bf16 inputs); QLoRA's
    unquantized layers are bf16 on a GPU, and so is its residual stream. Where peft casts LoRA inputs to
    fp32 (a plain transformers/peft loop), the recomputed layer's peak is its LoRA branch's fp32 copies of
    down_proj's input beside the layer's incoming gradient; ftune's engine leaves that cast out on a GPU
    (training.model.skip_adapter_input_casts), and its peak is a block's gradients in flight."""
    gpu, tokens = resolve_gpu("H100"), 4 * 1024
    fp32 = from_config({**LLAMA2_7B, "torch_dtype": "float32"})
    h, inter = fp32.hidden_size, fp32.intermediate_size
    for method, res_b in (("lora", 4), ("qlora", 2)):
        plan = estimate(
            spec(method=method, gradient_checkpointing=True, max_seq_len=1024), fp32, gpu, suggest=False
        )
        # + the final norm's input: as it is, the engine's norms being compiled on a GPU (training.fused)
        assert term(plan, "activations") == fp32.num_layers * res_b * h * tokens + res_b * h * tokens
    job = spec(method="lora", gradient_checkpointing=True, max_seq_len=1024)
    peft_cast = estimate(job, fp32, gpu, suggest=False, runtime=Runtime(fused_loss=True))
    working = next(t for t in peft_cast.breakdown if t.name == "backward working buffers")
    assert working.bytes == tokens * (inter * (4 + 4) + 4 * h) and "down_proj" in working.note
    ftune = estimate(job, fp32, gpu, suggest=False, runtime=FTUNE)
    working = next(t for t in ftune.breakdown if t.name == "backward working buffers")
    assert working.bytes == tokens * (4 * h + 2 * inter * 2) and "grads in flight" in working.note


def test_qlora_lora_full_weights_and_totals_are_ordered() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("H100")
    plans = {m: estimate(spec(method=m), arch, gpu, suggest=False) for m in ("qlora", "lora", "full")}
    q = plans["qlora"]
    q_weights = term(q, "base weights (NF4)") + term(q, "unquantized weights")
    assert q_weights < term(plans["lora"], "base weights") == term(plans["full"], "base weights")
    assert q.total_bytes < plans["lora"].total_bytes < plans["full"].total_bytes
    assert q.trainable_params == plans["lora"].trainable_params < plans["full"].trainable_params


def test_full_finetune_with_master_weights_is_16_bytes_per_param() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("H100")
    p = estimate(spec(method="full", torch_dtype="bfloat16", master_weights=True), arch, gpu, suggest=False)
    state = sum(term(p, n) for n in ("base weights", "gradients", "master weights", "optimizer states"))
    assert state == 16 * arch.total_params
    p8 = estimate(
        spec(method="full", torch_dtype="bfloat16", optimizer="adamw_8bit"), arch, gpu, suggest=False
    )
    assert term(p8, "optimizer states") == pytest.approx(2 * arch.total_params, rel=0.02)


def test_paged_optimizer_leaves_the_forward_backward_peak() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("H100")
    plan = estimate(spec(method="full", optimizer="paged_adamw_8bit"), arch, gpu, suggest=False)
    assert "optimizer states" not in {t.name for t in plan.breakdown}
    assert "paged" in next(t.note for t in plan.breakdown if t.name == "optimizer states (paged)")
    assert sum(t.bytes for t in plan.breakdown) == plan.total_bytes


def test_fsdp_divides_sharded_terms() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")
    job = spec(method="full", master_weights=True, torch_dtype="bfloat16", optimizer="adamw_8bit")
    one = estimate(job, arch, gpu, suggest=False)
    four = estimate(one_spec := job.model_copy(update={"num_gpus": 4}), arch, gpu, suggest=False)
    for name in ("base weights", "gradients", "master weights", "optimizer states"):
        assert term(four, name) == term(one, name) // 4, name
    assert term(four, "activations") == term(one, "activations")  # each GPU runs its own micro-batch
    assert term(four, "FSDP all-gathered units") >= 2 * arch.layer_params * 2
    assert one_spec.num_gpus == 4 and four.total_bytes < one.total_bytes


# -- plan shape, input errors, GPUs -------------------------------------------------------------------
def test_plan_is_json_with_noted_terms_summing_to_total() -> None:
    plan = estimate(spec(), from_config(LLAMA2_7B), resolve_gpu("L4"), tokens_per_epoch=1_000_000)
    data = json.loads(plan.model_dump_json())
    assert sum(t["bytes"] for t in data["breakdown"]) == data["total_bytes"]
    assert all(t["note"] for t in data["breakdown"])
    assert data["headroom_bytes"] == data["usable_bytes"] - data["total_bytes"]
    assert plan.est_seconds_per_epoch and plan.est_seconds_per_epoch > 0
    names = {t["name"] for t in data["breakdown"]}
    assert {"activations", "logits and loss", "CUDA context", "allocator fragmentation"} <= names


def test_unknown_targets_are_an_input_error() -> None:
    with pytest.raises(InvalidInput):
        estimate(spec(lora_target_modules=["c_attn"]), from_config(LLAMA2_7B), resolve_gpu("H100"))


def test_resolve_gpu() -> None:
    assert resolve_gpu("a100 80gb").name == resolve_gpu("A100-80GB").name == "A100-80GB"
    assert resolve_gpu("NVIDIA GeForce RTX 4090").name == "RTX-4090"
    assert resolve_gpu("24GB").memory_bytes == resolve_gpu("24GiB").memory_bytes == 24 * GiB
    assert 0 < resolve_gpu("H100").usable_bytes < resolve_gpu("H100").memory_bytes
    assert not resolve_gpu("T4").bf16_supported
    with pytest.raises(InvalidInput):
        resolve_gpu("Voodoo5")


# -- loss head, phases, devices, framework settings ------------------------------------------------
def test_loss_head_is_12_bytes_per_vocab_entry_in_fp32_and_3e_without_upcast() -> None:
    arch = from_config(LLAMA3_8B)
    assert logits_bytes_per_token(arch, 2) == logits_bytes_per_token(arch, 4) == 12 * arch.vocab_size
    assert logits_bytes_per_token(arch, 2, loss_fp32=False) == 6 * arch.vocab_size


def test_the_chunked_loss_head_holds_one_chunk_of_logits() -> None:
    """ftune's engine (training.loss): one chunk of loss_chunk_tokens(vocab) scored tokens' vocab-sized
    buffers at a time (8 B per entry: fp32 logits + logsumexp's buffer), plus [scored, hidden] hidden
    states and their gradients; a framework's plain head holds every scored token's logits (12 B)."""
    arch = from_config(LLAMA3_8B)
    scored = 8192
    chunk = loss_chunk_tokens(arch.vocab_size)
    assert chunk == LOSS_CHUNK_BYTES // (4 * arch.vocab_size) == 523
    head = chunked_loss_bytes(arch, 2, 2, scored, head_cast=False)
    assert (head.chunk, head.transient) == (chunk, chunk * arch.vocab_size * 8)
    assert head.kept == scored * (2 * arch.hidden_size * 2 + 4) + chunk * arch.hidden_size * 2
    cast = chunked_loss_bytes(arch, 2, 4, scored, head_cast=True)  # an fp32 lm_head under bf16 autocast
    assert cast.transient == chunk * arch.vocab_size * 6 + arch.vocab_size * arch.hidden_size * 2
    reference = chunked_loss_bytes(arch, 2, 2, scored, head_cast=False, grad=False)
    assert reference.kept == scored * (arch.hidden_size * 2 + 4)  # no gradient: a no-grad reference forward
    gpu = resolve_gpu("H100")
    job = spec(method="lora", max_seq_len=4096, micro_batch_size=2, gradient_checkpointing=False)
    fused = estimate(job, arch, gpu, suggest=False)
    plain = estimate(job, arch, gpu, suggest=False, runtime=Runtime())
    assert "chunked head" in next(t.note for t in fused.breakdown if t.name == "logits and loss")
    assert term(plain, "logits and loss") == scored * logits_bytes_per_token(arch, 2)
    assert fused.total_bytes < plain.total_bytes - 4 * GiB


@pytest.mark.parametrize(
    ("config", "fields"),
    [
        ({}, {"lora_target_modules": ["q_proj", "lm_head"]}),  # LoRA on the lm_head: it trains
        ({}, {"method": "full"}),
        ({"model_type": "gemma2", "head_dim": 128}, {}),  # final_logit_softcapping
    ],
)
def test_the_plain_head_serves_what_the_chunked_one_cannot(config: dict, fields: dict) -> None:
    from planner.context import plan_context

    arch, gpu = from_config({**LLAMA2_7B, **config}), resolve_gpu("H100")
    assert not plan_context(spec(**fields), arch, gpu, FTUNE).fused_loss
    assert plan_context(spec(), from_config(LLAMA2_7B), gpu, FTUNE).fused_loss


def test_peak_takes_the_larger_of_loss_and_layer_backward() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("H100")
    plan = estimate(spec(method="qlora", max_seq_len=4096), arch, gpu, suggest=False)
    loss, layer = term(plan, "logits and loss"), term(plan, "recomputed layer")
    assert (loss == 0) != (layer == 0)  # exactly one phase is at the peak, the other is noted
    names = ("logits and loss", "recomputed layer")
    idle = next(t for t in plan.breakdown if t.bytes == 0 and t.name in names)
    assert "not at the peak" in idle.note
    assert sum(t.bytes for t in plan.breakdown) == plan.total_bytes


def test_cpu_device_has_no_cuda_terms() -> None:
    from planner.feasibility import device_gpu, plan_on

    cpu = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * GiB})
    plan = plan_on(spec(), from_config(LLAMA2_7B), cpu)
    assert term(plan, "CUDA context") == 0
    norms = next(t for t in plan.breakdown if t.name == "gradient-norm buffers")
    assert "CUDA" not in norms.note


def test_kbit_upcast_keeps_unquantized_weights_in_fp32() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")
    job = spec(method="qlora", max_seq_len=2048)
    plain = estimate(job, arch, gpu, suggest=False)
    upcast = estimate(job, arch, gpu, suggest=False, runtime=Runtime(kbit_fp32_upcast=True))
    assert term(upcast, "unquantized weights") == 2 * term(plain, "unquantized weights")
    assert term(upcast, "lm_head compute-dtype copy") == arch.vocab_size * arch.hidden_size * 2
    assert term(upcast, "activations") > term(plain, "activations")  # fp32 residual stream
    assert upcast.total_bytes > plain.total_bytes


def test_half_model_with_master_weights_is_deepspeeds_16_bytes_per_lora_param() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A100-80GB")
    job = spec(method="qlora", max_seq_len=512)
    plain = estimate(job, arch, gpu, suggest=False)
    ds = estimate(job, arch, gpu, suggest=False, runtime=Runtime(half_model_master=True))
    p = ds.trainable_params
    state = ("LoRA adapters", "gradients", "master weights", "optimizer states")
    assert [term(ds, n) for n in state] == [2 * p, 2 * p, 4 * p, 8 * p]
    assert term(plain, "autocast weight copies") == 2 * p  # no autocast in a half-precision model
    assert not any(t.name == "autocast weight copies" for t in ds.breakdown)
    step = next(t for t in ds.breakdown if t.name == "fp32 gradient copy for the step")
    assert step.bytes in (0, 6 * p) and "2 + 4 B/param" in step.note
    assert sum(t.bytes for t in ds.breakdown) == ds.total_bytes


def test_gptq_dequantized_weights_are_kept_by_the_recomputed_layer() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")  # small vocab: the layer is the peak
    job = spec(method="qlora", max_seq_len=256)
    bnb = estimate(job, arch, gpu, suggest=False)
    gptq = estimate(job, arch, gpu, suggest=False, runtime=Runtime(dequant_saved=True))
    layer_weights = sum(m.weight_numel for m in arch.block_linears) * 2
    recomputed = next(t for t in gptq.breakdown if t.name == "recomputed layer")
    assert recomputed.bytes > layer_weights and "dequantized" in recomputed.note  # the peak here
    assert gptq.total_bytes > bnb.total_bytes
    assert not any(t.name == "QLoRA dequantization buffer" for t in gptq.breakdown)
    unpack = next(t for t in gptq.breakdown if t.name == "GPTQ unpacking buffer")
    tokens = job.micro_batch_size * job.max_seq_len
    assert unpack.bytes == 3 * arch.largest_linear_numel - 2 * 2 * arch.intermediate_size * tokens
    off = estimate(
        spec(method="qlora", max_seq_len=256, gradient_checkpointing=False),
        arch,
        gpu,
        suggest=False,
        runtime=Runtime(dequant_saved=True),
    )
    assert term(off, "frozen weight copies kept by matmuls") == arch.num_layers * layer_weights


def test_packed_attention_without_grouped_kv_keeps_k_and_v_per_query_head() -> None:
    """ftune's packed rows on a torch whose varlen attention has no enable_gqa: k and v repeated to every
    query head and saved so (an H200 with torch 2.11: 0.6 GiB more for a 22-layer 1.1B model)."""
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("H100")
    job = spec(method="lora", max_seq_len=1024, packing=True, gradient_checkpointing=False)
    repeated = estimate(job, arch, gpu, suggest=False)
    grouped = estimate(job, arch, gpu, suggest=False, runtime=replace(FTUNE, varlen_gqa=True))
    kv = arch.num_kv_heads * arch.head_dim
    extra = arch.num_layers * 4 * 1024 * 2 * 2 * (arch.num_heads * arch.head_dim - kv)
    assert term(repeated, "activations") - term(grouped, "activations") == extra


# -- the data's lengths (token statistics) ----------------------------------------------------------
def test_the_datas_largest_micro_batch_replaces_the_worst_case() -> None:
    """max_seq_len 4096 for data whose longest example is 300 tokens: refused on the worst case (every
    micro-batch 8 x 4096 tokens), it fits once planned from the data (8 x 300, 1800 of them scored)."""
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("A10G")
    job = spec(method="qlora", micro_batch_size=8, max_seq_len=4096, gradient_checkpointing=True)
    worst = estimate(job, arch, gpu, suggest=False)
    data = estimate(job, arch, gpu, suggest=False, shape=BatchShape(tokens=2400, seq_len=300, targets=1800))
    assert not worst.fits and data.fits
    assert worst.batch_shape is None and worst.planned_tokens == 8 * 4096
    assert data.planned_tokens == 2400 and "the data's largest micro-batch" in next(
        t.note for t in data.breakdown if t.name == "activations"
    )
    assert term(data, "activations") < term(worst, "activations") * 2400 / 32768 * 1.01
    logits = [t for p in (data, worst) for t in p.breakdown if t.name == "logits and loss"]
    assert "of 1800 scored tokens" in logits[0].note and "of 32768 scored tokens" in logits[1].note


def test_a_shape_never_plans_more_than_the_worst_case() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("A100-80GB")
    job = spec(micro_batch_size=2, max_seq_len=1024)
    worst = estimate(job, arch, gpu, suggest=False)
    huge = BatchShape(tokens=10**6, seq_len=10**5, targets=10**6)  # e.g. statistics of other settings
    assert estimate(job, arch, gpu, suggest=False, shape=huge).total_bytes == worst.total_bytes


def test_fsdp_on_cpus_has_no_nccl_buffers() -> None:
    from planner.feasibility import device_gpu, plan_on

    cpu = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * GiB})
    names = [t.name for t in plan_on(spec(num_gpus=2), from_config(LLAMA2_7B), cpu).breakdown]
    assert "FSDP all-gathered units" in names and "NCCL buffers" not in names
    names = [
        t.name for t in estimate(spec(num_gpus=2), from_config(LLAMA2_7B), resolve_gpu("A100-80GB")).breakdown
    ]
    assert "NCCL buffers" in names
