"""training.fused: compiled RMSNorms, gated-MLP products and rotary embeddings train the model as its own
modules do, keep for backward what the planner says they keep, and replace exactly the modules of the
families the planner counts as fused. Run on a CPU (inductor's C++ backend); the engine installs them where
it trains on CUDA."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core.arch import load_architecture
from core.spec import JobSpec
from planner.memory import ActivationSetup, fused_gate, fused_norm, layer_saved_bytes_per_token
from training import fused
from training.model import load_model, skip_adapter_input_casts

CPU = torch.device("cpu")
pytestmark = pytest.mark.slow  # compiles (seconds; inductor caches them on disk)


def spec(**kw) -> JobSpec:
    return JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0, **kw)


def _pair(
    model_dir: Path, s: JobSpec, jit: bool = True, device: torch.device = CPU
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model as loaded, and the same model (same LoRA init, lora_B made non-zero) with fused modules
    (`jit`: compiled)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = load_model(s, model_dir, device)
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    # 2 layers x 2 norms + the final norm
    assert fused.install(models[1], jit=jit) == {"norms": 5, "mlps": 2, "ropes": 2}
    return models[0], models[1]


def _step(model: torch.nn.Module, ids: torch.Tensor, autocast: bool = False):
    """One forward and backward: the loss, the adapter's gradients and the bytes of the distinct storages
    autograd saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    ids = ids.to(next(model.parameters()).device)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast(ids.device.type, torch.bfloat16, enabled=autocast),
    ):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(
    ("device", "checkpointing", "jit"),
    [
        ("cpu", False, True),
        ("cpu", True, True),
        ("cpu", False, False),
        pytest.param("cuda", False, True, marks=ON_CUDA),
        pytest.param("cuda", False, False, marks=ON_CUDA),  # the norms: ATen's fused kernels
    ],
)
def test_fused_modules_train_as_the_models_own(
    tiny_model: Path, device: str, checkpointing: bool, jit: bool
) -> None:
    """fp32: the same loss and gradients, compiled (Triton on CUDA) or not, with layers recomputed or not."""
    s = spec(gradient_checkpointing=checkpointing)
    plain, fast = _pair(tiny_model, s, jit, torch.device(device))
    for length in (48, 31):  # another length: the same compiled code (dynamic shapes)
        ids = torch.randint(1, 1000, (2, length))
        loss, grads, _ = _step(plain, ids)
        loss_fused, grads_fused, _ = _step(fast, ids)
        assert abs(loss.item() - loss_fused.item()) <= 1e-6 * loss.item()
        assert grads.keys() == grads_fused.keys() and len(grads) == 2 * 2 * 7
        for name, grad in grads.items():
            error = (grad - grads_fused[name]).norm() / grad.norm()
            assert error < 1e-5, (name, error.item())


@pytest.mark.parametrize(("stored", "residual_bytes"), [("bfloat16", 2), ("float32", 4)])
def test_what_autograd_keeps_is_what_the_planner_counts(
    tiny_model: Path, stored: str, residual_bytes: int
) -> None:
    """Under bf16 autocast, as the engine trains on a GPU: with bf16 weights each norm keeps its bf16 input
    instead of an fp32 copy (with fp32 weights the residual stream is fp32: the same bytes) and each MLP
    no act(gate), the rotary embeddings what eager keeps; the difference is the planner's, byte for byte."""
    s = spec(torch_dtype=stored, mixed_precision="bf16")
    plain, fast = _pair(tiny_model, s)
    for model in (plain, fast):
        skip_adapter_input_casts(model)
    ids = torch.randint(1, 1000, (2, 48))
    loss, _, kept = _step(plain, ids, autocast=True)
    loss_fused, _, kept_fused = _step(fast, ids, autocast=True)
    assert abs(loss.item() - loss_fused.item()) < 1e-2 * loss.item()  # bf16: rounded in other places

    arch = load_architecture(tiny_model)
    setup = ActivationSetup(
        compute_bytes=2, autocast=True, full=False, lora=(), lora_r=8, lora_dropout=False, attn="sdpa",
        kv_repeated=False, seq_len=48, residual_bytes=residual_bytes, lora_input_cast=False,
    )  # fmt: skip
    before, _ = layer_saved_bytes_per_token(arch, setup)
    after, _ = layer_saved_bytes_per_token(arch, replace(setup, fused_norms=True, fused_gate=True))
    # The planner's final-norm term changes by one norm's (4 - 2) B x hidden too; the first block's input
    # norm, whose input (the frozen embedding) needs no gradient, is kept by neither: they cancel.
    assert kept - kept_fused == (before - after) * arch.num_layers * ids.numel() > 0


def _native_norm_case(device: str, dtype: torch.dtype, weight_grad: bool):
    """An eager FusedRMSNorm forward and backward; returns (output, input grad, weight grad, saved)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 64, generator=gen) * 3).to(device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(64, generator=gen).to(device=device, dtype=dtype).requires_grad_(weight_grad)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fused.FusedRMSNorm.apply(x, weight, 1e-5, False)
    y.backward(torch.ones_like(y))
    return y, x.grad, weight.grad, saved


@pytest.mark.parametrize("weight_grad", [False, True])
def test_the_native_norm_is_called_as_aten_defines_it(
    monkeypatch: pytest.MonkeyPatch, weight_grad: bool
) -> None:
    """ATen's fused RMSNorm (CUDA only: no CPU backward) called on meta tensors, which check each call's
    arguments and shapes: the output and gradients in the input's shapes and dtype, and autograd keeps
    what rms_norm_forward keeps (the planner's terms): the input, the weight, an fp32 rstd a row."""
    if not fused.HAS_NATIVE_NORM:
        pytest.skip("this torch has no aten._fused_rms_norm")
    monkeypatch.setattr(fused, "NATIVE_NORM_DEVICES", {"meta"})
    y, gx, gw, saved = _native_norm_case("meta", torch.bfloat16, weight_grad)
    assert (y.shape, y.dtype, gx.shape, gx.dtype) == ((2, 5, 64), torch.bfloat16, (2, 5, 64), torch.bfloat16)
    assert (gw.shape if weight_grad else gw) == ((64,) if weight_grad else None)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((2, 5, 64), torch.bfloat16),
        ((64,), torch.bfloat16),
        ((10, 1), torch.float32),
    ]
    fp32, bf16 = torch.empty(3, 64, device="meta"), torch.empty(3, 64, device="meta", dtype=torch.bfloat16)
    assert fused.native_norm(fp32, fp32[0])
    # a weight of another dtype (fp32 norms of a QLoRA model on a bf16 stream): the formula's own code
    assert not fused.native_norm(bf16, fp32[0])


@ON_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_norm_computes_llamas(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """On CUDA, ATen's fused kernels against the formula's eager code: in bf16 within one rounding."""
    native = _native_norm_case("cuda", dtype, True)
    monkeypatch.setattr(fused, "NATIVE_NORM_DEVICES", set())
    formula = _native_norm_case("cuda", dtype, True)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(native[:3], formula[:3], strict=True):
        assert got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)


FAMILIES = {  # tiny models of each family core.arch plans: (config class, extra config)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_modules_are_those_the_planner_counts(tmp_path: Path, family: str) -> None:
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **extra,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    arch = load_architecture(tmp_path)
    counts = fused.install(model)
    norms_per_model = 2 * (arch.norms_per_layer + (2 if arch.qk_norm else 0)) + 1
    assert counts["norms"] == (norms_per_model if fused_norm(arch) else 0), counts
    assert counts["mlps"] == (2 if fused_gate(arch) else 0), counts
    assert counts["ropes"] == 2, counts  # every family here rotates as Llama does (memory: no plan term)
    if counts["norms"] or counts["mlps"] or counts["ropes"]:
        ids = torch.randint(1, 128, (1, 9))
        got = model(input_ids=ids).logits.detach()  # recording autograd: the fused path at any length
        for module in model.modules():  # back to the modules' own forwards
            module.__dict__.pop("forward", None)
        with torch.no_grad():
            assert torch.allclose(got, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_where_torch_compile_fails_the_same_functions_run_eagerly(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device without a working compiler (no Triton, no C++ compiler): each function's first call fails,
    which is logged once per function, and the autograd functions run eagerly from then on, keeping the
    tensors the planner counts."""
    calls: list[str] = []

    def broken(fn, **_):  # what a compiled function's first call raises there
        def call(*args):
            calls.append(fn.__name__)
            raise RuntimeError("no compiler")

        return call

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_eager", set())
    monkeypatch.setattr(fused.torch, "compile", broken)
    plain, fast = _pair(tiny_model, spec(), jit=True)
    for length in (40, 33):  # the second step calls nothing compiled
        ids = torch.randint(1, 1000, (2, length))
        loss, grads, _ = _step(plain, ids)
        loss_fused, grads_fused, _ = _step(fast, ids)
        assert abs(loss.item() - loss_fused.item()) <= 1e-6 * loss.item()
        for name, grad in grads.items():
            assert ((grad - grads_fused[name]).norm() / grad.norm()).item() < 1e-5, name
    # each tried once: the norm's forward and input gradient (its weight is frozen), the rope's and the
    # gate's forward and gradient
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 6, calls
    assert caplog.text.count("torch.compile fails") == 6


def test_other_lengths_and_evaluation_compile_nothing_more(tiny_model: Path) -> None:
    """Once a step has run, steps of other lengths and batch sizes and a no-grad evaluation reuse the
    compiled graphs: dynamo compiles again for each grad or autocast state, Parameter, requires_grad, alias
    and size-1 dimension unless the calls hide them (past 8 a function would run eagerly)."""
    from torch._dynamo.utils import counters

    _, fast = _pair(tiny_model, spec())
    _step(fast, torch.randint(1, 1000, (2, 48)), autocast=True)
    graphs = counters["stats"]["unique_graphs"]
    for shape in ((2, 31), (1, 17), (3, 9)):
        _step(fast, torch.randint(1, 1000, shape), autocast=True)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):  # fused: as many tokens as that takes
        fast(input_ids=torch.randint(1, 1000, (4, fused.NO_GRAD_MIN_TOKENS // 4)))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("jit", [False, True])
def test_the_fused_rotary_embedding_is_the_familys(jit: bool) -> None:
    """bf16 q and k with fp32 cos and sin (fp32 weights under autocast), a cos of batch 1: the outputs (fp32,
    promoted as there) and the gradients (bf16) of Llama's apply_rotary_pos_emb, bit for bit eagerly."""
    from transformers.models.llama import modeling_llama

    family = getattr(modeling_llama.apply_rotary_pos_emb, "original", modeling_llama.apply_rotary_pos_emb)
    gen = torch.Generator().manual_seed(0)
    # [batch, positions, heads, head_dim] projections seen as [batch, heads, positions, head_dim]
    q = torch.randn(3, 7, 4, 16, generator=gen).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(3, 7, 2, 16, generator=gen).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 7, 16, generator=gen), torch.randn(1, 7, 16, generator=gen)
    out_grads = [torch.randn(3, 4, 7, 16, generator=gen), torch.randn(3, 2, 7, 16, generator=gen)]
    results = []
    for run in (
        lambda: family(q, k, cos, sin),
        lambda: [fused.FusedRope.apply(t, cos, sin, jit) for t in (q, k)],
    ):
        q.grad = k.grad = None
        outs = run()
        torch.autograd.backward(outs, out_grads)
        results.append([*outs, q.grad, k.grad])
    for want, got in zip(*results, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if jit:  # one rounding where eager rounds each op
            assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(got, want)


def test_the_rotary_embedding_is_fused_only_in_installed_forwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family's function is module-level, shared by every model of the family: another model, and a
    partial rotary embedding (Phi-3's rotary dims < head_dim), still run the family's own."""
    import transformers

    calls: list[int] = []
    apply = fused.FusedRope.apply
    monkeypatch.setattr(fused.FusedRope, "apply", lambda *a: calls.append(1) or apply(*a))

    def tiny(**extra):
        config = transformers.Phi3Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, **extra,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)

    ids = torch.randint(1, 128, (1, 9))
    installed, other, partial = tiny(), tiny(), tiny(partial_rotary_factor=0.5)
    fused.install(installed)
    assert fused.install(partial)["ropes"] == 2
    installed(input_ids=ids)  # recording autograd: fused at any length
    assert len(calls) == 2 * 2  # q and k in each layer
    want = other(input_ids=ids).logits.detach()
    partial(input_ids=ids)
    assert len(calls) == 2 * 2
    assert torch.allclose(installed(input_ids=ids).logits.detach(), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * 2 * 2  # two forwards of the installed model


def _count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for cls in (fused.FusedRMSNorm, fused.FusedGate, fused.FusedRope):
        apply = cls.apply
        monkeypatch.setattr(
            cls, "apply", lambda *a, _apply=apply, _name=cls.__name__: calls.append(_name) or _apply(*a)
        )
    return calls


def test_a_small_no_grad_call_runs_the_modules_own_code(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding (a no-grad forward of a token or a few per sequence) runs the modules' own code, bit for bit
    the model's; a no-grad forward of NO_GRAD_MIN_TOKENS tokens, and any forward that records autograd, the
    fused functions."""
    plain, fast = _pair(tiny_model, spec(), jit=False)
    calls = _count_fused_calls(monkeypatch)
    decoding = torch.randint(1, 1000, (16, 1))
    with torch.no_grad():
        assert torch.equal(fast(input_ids=decoding).logits, plain(input_ids=decoding).logits)
    assert calls == []
    with torch.no_grad():
        fast(input_ids=torch.randint(1, 1000, (2, fused.NO_GRAD_MIN_TOKENS // 2)))
    assert sorted(set(calls)) == ["FusedGate", "FusedRMSNorm", "FusedRope"]
    calls.clear()
    fast(input_ids=decoding)
    assert len(calls) == 5 + 2 + 2 * 2  # norms, gates, q and k of each layer


def test_under_torch_compile_the_installed_model_is_one_graph(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside torch.compile (transformers compiles the decoding step of a static cache, on CUDA with CUDA
    graphs) the installed forwards trace the modules' own code, which the compiler fuses: no graph break
    (fullgraph=True raises on one), the model's logits."""
    plain, fast = _pair(tiny_model, spec())
    calls = _count_fused_calls(monkeypatch)
    ids = torch.randint(1, 1000, (2, 7))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fast, fullgraph=True)(input_ids=ids).logits
        assert torch.allclose(got, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert calls == []
