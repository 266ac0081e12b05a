"""The live job-status dashboard: one static page that polls the JSON API."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["dashboard"])


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    return HTMLResponse(files("api").joinpath("static/dashboard.html").read_text())


@router.get("/", include_in_schema=False, response_class=HTMLResponse)
def root() -> HTMLResponse:
    return dashboard()
