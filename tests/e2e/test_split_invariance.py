"""Through the real service (`ftune up`: API, embedded broker, a CPU worker): three jobs that split the
same global batch differently (micro 4 x accumulation 1, micro 1 x accumulation 4, num_gpus 2 x micro
2, which the CPU worker runs as two gloo processes under torchrun) train the same adapter, packed, with
LoRA dropout on. The adapters are downloaded and compared. Packed only: the service hands `packing` to
the engine as it does any spec field, and tests/training/test_split_invariance.py proves the same three
splits equal both packed and padded (three jobs here, not six: ~65 s of the suite's time)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.e2e.stack import REPO, Up, api, download_adapter, upload, wait_finished
from tests.training.util import elementwise, relative_difference

pytestmark = pytest.mark.slow

SPEC = {
    "base_model": "ftune-demo",
    "max_steps": 6,
    "max_seq_len": 64,
    "learning_rate": 2e-3,
    "lora_dropout": 0.1,
    "checkpoint_every_steps": 0,
}
SPLITS = {
    "micro 4 x accum 1": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    "micro 1 x accum 4": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
    "2 ranks x micro 2": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
}
TOLERANCE = {"micro 1 x accum 4": 1e-4, "2 ranks x micro 2": 1e-3}
PACKING = (True,)


def test_jobs_that_split_the_same_global_batch_train_the_same_adapter(up: Up, tmp_path: Path) -> None:
    base = up.base
    start = time.monotonic()
    try:
        dataset = upload(base, REPO / "examples" / "alpaca_small.jsonl")["id"]
        jobs: dict[tuple[bool, str], str] = {}
        for packing in PACKING:
            for name, split in SPLITS.items():
                spec: dict[str, Any] = {**SPEC, **split, "dataset_id": dataset, "packing": packing}
                r = api.post(f"{base}/jobs", json=spec)
                assert r.status_code == 202, r.text
                jobs[packing, name] = r.json()["id"]
        wait_finished(base, list(jobs.values()), timeout=900)
        for key, job_id in jobs.items():
            job = api.get(f"{base}/jobs/{job_id}").json()
            assert job["status"] == "succeeded", (key, job)

        for packing in PACKING:
            adapters = {
                name: load_file(
                    download_adapter(base, jobs[packing, name], tmp_path) / "adapter_model.safetensors"
                )
                for name in SPLITS
            }
            losses = {
                name: [
                    s["loss"] for s in api.get(f"{base}/jobs/{jobs[packing, name]}/metrics").json()["data"]
                ]
                for name in SPLITS
            }
            ref = "micro 4 x accum 1"
            assert len(losses[ref]) == SPEC["max_steps"]
            diffs = {name: relative_difference(adapters[ref], adapters[name]) for name in TOLERANCE}
            worst = {name: elementwise(adapters[ref], adapters[name]) for name in TOLERANCE}
            print(
                f"\n{'packed' if packing else 'padded'}, through the service: relative difference to {ref} "
                "(elementwise): " + ", ".join(f"{k} {v:.1e} ({worst[k]:.1e})" for k, v in diffs.items())
            )
            for name, tolerance in TOLERANCE.items():
                assert losses[name] == pytest.approx(losses[ref], rel=1e-4), name
                assert diffs[name] < tolerance, name
        print(f"{len(jobs)} jobs in {time.monotonic() - start:.0f} s")
    except BaseException:
        print(up.tail())
        raise
