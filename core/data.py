"""Streaming JSONL validation at upload: bytes in, one DatasetReport out.

The API feeds each uploaded chunk to `DatasetValidator.feed` as it arrives and calls `finish` at the end.
One pass, memory bounded by the chunk passed in, plus `max_line_bytes` for a line that spans chunks (a
longer line is counted and skipped, never buffered whole), plus the duplicate set: one 64-bit hash per
distinct example (~60 bytes in a Python set: ~6 MB per 100k examples).

Formats (see core/examples.py): chat, instruction, prompt_completion, text. The file's format is the
format of its first line that has one; a line in another format is a `mixed_formats` problem.

Problem codes (stable; every problem has a 1-based line number, blank lines count):
invalid_utf8, invalid_json, not_an_object, unknown_format, mixed_formats, missing_field, wrong_type,
empty_content, unknown_role, no_assistant_turn, roles_not_alternating, line_too_long, and
too_few_examples, which is about the whole file and has line 0.
"""

from __future__ import annotations

import hashlib
import json
import random
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel

from core.examples import Format, apply_column_mapping, check_column_mapping, detect_format
from core.settings import Settings

BOM = b"\xef\xbb\xbf"
ROLES = ("system", "user", "assistant")
REQUIRED: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "instruction": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
# Percentiles come from a fixed-size, fixed-seed reservoir: exact up to this many examples.
RESERVOIR_SIZE = 10_000
READ_CHUNK = 1 << 20


class Problem(BaseModel):
    line: int  # 1-based; 0 for a problem with the whole file (too_few_examples)
    code: str
    message: str
    field: str | None = None  # JSON path in the line, e.g. "messages[2].role"


class DatasetReport(BaseModel):
    valid: bool
    format: Format | None
    num_examples: int  # lines that passed validation
    num_lines: int  # including blank and skipped lines
    size_bytes: int
    sha256: str  # of the raw bytes, as stored
    problems: list[Problem]  # the first max_problems, in file order
    problem_counts: dict[str, int]  # per code, over the whole file
    duplicates: int  # valid examples identical (in their used fields) to an earlier one
    stats: dict[str, Any]


class _Checked(NamedTuple):
    """What the stats and the duplicate set need from a valid line."""

    chars: int  # characters of content
    messages: int
    key: tuple[Any, ...]  # the used fields: equal keys are duplicate examples
    flag: bool  # chat: starts with a system message; instruction: has a non-empty input


class _LineProblem(Exception):
    """One problem that ends the checks of a line (its structure cannot be trusted past it)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def _show(value: Any, limit: int = 40) -> str:
    """A short rendering of a user value for a message: scalars as JSON, containers by type."""
    text = _json_type(value) if isinstance(value, (dict, list)) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + '..."'


class _Sha256:
    """sha256 of a byte stream that overlaps hashing with parsing.

    hashlib releases the GIL on large buffers, so big chunks are hashed on one helper thread while the
    caller parses them. At most one chunk is in flight, so memory stays bounded.
    """

    THREAD_MIN_BYTES = 1 << 16

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._busy: Future[None] | None = None

    def update(self, chunk: bytes) -> None:
        self._wait()
        if len(chunk) < self.THREAD_MIN_BYTES:
            self._hash.update(chunk)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftune-sha256")
        self._busy = self._pool.submit(self._hash.update, chunk)

    def hexdigest(self) -> str:
        self._wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return self._hash.hexdigest()

    def _wait(self) -> None:
        if self._busy is not None:
            self._busy.result()
            self._busy = None


class _Stats:
    """Constant-memory statistics over valid examples: min/mean/max exactly, percentiles from a reservoir."""

    def __init__(self) -> None:
        self.count = 0
        self.chars_sum = 0
        self.chars_min = 0
        self.chars_max = 0
        self.msgs_sum = 0
        self.msgs_min = 0
        self.msgs_max = 0
        self.flagged = 0
        self._chars: list[int] = []
        self._msgs: list[int] = []
        self._rng = random.Random(0)  # fixed seed: the same file gives the same report

    def add(self, chars: int, msgs: int, flag: bool) -> None:
        # Called once per example: plain comparisons, no min()/max() calls.
        self.count += 1
        self.flagged += flag
        if self.count == 1:
            self.chars_min = self.chars_max = chars
            self.msgs_min = self.msgs_max = msgs
        else:
            if chars < self.chars_min:
                self.chars_min = chars
            elif chars > self.chars_max:
                self.chars_max = chars
            if msgs < self.msgs_min:
                self.msgs_min = msgs
            elif msgs > self.msgs_max:
                self.msgs_max = msgs
        self.chars_sum += chars
        self.msgs_sum += msgs
        if self.count <= RESERVOIR_SIZE:
            self._chars.append(chars)
            self._msgs.append(msgs)
        else:
            # Reservoir sampling (algorithm R); random() is C, randrange() is Python.
            j = int(self._rng.random() * self.count)
            if j < RESERVOIR_SIZE:
                self._chars[j] = chars
                self._msgs[j] = msgs

    def summary(self, fmt: Format | None, blank_lines: int) -> dict[str, Any]:
        out: dict[str, Any] = {"blank_lines": blank_lines}
        if not self.count:
            return out
        out["percentiles_exact"] = self.count <= RESERVOIR_SIZE
        out["chars_per_example"] = self._dist(self._chars, self.chars_min, self.chars_sum, self.chars_max)
        if fmt == "chat":
            out["messages_per_example"] = self._dist(self._msgs, self.msgs_min, self.msgs_sum, self.msgs_max)
            out["with_system_message"] = self.flagged
        if fmt == "instruction":
            out["with_input"] = self.flagged
        return out

    def _dist(self, sample: list[int], lo: int, total: int, hi: int) -> dict[str, float]:
        ordered = sorted(sample)

        def pct(q: float) -> int:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {"min": lo, "mean": round(total / self.count, 2), "p50": pct(0.5), "p95": pct(0.95), "max": hi}


class DatasetValidator:
    """Validate a JSONL dataset fed in chunks of any size; lines may span chunks.

    A line's length is its bytes without the "\\n" (a "\\r" before it and a leading BOM count).
    """

    def __init__(
        self,
        *,
        max_line_bytes: int,
        min_examples: int,
        max_problems: int,
        column_mapping: dict[str, str] | None = None,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.min_examples = min_examples
        self.max_problems = max_problems
        self._mapping = check_column_mapping(column_mapping)
        # Problems name the user's keys, not the renamed ones.
        self._reverse = {dst: src for src, dst in self._mapping.items()}
        self._sha = _Sha256()
        self._size = 0
        self._pending = bytearray()
        self._skipping = False  # inside a line longer than max_line_bytes
        self._skip_len = 0
        self._line_no = 0
        self._blank = 0
        self._format: Format | None = None
        self._format_line = 0
        self._examples = 0
        self._duplicates = 0
        self._seen: set[int] = set()
        self._problems: list[Problem] = []
        self._counts: dict[str, int] = {}
        self._stats = _Stats()
        self._report: DatasetReport | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, column_mapping: dict[str, str] | None = None
    ) -> DatasetValidator:
        return cls(
            max_line_bytes=settings.max_line_bytes,
            min_examples=settings.min_examples,
            max_problems=settings.max_reported_problems,
            column_mapping=column_mapping,
        )

    # ---- byte stream -> lines

    def feed(self, chunk: bytes) -> None:
        if self._report is not None:
            raise RuntimeError("feed() after finish()")
        if not chunk:
            return
        if type(chunk) is not bytes:
            chunk = bytes(chunk)  # immutable, so the hashing thread sees what we parse
        self._sha.update(chunk)
        self._size += len(chunk)
        start = 0
        if self._pending or self._skipping:
            # Complete the line carried over from earlier chunks.
            nl = chunk.find(b"\n")
            if nl < 0:
                self._carry(chunk)
                return
            self._carry(chunk[:nl])
            self._end_carried_line()
            start = nl + 1
        last = chunk.rfind(b"\n")
        if last >= start:
            limit = self.max_line_bytes
            for raw in chunk[start:last].split(b"\n"):
                self._line_no += 1
                if len(raw) > limit:
                    self._too_long(len(raw))
                else:
                    self._line(raw)
            start = last + 1
        if start < len(chunk):
            self._carry(chunk[start:])

    def _carry(self, data: bytes) -> None:
        """Buffer part of an unfinished line, but never more than max_line_bytes of it."""
        if self._skipping:
            self._skip_len += len(data)
        elif len(self._pending) + len(data) > self.max_line_bytes:
            self._skipping = True
            self._skip_len = len(self._pending) + len(data)
            self._pending = bytearray()
        else:
            self._pending += data

    def _end_carried_line(self) -> None:
        self._line_no += 1
        if self._skipping:
            self._too_long(self._skip_len)
            self._skipping = False
            self._skip_len = 0
        else:
            raw = bytes(self._pending)
            self._pending = bytearray()
            self._line(raw)

    def finish(self) -> DatasetReport:
        """Validate the last line (if it has no newline) and return the report. Idempotent.

        Too few valid examples is a problem with line 0, listed first.
        """
        if self._report is None:
            if self._pending or self._skipping:
                self._end_carried_line()
            if self._examples < self.min_examples:
                self._too_few()
            self._report = DatasetReport(
                valid=not self._counts,
                format=self._format,
                num_examples=self._examples,
                num_lines=self._line_no,
                size_bytes=self._size,
                sha256=self._sha.hexdigest(),
                problems=self._problems,
                problem_counts=dict(self._counts),
                duplicates=self._duplicates,
                stats=self._stats.summary(self._format, self._blank),
            )
        return self._report

    # ---- one line

    def _add(self, line: int, code: str, message: str, field: str | None = None) -> None:
        self._counts[code] = self._counts.get(code, 0) + 1
        if len(self._problems) < self.max_problems:
            self._problems.append(Problem(line=line, code=code, message=message, field=field))

    def _too_few(self) -> None:
        """The whole-file problem, line 0: listed first, so a full list of line problems cannot hide it."""
        self._counts["too_few_examples"] = 1
        message = f"file: has {self._examples} valid example(s); at least {self.min_examples} required"
        self._problems.insert(0, Problem(line=0, code="too_few_examples", message=message))
        del self._problems[max(self.max_problems, 0) :]

    def _too_long(self, length: int) -> None:
        self._add(
            self._line_no,
            "line_too_long",
            f"line {self._line_no}: is {length} bytes, over the limit of {self.max_line_bytes}; skipped",
        )

    def _line(self, raw: bytes) -> None:
        if self._line_no == 1 and raw.startswith(BOM):
            raw = raw[3:]
        if not raw.strip():
            self._blank += 1
            return
        try:
            self._check_line(raw)
        except _LineProblem as p:
            field = self._user_field(p.field)
            where = f'line {self._line_no}: field "{field}"' if field else f"line {self._line_no}:"
            self._add(self._line_no, p.code, f"{where} {p.message}", field)

    def _check_line(self, raw: bytes) -> None:
        obj = self._parse(raw)
        if self._mapping:
            obj = apply_column_mapping(obj, self._mapping)
        fmt = detect_format(obj)
        if fmt is None or fmt != self._format:  # the common case, a line like the others, skips this
            fmt = self._line_format(obj, fmt)
        # Lone surrogate escapes (\ud800) decode to str that cannot be encoded; look only if one may be there.
        strict = b"\\ud" in raw or b"\\uD" in raw
        checked = _check_chat(obj, strict) if fmt == "chat" else _check_flat(obj, fmt, strict)
        self._examples += 1
        self._stats.add(checked.chars, checked.messages, checked.flag)
        # A 64-bit hash (SipHash of each string, in C) is ~4x cheaper than a digest of a canonical dump;
        # a false duplicate needs a collision (~n^2/2^65: 3e-6 at 10M examples) and only skews a count.
        digest = hash(checked.key)
        if digest in self._seen:
            self._duplicates += 1
        else:
            self._seen.add(digest)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _LineProblem(
                "invalid_utf8", f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
            ) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _LineProblem("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise _LineProblem("invalid_json", "invalid JSON: nested too deeply") from None
        except ValueError as e:  # e.g. an integer with too many digits
            raise _LineProblem("invalid_json", f"invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise _LineProblem("not_an_object", f"expected a JSON object; got {_json_type(obj)}")
        return obj

    def _line_format(self, obj: dict[str, Any], fmt: Format | None) -> Format:
        """The line's format, which must be the file's; sets the file's format from its first line."""
        guess = fmt or _partial_format(obj) or self._format
        if guess is None:
            raise _LineProblem("unknown_format", _unknown_format_message(obj, self._reverse))
        if self._format is not None and guess != self._format:
            raise _LineProblem(
                "mixed_formats",
                f'format is "{guess}" but the file\'s format is "{self._format}" (from line '
                f"{self._format_line}); a file must use one format",
            )
        if fmt is None:
            missing = next(k for k in REQUIRED[guess] if k not in obj)
            raise _LineProblem("missing_field", f'is required (format "{guess}")', missing)
        if self._format is None:
            self._format, self._format_line = fmt, self._line_no
        return fmt

    def _user_field(self, field: str | None) -> str | None:
        if field is None or not self._reverse:
            return field
        root, sep, rest = field.partition("[")
        return self._reverse.get(root, root) + sep + rest


def _partial_format(obj: dict[str, Any]) -> Format | None:
    """A format a line meant to have but lacks a required key of, for a missing_field message."""
    if "instruction" in obj or "output" in obj:
        return "instruction"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    return None


def _unknown_format_message(obj: dict[str, Any], reverse: dict[str, str]) -> str:
    keys = ", ".join(_show(k) for k in list(obj)[:10]) + (", ..." if len(obj) > 10 else "")
    expected = [
        ("chat", "messages"),
        ("instruction", "instruction + output"),
        ("prompt_completion", "prompt + completion"),
        ("text", "text"),
    ]
    alts = "; ".join(f"{name}: {keys_}" for name, keys_ in expected)
    hint = "" if reverse else " (or pass a column_mapping)"
    return f"no known format: expected keys for {alts}{hint}; got keys [{keys}]"


def _path(key: str, at: int | None) -> str:
    """JSON path of a field, built only for a problem: "output" or "messages[2].content"."""
    return key if at is None else f"messages[{at}].{key}"


def _text(
    obj: dict[str, Any], key: str, strict: bool, *, at: int | None = None, required: bool = True
) -> str:
    """The string at obj[key]; raise for a missing, non-string or blank value (null is absent if optional)."""
    value = obj.get(key)
    if value is None:
        if required:
            raise _LineProblem("missing_field", "is required", _path(key, at))
        return ""
    if type(value) is not str:
        raise _LineProblem("wrong_type", f"must be a string; got {_json_type(value)}", _path(key, at))
    if required and (not value or value.isspace()):
        raise _LineProblem("empty_content", "must not be empty", _path(key, at))
    if strict:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = "contains an unpaired surrogate escape such as \\ud800 (not valid Unicode)"
            raise _LineProblem("invalid_utf8", msg, _path(key, at)) from None
    return value


def _check_flat(obj: dict[str, Any], fmt: Format, strict: bool) -> _Checked:
    """Check an instruction, prompt_completion or text line; flag: an instruction has an input."""
    if fmt == "instruction":
        values = (
            _text(obj, "instruction", strict),
            _text(obj, "input", strict, required=False),
            _text(obj, "output", strict),
        )
    elif fmt == "prompt_completion":
        values = (_text(obj, "prompt", strict), _text(obj, "completion", strict))
    else:
        values = (_text(obj, "text", strict),)
    has_input = fmt == "instruction" and bool(values[1])
    # Only used fields make an example: extra keys (ids, metadata) do not hide a duplicate.
    return _Checked(sum(map(len, values)), 1 if fmt == "text" else 2, (fmt, *values), has_input)


def _check_chat(obj: dict[str, Any], strict: bool) -> _Checked:
    """Check a chat line; flag: it starts with a system message."""
    messages = obj["messages"]
    if type(messages) is not list:
        raise _LineProblem("wrong_type", f"must be an array; got {_json_type(messages)}", "messages")
    if not messages:
        raise _LineProblem("empty_content", "must not be empty", "messages")
    first = messages[0]
    system_first = type(first) is dict and first.get("role") == "system"
    chars = 0
    assistant = False
    canon: list[tuple[str, str, int | None]] = []
    for i, m in enumerate(messages):
        if type(m) is not dict:
            raise _LineProblem("wrong_type", f"must be an object; got {_json_type(m)}", f"messages[{i}]")
        role = _role(m, i, system_first)
        content = _text(m, "content", strict, at=i)
        weight = m.get("weight")
        if weight is not None and (type(weight) is not int or weight not in (0, 1)):
            raise _LineProblem("wrong_type", f"must be 0 or 1; got {_show(weight)}", _path("weight", i))
        chars += len(content)
        assistant = assistant or role == "assistant"
        canon.append((role, content, weight))
    if not assistant:
        raise _LineProblem(
            "no_assistant_turn", "has no assistant message; at least one is required", "messages"
        )
    return _Checked(chars, len(messages), tuple(canon), system_first)


def _role(m: dict[str, Any], i: int, system_first: bool) -> str:
    """The role of messages[i]: known, and in order (optional system first, then user/assistant alternate)."""
    role = m.get("role")
    if i == 0 and system_first:
        return "system"
    # The happy path: the role the position asks for.
    expected = "user" if (i - system_first) % 2 == 0 else "assistant"
    if role == expected:
        return role
    if role is None:
        raise _LineProblem("missing_field", "is required", _path("role", i))
    if type(role) is not str:
        raise _LineProblem("wrong_type", f"must be a string; got {_json_type(role)}", _path("role", i))
    if role not in ROLES:
        raise _LineProblem(
            "unknown_role", f"must be one of {', '.join(ROLES)}; got {_show(role)}", _path("role", i)
        )
    raise _LineProblem(
        "roles_not_alternating",
        f'must be "{expected}" (after an optional first system message, roles alternate '
        f"user, assistant, user, ...); got {_show(role)}",
        _path("role", i),
    )


def validate_file(
    path: Path,
    *,
    max_line_bytes: int,
    min_examples: int,
    max_problems: int,
    column_mapping: dict[str, str] | None = None,
) -> DatasetReport:
    validator = DatasetValidator(
        max_line_bytes=max_line_bytes,
        min_examples=min_examples,
        max_problems=max_problems,
        column_mapping=column_mapping,
    )
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            validator.feed(chunk)
    return validator.finish()
