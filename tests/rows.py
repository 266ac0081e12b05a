"""Rows that tests put straight into the database when the upload path is not what they test."""

from __future__ import annotations

from models.tables import Dataset


def valid_dataset(tenant_id: str, dataset_id: str) -> Dataset:
    """A valid one-example instruction dataset row (no file on disk)."""
    return Dataset(
        id=dataset_id,
        tenant_id=tenant_id,
        filename="x.jsonl",
        status="valid",
        format="instruction",
        num_examples=1,
        size_bytes=1,
        sha256="0" * 64,
        report={},
    )
