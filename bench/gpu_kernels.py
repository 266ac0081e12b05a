"""The engine's GPU kernels against their exact paths, on the GPU found (a minute at most).

    python bench/gpu_kernels.py

1. Packed attention: which kernel a bf16 packed row gets (torch varlen flash attention, or the per-example
   fallback), its output and gradients against per-example SDPA, and the time of each.
2. The loss head: the chunked head (training.loss) against the plain one (all scored tokens' logits, fp32
   cross-entropy) on 8,192 scored tokens, hidden 2048, a 128,256-token vocabulary (Llama 3's): losses and
   hidden-state gradients, peak memory above the inputs, time.
3. Host syncs: a packed micro-batch's forward and backward through a small Llama-shaped model with LoRA,
   under torch.cuda.set_sync_debug_mode("warn"), counting the syncs it makes.

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn, repeat: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def attention(device) -> None:
    import torch

    from training.packing import per_example_attention, varlen_kernel

    torch.manual_seed(0)
    lengths = torch.randint(16, 900, (40,))
    lengths = lengths[lengths.cumsum(0) <= 8192]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    total, longest = int(cu[-1]), int(lengths.max())
    q, k, v = (torch.randn(1, h, total, 64, device=device, dtype=torch.bfloat16) for h in (32, 4, 4))
    kernel = varlen_kernel(q)
    print(
        f"attention: {len(lengths)} examples, {total} tokens; kernel: {'varlen' if kernel else 'per-example'}"
    )
    if kernel is None:
        return
    cu_dev = cu.to(device)
    grads = []
    for run in (
        lambda x, y, z: kernel(x, y, z, cu_dev, longest, None),
        lambda x, y, z: per_example_attention(x, y, z, cu),
    ):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*xs)
        out.float().square().mean().backward()
        grads.append((out.detach(), [x.grad for x in xs]))

        def step(run=run):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            run(*xs).float().square().mean().backward()

        print(
            f"  {'varlen' if len(grads) == 1 else 'per-example'}: {timed(step) * 1e3:.2f} ms forward+backward"
        )
    (o1, g1), (o2, g2) = grads
    print(f"  max |out diff| {float((o1 - o2).abs().max()):.3g}; max |grad diff| "
          f"{max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)):.3g}")  # fmt: skip


def loss_head(device) -> None:
    import torch

    from planner.memory import loss_chunk_tokens
    from training.loss import _LinearCrossEntropy

    torch.manual_seed(0)
    n, hidden, vocab = 8192, 2048, 128_256
    h0 = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5
    wanted = torch.randint(0, vocab, (n,), device=device)
    results = {}
    for name in ("plain", "chunked"):

        def run(name=name):
            h = h0.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if name == "plain":
                    losses = torch.nn.functional.cross_entropy(
                        torch.nn.functional.linear(h, weight).float(), wanted, reduction="none"
                    )
                else:
                    losses, _ = _LinearCrossEntropy.apply(h, weight, None, wanted, loss_chunk_tokens(vocab))
            (losses.sum() / n).backward()
            return losses.detach(), h.grad

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        losses, grad = run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results[name] = (losses, grad, peak, timed(run, 3))
    for name, (_, _, peak, t) in results.items():
        print(f"loss head {name:8}: peak {peak / 2**30:6.2f} GiB above its inputs, {t * 1e3:7.2f} ms fwd+bwd")
    (l1, g1, *_), (l2, g2, *_) = results.values()
    loss_diff, grad_diff = float((l1 - l2).abs().max()), float((g1 - g2).abs().max())
    print(
        f"  max |loss diff| {loss_diff:.3g} (mean loss {float(l1.mean()):.4f}); "
        f"max |grad diff| {grad_diff:.3g}"
    )


def syncs(device) -> None:
    import torch

    from core.spec import JobSpec
    from training.data import Tokenized
    from training.demo import DemoSize, build_demo_model
    from training.loss import token_losses
    from training.model import load_model, use_cuda_paths
    from training.packing import collate_packed

    model_dir = build_demo_model(Path(tempfile.mkdtemp()), name="sync-check", size=DemoSize())
    spec = JobSpec(base_model="sync-check", dataset_id="synccheck1", packing=True, torch_dtype="bfloat16",
                   lora_dropout=0.0)  # fmt: skip
    model = load_model(spec, model_dir, device)
    use_cuda_paths(model, device, autocast=True)  # as training.recipe does
    items = [Tokenized(list(range(3, 3 + n)), list(range(3, 3 + n))) for n in (50, 200, 17, 400)]
    batch = collate_packed(items)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses, _ = token_losses(model, batch, device)
        losses.sum().backward()

    step()  # warm: the varlen kernel's one-time check runs here
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the first warning may be torch's notice that this debug mode is a prototype: not a sync)
    found = [str(w.message).splitlines()[0] for w in caught if "prototype" not in str(w.message)]
    print(f"host syncs in a packed micro-batch's forward+backward: {len(found)}")
    for line in sorted(set(found))[:5]:
        print(f"  {line}")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; nothing to measure.")
        return 0
    device = torch.device("cuda", 0)
    print(f"gpu_kernels on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failed = 0
    for check in (attention, loss_head, syncs):
        try:
            check(device)
        except Exception:  # report and go on: one run on a lent GPU should say as much as it can
            traceback.print_exc()
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
