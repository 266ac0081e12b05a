"""A succeeded job's adapter is registered with the inference engine (FTUNE_INFERENCE_URL) at once, with
vLLM's load_lora_adapter body; without an engine, or with one down, nothing fails."""

from __future__ import annotations

from pathlib import Path

from core import ft_names
from core.settings import Settings
from core.storage import Storage
from models.tables import Job
from tests.e2e.stack import free_port
from tests.openai.engine_double import EngineDouble, serve
from worker.serving import announce_adapter

JOB = Job(id="a" * 32, tenant_id="t" * 32, base_model="ftune-demo", suffix="faq")


def test_the_adapter_is_loaded_under_its_ft_name(tmp_path: Path) -> None:
    engine = EngineDouble()
    server = serve(engine)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        storage = Storage(tmp_path)
        assert announce_adapter(Settings(inference_url=url), storage, JOB)
    finally:
        server.shutdown()
    name = ft_names.fine_tuned_model("ftune-demo", "t" * 32, "faq", "a" * 32)
    assert engine.loads == [
        {"lora_name": name, "lora_path": str(storage.adapter_dir("a" * 32)), "base_model": "ftune-demo"}
    ]


def test_no_engine_or_an_unreachable_one_is_not_an_error(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    assert not announce_adapter(Settings(inference_url=""), storage, JOB)
    assert not announce_adapter(Settings(inference_url=f"http://127.0.0.1:{free_port()}"), storage, JOB)


def test_the_engines_key_goes_with_the_registration(tmp_path: Path) -> None:
    engine = EngineDouble(key="engine-key")
    server = serve(engine)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        storage = Storage(tmp_path)
        assert not announce_adapter(Settings(inference_url=url), storage, JOB)  # 401 without the key
        assert announce_adapter(Settings(inference_url=url, inference_api_key="engine-key"), storage, JOB)
    finally:
        server.shutdown()
    assert len(engine.loads) == 1
