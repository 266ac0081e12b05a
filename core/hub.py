"""Pull a base model from the Hugging Face Hub into the models directory (`ftune models pull`).

The one place ftune downloads a model, and only when an operator asks: jobs and the API never do. What
comes down is checked before it can run anything or fill a disk: the architecture is read from config.json
before any weights are fetched, custom code (`auto_map`) is refused (ftune never enables trust_remote_code),
and only safetensors weights and known text files are requested, never pickle (*.bin, *.pt, *.ckpt).

Files land in a staging directory, `models_dir/.pulls/<org>--<name>/<commit>/`, which the catalog never
lists: each is written to `<file>.part` and renamed when complete. A rerun after an interruption (a broken
connection, a killed process) skips every complete file and continues a `.part` from its last byte (an
HTTP Range request; huggingface_hub's http_get, which also retries a dropped connection within a run), and
the model is moved to `models_dir/<org>/<name>/` in one atomic swap only when all of it is in. The commit
the revision resolved to is recorded beside it (catalog.PULL_RECORD).

A mirror is not trusted with paths or disk: the commit it answers must be a 40-hex sha before it names a
directory, and no file may be larger than `max_file_bytes` (FTUNE_HUB_MAX_FILE_BYTES): one listed larger is
refused before it is fetched, and a body that streams past it is cut off and deleted.

HF_ENDPOINT (a mirror), HF_TOKEN (private or gated repos) and HF_HUB_OFFLINE are read when a pull starts.
huggingface_hub is imported here lazily, so that core stays fast to import. What a repo may hold is checked
in core.hub_checks; the Hub's and the network's errors are translated in core.hub_errors.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from core.catalog import PULL_RECORD, read_pull_record
from core.errors import (
    Conflict,
    FtuneError,
    InvalidInput,
    PayloadTooLarge,
    Unavailable,
)
from core.hub_checks import (
    CONFIG,
    WEIGHTS,
    WEIGHTS_INDEX,
    check_config,
    commit_sha,
    custom_code,
    index_shards,
    refuse_oversized,
    refuse_without_safetensors,
    too_large,
)
from core.hub_errors import as_ftune_error, by_hand
from core.spec import MODEL_NAME_RE
from core.storage import atomic_dir, atomic_write_text

DEFAULT_ENDPOINT = "https://huggingface.co"
STAGING_DIR = ".pulls"  # under models_dir; a leading dot is never a model name (MODEL_NAME_RE)
DEFAULT_MAX_FILE_BYTES = 20 * 2**30  # core.settings.Settings.hub_max_file_bytes

# Every file a base model needs and nothing that can run code: weights in safetensors only (hub_checks),
# tokenizers as JSON/text or sentencepiece (protobuf). Top level only: subfolders hold other formats.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
OTHER_FILES = frozenset({"generation_config.json", "LICENSE", "LICENSE.txt", "LICENSE.md", "README.md"})

Progress = Callable[[str], None]


@dataclass
class PullProgress:
    """Where a pull stands, updated in place by the pulling thread and read by others (the API's progress
    route): plain attribute writes, so a reader sees each field whole, never a torn value."""

    stage: str = "resolving"  # resolving -> checking -> downloading -> registering -> done
    commit_sha: str | None = None
    file: str | None = None  # the file being fetched now
    files_done: int = 0
    files_total: int = 0
    bytes_total: int = 0  # of the files to fetch, as the Hub listed them (known from "downloading" on)
    bytes_before: int = 0  # of the files already complete
    file_bytes: int = 0  # the current file's size
    staging: Path | None = None

    @property
    def bytes_done(self) -> int:
        """Complete files, plus what of the current one is on disk (its `.part`)."""
        partial = 0
        if self.file is not None and self.staging is not None:
            with suppress(OSError):
                partial = _part(self.staging / self.file).stat().st_size
        return self.bytes_before + min(partial, self.file_bytes)


@dataclass(frozen=True)
class PulledModel:
    name: str
    path: Path
    commit_sha: str
    files: dict[str, int | None]  # file name -> size in bytes (as the Hub listed it)
    already_present: bool = False


@dataclass(frozen=True)
class _Limits:
    endpoint: str
    max_file_bytes: int


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def pull(
    repo_id: str,
    models_dir: Path,
    *,
    revision: str | None = None,
    force: bool = False,
    say: Progress | None = None,
    progress: PullProgress | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> PulledModel:
    """Download `repo_id` at `revision` (default: main) into models_dir/<repo_id> and return it.

    Raises FtuneError subclasses only, each with a message for people: unsupported architectures, custom
    code, no safetensors, an unreachable Hub (with the settings to change), a repo or revision not found,
    a commit that is not a sha, a file over `max_file_bytes`.
    `say` gets a line per step and per file; huggingface_hub draws its byte progress bars on a terminal;
    `progress`, when given, is kept up to date (stage, file, bytes) for a caller that polls it."""
    say = say or (lambda _msg: None)
    progress = progress or PullProgress()
    if not MODEL_NAME_RE.match(repo_id) or ".." in repo_id:
        raise InvalidInput(f"not a Hub model id: {repo_id!r} (expected org/name)", param="repo_id")
    endpoint = hub_endpoint()
    target = models_dir / repo_id
    if _truthy(os.environ.get("HF_HUB_OFFLINE")):
        raise Unavailable(
            f"HF_HUB_OFFLINE is set, so nothing can be pulled. Unset it to pull from {endpoint}, or copy "
            f"the model by hand: {by_hand(target)}",
            code="hub_offline",
        )
    staging_root = models_dir / STAGING_DIR
    staging_root.mkdir(parents=True, exist_ok=True)
    with _lock(staging_root / (repo_id.replace("/", "--") + ".lock"), repo_id):
        try:
            limits = _Limits(endpoint, max_file_bytes)
            return _pull(repo_id, models_dir, target, revision, force, limits, say, progress)
        except FtuneError:
            raise
        except Exception as exc:
            raise as_ftune_error(exc, repo_id, revision, endpoint, target) from exc


def _pull(
    repo_id: str,
    models_dir: Path,
    target: Path,
    revision: str | None,
    force: bool,
    limits: _Limits,
    say: Progress,
    progress: PullProgress,
) -> PulledModel:
    from huggingface_hub import HfApi

    endpoint = limits.endpoint
    say(f"resolving {repo_id}@{revision or 'main'} on {endpoint}")
    info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True, timeout=30)
    sha = commit_sha(info.sha, repo_id, revision, endpoint)
    listed = {s.rfilename: s.size for s in info.siblings or []}
    progress.commit_sha = sha
    say(f"revision {revision or 'main'} is commit {sha}")
    refuse_without_safetensors(repo_id, listed)

    if present := _present(repo_id, target, sha, force, listed):
        say(f"{repo_id} at {sha} is already in {target}")
        progress.stage = "done"
        return present

    staging = models_dir / STAGING_DIR / repo_id.replace("/", "--") / sha
    progress.stage, progress.staging = "checking", staging

    def fetch(filename: str) -> Path:
        return _download(repo_id, filename, sha, limits, staging / filename, listed.get(filename))

    texts = [f for f in sorted(listed) if f in TOKENIZER_FILES or f in OTHER_FILES]
    refuse_oversized(repo_id, [CONFIG, WEIGHTS_INDEX, *texts], listed, limits.max_file_bytes)
    # The architecture first, from config.json alone: nothing else is fetched for a model ftune cannot train.
    config = _read_json(fetch(CONFIG))
    check_config(repo_id, config)
    say(f"{CONFIG}: {config['model_type']} ({', '.join(config.get('architectures') or [])}), supported")

    shards = [WEIGHTS]
    if WEIGHTS_INDEX in listed:
        shards = index_shards(repo_id, _read_json(fetch(WEIGHTS_INDEX)), listed)
    refuse_oversized(repo_id, shards, listed, limits.max_file_bytes)
    total = sum(listed.get(f) or 0 for f in texts + shards)
    say(f"downloading {len(texts + shards)} files, {_size(total)} (safetensors weights only) to {staging}")
    progress.files_total, progress.bytes_total, progress.stage = len(texts + shards), total, "downloading"
    done = 0
    for i, filename in enumerate(texts + shards, 1):
        if filename == shards[0]:  # the tokenizer is in: no custom code there either, before the weights
            tokenizer_config = staging / "tokenizer_config.json"
            if tokenizer_config.is_file() and "auto_map" in _read_json(tokenizer_config):
                raise custom_code(repo_id, "tokenizer_config.json")
        progress.file_bytes, progress.file = listed.get(filename) or 0, filename
        fetch(filename)
        done += listed.get(filename) or 0
        progress.bytes_before, progress.files_done, progress.file = done, i, None
        share = f"{100 * done / total:.0f}%" if total else "?"
        size = _size(listed.get(filename) or 0)
        say(f"  [{i}/{len(texts + shards)}] {filename}  {size}  ({share} of {_size(total)})")

    files = [CONFIG, *([WEIGHTS_INDEX] if WEIGHTS_INDEX in listed else []), *texts, *shards]
    progress.stage = "registering"
    pulled = {
        "repo_id": repo_id,
        "revision": revision or "main",
        "commit_sha": sha,
        "endpoint": endpoint,
        "files": {f: listed.get(f) for f in files},
        "pulled_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    _register(staging, target, files, pulled)
    progress.stage = "done"
    say(f"registered {repo_id} at {target} (commit {sha})")
    return PulledModel(repo_id, target, sha, {f: listed.get(f) for f in files})


def _present(
    repo_id: str, target: Path, sha: str, force: bool, listed: dict[str, int | None]
) -> PulledModel | None:
    """The model at `target` when it is this commit already (None: pull it). Another model there is
    replaced only when forced (Conflict otherwise)."""
    if not (target / CONFIG).is_file():
        return None
    record = read_pull_record(target)
    if record and record.get("commit_sha") == sha:
        kept = {f: listed.get(f) for f in record.get("files", {})}
        return PulledModel(repo_id, target, sha, kept, already_present=True)
    if not force:
        held = f"commit {record.get('commit_sha')}" if record else "a model not pulled by ftune"
        raise Conflict(
            f"{target} already holds {held}; pass --force to replace it with {sha}", code="model_exists"
        )
    return None


def _register(staging: Path, target: Path, files: list[str], record: dict[str, Any]) -> None:
    """The staged files become the model at `target` in one atomic swap, with the pull's record."""
    with atomic_dir(target) as tmp:
        for filename in files:
            os.replace(staging / filename, tmp / filename)
        atomic_write_text(tmp / PULL_RECORD, json.dumps(record, indent=2) + "\n")
    shutil.rmtree(staging, ignore_errors=True)
    with suppress(OSError):
        staging.parent.rmdir()  # when no other revision of the repo is half-pulled there


class _Capped:
    """The `.part` file as http_get writes it, refusing to grow past `cap` bytes."""

    def __init__(self, f: BinaryIO, cap: int, what: str) -> None:
        self.f, self.cap, self.what = f, cap, what

    def write(self, chunk: bytes) -> int:
        if self.f.tell() + len(chunk) > self.cap:
            raise too_large(f"{self.what} sent more than the cap", self.cap)
        return self.f.write(chunk)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        return self.f.truncate(size)


def _download(repo_id: str, filename: str, sha: str, limits: _Limits, dest: Path, size: int | None) -> Path:
    """The file at this commit into `dest`, through `<dest>.part`: continued from its last byte when a
    pull before this one was cut off (HF_TOKEN sent to the Hub only: httpx drops it on a cross-host
    redirect to the CDN). A body past the size cap is cut off and its `.part` deleted."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    if dest.is_file():  # renamed into place only when complete
        return dest
    part = _part(dest)
    part.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(repo_id, filename, revision=sha, endpoint=limits.endpoint)
    with part.open("ab") as f:
        done = f.tell()
        if size is not None and done > size:  # not this file's bytes: start again
            f.truncate(0)
            done = 0
        capped: Any = _Capped(f, limits.max_file_bytes, f"{limits.endpoint} ({repo_id}: {filename})")
        try:
            http_get(url, capped, resume_size=done, headers=build_hf_headers(), expected_size=size)
        except PayloadTooLarge:
            part.unlink()
            raise
    os.replace(part, dest)
    return dest


def _part(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read {path.name}: {exc}", param="repo_id") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path.name} is not a JSON object", param="repo_id")
    return data


@contextmanager
def _lock(path: Path, repo_id: str) -> Iterator[None]:
    """One pull of a repo at a time: two would write the same staging files."""
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(f"{repo_id} is being pulled already", code="pull_in_progress") from None
        yield


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")
