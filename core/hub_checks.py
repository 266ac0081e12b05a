"""What a pull accepts from a repo on the Hub (or a mirror), checked before anything can run or fill a disk
(core.hub): a commit sha before it names a directory, safetensors weights only (never pickle), a config
of an architecture ftune reads and no custom code, shards the index names among the repo's files, and no
file over the size cap."""

from __future__ import annotations

import re
from typing import Any

from core.arch import from_config
from core.arch.config import BUILDERS
from core.errors import InvalidInput, PayloadTooLarge, Unavailable, Unsupported

COMMIT_SHA_RE = re.compile(r"[0-9a-f]{40}")  # a git commit, as the Hub answers it (fullmatch only)
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def commit_sha(sha: object, repo_id: str, revision: str | None, endpoint: str) -> str:
    """The commit the Hub answered, only when it is one: it names a directory (and the URLs)."""
    if not sha:
        raise Unavailable(f"{endpoint} did not say which commit {repo_id}@{revision} is", code="hub_error")
    if not (isinstance(sha, str) and COMMIT_SHA_RE.fullmatch(sha)):
        raise Unavailable(
            f"{endpoint} answered {str(sha)[:80]!r} as the commit of {repo_id}@{revision or 'main'}, "
            "which is not a commit sha (40 hex digits); nothing was downloaded. Check HF_ENDPOINT: a mirror "
            "should answer what the Hub does.",
            code="hub_bad_commit",
        )
    return sha


def refuse_oversized(repo_id: str, files: list[str], listed: dict[str, int | None], cap: int) -> None:
    for filename in files:
        if (size := listed.get(filename)) is not None and size > cap:
            raise too_large(f"{repo_id}: {filename} is listed at {size} bytes, over the cap", cap)


def too_large(what: str, cap: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what} of {cap} bytes (FTUNE_HUB_MAX_FILE_BYTES); nothing more was downloaded. Raise the setting "
        "if the model really has files this large.",
        code="hub_file_too_large",
    )


def refuse_without_safetensors(repo_id: str, listed: dict[str, int | None]) -> None:
    if WEIGHTS in listed or WEIGHTS_INDEX in listed:
        if CONFIG not in listed:
            raise Unsupported(f"{repo_id} has no {CONFIG}", code="not_a_model", param="repo_id")
        return
    pickles = sorted(f for f in listed if f.endswith(PICKLE_SUFFIXES))
    found = f"it has {', '.join(pickles[:5])}" if pickles else "it has no weights ftune can load"
    raise Unsupported(
        f"{repo_id} has no safetensors weights ({WEIGHTS} or {WEIGHTS_INDEX}); {found}. ftune loads "
        "safetensors only: pickle weights can run code when loaded. Pick a revision or a repo with "
        "safetensors (or convert the weights yourself and copy them in by hand).",
        code="no_safetensors",
        param="repo_id",
    )


def check_config(repo_id: str, config: dict[str, Any]) -> None:
    if "auto_map" in config:
        raise custom_code(repo_id, CONFIG)
    try:
        from_config(config)
    except Unsupported as exc:
        supported = ", ".join(sorted(k for k in BUILDERS if k.islower()))
        model_type = config.get("model_type")
        if model_type in BUILDERS:  # a supported family whose config is not (a MoE with dense layers)
            raise Unsupported(f"{repo_id}: {exc.message}", code=exc.code, param="repo_id") from None
        detail = f"model_type {model_type!r}" if exc.code == "unsupported_architecture" else exc.message
        raise Unsupported(
            f"{repo_id}: {detail} is not supported by ftune; supported model types: {supported}",
            code="unsupported_architecture",
            param="repo_id",
        ) from None
    except InvalidInput as exc:
        raise InvalidInput(f"{repo_id}: {exc.message}", param="repo_id") from None


def custom_code(repo_id: str, filename: str) -> Unsupported:
    return Unsupported(
        f"{repo_id} needs custom code ({filename} has auto_map) and ftune never enables trust_remote_code; "
        "use a checkpoint of an architecture that transformers ships",
        code="remote_code_refused",
        param="repo_id",
    )


def index_shards(repo_id: str, index: dict[str, Any], listed: dict[str, int | None]) -> list[str]:
    weight_map = index.get("weight_map")
    shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
    bad = [s for s in shards if not (isinstance(s, str) and s.endswith(".safetensors") and s in listed)]
    if not shards or bad or any("/" in s for s in shards):
        raise Unsupported(
            f"{repo_id}: {WEIGHTS_INDEX} names shards that are not safetensors files of the repo: {bad[:3]}",
            code="no_safetensors",
            param="repo_id",
        )
    return shards
