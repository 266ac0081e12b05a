"""The duplicate check that `make lint` runs over product code (tests/duplicate_lines.py)."""

from tests.duplicate_lines import find_duplicates

BODY = "".join(f"    total = total + {i}\n" for i in range(6))


def test_six_shared_lines_are_one_pair_with_both_places():
    a = "def f():\n" + BODY + "    return total\n"
    b = "x = 1\n\n\ndef g(y):\n" + BODY
    [(first, second)] = find_duplicates({"a.py": a, "b.py": b})
    assert (first.path, first.first, first.last) == ("a.py", 2, 7)
    assert (second.path, second.first, second.last) == ("b.py", 5, 10)


def test_a_longer_run_is_reported_once_with_its_whole_extent():
    body = "".join(f"    v{i} = {i}\n" for i in range(9))
    [(first, second)] = find_duplicates({"a.py": "def f():\n" + body, "b.py": "def g():\n" + body})
    assert (first.first, first.last, second.first, second.last) == (2, 10, 2, 10)


def test_five_lines_are_not_a_duplicate():
    five = "".join(f"    total = total + {i}\n" for i in range(5))
    assert find_duplicates({"a.py": "def f():\n" + five, "b.py": "def g():\n" + five}) == []


def test_comments_docstrings_imports_brackets_and_signatures_do_not_count():
    shared = (
        "import os\nfrom pathlib import Path\n# one\n# two\n"
        "def f(\n    a,\n    b,\n    c,\n    d,\n    e,\n):\n"
        + '    """doc\n'
        + "    doc\n" * 6
        + '    """\n'
        + "    x = [\n        1,\n    ]\n    return x\n"
    )
    assert find_duplicates({"a.py": shared, "b.py": shared.replace("f(", "g(")}) == []


def test_two_places_in_one_file_count():
    source = "def f():\n" + BODY + "\n\ndef g():\n" + BODY
    [(first, second)] = find_duplicates({"a.py": source})
    assert first.path == second.path == "a.py" and first.last < second.first
