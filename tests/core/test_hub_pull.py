"""`ftune models pull` against a local stand-in for the Hub (tests/core/hub_double.py), serving a tiny
Llama built here: safetensors shards plus pickle decoys that must never be requested."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.catalog import PULL_RECORD, Catalog
from core.errors import Conflict, NotFound, PayloadTooLarge, Unavailable, Unsupported
from core.hub import STAGING_DIR, pull
from tests.core.hub_double import HubDouble, heal, serve

REPO = Path(__file__).resolve().parents[2]
DECOYS = {"pytorch_model.bin": b"PICKLE" * 100, "training_args.bin": b"x", "original/consolidated.pth": b"x"}
WEIGHTS = r"\.(safetensors|bin|pth)$"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """The demo model's files twice: sharded (main) and in one model.safetensors (the older v1)."""
    from transformers import AutoModelForCausalLM

    from training.demo import TINY, build_demo_model

    root = tmp_path_factory.mktemp("built")
    single = build_demo_model(root, name="single", size=TINY)
    sharded = root / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="300KB")
    for f in single.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not (sharded / f.name).exists():
            (sharded / f.name).write_bytes(f.read_bytes())
    read = {d: {f.name: f.read_bytes() for f in d.iterdir() if f.is_file()} for d in (single, sharded)}
    v1_config = {**json.loads(read[single]["config.json"]), "ftune_test_revision": "v1"}
    read[single]["config.json"] = json.dumps(v1_config).encode()
    return {"v1": read[single], "main": read[sharded]}


@pytest.fixture
def hub(tiny_files: dict[str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> Iterator[HubDouble]:
    double = HubDouble()
    double.add("acme/tiny", {**tiny_files["v1"], **DECOYS}, ref="v1")
    double.add("acme/tiny", {**tiny_files["main"], **DECOYS}, ref="main")
    llama = json.loads(tiny_files["v1"]["config.json"])
    weights = {"model.safetensors": tiny_files["v1"]["model.safetensors"], "tokenizer.json": b"{}"}
    double.add("acme/mamba", {"config.json": json.dumps({"model_type": "mamba"}).encode(), **weights})
    custom = {**llama, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    double.add("acme/custom", {"config.json": json.dumps(custom).encode(), "modeling_x.py": b"", **weights})
    double.add("acme/pickled", {"config.json": json.dumps(llama).encode(), **DECOYS})
    with serve(double):
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield double


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pull_registers_a_model_that_lists_and_loads(hub: HubDouble, tmp_path: Path) -> None:
    """The real command, with HF_ENDPOINT from its environment: sharded safetensors, no pickle asked for."""
    env = {
        "HF_ENDPOINT": hub.url,
        "FTUNE_MODELS_DIR": str(tmp_path),
        "FTUNE_HF_CACHE_DIR": str(tmp_path / "hf"),
    }
    done = _cli("models", "pull", "acme/tiny", env=env)
    assert done.returncode == 0, done.stderr
    main_sha = hub.resolve("acme/tiny", "main")
    assert (
        f"registered acme/tiny at {tmp_path / 'acme/tiny'} (commit {main_sha})" in done.stdout + done.stderr
    )

    listed = _cli("models", "list", env=env)
    assert listed.stdout.split("\t")[:3] == ["acme/tiny", "LlamaForCausalLM", "models_dir"]
    [model] = Catalog(tmp_path, hf_cache=tmp_path / "hf").list()
    assert model.revision == main_sha
    record = json.loads((model.path / PULL_RECORD).read_text())
    assert record["commit_sha"] == main_sha and record["revision"] == "main"
    assert sum(f.endswith(".safetensors") for f in record["files"]) > 1  # the shards, via the index
    assert not (tmp_path / STAGING_DIR / "acme--tiny").exists()

    fetched = {path.rsplit("/", 1)[-1] for _, path in hub.requested(r"/resolve/")}
    assert not [f for f in fetched if f.endswith((".bin", ".pth"))]
    assert all(f"/resolve/{main_sha}/" in path for _, path in hub.requested(r"/resolve/"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, trust_remote_code=False)
    assert loaded.config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(model.path, local_files_only=True).chat_template


def test_revision_pins_that_commit(hub: HubDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_private")
    pulled = pull("acme/tiny", tmp_path, revision="v1")
    assert set(hub.authorizations) == {"Bearer hf_private"}  # HF_TOKEN, read when the pull starts
    v1 = hub.resolve("acme/tiny", "v1")
    assert pulled.commit_sha == v1
    assert json.loads((pulled.path / "config.json").read_text())["ftune_test_revision"] == "v1"
    assert (pulled.path / "model.safetensors").is_file()
    assert json.loads((pulled.path / PULL_RECORD).read_text())["revision"] == "v1"
    assert all(f"/resolve/{v1}/" in path for _, path in hub.requested(r"/resolve/"))

    # The same commit again: nothing is fetched. Another commit over it: only when asked to.
    before = len(hub.requests)
    assert pull("acme/tiny", tmp_path, revision=v1).already_present
    assert [path for _, path in hub.requests[before:]] == [f"/api/models/acme/tiny/revision/{v1}"]
    with pytest.raises(Conflict, match="--force"):
        pull("acme/tiny", tmp_path)
    assert pull("acme/tiny", tmp_path, force=True).commit_sha == hub.resolve("acme/tiny", "main")


def test_unsupported_architecture_is_refused_before_any_weights(hub: HubDouble, tmp_path: Path) -> None:
    with pytest.raises(Unsupported, match=r"'mamba'.*supported model types: falcon, gemma.*llama") as e:
        pull("acme/mamba", tmp_path)
    assert e.value.code == "unsupported_architecture"
    assert [path for _, path in hub.requested(r"/resolve/")] == [
        "/acme/mamba/resolve/" + str(hub.resolve("acme/mamba", "main")) + "/config.json"
    ]  # one GET of config.json
    assert Catalog(tmp_path, hf_cache=tmp_path / "hf").list() == []


def test_custom_code_is_refused(hub: HubDouble, tmp_path: Path) -> None:
    with pytest.raises(Unsupported, match=r"auto_map.*trust_remote_code") as e:
        pull("acme/custom", tmp_path)
    assert e.value.code == "remote_code_refused"
    assert not hub.requested(WEIGHTS) and not hub.requested(r"\.py$")


def test_a_repo_without_safetensors_is_refused(hub: HubDouble, tmp_path: Path) -> None:
    with pytest.raises(Unsupported, match=r"no safetensors weights.*pytorch_model\.bin") as e:
        pull("acme/pickled", tmp_path)
    assert e.value.code == "no_safetensors"
    assert not hub.requested(r"/resolve/")  # decided from the listing alone


def test_an_interrupted_pull_continues_and_is_never_listed_half_done(
    hub: HubDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)  # 10 MB chunks: the test's files are smaller
    sha = hub.resolve("acme/tiny", "main")
    shards = sorted(f for f in hub.repos["acme/tiny"].commits[str(sha)] if f.endswith(".safetensors"))
    hub.break_file = shards[-1]  # cut midway, then the Hub stays away
    with pytest.raises(Unavailable, match="run the same command again") as e:
        pull("acme/tiny", tmp_path)
    # huggingface_hub 2 retries the drop itself (and gets the 503); 1.x reports the drop
    assert e.value.code in ("hub_error", "hub_interrupted")
    staged = tmp_path / STAGING_DIR / "acme--tiny" / str(sha)
    assert (staged / "config.json").is_file() and (staged / shards[0]).is_file()
    assert not (tmp_path / "acme").exists()
    assert Catalog(tmp_path, hf_cache=tmp_path / "hf").list() == []

    kept = (staged / f"{shards[-1]}.part").stat().st_size  # what came before the cut, in whole chunks
    assert 0 < kept < len(hub.repos["acme/tiny"].commits[str(sha)][shards[-1]])

    heal(hub)
    done = len(hub.requests)
    pulled = pull("acme/tiny", tmp_path)
    again = [
        (path, r)
        for (_, path), r in zip(hub.requests[done:], hub.ranges[done:], strict=True)
        if "/resolve/" in path
    ]
    assert not [p for p, _ in again if p.endswith(("config.json", shards[0]))]  # complete files are kept
    assert [(p.rsplit("/", 1)[-1], r) for p, r in again] == [
        (shards[-1], f"bytes={kept}-")
    ]  # from the cut on
    assert [m.name for m in Catalog(tmp_path, hf_cache=tmp_path / "hf").list()] == ["acme/tiny"]
    assert pulled.commit_sha == sha


def test_unknown_repo_and_revision(hub: HubDouble, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="not a model repo"):
        pull("acme/nothing", tmp_path)
    with pytest.raises(NotFound, match="no revision 'v9'") as e:
        pull("acme/tiny", tmp_path, revision="v9")
    assert e.value.code == "revision_not_found"


def test_offline_mode_says_what_to_do(
    hub: HubDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Unavailable, match=r"HF_HUB_OFFLINE.*copy the model by hand"):
        pull("acme/tiny", tmp_path)
    assert hub.requests == []


def test_without_network_a_clear_message_and_no_traceback(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = {"HF_ENDPOINT": closed, "FTUNE_MODELS_DIR": str(tmp_path), "HF_HUB_OFFLINE": ""}
    done = _cli("models", "pull", "acme/tiny", env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "error (hub_unreachable): cannot reach the Hugging Face Hub at " + closed in done.stderr
    assert "HF_ENDPOINT" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
    assert str(tmp_path / "acme/tiny") in done.stderr


@pytest.mark.parametrize(
    "claimed", ["../../../victim", "0" * 39, "0" * 40 + "\n", "G" * 40, "0" * 40 + "/.."]
)
def test_a_commit_that_is_not_a_sha_touches_no_path(hub: HubDouble, tmp_path: Path, claimed: str) -> None:
    """A hostile mirror answers a "commit" that would put the staging directory elsewhere (and delete it
    when done): refused before any file is fetched or any directory made for it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    hub.claimed_sha = claimed
    with pytest.raises(Unavailable, match="not a commit sha") as e:
        pull("acme/tiny", tmp_path / "models")
    assert e.value.code == "hub_bad_commit"
    assert not hub.requested(r"/resolve/")
    assert [f.name for f in victim.iterdir()] == ["keep"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["models", "victim"]
    assert not (tmp_path / "models" / STAGING_DIR / "acme--tiny").exists()


def test_a_file_listed_over_the_size_cap_is_refused_before_it_is_fetched(
    hub: HubDouble, tmp_path: Path
) -> None:
    """FTUNE_HUB_MAX_FILE_BYTES, through the real command: the shards are listed over it, so none is asked
    for (nor the tokenizer, fetched just before them)."""
    files = hub.repos["acme/tiny"].commits[str(hub.resolve("acme/tiny", "main"))]
    cap = min(len(data) for name, data in files.items() if name.endswith(".safetensors")) - 1
    small = [data for name, data in files.items() if not name.endswith((".safetensors", ".bin"))]
    assert all(len(data) <= cap for data in small)
    env = {"HF_ENDPOINT": hub.url, "FTUNE_MODELS_DIR": str(tmp_path), "FTUNE_HUB_MAX_FILE_BYTES": str(cap)}
    done = _cli("models", "pull", "acme/tiny", env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error (hub_file_too_large): acme/tiny: model-00001-of-" in done.stderr
    assert f"over the cap of {cap} bytes (FTUNE_HUB_MAX_FILE_BYTES)" in done.stderr
    assert not hub.requested(WEIGHTS) and not hub.requested(r"tokenizer")
    assert not (tmp_path / "acme").exists()


def test_a_body_that_streams_past_the_cap_is_cut_off(
    hub: HubDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing says tokenizer.json is small; the mirror sends megabytes more: the download stops at
    the cap, what came is deleted, and nothing after it is fetched."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)
    cap = 1_000_000  # over every file's listed size
    hub.padded["tokenizer.json"] = 8_000_000
    with pytest.raises(
        PayloadTooLarge, match=r"tokenizer\.json\) sent more than the cap of 1000000 bytes"
    ) as e:
        pull("acme/tiny", tmp_path, max_file_bytes=cap)
    assert e.value.code == "hub_file_too_large"
    staged = tmp_path / STAGING_DIR / "acme--tiny" / str(hub.resolve("acme/tiny", "main"))
    assert not (staged / "tokenizer.json").exists() and not (staged / "tokenizer.json.part").exists()
    assert sum(f.stat().st_size for f in staged.iterdir()) < cap  # config.json and the other small files
    assert not hub.requested(WEIGHTS)
