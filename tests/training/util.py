"""Helpers shared by the training tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """n examples of all four formats and unequal lengths, from the demo corpus's Q/A lines."""
    lines = (Path(__file__).parents[2] / "training" / "demo_corpus.txt").read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for i in range(start, start + n):
        q, a = lines[(2 * i) % 300], lines[(2 * i + 1) % 300]
        kind = i % 4
        if kind == 0:
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        elif kind == 1:
            rows.append({"instruction": q, "output": a})
        elif kind == 2:
            rows.append({"prompt": q + "\n", "completion": a})
        else:
            rows.append({"text": f"{q} {a}"})
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as the worker reads it (core.run_protocol.read_records: resumes applied), as dicts."""
    from core.run_protocol import read_records

    return [r.model_dump() for r in read_records(path)]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||a|| (Frobenius) over the adapter's tensors. (Elementwise, a few LoRA B
    values differ more: after a few steps B is small, and Adam turns a gradient of rounding-noise size
    into an update of about lr whose sign that noise decides. `elementwise` shows it.)"""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)


def elementwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest max |a - b| / max |a| over the adapter's tensors."""
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


def pair_rows(n: int, start: int = 0, fmt: str = "preference") -> list[dict[str, Any]]:
    """n preference pairs from the demo corpus's Q/A lines, of unequal lengths: the chosen reply is the
    corpus's answer, the rejected one another line. fmt: "preference" (OpenAI's), "messages" (TRL's,
    message lists, explicit prompt), "implicit" (TRL's, whole conversations) or "text" (TRL's, strings)."""
    lines = (Path(__file__).parents[2] / "training" / "demo_corpus.txt").read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for i in range(start, start + n):
        q, a, b = lines[(2 * i) % 300], lines[(2 * i + 1) % 300], lines[(2 * i + 9) % 300]
        user = [{"role": "user", "content": q}]
        good, bad = [{"role": "assistant", "content": a}], [{"role": "assistant", "content": b}]
        if fmt == "preference":
            rows.append({"input": {"messages": user}, "preferred_output": good, "non_preferred_output": bad})
        elif fmt == "messages":
            rows.append({"prompt": user, "chosen": good, "rejected": bad})
        elif fmt == "implicit":
            rows.append({"chosen": user + good, "rejected": user + bad})
        else:
            rows.append({"prompt": q + "\n", "chosen": a, "rejected": b})
    return rows
