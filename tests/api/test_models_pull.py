"""POST /models/pull and its progress, against the local Hub stand-in (tests/core/hub_double.py, HF_ENDPOINT
pointed at it) serving the tiny demo model built here: the real core.hub.pull in the API's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.pulls import HubPulls
from core.hub import PulledModel, PullProgress
from tests.core.hub_double import HubDouble, serve


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from training.demo import TINY, build_demo_model

    built = build_demo_model(tmp_path_factory.mktemp("built"), name="tiny", size=TINY)
    return {f.name: f.read_bytes() for f in built.iterdir() if f.is_file()}


@pytest.fixture
def hub(tiny_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[HubDouble]:
    double = HubDouble()
    double.add("acme/tiny", {**tiny_files, "pytorch_model.bin": b"PICKLE"})
    with serve(double):
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield double


def _finished(c: TestClient, pull_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.get(f"/models/pulls/{pull_id}")
        assert r.status_code == 200, r.text
        if r.json()["state"] != "running":
            return dict(r.json())
        time.sleep(0.05)
    raise TimeoutError(f"pull {pull_id} still running")


def test_an_admin_pulls_a_model_and_it_is_listed(hub: HubDouble, admin_client: TestClient) -> None:
    r = admin_client.post("/models/pull", json={"repo": "acme/tiny"})
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["state"] == "running" and started["repo"] == "acme/tiny" and started["revision"] is None

    done = _finished(admin_client, started["id"])
    sha = hub.resolve("acme/tiny", "main")
    assert done["state"] == "succeeded", done
    assert done["stage"] == "done" and done["model"] == "acme/tiny" and done["commit_sha"] == sha
    assert done["files_done"] == done["files_total"] > 1 and done["current_file"] is None
    assert done["bytes_done"] == done["bytes_total"] > 0 and done["error"] is None
    assert done["finished_at"] is not None and not done["already_present"]
    assert not [p for _, p in hub.requested(r"/resolve/") if p.endswith(".bin")]

    listed = {m["name"]: m for m in admin_client.get("/models").json()}
    assert listed["acme/tiny"]["revision"] == sha
    assert [p["id"] for p in admin_client.get("/models/pulls").json()] == [started["id"]]

    # The same commit again: nothing downloaded, said so.
    again_id = admin_client.post("/models/pull", json={"repo": "acme/tiny"}).json()["id"]
    again = _finished(admin_client, again_id)
    assert again["state"] == "succeeded" and again["already_present"]


def test_failures_carry_the_hubs_code_and_message(hub: HubDouble, admin_client: TestClient) -> None:
    missing = admin_client.post("/models/pull", json={"repo": "acme/nothing"}).json()
    bad_rev = admin_client.post("/models/pull", json={"repo": "acme/tiny", "revision": "v9"}).json()
    for started, code in ((missing, "model_not_found"), (bad_rev, "revision_not_found")):
        done = _finished(admin_client, started["id"])
        assert done["state"] == "failed" and done["error"]["code"] == code, done
        assert done["error"]["message"] and done["model"] is None


def test_progress_follows_the_bytes_of_a_file_as_they_come(
    hub: HubDouble, admin_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held at half of the weights: the record counts the complete files plus what of the weights is on
    disk (huggingface_hub's .incomplete file), names the file, and says running until the rest comes."""
    from huggingface_hub import constants

    # huggingface_hub writes in chunks of 10 MB; the tiny model's weights are less than one
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.stall_file = "model.safetensors"
    pull_id = admin_client.post("/models/pull", json={"repo": "acme/tiny"}).json()["id"]
    weights = len(hub.repos["acme/tiny"].commits[str(hub.resolve("acme/tiny", "main"))]["model.safetensors"])
    deadline, seen = time.monotonic() + 30, {}
    try:
        while time.monotonic() < deadline:
            seen = admin_client.get(f"/models/pulls/{pull_id}").json()
            before = seen["bytes_total"] - weights  # every other file is complete by then
            if seen["current_file"] == "model.safetensors" and seen["bytes_done"] > before:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"never saw part of the weights: {seen}")
        assert seen["bytes_done"] <= before + weights // 2
        assert seen["state"] == "running" and seen["stage"] == "downloading"
        assert seen["files_done"] == seen["files_total"] - 1
    finally:
        hub.resume.set()
    done = _finished(admin_client, pull_id)
    assert done["state"] == "succeeded" and done["bytes_done"] == done["bytes_total"]


def test_one_pull_per_repo_at_a_time(admin_client: TestClient, settings: Any) -> None:
    release = threading.Event()

    def slow_pull(repo: str, models_dir: Path, *, progress: PullProgress, **_: Any) -> PulledModel:
        progress.stage, progress.file, progress.files_total, progress.bytes_total = "downloading", "a", 2, 10
        release.wait(30)
        return PulledModel(repo, models_dir / repo, "0" * 40, {})

    services = admin_client.app.state.services  # type: ignore[attr-defined]
    services.pulls = HubPulls(settings.models_dir, pull_fn=slow_pull)
    try:
        first = admin_client.post("/models/pull", json={"repo": "acme/a"})
        assert first.status_code == 202
        second = admin_client.post("/models/pull", json={"repo": "acme/a", "revision": "v1"})
        assert second.status_code == 409 and second.json()["error"]["code"] == "pull_in_progress"
        assert admin_client.post("/models/pull", json={"repo": "acme/b"}).status_code == 202
        running = admin_client.get(f"/models/pulls/{first.json()['id']}").json()
        assert (running["state"], running["current_file"], running["bytes_total"]) == ("running", "a", 10)
    finally:
        release.set()
    assert _finished(admin_client, first.json()["id"])["state"] == "succeeded"
    assert admin_client.post("/models/pull", json={"repo": "acme/a"}).status_code == 202


def test_admins_only_valid_ids_and_the_off_switch(
    client: TestClient, admin_client: TestClient, settings: Any
) -> None:
    r = client.post("/models/pull", json={"repo": "acme/tiny"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert client.get("/models/pulls").status_code == 403
    for body in ({"repo": "../etc"}, {"repo": "a/b/c"}, {"repo": "a..b/c"}, {"repo": "a/b", "revision": ""}):
        r = admin_client.post("/models/pull", json=body)
        assert r.status_code == 422 and r.json()["error"]["param"] in ("repo", "revision"), (body, r.text)
    assert admin_client.get("/models/pulls/" + "0" * 32).json()["error"]["code"] == "pull_not_found"

    settings.hub_pull_enabled = False  # the app holds this Settings object
    r = admin_client.post("/models/pull", json={"repo": "acme/tiny"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "hub_pull_disabled"
    assert "FTUNE_HUB_PULL_ENABLED" in r.json()["error"]["message"]
    assert admin_client.get("/models/pulls").json() == []


def test_progress_counts_the_partial_file(tmp_path: Path) -> None:
    progress = PullProgress(staging=tmp_path, bytes_before=100, file="w.safetensors", file_bytes=50)
    assert progress.bytes_done == 100
    partial = tmp_path / "w.safetensors.part"
    partial.write_bytes(b"x" * 20)
    assert progress.bytes_done == 120
    partial.write_bytes(b"x" * 80)  # never past the file's listed size
    assert progress.bytes_done == 150
    progress.file = None  # between files: the complete ones only
    assert progress.bytes_done == 100
