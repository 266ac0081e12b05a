"""The reinforcement toy: the demo model learns, by reward alone, which of five words a prompt asks for.

Against a running ftune (`make up`), with the official openai SDK, as a user would:
1. supervised: examples/toy_words_sft.jsonl answers every prompt with a RANDOM one of the five words, so the
   tuned model learns the answer's form (one word, then stop) but picks the right word a fifth of the time;
2. reinforcement, continuing from that model: examples/toy_words_rft.jsonl's prompts, graded by an exact
   string match with the row's `answer`; 8 samples a prompt at temperature 0.3, 4 prompts a step. 20 of the
   100 prompts are held out (validation_fraction 0.2): valid_reward_mean is the share of them whose greedy
   answer is exactly right, before training (step 0) and every 25 steps.

    .venv/bin/python examples/rft_toy.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY] [--steps 200]

Prints the valid_reward_mean curve and the wall time of each job. The same seed gives the same rewards
(the samples are seeded by (seed, step); docs/training.md "Reinforcement fine-tuning").
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import openai

HERE = Path(__file__).resolve().parent
GRADER = {
    "type": "string_check",
    "name": "exact",
    "operation": "eq",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}
COMMON = {
    "lora_r": 16,
    "lora_dropout": 0.0,
    "max_seq_len": 64,
    "warmup_steps": 0,
    "checkpoint_every_steps": 0,
}


def upload(client: openai.OpenAI, name: str) -> str:
    with (HERE / name).open("rb") as f:
        file_id = client.files.create(file=f, purpose="fine-tune").id
    return client.files.wait_for_processing(file_id, poll_interval=0.5).id


def finish(client: openai.OpenAI, job_id: str) -> Any:
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            if job.status != "succeeded":
                raise SystemExit(f"job {job_id} {job.status}: {job.error}")
            return job
        time.sleep(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("FTUNE_BASE_URL", "http://127.0.0.1:8000/v1"))
    key_file = HERE.parent / "var" / "data" / "local-admin-key"  # what `make up` made
    default_key = os.environ.get("FTUNE_KEY") or (
        key_file.read_text().strip() if key_file.is_file() else None
    )
    p.add_argument(
        "--api-key", default=default_key, help="default: $FTUNE_KEY, else make up's local admin key"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", type=int, default=200, help="reinforcement steps")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    started = time.monotonic()
    sft = client.fine_tuning.jobs.create(
        model="ftune-demo",
        training_file=upload(client, "toy_words_sft.jsonl"),
        seed=args.seed,
        method={"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 10}}},
        extra_body={**COMMON, "max_steps": 60, "micro_batch_size": 8},
    )
    sft = finish(client, sft.id)
    print(f"supervised: {sft.fine_tuned_model} in {time.monotonic() - started:.0f} s")

    started = time.monotonic()
    hyperparameters = {
        "batch_size": 4,
        "learning_rate_multiplier": 2.5,
        "eval_interval": 25,
        "eval_samples": 20,
    }
    rft = client.fine_tuning.jobs.create(
        model=sft.fine_tuned_model,  # continue from the supervised adapter
        training_file=upload(client, "toy_words_rft.jsonl"),
        seed=args.seed,
        method={
            "type": "reinforcement",
            "reinforcement": {"grader": GRADER, "hyperparameters": hyperparameters},
        },
        extra_body={
            **COMMON,
            "max_steps": args.steps,
            "num_generations": 8,
            "temperature": 0.3,
            "max_completion_tokens": 4,
            "validation_fraction": 0.2,
            "lr_scheduler": "constant",
        },
    )
    rft = finish(client, rft.id)
    print(f"reinforcement: {rft.fine_tuned_model} in {time.monotonic() - started:.0f} s")
    events = client.fine_tuning.jobs.list_events(rft.id, limit=1000).data
    scores = {e.data["step"]: e.data["scores"] for e in events if e.type == "metrics" and e.data}
    print("step  valid_reward_mean  train_reward_mean (mean of the steps since the last evaluation)")
    evaluated = sorted(step for step, s in scores.items() if "valid_reward_mean" in s)
    for before, step in zip([0, *evaluated], evaluated, strict=False):
        train = [scores[k]["train_reward_mean"] for k in range(before + 1, step + 1) if k in scores]
        shown = f"{sum(train) / len(train):.3f}" if train else "-"
        print(f"{step:4d}  {scores[step]['valid_reward_mean']:17.3f}  {shown:>17}")


if __name__ == "__main__":
    main()
