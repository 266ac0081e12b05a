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
from typing import Any

from core import keys
from core.judge_config import GRADING_TENANT_HEADER, JudgeConfig
from graders.chat import ChatError, ChatFn, ChatReply, OpenAICompatibleChat

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


def connect(config: JudgeConfig, tenant_id: str) -> BoundedJudge:
    """The judge for `tenant_id`'s grading (close() it when done). The tenant is named only to
    ftune's own /v1, even when empty (where ftune then refuses the request rather than answer as the
    judge key's tenant)."""
    headers = {GRADING_TENANT_HEADER: tenant_id} if keys.parse(config.api_key) else {}
    chat = OpenAICompatibleChat(
        config.base_url,
        config.api_key or None,
        config.timeout_seconds,
        structured_outputs=config.structured_outputs,
        headers=headers,
    )
    return BoundedJudge(chat, config, tenant_slots(tenant_id, config.max_concurrent_per_tenant))
