"""Job admission for data with images: only a vision-language base trains on them (core.data.images checks
the images at upload, where the base is not known yet)."""

from __future__ import annotations

from core.catalog import Catalog
from core.errors import InvalidInput
from core.spec import JobSpec
from models.job_inputs import base_model, datasets_with
from models.tables import Dataset


def check_image_base(*, catalog: Catalog, spec: JobSpec, datasets: list[Dataset]) -> None:
    """Data whose rows hold images train only on a base that reads them, with objective sft: a text-only
    base would learn answers to questions about pictures it never saw."""
    pictured = datasets_with(datasets, "with_images")
    if not pictured:
        return
    model = base_model(catalog, spec)
    ds = pictured[0]
    count = ds.report["stats"]["with_images"]
    if "image" not in model.modality:
        raise InvalidInput(
            f"base model {spec.base_model!r} reads text only, and {count} examples of dataset {ds.id!r} hold "
            "images; choose a vision-language base (Qwen2.5-VL) or a dataset without image parts",
            code="base_reads_no_images",
            param="base_model",
            details={"base_model": spec.base_model, "dataset_id": ds.id, "examples_with_images": count},
        )
    if spec.objective != "sft":
        raise InvalidInput(
            f"dataset {ds.id!r} holds images, which train with objective 'sft' only for now",
            code="images_need_sft",
            param="objective",
        )
