"""The SFT job bench/gpu_vs_trl.py trains on both engines and bench/step_profile.py profiles: what both sides
train with (Setup), the model (gpu_check.py's ~1.1B shape, or a tiny one for a CPU smoke), the chat rows,
ftune's JobSpec for them, and the engine as such a bench process runs it (prepare_engine).

Imported by those scripts, which put the repository root and bench/ on sys.path first.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import gpu_check

SMOKE_NAME = "gpu-vs-trl-tiny"
DATASET_ID = "gpuvstrl01"


@dataclass(frozen=True)
class Setup:
    """What both engines train with."""

    smoke: bool
    steps: int
    micro_batch: int
    max_seq_len: int
    rows: int
    median_words: float
    lr: float
    checkpointing: bool
    attn: str
    method: str = "lora"  # "lora" | "qlora" (--qlora: nf4 4-bit base weights on both sides)

    @property
    def cuda_dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"


def gpu_setup(steps: int, checkpointing: bool = False, attn: str = "sdpa", method: str = "lora") -> Setup:
    """The GPU's: micro-batch 8 x 1024, 2,000 rows of median 120 words."""
    return Setup(False, steps, 8, 1024, 2000, 120, 1e-4, checkpointing, attn, method)


def smoke_setup(
    checkpointing: bool = False, attn: str = "sdpa", steps: int = 3, method: str = "lora"
) -> Setup:
    """A CPU's: a tiny model, micro-batch 4 x 256, 40 rows."""
    return Setup(True, steps, 4, 256, 40, 30, 1e-4, checkpointing, attn, method)


# -- the model and the data ----------------------------------------------------------------------------------


def build_model(models_dir: Path, smoke: bool) -> Path:
    """The smoke's tiny model, or gpu_check.py's ~1.1B one (a directory it built is reused as it is)."""
    from training.demo import TINY, build_demo_model

    return (
        build_demo_model(models_dir, name=SMOKE_NAME, size=TINY)
        if smoke
        else gpu_check.build_model(models_dir)
    )


def write_rows(path: Path, rows: int, median_words: float, seed: int = 0) -> Path:
    """`rows` chat examples (a user turn, an assistant reply) of lognormal length in words (median
    `median_words`, sigma 0.6, at least 8; about a third prompt), spans of the demo corpus's words."""
    from training.demo import CORPUS

    words = CORPUS.read_text().split()
    rng = random.Random(seed)

    def span(n: int) -> str:
        start = rng.randrange(len(words))
        return " ".join(words[(start + i) % len(words)] for i in range(n))

    with path.open("w") as f:
        for _ in range(rows):
            total = max(8, round(rng.lognormvariate(math.log(median_words), 0.6)))
            prompt = max(3, total // 3)
            messages = [
                {"role": "user", "content": span(prompt)},
                {"role": "assistant", "content": span(total - prompt)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def job_spec(setup: Setup, packing: bool, base_model: str):  # -> core.spec.JobSpec
    from core.spec import JobSpec

    return JobSpec(
        base_model=base_model,
        dataset_id=DATASET_ID,
        method=setup.method,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_target_modules="all-linear",
        max_steps=setup.steps,
        micro_batch_size=setup.micro_batch,
        gradient_accumulation_steps=1,
        max_seq_len=setup.max_seq_len,
        packing=packing,
        learning_rate=setup.lr,
        lr_scheduler="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optimizer="adamw",
        seed=42,
        gradient_checkpointing=setup.checkpointing,
        checkpoint_every_steps=0,
        torch_dtype=setup.cuda_dtype,
        mixed_precision="auto",  # bf16 autocast on a GPU with bf16, none on a CPU
        attn_implementation=setup.attn,
    )


def sequence_lengths(model_dir: Path, data: Path, spec) -> list[int]:
    """The token length of each training example as ftune tokenizes it (training.data.load_for_training:
    the very ids both engines of bench/gpu_vs_trl.py train on): the sequences bench/flops.py counts
    attention over."""
    from training.data import load_for_training
    from training.model import load_tokenizer

    items, _, _ = load_for_training(data, load_tokenizer(model_dir), spec)
    return [len(item.input_ids) for item in items]


COMPILE_MODES = ("fused",)


def prepare_engine(compiled: str = "") -> None:
    """The engine in this bench process, before it trains. `compiled` (where use_cuda_paths acts: CUDA):
    "fused", its fused norms, gates and rotary embeddings compiled (training.fused, jit=True) where
    use_cuda_paths installs them eagerly (the engine's compiled decoder layers are
    RunConfig.compile_layers: training.compiled), the engine's step otherwise unchanged. On a CPU, the
    peak memory is not profiled: the smoke times nothing, that profiling of the first steps
    (training.memory) would take most of its wall time, and it cannot run inside another torch profiler.
    On a GPU the peak is the allocator's, never profiled."""
    import torch

    from training import fused, memory

    if compiled == "fused":
        install = fused.install
        fused.install = lambda model, jit=True: install(model, jit=True)  # type: ignore[assignment]
    elif compiled:
        raise ValueError(f"compiled: one of {COMPILE_MODES}, not {compiled!r}")
    if not torch.cuda.is_available():
        memory.PeakMemory.__init__.__defaults__ = (0,)
