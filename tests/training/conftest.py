"""Fixtures for the training engine: tiny models built locally, small datasets, run configs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.run_protocol import RunConfig
from core.spec import JobSpec
from tests.training.util import qa_rows, write_jsonl
from training.demo import TINY, build_demo_model

DATASET_ID = "testdata01"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """hidden 64, 2 layers, GQA 4/2 heads, vocab 1024: milliseconds per step."""
    return build_demo_model(models_dir, name="tiny", size=TINY)


@pytest.fixture(scope="session")
def moe_models(models_dir: Path) -> dict[str, Path]:
    """Tiny random-weight MoE bases (training.demo_moe: hidden 64, 2 layers, 8 experts, top 2): a
    Qwen3-MoE whose config asks for the router's load-balancing loss (coef 0.05), and a Mixtral."""
    from training.demo_moe import build_moe_model

    return {
        "qwen3_moe": build_moe_model(models_dir, name="tiny-qwen3-moe", aux_loss_coef=0.05),
        "mixtral": build_moe_model(models_dir, name="tiny-mixtral", family="mixtral"),
    }


@pytest.fixture(scope="session")
def demo_model(models_dir: Path) -> Path:
    return build_demo_model(models_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    from training.model import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture
def make_config(tmp_path: Path, tiny_model: Path) -> Callable[..., RunConfig]:
    """A RunConfig on the tiny model; keyword arguments override the spec."""

    def make(
        rows: list[dict[str, Any]] | None = None,
        model_dir: Path | None = None,
        name: str = "run",
        **spec: Any,
    ) -> RunConfig:
        data = write_jsonl(tmp_path / f"{name}.jsonl", rows if rows is not None else qa_rows(12))
        base = {
            "base_model": "tiny",
            "dataset_id": DATASET_ID,
            "lora_r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_seq_len": 64,
            "learning_rate": 5e-3,
            "checkpoint_every_steps": 0,
            "warmup_steps": 1,
        }
        return RunConfig(
            job_id=f"job{name}",
            spec=JobSpec(**{**base, **spec}),
            model_dir=str(model_dir or tiny_model),
            dataset_path=str(data),
            output_dir=str(tmp_path / name),
        )

    return make
