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
huggingface_hub is imported here lazily, so that core stays fast to import.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from core.arch import from_config
from core.arch.config import BUILDERS
from core.catalog import PULL_RECORD, read_pull_record
from core.errors import (
    Conflict,
    Forbidden,
    FtuneError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    Unavailable,
    Unsupported,
)
from core.spec import MODEL_NAME_RE
from core.storage import atomic_dir, atomic_write_text

DEFAULT_ENDPOINT = "https://huggingface.co"
STAGING_DIR = ".pulls"  # under models_dir; a leading dot is never a model name (MODEL_NAME_RE)
COMMIT_SHA_RE = re.compile(r"[0-9a-f]{40}")  # a git commit, as the Hub answers it (fullmatch only)
DEFAULT_MAX_FILE_BYTES = 20 * 2**30  # core.settings.Settings.hub_max_file_bytes

# Every file a base model needs and nothing that can run code: weights in safetensors only, tokenizers as
# JSON/text or sentencepiece (protobuf). Top level only: subfolders hold other formats (original/, onnx/).
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
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
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

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
            f"the model by hand: {_by_hand(target)}",
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
            raise _as_ftune_error(exc, repo_id, revision, endpoint, target) from exc


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
    sha = _commit_sha(info.sha, repo_id, revision, endpoint)
    listed = {s.rfilename: s.size for s in info.siblings or []}
    progress.commit_sha = sha
    say(f"revision {revision or 'main'} is commit {sha}")
    _refuse_without_safetensors(repo_id, listed)

    if present := _present(repo_id, target, sha, force, listed):
        say(f"{repo_id} at {sha} is already in {target}")
        progress.stage = "done"
        return present

    staging = models_dir / STAGING_DIR / repo_id.replace("/", "--") / sha
    progress.stage, progress.staging = "checking", staging

    def fetch(filename: str) -> Path:
        return _download(repo_id, filename, sha, limits, staging / filename, listed.get(filename))

    texts = [f for f in sorted(listed) if f in TOKENIZER_FILES or f in OTHER_FILES]
    _refuse_oversized(repo_id, [CONFIG, WEIGHTS_INDEX, *texts], listed, limits.max_file_bytes)
    # The architecture first, from config.json alone: nothing else is fetched for a model ftune cannot train.
    config = _read_json(fetch(CONFIG))
    _check_config(repo_id, config)
    say(f"{CONFIG}: {config['model_type']} ({', '.join(config.get('architectures') or [])}), supported")

    shards = [WEIGHTS]
    if WEIGHTS_INDEX in listed:
        shards = _shards(repo_id, _read_json(fetch(WEIGHTS_INDEX)), listed)
    _refuse_oversized(repo_id, shards, listed, limits.max_file_bytes)
    total = sum(listed.get(f) or 0 for f in texts + shards)
    say(f"downloading {len(texts + shards)} files, {_size(total)} (safetensors weights only) to {staging}")
    progress.files_total, progress.bytes_total, progress.stage = len(texts + shards), total, "downloading"
    done = 0
    for i, filename in enumerate(texts + shards, 1):
        if filename == shards[0]:  # the tokenizer is in: no custom code there either, before the weights
            tokenizer_config = staging / "tokenizer_config.json"
            if tokenizer_config.is_file() and "auto_map" in _read_json(tokenizer_config):
                raise _custom_code(repo_id, "tokenizer_config.json")
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


def _commit_sha(sha: object, repo_id: str, revision: str | None, endpoint: str) -> str:
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


def _refuse_oversized(repo_id: str, files: list[str], listed: dict[str, int | None], cap: int) -> None:
    for filename in files:
        if (size := listed.get(filename)) is not None and size > cap:
            raise _too_large(f"{repo_id}: {filename} is listed at {size} bytes, over the cap", cap)


def _too_large(what: str, cap: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{what} of {cap} bytes (FTUNE_HUB_MAX_FILE_BYTES); nothing more was downloaded. Raise the setting "
        "if the model really has files this large.",
        code="hub_file_too_large",
    )


class _Capped:
    """The `.part` file as http_get writes it, refusing to grow past `cap` bytes."""

    def __init__(self, f: BinaryIO, cap: int, what: str) -> None:
        self.f, self.cap, self.what = f, cap, what

    def write(self, chunk: bytes) -> int:
        if self.f.tell() + len(chunk) > self.cap:
            raise _too_large(f"{self.what} sent more than the cap", self.cap)
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


def _refuse_without_safetensors(repo_id: str, listed: dict[str, int | None]) -> None:
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


def _check_config(repo_id: str, config: dict[str, Any]) -> None:
    if "auto_map" in config:
        raise _custom_code(repo_id, CONFIG)
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


def _custom_code(repo_id: str, filename: str) -> Unsupported:
    return Unsupported(
        f"{repo_id} needs custom code ({filename} has auto_map) and ftune never enables trust_remote_code; "
        "use a checkpoint of an architecture that transformers ships",
        code="remote_code_refused",
        param="repo_id",
    )


def _shards(repo_id: str, index: dict[str, Any], listed: dict[str, int | None]) -> list[str]:
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


def _as_ftune_error(
    exc: Exception, repo_id: str, revision: str | None, endpoint: str, target: Path
) -> FtuneError:
    """huggingface_hub's and httpx's exceptions, as errors that say what to do."""
    from huggingface_hub import errors as hub

    if isinstance(exc, hub.GatedRepoError):
        return Forbidden(
            f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN to a token of that account",
            code="hub_gated",
        )
    if isinstance(exc, hub.RevisionNotFoundError):
        return NotFound(f"{repo_id} has no revision {revision!r} on {endpoint}", code="revision_not_found")
    if isinstance(exc, hub.RepositoryNotFoundError):
        return NotFound(
            f"{repo_id} is not a model repo on {endpoint} (a private repo needs HF_TOKEN)",
            code="model_not_found",
        )
    if isinstance(exc, hub.OfflineModeIsEnabled):
        return Unavailable(
            f"HF_HUB_OFFLINE is set; copy the model by hand: {_by_hand(target)}", code="hub_offline"
        )
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return Forbidden(
            f"{endpoint} refused access to {repo_id} ({status}): check HF_TOKEN", code="hub_auth"
        )
    resume = "Files already downloaded are kept: run the same command again to continue."
    fault = _network_fault(exc)
    if fault == "connect":
        return Unavailable(
            f"cannot reach the Hugging Face Hub at {endpoint} ({_reason(exc)}). Set HF_ENDPOINT to a Hub "
            "mirror this machine can reach; or, without network, set HF_HUB_OFFLINE=1 and copy the model "
            f"by hand: {_by_hand(target)}. {resume}",
            code="hub_unreachable",
        )
    if fault == "dropped":
        return Unavailable(
            f"the connection to {endpoint} broke off while pulling {repo_id} ({_reason(exc)}). {resume}",
            code="hub_interrupted",
        )
    return Unavailable(
        f"pulling {repo_id} from {endpoint} failed: {_reason(exc)}. {resume}", code="hub_error"
    )


def _network_fault(exc: BaseException) -> str | None:
    """Which network fault is in the chain of causes: "connect" (refused, a name that does not resolve, a
    connect timeout) or "dropped" (broke off or stalled mid-transfer); None for an answer from the server."""
    from huggingface_hub import errors as hub

    connect: list[type[BaseException]] = [hub.LocalEntryNotFoundError, ConnectionError]
    dropped: list[type[BaseException]] = [TimeoutError]
    for name in ("httpx2", "httpx"):  # huggingface_hub 2 uses httpx2, 1.x httpx
        with suppress(ImportError, AttributeError):
            module = __import__(name)
            connect += [module.ConnectError, module.ConnectTimeout, module.ProxyError]
            dropped.append(module.TransportError)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, tuple(connect)):
            return "connect"
        if isinstance(seen, tuple(dropped)):
            return "dropped"
        seen = seen.__cause__  # not __context__: an HTTP 503 raised while retrying a drop is no network fault
    return None


def _reason(exc: BaseException) -> str:
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    return f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}".rstrip(": ")


def _by_hand(target: Path) -> str:
    return (
        f"put config.json, the tokenizer files and the *.safetensors weights in {target}/ "
        "(`ftune models list` shows it)"
    )


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")
