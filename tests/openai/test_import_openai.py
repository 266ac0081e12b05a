"""`ftune import-openai` between two real ftune instances: the source is a second ftune, which speaks
OpenAI's API; the destination is the package's `server`. The real command (`python -m cli`) moves files
and job definitions, a rerun duplicates nothing, and `--dry-run` changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import FileObject
from openai.types.fine_tuning import FineTuningJob

from cli.openai_import.command import run
from cli.openai_import.endpoints import connect
from cli.openai_import.files import FileMap, copy_one
from cli.openai_import.jobs import definition
from cli.openai_import.options import Options, parse_models
from cli.openai_import.report import Outcome
from core.settings import Settings
from tests.e2e.stack import REPO, Proc, env_for, free_port
from tests.openai.conftest import EXAMPLES, TINY, Server, _healthy

GRADER = {"type": "string_check", "name": "exact", "operation": "eq"}
GRADER |= {"input": "{{sample.output_text}}", "reference": "{{item.answer}}"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second ftune (the API alone, as `server`), with two base models: `tiny` and `elsewhere`."""
    tmp = tmp_path_factory.mktemp("import-source")
    for name in ("tiny", "elsewhere"):
        (tmp / "models" / name).mkdir(parents=True)
        (tmp / "models" / name / "config.json").write_text(json.dumps(TINY))
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    api = Proc(["api"], env, tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base):
            assert api.p.poll() is None and time.monotonic() < deadline, api.tail()
            time.sleep(0.2)
        yield Server(base, tmp / "data", database_url)
    finally:
        api.stop()


def _sdk(server: Server) -> tuple[openai.OpenAI, str]:
    key = server.key(f"org-{uuid.uuid4().hex[:10]}")
    return openai.OpenAI(api_key=key, base_url=f"{server.base}/v1", max_retries=0, timeout=30), key


def _upload(sdk: openai.OpenAI, name: str) -> str:
    with (EXAMPLES / name).open("rb") as f:
        return sdk.files.create(file=f, purpose="fine-tune").id


def _fill(src: openai.OpenAI) -> dict[str, str]:
    """The source tenant's files and jobs; their ids by role."""
    ids = {"train": _upload(src, "alpaca_small.jsonl"), "valid": _upload(src, "chat_small.jsonl")}
    ids |= {"pref": _upload(src, "preference_small.jsonl"), "rft": _upload(src, "rft_small.jsonl")}
    ids["bad"] = src.files.create(
        file=("bad.jsonl", b'{"instruction": "no output"}\n'), purpose="fine-tune"
    ).id
    jobs = src.fine_tuning.jobs
    supervised: Any = {"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 0.5}
    ids["sft"] = jobs.create(
        model="tiny",
        training_file=ids["train"],
        validation_file=ids["valid"],
        suffix="support bot",
        seed=7,
        metadata={"team": "search"},
        method={"type": "supervised", "supervised": {"hyperparameters": supervised}},
    ).id
    dpo: Any = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1}}}
    ids["dpo"] = jobs.create(model="tiny", training_file=ids["pref"], method=dpo).id
    rft: Any = {
        "type": "reinforcement",
        "reinforcement": {"grader": GRADER, "hyperparameters": {"eval_samples": 4}},
    }
    ids["rft"] = jobs.create(model="tiny", training_file=ids["rft"], method=rft).id
    full = {f"k{i}": str(i) for i in range(16)}  # no room left for imported_from: the key alone guards it
    ids["full"] = jobs.create(model="tiny", training_file=ids["train"], metadata=full).id
    ids["unmapped"] = jobs.create(model="elsewhere", training_file=ids["train"]).id
    ids["cancelled"] = jobs.create(model="tiny", training_file=ids["train"], seed=1).id
    jobs.cancel(ids["cancelled"])
    return ids


def _import(source: Server, dest: Server, src_key: str, dest_key: str, tmp: Path, *flags: str) -> Any:
    env = env_for(tmp, tmp / "models", SOURCE_KEY=src_key, FTUNE_KEY=dest_key)
    args = ["import-openai", "--from-base-url", f"{source.base}/v1", "--from-key-env", "SOURCE_KEY"]
    args += ["--to-base-url", f"{dest.base}/v1", "--model", "tiny=tiny", *flags]
    done = subprocess.run(
        [sys.executable, "-m", "cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr  # 1: some were not moved (listed)
    assert src_key not in done.stdout + done.stderr and dest_key not in done.stdout + done.stderr
    return done.stdout


def _state(sdk: openai.OpenAI) -> tuple[list[Any], list[FineTuningJob]]:
    return list(sdk.files.list()), list(sdk.fine_tuning.jobs.list())


def _ids(sdk: openai.OpenAI) -> tuple[list[str], list[str]]:
    files, jobs = _state(sdk)
    return [f.id for f in files], [j.id for j in jobs]


def _method(job: FineTuningJob) -> Any:
    return job.to_dict()["method"]


def _line(out: str, source_id: str) -> str:
    return next(line for line in out.splitlines() if f" {source_id}: " in line)


def test_import_moves_files_and_jobs_once_and_a_dry_run_changes_nothing(
    source: Server, server: Server, tmp_path: Path
) -> None:
    src, src_key = _sdk(source)
    dst, dest_key = _sdk(server)
    ids = _fill(src)

    planned = _import(source, server, src_key, dest_key, tmp_path, "--dry-run", "--gpu", "A100-80GB")
    assert _ids(dst) == ([], [])  # nothing changed
    assert "would copy" in _line(planned, ids["train"]) and "would copy" in _line(planned, ids["sft"])
    assert "memory plan on A100-80GB x1" in planned and "fits (micro-batch 4 x 2)" in planned
    assert "has no mapping: --model elsewhere=<local model>" in _line(planned, ids["unmapped"])
    assert "cancelled on the source: not copied by default" in _line(planned, ids["cancelled"])

    out = _import(source, server, src_key, dest_key, tmp_path)
    files, jobs = _state(dst)
    by_name = {f.filename: f for f in files}
    assert sorted(by_name) == sorted(
        ["alpaca_small.jsonl", "chat_small.jsonl", "preference_small.jsonl", "rft_small.jsonl", "bad.jsonl"]
    )
    for name in ("alpaca_small.jsonl", "rft_small.jsonl"):  # the bytes as uploaded to the source
        assert dst.files.content(by_name[name].id).read() == (EXAMPLES / name).read_bytes()
    assert by_name["bad.jsonl"].status == "error" and "finds it invalid" in _line(out, ids["bad"])
    copies = {
        (j.metadata or {}).get("imported_from", "full" if len(j.metadata or {}) == 16 else "?"): j
        for j in jobs
    }
    assert sorted(copies) == sorted([ids["sft"], ids["dpo"], ids["rft"], "full"])
    sft = copies[ids["sft"]]
    assert (sft.model, sft.seed, sft.metadata) == ("tiny", 7, {"team": "search", "imported_from": ids["sft"]})
    assert (sft.training_file, sft.validation_file) == (
        by_name["alpaca_small.jsonl"].id,
        by_name["chat_small.jsonl"].id,
    )
    assert sft.model_extra and sft.model_extra["user_provided_suffix"] == "support bot"
    hp = _method(sft)["supervised"]["hyperparameters"]
    assert (hp["n_epochs"], hp["batch_size"], hp["learning_rate_multiplier"]) == (2, 8, 0.5)
    assert _method(copies[ids["dpo"]])["dpo"]["hyperparameters"]["beta"] == 0.2
    rft = _method(copies[ids["rft"]])["reinforcement"]
    assert rft["grader"] == GRADER and rft["hyperparameters"]["eval_samples"] == 4
    assert "not moved, and why:" in out and "has no mapping" in _line(out, ids["unmapped"])

    again = _import(source, server, src_key, dest_key, tmp_path)  # the rerun: no duplicates
    assert _ids(dst) == ([f.id for f in files], [j.id for j in jobs])
    for role in ("train", "valid", "bad", "sft", "dpo", "rft", "full"):
        assert "already there" in _line(again, ids[role]), role
    assert "done: 0 copied, 9 already there, 2 not moved" in again

    replanned = _import(source, server, src_key, dest_key, tmp_path, "--dry-run", "--gpu", "A100-80GB")
    assert _ids(dst) == ([f.id for f in files], [j.id for j in jobs])
    assert "already there" in _line(replanned, ids["sft"])

    out = _import(source, server, src_key, dest_key, tmp_path, "--include-failed", "--paused")
    assert "done: 1 copied, 9 already there, 1 not moved" in out
    copied = dst.fine_tuning.jobs.list(metadata={"imported_from": ids["cancelled"]}).data
    assert [(j.seed, j.status) for j in copied] == [(1, "paused")]  # paused at once: nothing trains it


def _job(**fields: Any) -> FineTuningJob:
    """A job object as OpenAI answers it (its documented example, abridged)."""
    body = {
        "id": "ftjob-abc123",
        "object": "fine_tuning.job",
        "created_at": 1721764800,
        "model": "gpt-4o-mini",
    }
    body |= {"organization_id": "org-123", "status": "succeeded", "training_file": "file-abc123"}
    body |= {"validation_file": None, "seed": 683058546, "result_files": [], "trained_tokens": 5768}
    body |= {"fine_tuned_model": "ft:gpt-4o-mini:openai::7p4lURel", "finished_at": None, "error": None}
    body |= {"hyperparameters": {"n_epochs": 3, "batch_size": 1, "learning_rate_multiplier": 1.8}}
    return FineTuningJob.model_validate(body | fields)


def test_openai_objects_map_onto_create_requests_or_a_reason() -> None:
    files = FileMap(ids={"file-abc123": "f" * 32})
    models = parse_models(["gpt-4o-mini=ftune-demo"])
    made = definition(_job(), models, files)
    assert not isinstance(made, str)
    hp = {"n_epochs": 3, "batch_size": 1, "learning_rate_multiplier": 1.8}
    assert made.body == {
        "model": "ftune-demo",
        "training_file": "f" * 32,
        "seed": 683058546,
        "metadata": {"imported_from": "ftjob-abc123"},
        "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
    }
    wandb = [{"type": "wandb", "wandb": {"project": "p"}}]
    made = definition(_job(fine_tuned_model="ft:gpt-4o-mini:org:bot:xyz", integrations=wandb), models, files)
    assert not isinstance(made, str) and made.body["suffix"] == "bot"
    assert made.notes == ["its integrations (wandb) are not copied: ftune has none"]

    assert "is a fine-tuned model" in str(definition(_job(model="ft:gpt-4o-mini:org::x"), models, files))
    missing = definition(_job(validation_file="file-gone"), models, files)
    assert missing == "its validation file file-gone is not among the source's files (deleted there?)"
    files.why["file-gone"] = "was not moved: batch.jsonl (2 B, purpose batch): ftune stores ..."
    missing = definition(_job(validation_file="file-gone"), models, files)
    assert (
        missing
        == "its validation file file-gone was not moved: batch.jsonl (2 B, purpose batch): ftune stores ..."
    )
    batch = FileObject.model_validate(
        {"id": "file-b", "object": "file", "bytes": 2, "created_at": 1, "filename": "b.jsonl"}
        | {"purpose": "batch", "status": "processed"}
    )
    outcome, dest_id, detail = copy_one(None, batch, dry_run=False, known=None)  # type: ignore[arg-type]
    assert (outcome, dest_id) == (Outcome.NOT_MOVED, None)
    assert detail == "b.jsonl (2 B, purpose batch): ftune stores fine-tuning files only (purpose 'fine-tune')"
    with pytest.raises(ValueError, match="mapped twice"):
        parse_models(["a=b", "a=c"])
    with pytest.raises(ValueError, match="SOURCE=LOCAL"):
        parse_models(["gpt-4o-mini"])


def test_it_will_not_start_without_its_keys_or_into_its_own_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path, api_host="0.0.0.0", api_port=8000)  # no local admin key yet

    def run_with(**flags: Any) -> str:
        options = Options(**{"from_key_env": "SOURCE_KEY", "to_key_env": "DEST_KEY", "models": {}} | flags)
        assert run(options, settings) == 2
        return capsys.readouterr().err

    monkeypatch.delenv("SOURCE_KEY", raising=False)
    assert "no source API key: set SOURCE_KEY" in run_with(from_base_url="http://a/v1", to_base_url=None)
    monkeypatch.setenv("SOURCE_KEY", "sk-source")
    monkeypatch.delenv("DEST_KEY", raising=False)
    assert "no ftune API key: set DEST_KEY" in run_with(from_base_url="http://a/v1", to_base_url=None)
    (tmp_path / "local-admin-key").write_text("ftk-local\n")  # what `ftune up` keeps: the fallback
    options = Options("http://a/v1", "SOURCE_KEY", None, "DEST_KEY", {})
    ends = connect(options, settings)
    assert (ends.dest.api_key, ends.dest_url) == ("ftk-local", "http://127.0.0.1:8000/v1")
    ends.close()
    monkeypatch.setenv("DEST_KEY", "ftk-dest")
    err = run_with(from_base_url="http://a:1/v1/", to_base_url="http://A:1/v1")
    assert "the source and the destination are the same API" in err
