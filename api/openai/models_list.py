"""GET /v1/models and /v1/models/{model}: what the caller can name in chat completions; DELETE
/v1/models/{model}: a fine-tuned model of the caller's.

OpenAI's model object `{id, object: "model", created, owned_by}` for every base model in the local catalog
(owned by "ftune") and the caller's tenant's fine-tuned models (owned by the organization, as the job
object's organization_id says), each followed by the checkpoints its job still keeps on disk
(`...:ckpt-step-<n>`, the checkpoints list's fine_tuned_model_checkpoint). One list, not paged (OpenAI
does not page it), and only the caller's.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from api.auth import PrincipalDep
from api.deps import Services, ServicesDep
from api.openai.chat import model_not_found
from api.openai.errors import AUTHED, OpenAIRoute, documented
from core import ft_names
from core.catalog import BaseModelInfo
from core.errors import Forbidden, FtuneError
from models import served

router = APIRouter(prefix="/models", tags=["openai: models"], route_class=OpenAIRoute)
BASE_OWNER = "ftune"


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def _base(info: BaseModelInfo) -> ModelObject:
    try:  # a local directory has no publication date; when it was put here is the closest
        created = int((info.path / "config.json").stat().st_mtime)
    except OSError:
        created = 0
    return ModelObject(id=info.name, created=created, owned_by=BASE_OWNER)


def _is_base(services: Services, name: str) -> bool:
    try:
        services.catalog.get(name)
    except FtuneError:
        return False
    return True


def _tuned(model: served.FineTunedModel) -> ModelObject:
    return ModelObject(id=model.name, created=int(model.created.timestamp()), owned_by=model.tenant_id)


@router.get("", response_model=ModelList, responses=documented(*AUTHED))
def list_models(services: ServicesDep, principal: PrincipalDep) -> ModelList:
    """`client.models.list()`: the base models, then the caller's fine-tuned models (newest first), each
    with its kept checkpoints (newest first)."""
    with services.sessions() as s:
        tuned = served.of_tenant(s, principal.tenant_id, services.storage)
    return ModelList(data=[_base(m) for m in services.catalog.list()] + [_tuned(m) for m in tuned])


@router.get("/{model:path}", response_model=ModelObject, responses=documented(*AUTHED, 404))
def retrieve_model(model: str, services: ServicesDep, principal: PrincipalDep) -> ModelObject:
    """`client.models.retrieve(model)`; another organization's fine-tuned model, or a pruned checkpoint's,
    is 404, like a missing one."""
    if ft_names.is_fine_tuned(model):
        with services.sessions() as s:
            found = served.find(s, model, principal.tenant_id, services.storage)
        if found is None:
            raise model_not_found(model)
        return _tuned(found)
    try:
        return _base(services.catalog.get(model))
    except FtuneError:
        raise model_not_found(model) from None


@router.delete("/{model:path}", response_model=ModelDeleted, responses=documented(*AUTHED, 403, 404))
def delete_model(model: str, services: ServicesDep, principal: PrincipalDep) -> ModelDeleted:
    """`client.models.delete(model)`: a fine-tuned model of the caller's organization. The final model: its
    job's files go, as DELETE /jobs/{id} removes them (the job stays, marked deleted, with its name), and
    with them every checkpoint's model. A checkpoint's model: that checkpoint's files alone, as
    keep_checkpoints prunes one. Another organization's, or a missing one: 404; a base model is the
    operator's: 403."""
    with services.sessions() as s:
        found = served.find(s, model, principal.tenant_id, services.storage)
    if found is None:
        if not ft_names.is_fine_tuned(model) and _is_base(services, model):
            raise Forbidden(f"`{model}` is a base model: the operator's, not deletable through the API")
        raise model_not_found(model)
    if found.step is not None and found.checkpoint is not None:  # a checkpoint's model
        services.storage.delete_checkpoint_files(found.job_id, found.step, found.checkpoint)
    else:
        services.delete_finished_job(found.job_id)
    return ModelDeleted(id=model, deleted=True)
