"""The CPU peak-memory tracker counts what it says it counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from training.memory import PeakMemory, model_state_tensors, reset_cuda_peaks, running_peak, storage_bytes
from training.model import load_model, trainable_parameters

MB = 1_000_000


def test_running_peak() -> None:
    assert running_peak([3, -1, 5, -7, 2]) == 7
    assert running_peak([]) == 0


@pytest.mark.parametrize("initialized", [False, True])
def test_cuda_peaks_are_reset_once_cuda_is_in_use(monkeypatch: pytest.MonkeyPatch, initialized: bool) -> None:
    """torch raises 'Invalid device argument' when the peaks are reset before CUDA's first use (every job
    failed so on an H200): a run resets them only where CUDA is initialized, and never on a CPU. torch's
    two functions are doubles here (no CUDA on this machine)."""
    resets: list[torch.device] = []

    def reset(device: torch.device) -> None:
        if not initialized:
            raise RuntimeError("Invalid device argument ")
        resets.append(device)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    reset_cuda_peaks(torch.device("cpu"))
    reset_cuda_peaks(torch.device("cuda:0"))
    assert resets == ([torch.device("cuda:0")] if initialized else [])


def test_storage_bytes_counts_shared_storage_once() -> None:
    a = torch.zeros(1000)
    assert storage_bytes([a, a[10:], a.view(10, 100)]) == 4000


def test_tracker_sees_allocations_and_frees_inside_the_step() -> None:
    resident = torch.zeros(MB, dtype=torch.uint8)
    tracker = PeakMemory(torch.device("cpu"), measured_steps=1)
    with tracker.step([resident]):
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 2, dtype=torch.uint8)
        del b, c
    assert tracker.peak_bytes == MB + 3 * MB  # resident + (a + b live together)
    with tracker.step([resident]):  # past measured_steps: not measured, peak kept
        torch.empty(10 * MB, dtype=torch.uint8)
    assert tracker.peak_bytes == 4 * MB


def test_step_peak_covers_weights_grads_optimizer_and_activations(tiny_model: Path) -> None:
    spec = JobSpec(base_model="tiny", dataset_id="testdata01", lora_r=8)
    torch.manual_seed(0)
    model = load_model(spec, tiny_model, torch.device("cpu"))
    params = [p for _, p in trainable_parameters(model)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    weights = storage_bytes(list(model.parameters()) + list(model.buffers()))
    lora = sum(p.numel() * 4 for p in params)
    ids = torch.randint(0, 1000, (4, 64))
    tracker = PeakMemory(torch.device("cpu"))
    with tracker.step(model_state_tensors(model, opt)):
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        del logits
        opt.step()
    logits_bytes = 4 * 64 * 1024 * 4
    # weights + grads + 2 Adam states + at least the logits were live at some point
    assert tracker.peak_bytes >= weights + 3 * lora + logits_bytes
    assert tracker.peak_bytes < weights + 3 * lora + 100 * logits_bytes
