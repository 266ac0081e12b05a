"""Shared by the planner's tests: model configs and small helpers."""

from __future__ import annotations

from core.arch import from_config
from core.spec import JobSpec
from planner import Plan, estimate
from planner.gpus import resolve_gpu

LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def spec(**kw) -> JobSpec:
    return JobSpec(base_model="m", dataset_id="abcdefgh", **kw)


def total(s: JobSpec, arch=None, gpu: str = "A100-80GB") -> int:
    return estimate(s, arch or from_config(LLAMA2_7B), resolve_gpu(gpu), suggest=False).total_bytes


def term(plan: Plan, name: str) -> int:
    return next(t.bytes for t in plan.breakdown if t.name == name)
