"""Each JobSpec field is declared once, with its group (core.spec): every field names one group, and each
group's view (core.spec_groups) holds exactly its group's fields, typed as declared, plus other groups'
fields under their own names and the values JobSpec derives. A view that drifts from the declaration (a
field missing, renamed or retyped) fails here, naming the field."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Union

from core.spec import GRPO_DEFAULTS, JobSpec, group_defaults, group_of
from core.spec_groups import GROUPS, RL, Group, Method

# Values a view property computes instead of reading a field as is (core.spec.JobSpec's properties).
DERIVED = {
    "batch": {"packing", "sequences_per_example"},
    "rl": {"step_prompts"},
    "placement": {"gradient_checkpointing"},
}


def _plain(tp: Any) -> Any:
    """A type without its Annotated metadata (bounds, group markers), at any depth."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _plain(args[0])
    if origin in (Union, types.UnionType):
        return Union[tuple(_plain(a) for a in args)]  # noqa: UP007  # rebuilt from a tuple
    if origin is list:
        return list[_plain(args[0])]  # type: ignore[misc]
    return tp


def view_drift(group: Group[Any], view: type[Any]) -> list[str]:
    """How `view` (a dataclass) disagrees with the declaration of `group`'s fields."""
    hints = typing.get_type_hints(view)
    fields = {f.name for f in dataclasses.fields(view)}
    own = {n.removeprefix(group.prefix): n for n in JobSpec.model_fields if group_of(n) is group}
    problems = [
        f"{flat}: not in {view.__name__} (as {name})" for name, flat in own.items() if name not in fields
    ]
    for name in sorted(fields - DERIVED.get(group.name, set())):
        flat = own.get(name, name)
        if flat not in JobSpec.model_fields:
            problems.append(f"{view.__name__}.{name}: no such JobSpec field, nor derived")
        elif _plain(hints[name]) != _plain(JobSpec.model_fields[flat].annotation):
            declared = JobSpec.model_fields[flat].annotation
            problems.append(f"{view.__name__}.{name}: {hints[name]} but {flat} is declared {declared}")
    return problems


def test_every_field_is_declared_in_one_group() -> None:
    for name, field in JobSpec.model_fields.items():
        markers = [m for m in field.metadata if isinstance(m, Group)]
        assert len(markers) == 1 and markers[0] in GROUPS, name
    assert {g.name for g in GROUPS} == {group_of(n).name for n in JobSpec.model_fields}


def test_each_view_holds_its_groups_fields_as_declared() -> None:
    for group in GROUPS:
        if group.view is not None:
            assert view_drift(group, group.view) == [], group.name


def test_a_view_that_drifts_is_named() -> None:
    @dataclasses.dataclass(frozen=True)
    class Renamed:  # lora_r missing (spelled rank), lora_alpha retyped
        method: Method
        rank: int
        alpha: int
        dropout: float
        target_modules: list[str] | typing.Literal["all-linear"]
        init_from: str | None
        init_from_step: int | None

    lora = next(g for g in GROUPS if g.name == "lora")
    assert view_drift(lora, Renamed) == [
        "lora_r: not in Renamed (as r)",
        "Renamed.alpha: <class 'int'> but lora_alpha is declared <class 'float'>",
        "Renamed.rank: no such JobSpec field, nor derived",
    ]


def test_the_checks_read_their_defaults_from_the_declaration() -> None:
    """The fields only grpo uses are the rl group's, each at its declared default; grpo's own defaults
    are the declared GrpoDefault markers."""
    assert list(group_defaults(RL)) == [f for f in JobSpec.model_fields if group_of(f) is RL]
    assert group_defaults(RL)["num_generations"] == JobSpec.model_fields["num_generations"].default == 4
    assert GRPO_DEFAULTS == {"beta": 0.0, "loss_type": "dapo"}
    grader = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}  # fmt: skip
    spec = JobSpec(base_model="tiny", dataset_id="abcdefgh12", objective="grpo", grader=grader)
    assert (spec.beta, spec.loss_type) == (0.0, "dapo")
