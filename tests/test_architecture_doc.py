"""docs/architecture.md's layer table says what the import-linter contracts in pyproject.toml enforce.

The table has one row a package: what it may import of ours, what it must not import, and the named
exceptions (a contract's ignore_imports). Each forbidden contract of one source package must match its
row exactly; a root package with no contract must say it may import every other one and forbid nothing.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
MARKER = "<!-- import contracts:"
_NAME = re.compile(r"`([^`]+)`")


@pytest.fixture(scope="module")
def linter() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def layer_table(text: str) -> dict[str, dict[str, set[str]]]:
    """{package: {"may": ..., "must_not": ..., "exceptions": ...}} from the table after MARKER."""
    lines = text[text.index(MARKER) :].splitlines()[1:]
    end = next(i for i, line in enumerate(lines) if not line.startswith("|"))
    table: dict[str, dict[str, set[str]]] = {}
    for row in lines[2:end]:  # past the header and its rule
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a row of four cells: {row}"
        package, may, must_not, exceptions = (set(_NAME.findall(cell)) for cell in cells)
        (name,) = package
        assert name not in table, f"{name} has two rows"
        table[name] = {"may": may, "must_not": must_not, "exceptions": exceptions}
    return table


def described(contract: dict, roots: list[str]) -> dict[str, set[str]]:
    """What a forbidden contract of one source package says, in the table's terms."""
    forbidden = set(contract["forbidden_modules"])
    (source,) = contract["source_modules"]
    return {
        "may": set(roots) - {source} - forbidden,
        "must_not": forbidden,
        "exceptions": set(contract.get("ignore_imports", [])),
    }


def contracts_by_package(linter: dict) -> dict[str, dict[str, set[str]]]:
    out = {}
    for contract in linter["contracts"]:
        # Only one-package forbidden contracts have a row's form; another kind needs this test to grow.
        assert contract["type"] == "forbidden" and len(contract["source_modules"]) == 1, contract["name"]
        out[contract["source_modules"][0]] = described(contract, linter["root_packages"])
    return out


def test_the_doc_has_one_row_for_each_root_package(linter: dict) -> None:
    assert set(layer_table(DOC.read_text())) == set(linter["root_packages"])


def test_each_contract_reads_as_its_row(linter: dict) -> None:
    table = layer_table(DOC.read_text())
    for package, contract in contracts_by_package(linter).items():
        assert table[package] == contract, f"the row for {package} differs from its contract"


def test_a_package_without_a_contract_is_described_as_free(linter: dict) -> None:
    table = layer_table(DOC.read_text())
    roots = linter["root_packages"]
    for package in set(roots) - set(contracts_by_package(linter)):
        assert table[package] == {"may": set(roots) - {package}, "must_not": set(), "exceptions": set()}


def test_a_row_that_drifts_from_its_contract_is_caught(linter: dict) -> None:
    """The drift this test exists for: the doc saying inference imports only core."""
    text = DOC.read_text()
    drifted = text.replace(
        "| `inference` | `core`, `planner`, `graders`, `training` |", "| `inference` | `core` |"
    )
    assert drifted != text
    assert layer_table(drifted)["inference"] != contracts_by_package(linter)["inference"]
