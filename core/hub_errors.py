"""huggingface_hub's and httpx's exceptions during a pull, as ftune errors that say what to do (core.hub)."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path

from core.errors import Forbidden, FtuneError, NotFound, Unavailable


def as_ftune_error(
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
            f"HF_HUB_OFFLINE is set; copy the model by hand: {by_hand(target)}", code="hub_offline"
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
            f"by hand: {by_hand(target)}. {resume}",
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


def by_hand(target: Path) -> str:
    return (
        f"put config.json, the tokenizer files and the *.safetensors weights in {target}/ "
        "(`ftune models list` shows it)"
    )
