"""The judge of score_model and label_model graders, under the operator's bounds (the grader_model_*
settings): the models a grader may name (an allow-list), the tokens one call may ask for, a tenant's calls
at once in a process, and the tokens a run may spend.

The judge acts for the grading tenant. Where it is ftune's own /v1 (the judge key is an ftune key, ftk_...)
every request names that tenant in GRADING_TENANT_HEADER, and ftune's /v1 answers it as that tenant
(api.auth.get_chat_principal): that tenant's `ft:` models only, its chat slots, its request rate. The
header counts only with the operator's judge key, so no tenant can claim another's identity with it, and
the judge key's own tenant is never the one asking. Another judge (OpenAI, vLLM) is never sent the header:
there the allow-list decides what the operator pays for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core import keys
from core.graders.chat import ChatError, ChatFn, ChatReply, OpenAICompatibleChat

if TYPE_CHECKING:
    from core.settings import Settings

GRADING_TENANT_HEADER = "X-Ftune-Grading-Tenant"
ALLOWED_MODELS_SETTING = "FTUNE_GRADER_MODEL_ALLOWED_MODELS"


@dataclass(frozen=True)
class JudgeConfig:
    """The judge endpoint and the operator's bounds on it, as admission, /run and a training run see them
    (core.run_protocol.GradingConfig carries it to training). `allowed_models`: names as listed, or a name
    ending in * for every name starting with the rest ("ft:*": the grading tenant's own models, where the
    judge is ftune's own /v1). `max_tokens_per_run` 0: no bound."""

    base_url: str
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 60
    structured_outputs: bool = True
    allowed_models: tuple[str, ...] = ()
    max_completion_tokens: int = 4096
    max_concurrent_per_tenant: int = 2
    max_tokens_per_run: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> JudgeConfig | None:
        """The operator's judge; None where none is configured (model graders are refused)."""
        if not settings.grader_model_base_url:
            return None
        return cls(
            base_url=settings.grader_model_base_url,
            api_key=settings.grader_model_api_key,
            timeout_seconds=settings.grader_model_timeout_seconds,
            structured_outputs=settings.grader_model_structured_outputs,
            allowed_models=tuple(settings.grader_model_allowed_models),
            max_completion_tokens=settings.grader_model_max_completion_tokens,
            max_concurrent_per_tenant=settings.grader_model_max_concurrent_per_tenant,
            max_tokens_per_run=settings.grader_model_max_tokens_per_run,
        )

    def allows(self, model: str) -> bool:
        return any(
            model == name or (name.endswith("*") and model.startswith(name[:-1]))
            for name in self.allowed_models
        )

    def connect(self, tenant_id: str) -> BoundedJudge:
        """The judge for `tenant_id`'s grading (close() it when done). The tenant is named only to
        ftune's own /v1, even when empty (where ftune then refuses the request rather than answer as the
        judge key's tenant)."""
        headers = {GRADING_TENANT_HEADER: tenant_id} if keys.parse(self.api_key) else {}
        chat = OpenAICompatibleChat(
            self.base_url,
            self.api_key or None,
            self.timeout_seconds,
            structured_outputs=self.structured_outputs,
            headers=headers,
        )
        return BoundedJudge(chat, self, tenant_slots(tenant_id, self.max_concurrent_per_tenant))


_slots: dict[tuple[str, int], threading.Semaphore] = {}
_slots_lock = threading.Lock()


def tenant_slots(tenant_id: str, limit: int) -> threading.Semaphore:
    """The tenant's judge calls at once in this process: one semaphore per tenant for the process's life,
    shared by its runs (a training process grades one job; an API process every tenant's graders/run)."""
    with _slots_lock:
        return _slots.setdefault((tenant_id, limit), threading.BoundedSemaphore(limit))


class BoundedJudge:
    """A ChatFn within the operator's bounds: a model off the list is never asked; max_completion_tokens
    is the grader's, at most the operator's (the operator's where the grader sets none); a call waits for
    one of the tenant's slots; once the run's tokens are spent no call is made (checked before each call,
    so calls in flight may pass the budget by their own tokens). Refusals are ChatErrors: the grader
    scores 0 with model_grader_server_error."""

    def __init__(self, chat: ChatFn, config: JudgeConfig, slots: threading.Semaphore) -> None:
        self.chat, self.config, self.slots = chat, config, slots
        self.spent = 0
        self._lock = threading.Lock()

    def __call__(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any]) -> ChatReply:
        config = self.config
        if not config.allows(model):
            raise ChatError("the model is not one of this server's judge models")
        bound = config.max_completion_tokens
        bounded = {
            **params,
            "max_completion_tokens": min(params.get("max_completion_tokens") or bound, bound),
        }
        budget = config.max_tokens_per_run
        with self._lock:
            if budget and self.spent >= budget:
                raise ChatError(f"this run has spent its judge budget of {budget} tokens")
        with self.slots:
            reply = self.chat(model, messages, bounded)
        with self._lock:
            self.spent += reply.prompt_tokens + reply.completion_tokens
        return reply

    def close(self) -> None:
        close = getattr(self.chat, "close", None)
        if close is not None:
            close()
