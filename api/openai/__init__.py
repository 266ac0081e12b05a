"""The OpenAI-shaped surface under /v1: translation only, onto the same rows and services as the native API.

`router` holds every /v1 route; errors under it are in OpenAI's shape (api/openai/errors.py), including
an unknown /v1 URL, which is a 404 as on OpenAI.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.openai import chat, files, graders, jobs, models_list
from api.openai.errors import OpenAIRoute
from core.errors import NotFound

router = APIRouter(prefix="/v1", route_class=OpenAIRoute)
router.include_router(files.router)
router.include_router(jobs.router)
router.include_router(graders.router)
router.include_router(chat.router)
router.include_router(models_list.router)


# Last: only what no /v1 route matched, whatever the method.
@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
def unknown_url(request: Request, path: str) -> None:
    raise NotFound(f"Invalid URL ({request.method} /v1/{path})", code="unknown_url")
