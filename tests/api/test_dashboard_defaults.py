"""The dashboard's new-job form (api/static/dashboard.html) against JobSpec's declaration: every input is a
JobSpec field (or marked plan-only), shows the field's default (none where the default is null: the API's
then applies), its bounds as min/max, and only values the field accepts. A form that drifts fails here,
naming the field."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from core.spec import JobSpec

PAGE = Path(__file__).resolve().parents[2] / "api" / "static" / "dashboard.html"
SCHEMA = JobSpec.model_json_schema()["properties"]
JSON_TYPE = {"int": "integer", "float": "number", "bool": "boolean"}


class _Form(HTMLParser):
    """#new-form's named inputs and selects: name -> attributes; a select's options as [value, selected]."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self._select = False, ""
        self.fields: dict[str, dict[str, Any]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form":
            self.inside = a.get("id") == "new-form"
        elif self.inside and tag in ("input", "select") and a.get("name"):
            self.fields[str(a["name"])] = {**a, "options": []}
            self._select = str(a["name"]) if tag == "select" else ""
        elif self.inside and tag == "option" and self._select:
            self.fields[self._select]["options"].append([a.get("value"), "selected" in a])

    def handle_data(self, data: str) -> None:
        options = self.fields[self._select]["options"] if self._select else []
        if options and options[-1][0] is None:  # <option>lora</option>: the value is its text
            options[-1][0] = data.strip()

    def handle_endtag(self, tag: str) -> None:
        self.inside = self.inside and tag != "form"
        self._select = "" if tag == "select" else self._select


def _number(text: str | None) -> float | None:
    return None if text is None else float(text)


def _branch(p: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of `T | None`."""
    return next((q for q in p.get("anyOf", [p]) if q.get("type") != "null"), p)


def _input_drift(name: str, a: dict[str, Any], p: dict[str, Any]) -> list[str]:
    b = _branch(p)
    problems = []
    if JSON_TYPE.get(a.get("data-type", "")) != b.get("type"):
        problems.append(f"{name}: data-type {a.get('data-type')} but the field is {b.get('type')}")
    if _number(a.get("value")) != p.get("default"):
        problems.append(f"{name}: value {a.get('value')} but the default is {p.get('default')}")
    for attr, key in (("min", "minimum"), ("max", "maximum")):
        if _number(a.get(attr)) != b.get(key):
            problems.append(f"{name}: {attr} {a.get(attr)} but the bound is {b.get(key)}")
    return problems


def _select_drift(name: str, a: dict[str, Any], p: dict[str, Any]) -> list[str]:
    if "default" not in p:  # required (dataset, base model): filled from the API's lists
        return []
    if a.get("data-type") == "bool":
        accepted, as_json = {"", "true", "false"}, {"": None, "true": True, "false": False}
    else:
        accepted, as_json = {str(v) for v in p["enum"]}, {str(v): v for v in p["enum"]}
    values = [v for v, _ in a["options"]]
    shown = next((v for v, selected in a["options"] if selected), values[0] if values else None)
    problems = [f"{name}: option {v!r} is not a value of the field" for v in values if v not in accepted]
    if as_json.get(str(shown)) != p["default"]:
        problems.append(f"{name}: shows {shown!r} but the default is {p['default']!r}")
    return problems


def _fields(html: str) -> dict[str, dict[str, Any]]:
    form = _Form()
    form.feed(html)
    return form.fields


def form_drift(html: str) -> list[str]:
    """How the new-job form in `html` disagrees with JobSpec's declaration."""
    fields = _fields(html)
    assert fields, "no #new-form inputs found"
    problems = []
    for name, a in fields.items():
        if "data-plan-only" in a:
            continue
        if name not in SCHEMA:
            problems.append(f"{name}: not a JobSpec field")
        elif "type" in a:  # an <input>
            problems += _input_drift(name, a, SCHEMA[name])
        else:
            problems += _select_drift(name, a, SCHEMA[name])
    return problems


def test_the_form_shows_the_declared_defaults_and_bounds() -> None:
    html = PAGE.read_text(encoding="utf-8")
    assert form_drift(html) == []
    assert "examples_per_step" in _fields(html)


def test_a_form_that_drifts_is_named() -> None:
    html = PAGE.read_text(encoding="utf-8")
    drifted = (
        html.replace('name="lora_r" type="number" min="1" max="512" value="16"',
                     'name="lora_r" type="number" min="1" max="512" value="8"')
        .replace('max="524288"', 'max="4096"')
        .replace("<option>qlora</option>", "<option>qlora</option><option>dora</option>")
        .replace('name="epochs"', 'name="epoch"')
    )  # fmt: skip
    assert form_drift(drifted) == [
        "method: option 'dora' is not a value of the field",
        "epoch: not a JobSpec field",
        "examples_per_step: max 4096 but the bound is 524288",
        "lora_r: value 8 but the default is 16",
    ]


def _as_sent(a: dict[str, Any]) -> Any:
    """A field's initial value as the form sends it (new.js formSpec): typed by data-type; None: left out."""
    value = a.get("value") if "type" in a else next((v for v, _ in a["options"]), None)
    if value in (None, ""):
        return None
    kind = a.get("data-type")
    return (
        value == "true"
        if kind == "bool"
        else int(value)
        if kind == "int"
        else float(value)
        if kind == "float"
        else value
    )


def test_the_untouched_form_submits_the_declared_defaults(client: TestClient, dataset_id: str) -> None:
    """POST /jobs with what the untouched form sends (plus the dataset, base model and examples_per_step,
    which it leaves empty) stores each field at its declared default."""
    fields = {n: a for n, a in _fields(PAGE.read_text(encoding="utf-8")).items() if "data-plan-only" not in a}
    sent = {n: v for n, a in fields.items() if (v := _as_sent(a)) is not None}
    body = {**sent, "dataset_id": dataset_id, "base_model": "tiny", "examples_per_step": 8}
    r = client.post("/jobs", json=body)
    assert r.status_code == 202, r.text
    spec = r.json()["spec"]
    assert spec["examples_per_step"] == 8
    for name in set(fields) - {"dataset_id", "base_model", "examples_per_step", "gradient_checkpointing"}:
        assert spec[name] == JobSpec.model_fields[name].default, name
