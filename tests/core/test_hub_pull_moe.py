"""`ftune models pull` of mixture-of-experts bases, against the local stand-in for the Hub
(tests/core/hub_double.py): a tiny Qwen3-MoE and a tiny Mixtral built here (training.demo_moe) are
checked from config.json first, pulled, listed with their family, total and active parameters and
modality, and load as transformers' own classes; a config the planner cannot read (a Qwen3-MoE with
dense layers) is refused before any weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.arch import load_architecture
from core.catalog import Catalog
from core.errors import Unsupported
from core.hub import pull
from tests.core.hub_double import HubDouble, serve


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    from training.demo_moe import build_moe_model

    root = tmp_path_factory.mktemp("built")
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        built = build_moe_model(root, name=family, family=family)
        out[family] = {f.name: f.read_bytes() for f in built.iterdir() if f.is_file()}
    return out


@pytest.fixture
def hub(moe_files: dict[str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> Iterator[HubDouble]:
    double = HubDouble()
    double.add("acme/tiny-qwen3-moe", moe_files["qwen3_moe"])
    double.add("acme/tiny-mixtral", moe_files["mixtral"])
    dense = {**json.loads(moe_files["qwen3_moe"]["config.json"]), "mlp_only_layers": [0]}
    double.add("acme/dense-moe", {**moe_files["qwen3_moe"], "config.json": json.dumps(dense).encode()})
    with serve(double):
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield double


@pytest.mark.parametrize(
    ("repo", "family", "cls"),
    [("acme/tiny-qwen3-moe", "Qwen3-MoE", "Qwen3MoeForCausalLM"), ("acme/tiny-mixtral", "Mixtral",
                                                                     "MixtralForCausalLM")],
)  # fmt: skip
def test_a_moe_base_is_pulled_listed_with_its_sizes_and_loads(
    hub: HubDouble, tmp_path: Path, repo: str, family: str, cls: str
) -> None:
    pull(repo, tmp_path)
    [model] = Catalog(tmp_path, hf_cache=tmp_path / "hf").list()
    arch = load_architecture(model.path)
    assert (model.name, model.family, model.modality) == (repo, family, "text")
    assert model.total_params == arch.total_params and model.active_params == arch.active_params
    assert model.active_params is not None and model.total_params is not None
    assert model.active_params < model.total_params  # 2 of 8 experts per token

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, trust_remote_code=False)
    assert type(loaded).__name__ == cls
    assert sum(p.numel() for p in loaded.parameters()) == model.total_params


def test_a_moe_config_the_planner_cannot_read_is_refused_before_any_weights(
    hub: HubDouble, tmp_path: Path
) -> None:
    with pytest.raises(Unsupported, match="dense layers"):
        pull("acme/dense-moe", tmp_path)
    fetched = [path.rsplit("/", 1)[-1] for _, path in hub.requested(r"/resolve/")]
    assert fetched == ["config.json"]
    assert Catalog(tmp_path, hf_cache=tmp_path / "hf").list() == []
