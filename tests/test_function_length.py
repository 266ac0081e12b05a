"""Every product function is at most MAX_LINES long (its `def` line to its last, decorators left out):
a function longer than a screen does more than one thing, and reads as a list of steps to name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "planner", "graders", "training", "models", "api", "worker", "cli", "inference")
MAX_LINES = 80

# Functions still over the bound, as "path:qualified name": none. A listed function that is no longer over
# the bound fails the test too, so the list only shrinks.
ALLOWED: set[str] = set()


def long_functions(source: str, path: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """{"path:qualified name": lines} of the functions (and methods, nested ones too) over max_lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > max_lines:
                        found[f"{path}:{name}"] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def product_long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for package in PACKAGES:
        for file in sorted((REPO / package).rglob("*.py")):
            found |= long_functions(file.read_text(), file.relative_to(REPO).as_posix())
    return found


def test_no_product_function_is_over_the_bound() -> None:
    over = {name: lines for name, lines in product_long_functions().items() if name not in ALLOWED}
    assert over == {}, f"functions over {MAX_LINES} lines (split them): {over}"


def test_the_allow_list_holds_only_functions_still_over_the_bound() -> None:
    stale = ALLOWED - set(product_long_functions())
    assert stale == set(), f"no longer over {MAX_LINES} lines: take them off ALLOWED: {sorted(stale)}"


@pytest.mark.parametrize(
    ("body_lines", "expected"),
    [(MAX_LINES - 1, {}), (MAX_LINES, {"m.py:C.f": MAX_LINES + 1})],
)
def test_a_method_over_the_bound_is_found_by_its_name(body_lines: int, expected: dict[str, int]) -> None:
    source = "class C:\n    def f(self):\n" + "        x = 1\n" * body_lines
    assert long_functions(source, "m.py") == expected


def test_a_nested_function_over_the_bound_is_found_beside_its_parent() -> None:
    source = "def outer():\n    def inner():\n" + "        x = 1\n" * MAX_LINES + "    return inner\n"
    found = long_functions(source, "m.py")
    assert found == {"m.py:outer": MAX_LINES + 3, "m.py:outer.inner": MAX_LINES + 1}
