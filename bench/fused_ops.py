"""training.fused against the modules it replaces, one layer's worth at bench/gpu_check.py's 1.1B shape:
a Llama RMSNorm over [tokens, 2048], a SwiGLU product over [tokens, 5632] and the rotary embedding of q
(32 heads) and k (4 heads) of 64 dims, forward + backward, bf16 (the engine's compute dtype on a GPU), on
CUDA when there is one, else on this CPU.

    python bench/fused_ops.py [--tokens 8192] [--repeat 10]

Prints, side by side: the modules' eager time, the fused functions' (compiled; and eager, which keeps the
same tensors: on CUDA the norm is then ATen's fused RMSNorm kernels), the largest difference of each from
the eager result (output and input gradients), and the bytes of the new tensors autograd keeps for backward
(beyond the inputs themselves).
The first call of each compiled function (compiling, its kernels tuned for these sizes) is not timed; a
function torch.compile fails on runs eagerly (logged).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from gpu_check import SHAPE  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

from training import fused  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


Outputs = tuple[torch.Tensor, ...]


def run(fn: Callable[[], Outputs], inputs: list[torch.Tensor], given: list[torch.Tensor], repeat: int,
        device: torch.device):  # fmt: skip
    """Time of forward + backward (ms), the outputs, the input gradients, the bytes of the new tensors
    autograd kept (not `inputs` nor the other tensors `given`)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def once() -> Outputs:
        for t in inputs:
            t.grad = None
        out = fn()
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
        return out

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    inputs_bytes = {t.untyped_storage().data_ptr() for t in inputs + given}
    saved = sum(b for ptr, b in kept.items() if ptr not in inputs_bytes)  # new tensors only
    once()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        out = once()
    sync(device)
    ms = (time.perf_counter() - start) / repeat * 1000
    return ms, [o.detach() for o in out], [t.grad.clone() for t in inputs], saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=0, help="default: 8192 on CUDA, 2048 on a CPU")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or (8192 if device.type == "cuda" else 2048)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; each function compiled at its first call, here")
    torch.manual_seed(0)
    dt = torch.bfloat16
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    x = torch.randn(tokens, h, device=device, dtype=dt, requires_grad=True)
    norm = LlamaRMSNorm(h, eps=1e-5).to(device=device, dtype=dt).requires_grad_(False)
    gate, up = (torch.randn(tokens, inter, device=device, dtype=dt, requires_grad=True) for _ in "gu")
    # q and k as the attention makes them: [1, heads, tokens, 64] views of [1, tokens, heads, 64]
    heads, kv_heads = SHAPE["num_heads"], SHAPE["num_kv_heads"]
    head_dim = h // heads
    q, k = (torch.randn(1, tokens, n, head_dim, device=device, dtype=dt).transpose(1, 2).requires_grad_()
            for n in (heads, kv_heads))  # fmt: skip
    angles = torch.arange(tokens, device=device)[:, None] / 10_000 ** (
        torch.arange(head_dim, device=device) / head_dim
    )
    cos, sin = (f(angles)[None].to(dt) for f in (torch.cos, torch.sin))

    def rotary(jit: bool) -> Outputs:
        return fused.FusedRope.apply(q, cos, sin, jit), fused.FusedRope.apply(k, cos, sin, jit)

    cases = {  # inputs needing gradients, other inputs, the modules', fused compiled, fused eager
        "RMSNorm": (
            [x], [norm.weight],
            lambda: (norm(x),),
            lambda: (fused.FusedRMSNorm.apply(x, norm.weight, norm.variance_epsilon, True),),
            lambda: (fused.FusedRMSNorm.apply(x, norm.weight, norm.variance_epsilon, False),),
        ),
        "silu(gate) * up": (
            [gate, up], [],
            lambda: (torch.nn.functional.silu(gate) * up,),
            lambda: (fused.FusedGate.apply(gate, up, "SiLU", True),),
            lambda: (fused.FusedGate.apply(gate, up, "SiLU", False),),
        ),
        "rotary q, k": (
            [q, k], [cos, sin],
            lambda: apply_rotary_pos_emb(q, k, cos, sin),
            lambda: rotary(True),
            lambda: rotary(False),
        ),
    }  # fmt: skip
    print(f"{tokens} tokens, bf16, forward + backward, {args.repeat} repeats")
    native = fused.native_norm(x, norm.weight)
    print(f"the norm's fused eager column: {'ATen _fused_rms_norm' if native else 'the formula, eagerly'}")
    print(f"{'op':18} {'eager ms':>9} {'fused ms':>9} {'speed-up':>8} {'max |diff|':>10} "
          f"{'fused eager ms':>14} {'speed-up':>8} {'max |diff|':>10} "
          f"{'new tensors kept: eager':>24} {'fused':>9}")  # fmt: skip

    def largest_difference(a: tuple[list[torch.Tensor], ...], b: tuple[list[torch.Tensor], ...]) -> float:
        """Over the outputs and the input gradients of two runs."""
        pairs = zip([*a[0], *a[1]], [*b[0], *b[1]], strict=True)
        return max((p.float() - q.float()).abs().max().item() for p, q in pairs)

    for op, (inputs, given, eager, compiled, uncompiled) in cases.items():
        e_ms, e_out, e_grads, e_kept = run(eager, inputs, given, args.repeat, device)
        f_ms, f_out, f_grads, f_kept = run(compiled, inputs, given, args.repeat, device)
        u_ms, u_out, u_grads, _ = run(uncompiled, inputs, given, args.repeat, device)
        diff = largest_difference((e_out, e_grads), (f_out, f_grads))
        u_diff = largest_difference((e_out, e_grads), (u_out, u_grads))
        print(
            f"{op:18} {e_ms:9.2f} {f_ms:9.2f} {e_ms / f_ms:7.2f}x {diff:10.3g} "
            f"{u_ms:14.2f} {e_ms / u_ms:7.2f}x {u_diff:10.3g} "
            f"{e_kept / 2**20:20.1f} MiB {f_kept / 2**20:5.1f} MiB"
        )
    # a function whose compiling failed ran eagerly in the fused column: say so beside the figures
    print(f"torch.compile failed on: {', '.join(fused.not_compiled()) or 'none'}")


if __name__ == "__main__":
    main()
