"""Before/after samples on the dashboard's job page, on real processes (`ftune up`: API, embedded broker,
worker, SQLite) and the system chromium.

A short LoRA job on the demo model asks for samples of two prompts, a string and a chat. The job page is
open while it trains; when the worker relays the samples record, the page draws prompt | base | tuned,
and those texts are the ones GET /jobs/{id}/samples returns. The /v1 events carry the same set.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import open_browser
from tests.e2e.stack import AUTH, REPO, Proc, api, env_for, free_port, upload, wait_finished, wait_ready

pytestmark = pytest.mark.slow
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of <Norway>?"},
]
SPEC = {
    "base_model": "ftune-demo",
    "max_steps": 2,
    "micro_batch_size": 2,
    "max_seq_len": 64,
    "learning_rate": 5e-3,
    "lora_dropout": 0.0,
    "checkpoint_every_steps": 0,
    "sample_prompts": ["What colour is the sky?", CHAT],
    "sample_max_tokens": 8,
}
SHOTS = REPO / "test-artifacts" / "dashboard"


def write_dataset(path: Path) -> Path:
    """Eight short chat examples: a quick job (the demo model's steps take seconds on a busy CPU)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """A prompt as the page shows it: the text, or one "role: content" line per message."""
    return prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def test_job_page_shows_the_samples_side_by_side(models_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = Proc(["up"], env_for(tmp_path, models_dir, FTUNE_API_PORT=str(port)), tmp_path / "up.log")
    try:
        wait_ready(base, [up], timeout=120)
        dataset = upload(base, write_dataset(tmp_path / "chat.jsonl"))
        r = api.post(f"{base}/jobs", json={**SPEC, "dataset_id": dataset["id"]})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        with open_browser() as browser:
            page = browser.new_page(f"{base}/dashboard?interval=500")
            page.evaluate(
                "(key) => localStorage.setItem('ftune.apiKey', key)", AUTH["Authorization"].split()[1]
            )
            page.goto(
                f"{base}/dashboard?interval=500#/jobs/{job_id}"
            )  # open while the job is queued or training
            page.wait_for_selector("#samples table.samples tr.sample", timeout=90000)
            wait_finished(base, [job_id], timeout=60)
            rows = page.eval_on_selector_all(
                "#samples table.samples:first-of-type tr.sample",
                "rows => rows.map((r) => [...r.cells].map((c) => c.textContent))",
            )
            title = page.text_content("#samples h3")
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "samples.png"), full_page=True)
            assert browser.errors == []

        samples: dict[str, Any] = api.get(f"{base}/jobs/{job_id}/samples").json()
        assert [(s["step"], s["at"]) for s in samples["sets"]] == [(2, "end")]
        items = samples["latest"]["items"]
        assert [i["prompt"] for i in items] == SPEC["sample_prompts"]
        assert rows == [[prompt_text(i["prompt"]), i["base"], i["tuned"]] for i in items]
        assert rows[1][0] == "system: Answer in one word.\nuser: Capital of <Norway>?"  # as text, not markup
        assert title == "step 2, end of training"

        native = api.get(f"{base}/jobs/{job_id}/events", params={"limit": 500}).json()["data"]
        assert [e["data"] for e in native if e["kind"] == "samples"] == [samples["latest"]]
        v1 = api.get(f"{base}/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
        (message,) = [e["message"] for e in v1 if e["message"].startswith("samples at step 2")]
        assert "(at the end): 2 prompts; first:" in message
    except BaseException:
        print(up.tail(120))
        raise
    finally:
        assert up.stop(signal.SIGINT, timeout=120) == 0, up.tail()
