"""The official openai SDK's `client.fine_tuning.jobs` against `ftune up` (API, embedded broker, a training
worker and a CPU worker, all real processes; SQLite): one stack for the module, tiny demo jobs."""

from __future__ import annotations

import csv
import io
import json
import signal
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from core import ft_names
from core.spec import JobSpec
from models import webhooks as webhooks_db
from models.db import make_engine, make_session_factory, session_scope
from models.tenants import create_key
from tests.e2e.conftest import models_dir  # noqa: F401  (the demo model, built once per session)
from tests.e2e.stack import REPO, Proc, env_for, free_port, wait_ready

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples"
STEPS = 30
# ftune's own settings as extra body fields: tiny, deterministic runs of the demo model.
TINY = {"max_steps": STEPS, "max_seq_len": 96, "lora_r": 8, "lora_dropout": 0.0, "checkpoint_every_steps": 10}
TINY |= {"keep_checkpoints": 2}
SUPERVISED: Any = {"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 5}}}


@dataclass
class Stack:
    base: str
    database_url: str
    models_dir: Path

    def tenant(self) -> tuple[openai.OpenAI, httpx.Client, str]:
        name = f"org-{uuid.uuid4().hex[:10]}"
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as s:
                key = create_key(s, name)
        finally:
            engine.dispose()
        sdk = openai.OpenAI(api_key=key, base_url=f"{self.base}/v1", max_retries=0, timeout=60)
        native = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return sdk, native, key


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Stack]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("openai-jobs")
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, models_dir, FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    env |= {"FTUNE_REAPER_INTERVAL_SECONDS": "0.5", "FTUNE_WEBHOOK_BACKOFF_SECONDS": "0.5"}  # fast retries
    up = Proc(["up"], env, tmp / "up.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, [up], timeout=180)
        yield Stack(base, database_url, models_dir)
    except BaseException:
        print(up.tail(200))
        raise
    finally:
        up.stop(signal.SIGINT, timeout=120)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver(fails=2)
    try:
        yield r
    finally:
        r.server.shutdown()


@pytest.fixture(scope="module")
def org(stack: Stack, receiver: Receiver) -> Iterator[tuple[openai.OpenAI, httpx.Client, str]]:
    """The module's main tenant, with a webhook on `receiver` before any of its jobs exists."""
    sdk, native, key = stack.tenant()
    with sdk, native:
        r = native.post("/webhooks", json={"url": receiver.url})
        assert r.status_code == 201, r.text
        receiver.secret = r.json()["secret"]
        yield sdk, native, key


@pytest.fixture(scope="module")
def training_file(org: tuple[openai.OpenAI, httpx.Client, str]) -> str:
    sdk, _, _ = org
    with (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
    return sdk.files.wait_for_processing(file_id, poll_interval=0.2).id


def wait_for(sdk: openai.OpenAI, job_id: str, statuses: set[str], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status not in {"failed", "cancelled", "succeeded"} - statuses, job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} never reached {statuses}")


@pytest.fixture(scope="module")
def finished(org: tuple[openai.OpenAI, httpx.Client, str], training_file: str) -> Any:
    """A job made with suffix, metadata and ftune settings, retrieved until it succeeded."""
    sdk, _, _ = org
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo",
        training_file=training_file,
        suffix="demo run",
        seed=7,
        metadata={"team": "search", "run": "baseline"},
        method=SUPERVISED,
        extra_body=TINY,
    )
    assert job.status in ("validating_files", "queued")
    return wait_for(sdk, job.id, {"succeeded"})


def test_create_with_suffix_metadata_and_ftune_settings_until_succeeded(
    stack: Stack,
    org: tuple[openai.OpenAI, httpx.Client, str],
    finished: Any,
    training_file: str,
    tmp_path: Path,
) -> None:
    sdk, native, _ = org
    job = finished
    assert job.object == "fine_tuning.job" and job.status == "succeeded"
    assert job.fine_tuned_model == f"ft:ftune-demo:{job.organization_id}:demo-run:{job.id}"
    assert ft_names.parse(job.fine_tuned_model) == ft_names.FineTunedName(job_id=job.id)
    assert job.model == "ftune-demo" and job.training_file == training_file and job.validation_file is None
    assert job.metadata == {"team": "search", "run": "baseline"} and job.seed == 7
    assert job.user_provided_suffix == "demo run"
    # No "auto" left: the demo model's planned micro-batch 4 x 1 accumulation, ftune's lr x 5.
    assert job.hyperparameters.model_dump() == {
        "n_epochs": 1,
        "batch_size": 4,
        "learning_rate_multiplier": 5.0,
    }
    assert job.method is not None and job.method.type == "supervised"
    assert job.finished_at is not None and job.finished_at >= job.created_at
    assert job.estimated_finish is None and job.error is None
    # The same job natively, with the settings that rode along.
    spec = native.get(f"/jobs/{job.id}").json()["spec"]
    assert {k: spec[k] for k in TINY} == TINY
    assert spec["learning_rate"] == pytest.approx(5 * 2e-4) and spec["seed"] == 7
    steps = native.get(f"/jobs/{job.id}/metrics").json()["data"]
    assert len(steps) == STEPS
    assert job.trained_tokens == sum(s["tokens"] for s in steps) > 0

    # Events: newest first, a metrics event per step with the training loss the run logged.
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=7))  # the SDK walks every page
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == list(range(STEPS, 0, -1))  # type: ignore[index]
    assert [e.data["train_loss"] for e in metrics][::-1] == [s["loss"] for s in steps]  # type: ignore[index]
    assert all(e.object == "fine_tuning.job.event" and e.level in ("info", "warn") for e in events)
    assert any(e.type == "message" and "queued" in e.message for e in events)
    assert len(sdk.fine_tuning.jobs.list_events(job.id).data) == 20  # OpenAI's default page

    # Checkpoints in step order, with their step's metrics, each named as a model.
    checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job.id))
    native_events = native.get(f"/jobs/{job.id}/events?limit=500").json()["data"]
    saved = sorted({e["data"]["step"] for e in native_events if e["kind"] == "checkpoint_saved"})
    assert {10, 20, 30} <= set(saved)
    assert [c.step_number for c in checkpoints] == saved[-2:]  # keep_checkpoints 2 (nothing evaluated)
    by_step = {s["step"]: s["loss"] for s in steps}
    for c in checkpoints:
        assert c.fine_tuning_job_id == job.id
        assert c.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-{c.step_number}"
        assert c.metrics.train_loss == by_step[c.step_number]

    # Each listed checkpoint downloads natively: the whole state as training saved it, safetensors only.
    last = checkpoints[-1].step_number
    r = native.get(f"/jobs/{job.id}/checkpoints/{last}")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"} == names
        state = json.loads(tar.extractfile(f"ftune-checkpoint-{job.id}-step-{last}/state.json").read())  # type: ignore[union-attr]
        assert state["position"]["step"] == last
    gone = [s for s in saved if s not in {c.step_number for c in checkpoints}]
    r = native.get(f"/jobs/{job.id}/checkpoints/{gone[0]}")  # pruned by keep_checkpoints
    assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found"

    # The result file: a CSV of the metrics per step.
    [result_id] = job.result_files
    meta = sdk.files.retrieve(result_id)
    assert meta.purpose == "fine-tune-results" and meta.status == "processed"
    rows = list(csv.DictReader(io.StringIO(sdk.files.content(result_id).text)))
    assert list(rows[0]) == [
        "step",
        "train_loss",
        "train_accuracy",
        "valid_loss",
        "valid_mean_token_accuracy",
    ]
    assert [(int(r["step"]), float(r["train_loss"])) for r in rows] == [(s["step"], s["loss"]) for s in steps]
    assert meta.bytes == len(sdk.files.content(result_id).content)

    # The adapter downloads natively and loads with peft.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = download_adapter_native(native, job.id, tmp_path)
    assert adapter and all(torch.isfinite(t).all() for t in adapter.values())
    base = AutoModelForCausalLM.from_pretrained(stack.models_dir / "ftune-demo", dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, tmp_path / job.id)
    assert tuned.peft_config["default"].r == 8


def test_list_walks_every_page_and_filters_by_metadata(stack: Stack, training_file: str) -> None:
    sdk, native, _ = stack.tenant()
    with sdk, native, (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
        ids = []
        for i in range(5):
            created = sdk.fine_tuning.jobs.create(
                model="ftune-demo", training_file=file_id, metadata={"i": str(i)}, extra_body=TINY
            )
            ids.append(created.id)
            # Cancelled at once (queued) or after its current step (running): listing needs no training.
            cancelled = sdk.fine_tuning.jobs.cancel(created.id)
            assert cancelled.id == created.id
        for job_id in ids:
            assert wait_for(sdk, job_id, {"cancelled"}).status == "cancelled"
        first = sdk.fine_tuning.jobs.list(limit=2)
        assert [j.id for j in first.data] == ids[::-1][:2] and first.has_more
        assert [j.id for j in sdk.fine_tuning.jobs.list(limit=2)] == ids[::-1]  # auto-pagination
        only = sdk.fine_tuning.jobs.list(metadata={"i": "3"})
        assert [j.id for j in only.data] == [ids[3]]
        assert only.data[0].metadata == {"i": "3"}
        # A cancelled job cannot be cancelled again: a 400 the SDK does not retry.
        with pytest.raises(openai.BadRequestError) as e:
            sdk.fine_tuning.jobs.cancel(ids[0])
        assert e.value.code == "job_finished"
        # Visible natively too, as cancelled.
        assert native.get(f"/jobs/{ids[0]}").json()["status"] == "cancelled"


def test_pause_then_resume_ends_succeeded_with_the_same_adapter_as_its_twin(
    stack: Stack,
    org: tuple[openai.OpenAI, httpx.Client, str],
    finished: Any,
    training_file: str,
    tmp_path: Path,
) -> None:
    sdk, native, _ = org
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=training_file, seed=7, method=SUPERVISED, extra_body=TINY
    )
    deadline = time.monotonic() + 300
    while native.get(f"/jobs/{job.id}").json()["progress"]["step"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sdk.fine_tuning.jobs.pause(job.id).status in ("running", "paused")
    paused = wait_for(sdk, job.id, {"paused", "succeeded"})
    assert paused.status == "paused", "the pause landed after the last step: make the run longer"
    assert native.get(f"/jobs/{job.id}").json()["progress"]["step"] < STEPS
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.pause(job.id)
    assert e.value.code == "job_not_pausable"
    assert sdk.fine_tuning.jobs.resume(job.id).status in ("queued", "validating_files", "running")
    done = wait_for(sdk, job.id, {"succeeded"})
    assert done.fine_tuned_model is not None
    twin = download_adapter_native(native, finished.id, tmp_path)
    resumed = download_adapter_native(native, job.id, tmp_path)
    assert twin.keys() == resumed.keys()
    for k in twin:
        assert torch.allclose(twin[k], resumed[k], atol=1e-5, rtol=0), k


@pytest.mark.skipif("init_from" not in JobSpec.model_fields, reason="JobSpec has no init_from yet")
def test_continue_from_a_fine_tuned_model(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], finished: Any, training_file: str
) -> None:
    sdk, native, _ = org
    job = sdk.fine_tuning.jobs.create(
        model=finished.fine_tuned_model,
        training_file=training_file,
        seed=7,
        method=SUPERVISED,
        extra_body={**TINY, "max_steps": 4},  # its first step is the claim
    )
    assert job.model == finished.fine_tuned_model
    spec = native.get(f"/jobs/{job.id}").json()["spec"]
    assert (spec["init_from"], spec["base_model"]) == (finished.id, "ftune-demo")
    done = wait_for(sdk, job.id, {"succeeded"})
    assert done.fine_tuned_model != finished.fine_tuned_model
    # It starts from the trained adapter: its first step (the same examples, seed 7) has a lower loss.
    first = native.get(f"/jobs/{finished.id}/metrics").json()["data"][0]["loss"]
    again = native.get(f"/jobs/{job.id}/metrics").json()["data"][0]["loss"]
    assert again < first - 0.1, (again, first)

    with pytest.raises(openai.BadRequestError) as e:  # a checkpoint's model: not supported yet
        sdk.fine_tuning.jobs.create(
            model=f"{finished.fine_tuned_model}:ckpt-step-30", training_file=training_file
        )
    assert e.value.param == "model"
    other, other_native, _ = stack.tenant()
    with other, other_native, pytest.raises(openai.BadRequestError) as e:  # another tenant's model
        other.fine_tuning.jobs.create(model=finished.fine_tuned_model, training_file=training_file)
    assert (e.value.code, e.value.param) == ("model_not_found", "model")


def download_adapter_native(native: httpx.Client, job_id: str, tmp: Path) -> dict[str, torch.Tensor]:

    r = native.get(f"/jobs/{job_id}/adapter")
    assert r.status_code == 200, r.text
    (tmp / f"{job_id}.tar.gz").write_bytes(r.content)
    with tarfile.open(tmp / f"{job_id}.tar.gz") as tar:
        tar.extractall(tmp / job_id, filter="data")
    return load_file(tmp / job_id / "adapter_model.safetensors")


def test_idempotent_create(org: tuple[openai.OpenAI, httpx.Client, str], training_file: str) -> None:
    """The SDK sends no Idempotency-Key of its own, so a retry without one makes a second job; with
    `extra_headers={"Idempotency-Key": ...}` a retry of the same create gets the first job back."""
    sdk, _, _ = org
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body: dict[str, Any] = {"model": "ftune-demo", "training_file": training_file, "extra_body": TINY}
    first = sdk.fine_tuning.jobs.with_raw_response.create(**body, extra_headers=key)
    again = sdk.fine_tuning.jobs.with_raw_response.create(**body, extra_headers=key)
    assert again.parse().id == first.parse().id
    assert again.headers.get("Idempotent-Replayed") == "true"
    other = sdk.fine_tuning.jobs.create(**body, extra_headers={"Idempotency-Key": uuid.uuid4().hex})
    assert other.id != first.parse().id
    with pytest.raises(openai.BadRequestError) as e:  # the same key with a different body
        sdk.fine_tuning.jobs.create(**{**body, "seed": 1}, extra_headers=key)
    assert e.value.code == "idempotency_key_reused"
    for job_id in (first.parse().id, other.id):
        sdk.fine_tuning.jobs.cancel(job_id)


def test_error_classes(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], training_file: str
) -> None:
    sdk, _, key = org
    jobs = sdk.fine_tuning.jobs

    def refused(exc: type[openai.APIStatusError], **body: Any) -> openai.APIStatusError:
        with pytest.raises(exc) as e:
            jobs.create(**{"model": "ftune-demo", "training_file": training_file, "extra_body": TINY, **body})
        return e.value

    bad = sdk.files.create(file=("bad.jsonl", b'{"instruction": "no output"}\n'), purpose="fine-tune")
    e = refused(openai.BadRequestError, training_file=bad.id)
    assert (e.code, e.param) == ("dataset_invalid", "training_file")
    e = refused(openai.NotFoundError, training_file="0" * 32)
    assert (e.code, e.param) == ("file_not_found", "training_file")
    e = refused(openai.BadRequestError, model="no-such-model")
    assert (e.code, e.param) == ("model_not_found", "model")
    e = refused(openai.BadRequestError, model=f"ft:ftune-demo:x::{'1' * 32}")
    assert (e.code, e.param) == ("model_not_found", "model")
    e = refused(openai.BadRequestError, method={"type": "reinforcement", "reinforcement": {}})
    assert e.param == "method.type"
    e = refused(openai.BadRequestError, integrations=[{"type": "wandb", "wandb": {"project": "p"}}])
    assert e.param == "integrations"
    e = refused(openai.BadRequestError, hyperparameters={"n_epochs": 2}, extra_body={**TINY, "epochs": 3})
    assert (e.code, e.param) == ("duplicate_parameter", "epochs")
    e = refused(openai.BadRequestError, extra_body={**TINY, "base_model": "ftune-demo"})
    assert e.param == "base_model"
    e = refused(openai.BadRequestError, extra_body={**TINY, "no_such_setting": 1})
    assert e.param == "no_such_setting"
    e = refused(openai.BadRequestError, suffix="x" * 65)
    assert e.param == "suffix"
    e = refused(openai.BadRequestError, metadata={f"k{i}": "v" for i in range(17)})
    assert e.param == "metadata"
    # Infeasible: the planner's breakdown and suggestions ride along in the error body.
    e = refused(openai.BadRequestError, extra_body={**TINY, "max_seq_len": 131072, "micro_batch_size": 512})
    assert e.code == "infeasible"
    details = e.body["details"]  # type: ignore[index]
    assert details["fits"] is False and details["breakdown"] and "suggestions" in details

    # Another tenant's file and job are 404, exactly like missing ones.
    other, other_native, _ = stack.tenant()
    with other, other_native:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(training_file)
        with pytest.raises(openai.NotFoundError) as theirs_file:
            other.fine_tuning.jobs.create(model="ftune-demo", training_file=training_file, extra_body=TINY)
        assert theirs_file.value.param == "training_file"
        mine = jobs.create(model="ftune-demo", training_file=training_file, extra_body=TINY).id
        jobs.cancel(mine)
        theirs = other.fine_tuning.jobs
        for call in (theirs.retrieve, theirs.cancel, theirs.pause, theirs.resume, theirs.list_events):
            with pytest.raises(openai.NotFoundError):
                call(mine)  # type: ignore[operator]
        assert mine not in [j.id for j in other.fine_tuning.jobs.list()]
    bad_key = openai.OpenAI(api_key=key[:-4] + "zzzz", base_url=str(sdk.base_url), max_retries=0)
    with bad_key, pytest.raises(openai.AuthenticationError):
        bad_key.fine_tuning.jobs.list()


def test_native_delete_of_datasets_and_finished_jobs(stack: Stack) -> None:
    """Files in use by an unfinished job stay; a finished job's files go, its record stays (deleted)."""
    sdk, native, _ = stack.tenant()
    with sdk, native, (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
        job = sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=file_id, extra_body=TINY)
        r = native.delete(f"/datasets/{file_id}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use", r.text
        assert r.json()["error"]["details"]["jobs"] == [job.id]
        r = native.delete(f"/jobs/{job.id}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_finished", r.text

        sdk.fine_tuning.jobs.cancel(job.id)
        wait_for(sdk, job.id, {"cancelled"})
        r = native.delete(f"/jobs/{job.id}")
        assert r.status_code == 200 and r.json()["deleted_at"] is not None, r.text
        assert native.get(f"/jobs/{job.id}").json()["status"] == "cancelled"  # the record stays
        assert native.get(f"/jobs/{job.id}/artifacts").json() == []
        assert native.get(f"/jobs/{job.id}/adapter").json()["error"]["code"] == "adapter_deleted"
        assert "deleted" in [e["kind"] for e in native.get(f"/jobs/{job.id}/events?limit=500").json()["data"]]

        assert native.delete(f"/datasets/{file_id}").status_code == 204
        assert file_id not in [d["id"] for d in native.get("/datasets").json()["data"]]
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(file_id)
        assert native.delete(f"/datasets/{file_id}").status_code == 404
        # Its record stays (the cancelled job names it), and a new job is told it was deleted.
        assert native.get(f"/datasets/{file_id}").json()["status"] == "deleted"
        with pytest.raises(openai.BadRequestError) as e:
            sdk.fine_tuning.jobs.create(model="ftune-demo", training_file=file_id, extra_body=TINY)
        assert (e.value.code, e.value.param) == ("dataset_deleted", "training_file")
        assert "deleted" in e.value.message


class Receiver:
    """A real local HTTP server that fails the first `fails` attempts of every webhook-id with a 500."""

    secret = ""

    def __init__(self, fails: int) -> None:
        self.received: list[tuple[dict[str, str], bytes, int]] = []  # headers, body, status answered
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    seen = sum(
                        1 for h, _, _ in receiver.received if h["webhook-id"] == self.headers["webhook-id"]
                    )
                    status = 500 if seen < fails else 200
                    receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def accepted(self) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for headers, _, status in self.received:
                out[headers["webhook-id"]] = out.get(headers["webhook-id"], 0) + (status == 200)
            return out


def test_webhooks_signed_retried_and_delivered_once_per_id(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], receiver: Receiver, finished: Any
) -> None:
    """Every finished job of the module's tenant (succeeded, cancelled) was announced to its webhook, a
    real local server that refused the first two attempts of every event."""
    sdk, native, _ = org
    secret = receiver.secret
    assert secret.startswith("whsec_")
    hooks = native.get("/webhooks").json()
    assert [h["url"] for h in hooks] == [receiver.url] and "secret" not in hooks[0]  # shown once
    assert native.post("/webhooks", json={"url": "ftp://x"}).status_code == 422
    cancelled = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=finished.training_file, extra_body=TINY
    )
    sdk.fine_tuning.jobs.cancel(cancelled.id)

    ended = {
        j.id: wait_for(sdk, j.id, {"succeeded", "cancelled"}).status for j in sdk.fine_tuning.jobs.list()
    }
    assert {"succeeded", "cancelled"} <= set(ended.values())
    deadline = time.monotonic() + 120
    while sum(1 for n in receiver.accepted().values() if n) < len(ended):
        assert time.monotonic() < deadline, receiver.received
        time.sleep(0.2)
    time.sleep(3)  # several delivery passes later: nothing more arrives for an accepted event

    verifier = openai.OpenAI(api_key="unused", webhook_secret=secret)
    events = {}
    for headers, body, _ in receiver.received:  # every attempt verifies, refused ones too
        event = verifier.webhooks.unwrap(body, headers)
        assert event.id == headers["webhook-id"]
        events[event.id] = (event.type, event.data.id)
    assert sorted(events.values()) == sorted(
        (f"fine_tuning.job.{st}", job_id) for job_id, st in ended.items()
    )
    assert receiver.accepted() == {event_id: 1 for event_id in events}  # exactly once per id
    assert len(receiver.received) == 3 * len(events)  # two refused attempts, then the accepted one

    headers, body, _ = receiver.received[-1]
    tampered = json.loads(body)
    tampered["data"]["id"] = "0" * 32
    with pytest.raises(openai.InvalidWebhookSignatureError):
        verifier.webhooks.unwrap(json.dumps(tampered), headers)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused", webhook_secret=webhooks_db.new_secret()).webhooks.unwrap(
            body, headers
        )

    engine = make_engine(stack.database_url)  # every attempt is recorded
    try:
        with make_session_factory(engine)() as s:
            for event_id in events:
                attempts = webhooks_db.deliveries(s, event_id)
                assert [(a.attempt, a.status_code) for a in attempts] == [(1, 500), (2, 500), (3, 200)]
    finally:
        engine.dispose()
