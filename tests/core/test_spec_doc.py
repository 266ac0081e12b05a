"""docs/job_spec.md is generated from JobSpec's declaration (core.spec_doc): the committed file is what
`python -m core.spec_doc` writes, and a declaration that drifts from it fails here. The README's short
table of the main fields is checked against the same declaration."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import Field

from core.spec import JobSpec
from core.spec_doc import render
from core.spec_groups import LORA

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "job_spec.md"
REGENERATE = "docs/job_spec.md is stale: run `python -m core.spec_doc > docs/job_spec.md`"


def _row(doc: str, field: str) -> str:
    (row,) = [line for line in doc.splitlines() if line.startswith(f"| `{field}` |")]
    return row


def _changed_rows(a: str, b: str) -> list[str]:
    return [y for x, y in zip(a.splitlines(), b.splitlines(), strict=True) if x != y]


def test_the_committed_table_is_the_generated_one() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), REGENERATE


def test_every_field_has_one_row_with_its_default_bounds_and_meaning() -> None:
    doc = render()
    for name, field in JobSpec.model_fields.items():
        assert field.description, f"{name} has no description"
        row = _row(doc, name)
        assert field.description in row
        assert ("required" if field.is_required() else "`") in row
    assert "| `lora_r` | integer | `16` | [1, 512] |" in doc
    assert "| `learning_rate` | number | `0.0002` | (0, 0.1] |" in doc
    assert "| `beta` | number | `0.1` (grpo: `0.0`) | [0, 100] |" in doc
    assert (
        '| `lora_target_modules` | list of string or `all-linear` | `"all-linear"` | at most 64 items |'
        in doc
    )


class _DriftedDefault(JobSpec):
    lora_r: Annotated[int, LORA] = Field(
        8, ge=1, le=512, description=JobSpec.model_fields["lora_r"].description
    )


class _DriftedBound(JobSpec):
    lora_r: Annotated[int, LORA] = Field(
        16, ge=1, le=256, description=JobSpec.model_fields["lora_r"].description
    )


def test_a_changed_default_or_bound_is_drift() -> None:
    """What the first test compares: a declaration with another default or bound renders another row for
    that field, and only that one, so the committed file no longer matches."""
    committed = DOC.read_text(encoding="utf-8")
    for drifted, expected in ((_DriftedDefault, "`8` | [1, 512]"), (_DriftedBound, "`16` | [1, 256]")):
        changed = _changed_rows(committed, render(drifted))
        assert len(changed) == 1 and changed[0].startswith("| `lora_r` |") and expected in changed[0]


def _same(text: str, default: object) -> bool:
    """A default as a README cell writes it (`lora`, 2e-4, null, true) against the declared one."""
    text = text.strip().strip("`").strip('"')
    if default is None or isinstance(default, bool):
        return text == {None: "null", True: "true", False: "false"}[default]
    if isinstance(default, int | float):
        return re.fullmatch(r"-?[0-9.e+-]+", text) is not None and float(text) == default
    return text == default


def readme_drift(readme: str) -> list[str]:
    """Rows `| `a`, `b` | 1, 2 | ... |` of the README's `| field | default |` tables whose defaults disagree
    with the declaration."""
    problems, in_table = [], False
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif cells[:2] == ["field", "default"]:
            in_table = True
        elif in_table and (names := re.findall(r"`(\w+)`", cells[0])):
            problems += _row_drift(names, re.split(r"\s*[,/]\s*", cells[1]))
    return problems


def _row_drift(names: list[str], values: list[str]) -> list[str]:
    """A README row's fields against their declared defaults ('?': no such field)."""
    if len(values) != len(names):
        return [f"{', '.join(names)}: {len(values)} defaults for {len(names)} fields"]
    declared = {n: JobSpec.model_fields[n].default if n in JobSpec.model_fields else "?" for n in names}
    return [
        f"{name}: README says {value}, the default is {declared[name]!r}"
        for name, value in zip(names, values, strict=True)
        if not _same(value, declared[name])
    ]


def test_the_readmes_defaults_are_the_declared_ones() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/job_spec.md" in readme
    assert readme_drift(readme) == []
    drifted = "| field | default |\n| `micro_batch_size`, `gradient_accumulation_steps` | 8, 1 |\n"
    drifted += "| `export` | `merged` |\n| `epoch` | 1 |"
    assert readme_drift(drifted) == [
        "micro_batch_size: README says 8, the default is 4",
        "export: README says `merged`, the default is 'adapter'",
        "epoch: README says 1, the default is '?'",
    ]
