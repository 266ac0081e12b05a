"""How fast the engine's rollouts decode (training.rollouts.sample, as objective grpo samples): milliseconds
per decoding step, side by side, on this machine's device.

    python bench/rollouts_decode.py [--prompts 2] [--generations 8] [--tokens 128] [--layers N]
                                    [--repeats 2] [--compile-cpu] [--models DIR] [--now]

Rows, each the mean of --repeats timed calls after one untimed (compiling) call, all of them sampling the
same prompts; ms / step is the time per decoding step (a call decodes as many steps as its longest answer):
  transformers alone       the base model, no LoRA, no ftune layers: generate() itself
  engine, bare model       the same model decoded by ftune's engine (training.decoding): its loop beside
                           generate()'s, the same tokens
  transformers + peft      the base model with peft's LoRA (r16, all linears) decoded by the engine: TRL's
                           GRPOTrainer's model without vLLM
  engine, fused always     the model as training.recipe builds it on CUDA (LoRA, training.lora_add and
                           training.fused installed), the fused functions on every call (before)
  engine, prompt by prompt the engine sampling one prompt per generate() call, as a step of micro-batch 1
                           did before its prompts were sampled together (before)
  engine                   the engine: a small no-grad call on the modules' own code, all the prompts in
                           one decoded batch (now)
  engine, static cache     cache="static": on CUDA the decoding step is compiled as generate() compiles it
                           (CUDA graphs); on a CPU it runs uncompiled unless --compile-cpu
On a CPU the model is bench/gpu_check.py's 22 layers at a small width (hidden 128), where a step's time
is mostly the host's work per module, as when a GPU decodes a 1.1B model for a few sequences; on CUDA
it is gpu_check's 1.1B model (the one it built in --models, if it did).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_check import SHAPE, build_model  # noqa: E402
from bench.gpu_grpo import GRADER, prompts  # noqa: E402
from core.spec import JobSpec  # noqa: E402
from tests.training.reference_decoding import generate_batch  # noqa: E402
from training import fused  # noqa: E402
from training import model as model_lib  # noqa: E402
from training.demo import DemoSize, build_demo_model  # noqa: E402
from training.rollouts import _seed, load_for_training, sample, stop_ids  # noqa: E402

CPU_SHAPE = {**SHAPE, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 352}


def build(models: Path, device: torch.device, layers: int | None) -> Path:
    if device.type == "cuda" and not layers:
        return build_model(models)
    shape = {**(SHAPE if device.type == "cuda" else CPU_SHAPE), **({"num_layers": layers} if layers else {})}
    size = DemoSize(vocab_size=DemoSize().vocab_size, max_position_embeddings=1024, **shape)
    return build_demo_model(models, name=f"rollouts-bench-{device.type}-{shape['num_layers']}", size=size)


def engine(spec: JobSpec, model_dir: Path, device: torch.device) -> Any:
    """The policy as training.recipe builds it: on CUDA its CUDA paths (fused layers among them); on a CPU
    the fused layers installed the same way, to time what a GPU's host runs."""
    net = model_lib.load_model(spec, model_dir, device)
    if device.type == "cuda":
        model_lib.use_cuda_paths(net, device, autocast=True)
    else:
        fused.install(net)
    return net


def timed(call: Callable[[], list[Any]], repeats: int, chunk: int) -> tuple[float, int]:
    """Mean seconds of a call after an untimed one, and the decoding steps it took: each generate() call
    of `chunk` prompts decodes as many as its longest answer."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        groups = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    calls = [groups[k : k + chunk] for k in range(0, len(groups), chunk)]
    return statistics.mean(seconds), sum(max(len(c.ids) for g in part for c in g) for part in calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, help="fewer layers than gpu_check's 22 (a quick check)")
    parser.add_argument("--models", type=Path, help="a models directory to build in, or reuse (gpu_check's)")
    parser.add_argument("--compile-cpu", action="store_true", help="compile the static cache's step on a CPU")
    parser.add_argument("--now", action="store_true", help="transformers alone, the engine, the static cache")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="rollouts-decode-"))
    model_dir = build(args.models or work / "models", device, args.layers)
    spec = JobSpec(
        base_model="rollouts-bench", dataset_id="benchdata01", objective="grpo", grader=GRADER, max_steps=1,
        max_seq_len=512, max_completion_tokens=args.tokens, lora_r=16, lora_dropout=0.0,
        micro_batch_size=args.prompts, num_generations=args.generations,
    )  # fmt: skip
    tokenizer = model_lib.load_tokenizer(model_dir)
    items, _, _ = load_for_training(prompts(work / "prompts.jsonl", args.prompts), tokenizer, spec, None)
    precision = model_lib.precision_for(spec, device, model_lib.bf16_supported(device))

    def run(net: Any, chunk: int = args.prompts, **kwargs: Any) -> Callable[[], list[Any]]:
        return lambda: sample(
            net, tokenizer, [p.input_ids for p in items], n=args.generations, temperature=1.0,
            max_new_tokens=args.tokens, seed=(1, 1), device=device, autocast=precision.autocast,
            chunk=chunk, **kwargs,
        )  # fmt: skip

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def base() -> Any:
        bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model_lib.base_dtype(spec, model_dir))
        return bare.to(device)

    bare = base()
    lora = LoraConfig(
        r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
    )
    with_peft = None if args.now else get_peft_model(base(), lora)
    net = engine(spec, model_dir, device)
    if args.compile_cpu and device.type == "cpu":
        from transformers import CompileConfig

        config = CompileConfig(mode="default")
        config._compile_all_devices = True  # transformers' own switch for compiling on a CPU
        net.generation_config.compile_config = config

    def generated() -> list[Any]:  # transformers' generate() of the same batch, seeded as sample() seeds it
        stops = stop_ids(tokenizer, bare)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), precision.autocast():
            torch.manual_seed(_seed((1, 1), 0))
            ids = generate_batch(
                bare, [p.input_ids for p in items], n=args.generations, temperature=1.0,
                max_new_tokens=args.tokens, stops=stops, pad=pad,
            )  # fmt: skip
        rows = [SimpleNamespace(ids=row) for row in ids]
        return [rows[k : k + args.generations] for k in range(0, len(rows), args.generations)]

    def fused_always() -> list[Any]:  # before: the fused functions whatever the call's size
        with mock.patch.object(fused, "NO_GRAD_MIN_TOKENS", 0):
            return run(net)()

    rows = [
        ("transformers alone", generated, args.prompts),
        ("engine, bare model", run(bare), args.prompts),
        *([] if args.now else [
            ("transformers + peft", run(with_peft), args.prompts),
            ("engine, fused always (before)", fused_always, args.prompts),
            ("engine, prompt by prompt (before)", run(net, chunk=1), 1),
        ]),
        ("engine (now)", run(net), args.prompts),
        ("engine, static cache" + (" compiled" if args.compile_cpu or device.type == "cuda" else ""),
         run(net, cache="static"), args.prompts),
    ]  # fmt: skip
    name = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    import transformers

    print(
        f"{name}, transformers {transformers.__version__}: {args.prompts} prompts x {args.generations} "
        f"generations, up to {args.tokens} tokens"
    )
    print(f"{'':34} {'ms / step':>10} {'steps':>6} {'seconds':>8}")
    failed = 0
    for label, call, chunk in rows:
        try:
            seconds, steps = timed(call, args.repeats, chunk)
        except Exception as e:  # a row that cannot run here (a compiler's error) leaves the others' figures
            print(f"{label:34} failed: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        print(f"{label:34} {seconds / steps * 1000:10.2f} {steps:6d} {seconds:8.2f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
