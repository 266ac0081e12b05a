"""`make lint`'s duplicate check: no two places in product code share six or more identical lines.

    python -m tests.duplicate_lines core planner graders training inference models api worker cli

Lines are compared after folding white space, leaving out what carries no logic of its own: blank
lines, comments, docstrings, functions' signatures, import lines and lines of brackets and commas alone.
A run of MIN_LINES such lines that stands in two places (two files, or two spots of one file) is reported
with both places, and the command exits 1. Text, with the ast only to find docstrings and signatures:
it runs in well under a second.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MIN_LINES = 6
_PUNCTUATION_ONLY = re.compile(r"^[\s()\[\]{},:;]*$")


@dataclass(frozen=True)
class Place:
    path: str
    first: int  # line numbers, 1-based, inclusive
    last: int


def meaningful_lines(source: str) -> list[tuple[int, str]]:
    """(line number, folded text) of the lines that count."""
    skipped = _skipped_lines(source)
    out = []
    for number, raw in enumerate(source.splitlines(), start=1):
        text = " ".join(raw.split())
        if number in skipped or not text or text.startswith("#") or _PUNCTUATION_ONLY.match(text):
            continue
        if text.startswith(("import ", "from ")) and " import " in f" {text} ":
            continue
        out.append((number, text))
    return out


def _skipped_lines(source: str) -> set[int]:
    """Docstrings, and functions' signatures (two functions may well take the same arguments)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            lines.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def find_duplicates(sources: dict[str, str], min_lines: int = MIN_LINES) -> list[tuple[Place, Place]]:
    """Pairs of places sharing a run of `min_lines` or more identical meaningful lines, longest runs
    merged into one pair."""
    kept = {path: meaningful_lines(text) for path, text in sources.items()}
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path, lines in kept.items():
        texts = [text for _, text in lines]
        for i in range(len(texts) - min_lines + 1):
            seen[tuple(texts[i : i + min_lines])].append((path, i))
    # Each window standing in two places; neighbouring windows of the same two places form one run.
    starts: set[tuple[str, int, str, int]] = set()
    for places in seen.values():
        for a, (path_a, i) in enumerate(places):
            for path_b, j in places[a + 1 :]:
                if path_a != path_b or abs(i - j) >= min_lines:
                    starts.add((path_a, i, path_b, j))
    pairs = []
    for path_a, i, path_b, j in sorted(starts):
        if (path_a, i - 1, path_b, j - 1) in starts:
            continue  # inside a run that began earlier
        length = min_lines
        while (path_a, i + length - min_lines + 1, path_b, j + length - min_lines + 1) in starts:
            length += 1
        lines_a, lines_b = kept[path_a], kept[path_b]
        pairs.append(
            (
                Place(path_a, lines_a[i][0], lines_a[i + length - 1][0]),
                Place(path_b, lines_b[j][0], lines_b[j + length - 1][0]),
            )
        )
    return pairs


def main(argv: list[str]) -> int:
    roots = argv or ["."]
    files = sorted(p for root in roots for p in Path(root).rglob("*.py"))
    pairs = find_duplicates({str(p): p.read_text() for p in files})
    for a, b in pairs:
        print(f"{a.path}:{a.first}-{a.last} ~ {b.path}:{b.first}-{b.last}")
    print(f"{len(pairs)} duplicated runs of {MIN_LINES}+ identical lines in {len(files)} files")
    return 1 if pairs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
