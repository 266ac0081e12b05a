"""Checkpoints hold the whole state: an interrupted and resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE
from tests.training.util import qa_rows, read_metrics
from training.checkpoint import list_checkpoints
from training.checkpoint_codec import flatten_optimizer_state, unflatten_optimizer_state
from training.run import EXIT_OK, EXIT_STOPPED, run


class StopAfter:
    """A stop flag that goes up once `steps` step records are in the metrics file (like SIGTERM
    arriving during that step)."""

    def __init__(self, out: Path, steps: int) -> None:
        self.metrics, self.steps = out / METRICS_FILE, steps

    def is_set(self) -> bool:
        return sum(r["type"] == "step" for r in read_metrics(self.metrics)) >= self.steps


def step_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / ADAPTER_DIR / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "optimizer", "stop_at", "packing"),
    [
        ("lora", "adamw", 4, True),  # mid-epoch 2, resumed run crosses the epoch 2 -> 3 boundary
        ("qlora", "paged_adamw_8bit", 2, True),  # mid-epoch 1, crosses two epoch boundaries
        ("lora", "adamw_8bit", 3, True),  # exactly at an epoch end
        ("lora", "adamw", 4, False),  # padded, length-grouped batches
    ],
)
def test_resumed_run_equals_uninterrupted_run(
    make_config, method: str, optimizer: str, stop_at: int, packing: bool
) -> None:
    # 12 examples of 40-64 tokens, micro 2, accumulation 2: 6 batches (packed: 6 packs of 2, as
    # 2 * max_seq_len 64 = 128 tokens fit two) = 3 optimizer steps an epoch, 9 steps in all.
    kw = {
        "packing": packing,
        "method": method,
        "optimizer": optimizer,
        "epochs": 3,
        "lora_dropout": 0.1,
        "lr_scheduler": "cosine",
    }
    full = make_config(qa_rows(12), name="full", **kw)
    parted = make_config(qa_rows(12), name="parted", **kw)
    out_full, out_parted = Path(full.output_dir), Path(parted.output_dir)

    assert run(full) == EXIT_OK
    assert run(parted, StopAfter(out_parted, stop_at)) == EXIT_STOPPED
    assert not (out_parted / ADAPTER_DIR).exists()
    assert list_checkpoints(out_parted / CHECKPOINTS_DIR)[-1].name == f"step-{stop_at:08d}"
    assert run(parted) == EXIT_OK

    losses_full, losses_parted = step_losses(out_full), step_losses(out_parted)
    assert sorted(losses_full) == sorted(losses_parted) == list(range(1, 10))
    for step in range(stop_at + 1, 10):
        assert losses_parted[step] == pytest.approx(losses_full[step], abs=1e-5), step
    a, b = adapter(out_full), adapter(out_parted)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)

    starts = [r for r in read_metrics(out_parted / METRICS_FILE) if r["type"] == "start"]
    assert [s["resumed_from_step"] for s in starts] == [0, stop_at]
    assert len(list_checkpoints(out_parted / CHECKPOINTS_DIR)) <= 3


def test_optimizer_state_round_trips_without_pickle() -> None:
    import bitsandbytes as bnb

    for cls in (torch.optim.AdamW, bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit):
        p = torch.nn.Parameter(torch.randn(64, 128))
        opt = cls([p], lr=1e-3)
        p.sum().backward()
        opt.step()
        tensors, tree = flatten_optimizer_state(opt.state_dict())
        json.dumps(tree)  # scalars are JSON
        restored = unflatten_optimizer_state(tensors, json.loads(json.dumps(tree)))
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat(opt.state_dict()).items()}
        opt.load_state_dict(restored)
        after = _flat(opt.state_dict())
        assert before.keys() == after.keys()
        for k, v in before.items():
            if torch.is_tensor(v):
                assert torch.equal(v, after[k]), k
            else:
                assert v == after[k], k


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flat(v, f"{prefix}/{i}").items()}
    return {prefix: obj}
