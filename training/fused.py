"""Each RMSNorm, each gated MLP's act(gate) * up and each rotary position embedding as one autograd
function that keeps fewer tensors than autograd would, its forward and backward each one compiled kernel
where asked (torch.compile: Triton on a GPU).

In eager PyTorch a Llama-style RMSNorm is seven kernels forward (upcast, square, mean, add, rsqrt, two
multiplies and a downcast, each a pass over [tokens, hidden]) and more backward, and autograd keeps its fp32
upcast input: 4 bytes a value. A gated MLP's act(gate) * up is two kernels forward, three backward, and
autograd keeps act(gate) besides gate and up. Here each is an autograd.Function that keeps only its inputs
(and a norm's fp32 rstd, one per token, as eager's rsqrt does), whatever the compiler fuses: a norm keeps
its input in its own dtype, an MLP no act(gate) (the planner counts that: Runtime.fused_norm_mlp). Its
backward is eager autograd's formula written out (the activations' own aten backward kernels). A rotary
embedding (x * cos + rotate_half(x) * sin: five kernels forward for q and five for k, more backward) keeps
cos and sin, as eager autograd does: the same bytes, so the planner counts nothing new for it.

Installed as instance forwards, and only where they compute what the module computed: a norm whose output
on a probe equals rms_norm's bit for bit (the same formula, not Gemma's 1 + weight), an MLP whose forward
is Llama's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with an activation known here, an attention whose
family's `apply_rotary_pos_emb` computes Llama's on a probe (that module-level function is replaced by one
that runs the fused one only inside the forwards installed here, the family's own everywhere else).
install(jit=True) compiles them (each at its first call; eagerly where that fails, keeping the same
tensors). Eagerly on CUDA a norm is ATen's own fused RMSNorm kernels (native_norm), keeping the same.
Decoding (a small no-grad call) and code inside torch.compile run the modules' own code. The engine
installs them where it trains on CUDA, eagerly (training.model.use_cuda_paths: compiled after a tiny probe
they were slower on an H200), for the tensors they do not keep.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
aten = torch.ops.aten


# -- the math, forward and backward (pure functions of tensors: what torch.compile fuses) --------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, as a function."""
    return rms_norm_forward(x, weight, eps)[0]


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm and its fp32 rstd (1 / root mean square, one per row)."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


def rms_norm_input_grad(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """d loss / d x, as autograd derives it from rms_norm_forward's ops."""
    g = (grad * weight).to(torch.float32)
    h = x.to(torch.float32)
    dot = (g * h).sum(-1, keepdim=True)
    return (g * rstd - h * (dot * rstd.pow(3) / h.shape[-1])).to(x.dtype)


def rms_norm_weight_grad(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return (grad * (x.to(torch.float32) * rstd).to(x.dtype)).flatten(0, -2).sum(0)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_gate_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def gelu_tanh_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh(gate) * up


def gelu_tanh_gate_grads(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return aten.gelu_backward(grad * up, gate, approximate="tanh"), grad * gelu_tanh(gate)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q and k (its dtype promoted with cos's, as there)."""
    return x * cos + rotate_half(x) * sin


def rope_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d loss / d x, as autograd derives it from rope's ops: each product's gradient in x's dtype, the
    second one rotated back (rotate_half's transpose, [y1, y2] -> [y2, -y1], is -rotate_half), summed."""
    return (grad * cos).to(dtype) - rotate_half((grad * sin).to(dtype))


Gate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GateGrads = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# transformers' activation classes (ACT2FN) by name: the function each computes, its gate and gradients
GATES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Gate, GateGrads]] = {
    "SiLUActivation": (F.silu, silu_gate, silu_gate_grads),
    "SiLU": (F.silu, silu_gate, silu_gate_grads),
    "GELUTanh": (gelu_tanh, gelu_tanh_gate, gelu_tanh_gate_grads),
    "PytorchGELUTanh": (gelu_tanh, gelu_tanh_gate, gelu_tanh_gate_grads),
}


# -- compiling ------------------------------------------------------------------------------------------
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_eager: set[Callable[..., Any]] = set()  # those torch.compile failed on: they run eagerly


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One compiled function per Python function, for every module and shape (dynamic shapes: a batch of
    another length does not compile again), always called without grad and autocast: dynamo compiles
    again for each such global state, and these elementwise ops cast for themselves (autocast changes
    none of them). Past torch's recompile limit (a dtype, a size-1 dimension each add one) a call runs
    eagerly, keeping the same tensors.

    Compiled at its first real call, never on a probe: under dynamic shapes inductor keeps the launch
    configs it tuned for the first shape for every later one (pytorch/pytorch#197842), and a 4 x 8 probe
    (until 2026-11-27) left these kernels 0.21x-0.90x as fast as eager on an H200 at 8,192 tokens. Where
    that first call fails (no Triton, no C++ compiler), it is logged once and the function runs eagerly
    from then on: the same tensors kept."""
    if fn not in _compiled:
        jitted = torch.compile(fn, dynamic=True)
        first = True

        def call(*args: Any) -> Any:
            nonlocal first
            # plain tensors (not Parameters, no requires_grad): dynamo guards on both
            plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            with torch.no_grad(), torch.autocast(plain[0].device.type, enabled=False):
                if fn in _eager:
                    return fn(*plain)
                if not first:
                    return jitted(*plain)
                first = False
                try:  # the first call compiles
                    return jitted(*plain)
                except Exception:  # inductor's errors share no base class: any failure means eager
                    log.exception("torch.compile fails for %s: it runs eagerly", fn.__name__)
                    _eager.add(fn)
                    return fn(*plain)

        _compiled[fn] = call
    return _compiled[fn]


def not_compiled() -> list[str]:
    """The functions torch.compile failed on in this process (they run eagerly)."""
    return sorted(fn.__name__ for fn in _eager)


# -- the autograd functions -----------------------------------------------------------------------------
# Each sees its tensors as [tokens, features] (views): every batch shape is then one compiled graph (torch
# specializes dimensions of size 1, which a [1, tokens, features] packed row would make another).
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# ATen's own fused RMSNorm, one kernel forward and one backward (a recent torch's, detected; CUDA only: the
# backward has no CPU kernel), keeping what the functions here keep: the input, the weight and an fp32
# rstd per row. Where a norm's input and weight share a dtype there, an eager (not jit) FusedRMSNorm runs
# it instead of the ~7 kernels forward and ~10 backward of rms_norm_forward and its gradients (0.84 ms
# forward + backward at 8,192 x 2,048 bf16 tokens on an H200, 2026-11-27). It rounds once, x * rstd *
# weight in fp32 to the input's dtype, where Llama's formula rounds x * rstd before the weight: in bf16
# they differ by an ulp.
NATIVE_NORM_DEVICES = {"cuda"}
HAS_NATIVE_NORM = hasattr(aten, "_fused_rms_norm") and hasattr(aten, "_fused_rms_norm_backward")


def native_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ATen's fused RMSNorm kernels compute this norm (see NATIVE_NORM_DEVICES)."""
    return HAS_NATIVE_NORM and x.device.type in NATIVE_NORM_DEVICES and x.dtype == weight.dtype


class FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, jit: bool) -> torch.Tensor:
        ctx.native = not jit and native_norm(x, weight)
        if ctx.native:  # not an autocast op (rms_norm is, in fp32): the output keeps x's dtype, as Llama's
            y, rstd = aten._fused_rms_norm(_rows(x), [x.shape[-1]], weight, eps)
        else:
            y, rstd = (compiled(rms_norm_forward) if jit else rms_norm_forward)(_rows(x), weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.jit = jit
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        if ctx.native:
            wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
            gx, gw = aten._fused_rms_norm_backward(_rows(grad), _rows(x), [x.shape[-1]], rstd, weight, wanted)
            return (gx.view(x.shape) if wanted[0] else None), (gw if wanted[1] else None), None, None
        input_grad, weight_grad = rms_norm_input_grad, rms_norm_weight_grad
        if ctx.jit:
            input_grad, weight_grad = compiled(input_grad), compiled(weight_grad)
        rows, x_rows = _rows(grad), _rows(x)
        gx = input_grad(rows, x_rows, weight, rstd).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = weight_grad(rows, x_rows, rstd) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class FusedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kind: str, jit: bool) -> torch.Tensor:
        _, fn, _ = GATES[kind]
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.jit = kind, jit
        return (compiled(fn) if jit else fn)(_rows(gate), _rows(up)).view(gate.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        _, _, grads = GATES[ctx.kind]
        g_gate, g_up = (compiled(grads) if ctx.jit else grads)(_rows(grad), _rows(gate), _rows(up))
        return g_gate.view(gate.shape), g_up.view(up.shape), None, None


# q and k as [batch, heads, positions, head_dim] views of [batch, positions, heads, head_dim] projections,
# cos and sin as [batch or 1, positions, head_dim]: seen as [batch x positions, heads, head_dim] and
# [batch x positions, 1, head_dim] (views, but for a cos of batch 1 expanded: a copy of head_dim per token).
def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _position_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    return t.expand(batch, -1, -1).reshape(-1, 1, t.shape[-1])


class FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, jit: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)  # the model's, shared by its layers: eager keeps the same
        ctx.dtype, ctx.jit = x.dtype, jit
        b, h, s, d = x.shape
        y = (compiled(rope) if jit else rope)(_heads_rows(x), _position_rows(cos, b), _position_rows(sin, b))
        return y.reshape(b, s, h, d).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        b, h, s, d = grad.shape
        fn = compiled(rope_grad) if ctx.jit else rope_grad
        g = fn(_heads_rows(grad), _position_rows(cos, b), _position_rows(sin, b), ctx.dtype)
        return g.reshape(b, s, h, d).transpose(1, 2), None, None, None


# Where an installed forward runs the module's own code instead: inside torch.compile (the compiler fuses
# that code itself, and the functions here would break its graph), and in a no-grad call on fewer tokens
# than this (decoding: one new token of each sequence), where nothing is kept for a backward and a
# compiled call's guards and launch cost more than its few small kernels (bench/rollouts_decode.py).
NO_GRAD_MIN_TOKENS = 1024


def _own_code(tokens: int) -> bool:
    return torch.compiler.is_compiling() or (tokens < NO_GRAD_MIN_TOKENS and not torch.is_grad_enabled())


# Whether the rotary embedding is fused in the forward running now, and compiled (set by the attention
# forwards install makes; None outside them): the family's function is module-level, shared by every model.
_rope_jit: ContextVar[bool | None] = ContextVar("ftune_fused_rope", default=None)


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Shapes the fused rotary embedding computes as Llama's function does (not a partial rotary
    embedding, not cos and sin that need a gradient); anything else takes the family's own."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or q.shape[-1] % 2:
        return False
    b, _, s, d = q.shape
    same = k.shape[0] == b and k.shape[2:] == (s, d) and cos.shape[1:] == (s, d) and cos.shape[0] in (1, b)
    return same and not (cos.requires_grad or sin.requires_grad)


def _fused_rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """A family's apply_rotary_pos_emb that runs the fused one inside installed forwards, for the shapes
    it computes as the family's does, and the family's `original` otherwise."""

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # before the ContextVar, whose get() would break the graph
            return original(q, k, cos, sin, *args, **kwargs)
        jit = _rope_jit.get()
        own = jit is None or args or kwargs.get("unsqueeze_dim", 1) != 1 or not _fits(q, k, cos, sin)
        if own or _own_code(q.shape[0] * q.shape[2]):  # q: [batch, heads, positions, head_dim]
            return original(q, k, cos, sin, *args, **kwargs)
        return FusedRope.apply(q, cos, sin, jit), FusedRope.apply(k, cos, sin, jit)

    apply_rotary_pos_emb.original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


# -- installing -----------------------------------------------------------------------------------------
def install(model: torch.nn.Module, jit: bool = False) -> dict[str, int]:
    """The fused forwards on the norms, gated MLPs and attentions (their rotary embeddings) of `model` that
    compute what they did; returns how many of each. `jit`: compile them (Triton on a GPU, C++ on a CPU),
    each at its first call (see compiled)."""
    norms = [m for m in model.modules() if _is_rms_norm(m)]
    mlps = [(m, kind) for m in model.modules() if (kind := gate_kind(m)) is not None]
    attentions = [m for m in model.modules() if _has_llama_rope(m)]
    for norm in norms:
        norm.forward = MethodType(_norm_forward(jit), norm)
    for mlp, kind in mlps:
        mlp.forward = MethodType(_mlp_forward(kind, jit), mlp)
    for attention in attentions:
        attention.forward = MethodType(_attention_forward(attention.forward, jit), attention)
    return {"norms": len(norms), "mlps": len(mlps), "ropes": len(attentions)}


def _norm_forward(jit: bool) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if _own_code(x.numel() // x.shape[-1]):
            return type(self).forward(self, x)
        return FusedRMSNorm.apply(x, self.weight, self.variance_epsilon, jit)

    return forward


def _mlp_forward(kind: str, jit: bool) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if _own_code(x.numel() // x.shape[-1]):
            return type(self).forward(self, x)
        return self.down_proj(FusedGate.apply(self.gate_proj(x), self.up_proj(x), kind, jit))

    return forward


def _attention_forward(own: Callable[..., Any], jit: bool) -> Callable[..., Any]:
    """The attention's own forward, its rotary embedding fused (see _fused_rotary)."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a ContextVar breaks the graph; the compiler fuses the rotation
            return own(*args, **kwargs)
        token = _rope_jit.set(jit)
        try:
            return own(*args, **kwargs)
        finally:
            _rope_jit.reset(token)

    return forward


_rope_modules: dict[str, bool] = {}  # whether a family module's apply_rotary_pos_emb is Llama's: once each


def _has_llama_rope(module: torch.nn.Module) -> bool:
    """An attention whose forward calls its family's module-level apply_rotary_pos_emb, that function
    computing Llama's on a probe bit for bit; that function is then replaced (once) by _fused_rotary's."""
    family = sys.modules.get(type(module).__module__)
    forward = getattr(type(module), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if family is None or code is None or "apply_rotary_pos_emb" not in code.co_names:
        return False
    name = family.__name__
    if name not in _rope_modules:
        own = getattr(family, "apply_rotary_pos_emb", None)
        _rope_modules[name] = callable(own) and _computes_rope(own)
        if own is not None and _rope_modules[name]:
            family.apply_rotary_pos_emb = _fused_rotary(own)  # type: ignore[attr-defined]
    return _rope_modules[name]


def _computes_rope(fn: Callable[..., Any]) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    cos, sin = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    try:
        with torch.no_grad():
            got_q, got_k = fn(q, k, cos, sin)
    except Exception:  # another signature or formula: not Llama's
        return False
    c, s = cos[:, None], sin[:, None]
    return torch.equal(got_q, rope(q, c, s)) and torch.equal(got_k, rope(k, c, s))


_norm_classes: dict[type, bool] = {}  # whether a class computes rms_norm: once per process


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm of the Llama formula: decided once per class, on a probe (of the first module's device
    and dtype; it needs real values), bit for bit."""
    cls, eps, weight = (
        type(module),
        getattr(module, "variance_epsilon", None),
        getattr(module, "weight", None),
    )
    if not cls.__name__.endswith("RMSNorm") or not isinstance(eps, float):
        return False
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    if cls not in _norm_classes:
        probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0))
        probe = (probe * 4).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            _norm_classes[cls] = torch.equal(module(probe), rms_norm(probe, weight, eps))
    return _norm_classes[cls]


_gate_kinds: dict[tuple[type, type], str | None] = {}


def _llama_mlp_code() -> Any:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP.forward.__code__


def gate_kind(module: torch.nn.Module) -> str | None:
    """The activation (a GATES key) of a gated MLP whose forward is Llama's (the same bytecode:
    transformers copies it into Mistral's, Qwen's, Gemma's ...) and whose activation computes the function
    known for it (checked on a probe, bit for bit); else None."""
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None or not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    act = getattr(module, "act_fn")  # noqa: B009  a module, for mypy
    key = (type(module), type(act))
    if key not in _gate_kinds:  # once per MLP class and activation class
        llama, kind = _llama_mlp_code(), type(act).__name__
        known = kind in GATES and (code.co_code, code.co_names) == (llama.co_code, llama.co_names)
        probe = torch.linspace(-6, 6, 97)
        with torch.no_grad():
            _gate_kinds[key] = kind if known and torch.equal(act(probe), GATES[kind][0](probe)) else None
    return _gate_kinds[key]
