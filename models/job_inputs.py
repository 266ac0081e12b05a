"""What admission's checks read of a job: its base model from the catalog, and which of its datasets hold
rows of a kind (their upload report's stats)."""

from __future__ import annotations

from core.catalog import BaseModelInfo, Catalog
from core.errors import InvalidInput, NotFound
from core.spec import JobSpec
from models.tables import Dataset


def datasets_with(datasets: list[Dataset], stat: str) -> list[Dataset]:
    """The datasets whose upload report counts rows with `stat` (e.g. "with_tools", "with_images")."""
    return [ds for ds in datasets if ((ds.report or {}).get("stats") or {}).get(stat)]


def base_model(catalog: Catalog, spec: JobSpec) -> BaseModelInfo:
    """The job's base model from the catalog; 422 model_not_found naming base_model."""
    try:
        return catalog.get(spec.base_model)
    except NotFound as e:
        raise InvalidInput(e.message, code="model_not_found", param="base_model") from e
