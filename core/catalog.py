"""Base models found on local disk. Never downloads: a name that is not here is refused.

A model is a Hugging Face format directory (config.json + weights + tokenizer) either
under models_dir/<name> (or models_dir/<org>/<name>) or in the local HF hub cache
(models--<org>--<name>/snapshots/<revision>/). `ftune models pull` (core.hub) is the one way to fetch
one, and only into models_dir/<org>/<name>, complete, with PULL_RECORD naming the commit it came from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from core.arch import describe
from core.errors import NotFound
from core.spec import MODEL_NAME_RE

PULL_RECORD = "ftune-hub.json"  # written by core.hub beside a pulled model: repo, commit, files


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    path: Path
    source: str  # "models_dir" | "hf_cache"
    architecture: str
    model_type: str
    revision: str | None = None  # the Hub commit: from PULL_RECORD, or the HF cache's snapshot name
    # from config.json (core.arch.describe): the family, what it reads, and its size; None: not readable
    family: str = ""
    modality: str = "text"
    total_params: int | None = None
    active_params: int | None = None  # a mixture-of-experts base's parameters per token


def default_hf_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return hf_home / "hub"


def read_pull_record(model_dir: Path) -> dict | None:
    """What core.hub recorded when it pulled this model (None for one copied in by hand)."""
    try:
        record = json.loads((model_dir / PULL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _info(name: str, path: Path, source: str) -> BaseModelInfo | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    archs = config.get("architectures") or ["unknown"]
    if source == "hf_cache":
        revision: str | None = path.name
    else:
        revision = str(record["commit_sha"]) if (record := read_pull_record(path)) else None
    facts = describe(config)
    return BaseModelInfo(
        name, path, source, str(archs[0]), str(config.get("model_type", "unknown")), revision,
        family=facts.family, modality=facts.modality, total_params=facts.total_params,
        active_params=facts.active_params,
    )  # fmt: skip


def _hf_snapshot(cache: Path, name: str) -> Path | None:
    repo = cache / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return snaps[-1] if snaps else None


class Catalog:
    def __init__(self, models_dir: Path, hf_cache: Path | None = None) -> None:
        self.models_dir = models_dir
        self.hf_cache = hf_cache if hf_cache is not None else default_hf_cache()

    def list(self) -> list[BaseModelInfo]:
        found: dict[str, BaseModelInfo] = {}
        if self.models_dir.is_dir():
            for config in sorted(self.models_dir.glob("*/config.json")) + sorted(
                self.models_dir.glob("*/*/config.json")
            ):
                name = config.parent.relative_to(self.models_dir).as_posix()
                if MODEL_NAME_RE.match(name) and (info := _info(name, config.parent, "models_dir")):
                    found.setdefault(name, info)
        if self.hf_cache.is_dir():
            for repo in sorted(self.hf_cache.glob("models--*")):
                name = repo.name.removeprefix("models--").replace("--", "/")
                snap = _hf_snapshot(self.hf_cache, name)
                if snap and MODEL_NAME_RE.match(name) and (info := _info(name, snap, "hf_cache")):
                    found.setdefault(name, info)
        return sorted(found.values(), key=lambda m: m.name)

    def get(self, name: str) -> BaseModelInfo:
        if MODEL_NAME_RE.match(name) and ".." not in name:
            info = _info(name, self.models_dir / name, "models_dir")
            if info is None and (snap := _hf_snapshot(self.hf_cache, name)):
                info = _info(name, snap, "hf_cache")
            if info is not None:
                return info
        raise NotFound(
            f"base model {name!r} is not available locally; ftune never downloads models for a job (an "
            "operator can: `ftune models pull <org/name>`). See GET /models for the models on this server.",
            code="model_not_found",
            param="base_model",
        )
