"""Streaming JSONL validation at upload: bytes in, one DatasetReport out.

The API feeds each uploaded chunk to `DatasetValidator.feed` as it arrives and calls `finish` at the end.
One pass, memory bounded by the chunk passed in, plus `max_line_bytes` for a line that spans chunks (a
longer line is counted and skipped, never buffered whole), plus the exact duplicate count: one 64-bit
hash per example, 8 bytes in a flat array, spilled to `spill_dir` past 4M of them
(core.data.stats.DuplicateCounter).

Formats (see core/data/examples.py): chat, instruction, prompt_completion, text (kind "sft"), and the
preference pairs preference (OpenAI's) and chosen_rejected (TRL's) (kind "preference", for objective
dpo), and reinforcement (OpenAI's RFT rows: messages ending in a user turn; kind "reinforcement", for
objective grpo). The file's format is the format of its first line that has one; a line in another format is a
`mixed_formats` problem. The report's `kind` says which objective the file trains.

Problem codes (stable; every problem has a 1-based line number, blank lines count):
invalid_utf8, invalid_json, not_an_object, unknown_format, mixed_formats, missing_field, wrong_type,
empty_content, unknown_role, no_assistant_turn, roles_not_alternating, line_too_long; for content parts
unsupported_content (an audio or file part: no base model here reads them); for image parts
(core.data.images) image_undecodable, image_too_large, too_many_images, image_url_invalid,
image_url_private, image_url_not_fetched and image_not_in_user_message, and where the API fetches image
URLs (`fetch_image`, core.image_fetch) image_fetch_failed; for function calling
(core.data.tools, core.data.conversation) invalid_tool_schema (a tool's parameters are not valid JSON
Schema), unknown_tool (a call to a tool the row does not define), invalid_tool_arguments (arguments that
are not a string of a JSON object), unknown_tool_call_id (a tool message that answers no call) and
parallel_tool_calls_disabled (several calls in one message of a row with parallel_tool_calls false);
for preference pairs also wrong_role (a reply that is not an assistant message), identical_replies
(chosen equals rejected: nothing to prefer) and no_common_prompt (an implicit prompt: chosen and
rejected must be one conversation up to their differing last reply); and
too_few_examples, which is about the whole file and has line 0.

Given `fetch_image`, a chat row's http(s) image URLs are fetched and the row is stored with each image
inlined as a data: URL (core.data.images): `stored(path)` rewrites the received file so once it is valid
(core.data.rewrites), and its report gives the stored file's size and sha256. A row with its images inlined
is held to the same line limit as a row sent so (line_too_long past it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from core.data.examples import (
    PREFERENCE_FORMATS,
    Format,
    Kind,
    apply_column_mapping,
    check_column_mapping,
    detect_format,
    kind_of,
)
from core.data.images import Fetch
from core.data.line_checks import (
    check_chat,
    check_flat,
    check_preference,
    partial_format,
    unknown_format_message,
)
from core.data.problems import LineProblem, json_type
from core.data.rewrites import LineRewrites
from core.data.stats import DuplicateCounter, ExampleStats, StreamSha256
from core.settings import Settings

BOM = b"\xef\xbb\xbf"
REQUIRED: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "reinforcement": ("messages",),
    "instruction": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "preference": ("input", "preferred_output", "non_preferred_output"),
    "chosen_rejected": ("chosen", "rejected"),
}
READ_CHUNK = 1 << 20


class Problem(BaseModel):
    line: int  # 1-based; 0 for a problem with the whole file (too_few_examples)
    code: str
    message: str
    field: str | None = None  # JSON path in the line, e.g. "messages[2].role"


class DatasetReport(BaseModel):
    valid: bool
    format: Format | None
    kind: Kind | None = None  # "sft" or "preference" (objective dpo); None without a format
    num_examples: int  # lines that passed validation
    num_lines: int  # including blank and skipped lines
    size_bytes: int
    sha256: str  # of the raw bytes, as stored
    problems: list[Problem]  # the first max_problems, in file order
    problem_counts: dict[str, int]  # per code, over the whole file
    duplicates: int  # valid examples identical (in their used fields) to an earlier one
    stats: dict[str, Any]


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
        spill_dir: Path | None = None,
        fetch_image: Fetch | None = None,
    ) -> None:
        """spill_dir: where the duplicate count may spill its hashes past a bound (DuplicateCounter), and
        rows with fetched images their inlined lines. fetch_image: how http(s) image URLs are fetched (none:
        they are refused)."""
        self.max_line_bytes = max_line_bytes
        self.min_examples = min_examples
        self.max_problems = max_problems
        self._mapping = check_column_mapping(column_mapping)
        # Problems name the user's keys, not the renamed ones.
        self._reverse = {dst: src for src, dst in self._mapping.items()}
        self._sha = StreamSha256()
        self._size = 0
        self._pending = bytearray()
        self._skipping = False  # inside a line longer than max_line_bytes
        self._skip_len = 0
        self._line_no = 0
        self._blank = 0
        self._format: Format | None = None
        self._format_line = 0
        self._examples = 0
        self._duplicates = DuplicateCounter(spill_dir)
        self._problems: list[Problem] = []
        self._counts: dict[str, int] = {}
        self._stats = ExampleStats()
        self._report: DatasetReport | None = None
        self._fetch_image = fetch_image
        self._fetched_in_line = 0
        self._fetched = 0
        self._rewrites = LineRewrites(spill_dir)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        column_mapping: dict[str, str] | None = None,
        spill_dir: Path | None = None,
        fetch_image: Fetch | None = None,
    ) -> DatasetValidator:
        return cls(
            max_line_bytes=settings.max_line_bytes,
            min_examples=settings.min_examples,
            max_problems=settings.max_reported_problems,
            column_mapping=column_mapping,
            spill_dir=spill_dir,
            fetch_image=fetch_image,
        )

    # ---- byte stream -> lines

    def feed_file(self, path: Path) -> None:
        """Feed a whole file, chunk by chunk."""
        with path.open("rb") as f:
            while chunk := f.read(READ_CHUNK):
                self.feed(chunk)

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
                kind=kind_of(self._format),
                num_examples=self._examples,
                num_lines=self._line_no,
                size_bytes=self._size,
                sha256=self._sha.hexdigest(),
                problems=self._problems,
                problem_counts=dict(self._counts),
                duplicates=self._duplicates.count(),
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
        except LineProblem as p:
            field = self._user_field(p.field)
            where = f'line {self._line_no}: field "{field}"' if field else f"line {self._line_no}:"
            self._add(self._line_no, p.code, f"{where} {p.message}", field)

    def _check_line(self, raw: bytes) -> None:
        sent = obj = self._parse(raw)
        if self._mapping:
            obj = apply_column_mapping(obj, self._mapping)  # shares its values with `sent`
        fmt = detect_format(obj)
        if fmt == "reinforcement" and self._format == "chat":
            fmt = "chat"  # in a chat file a line ending in a user turn lacks its reply: no_assistant_turn
        if fmt is None or fmt != self._format:  # the common case, a line like the others, skips this
            fmt = self._line_format(obj, fmt)
        # Lone surrogate escapes (\ud800) decode to str that cannot be encoded; look only if one may be there.
        strict = b"\\ud" in raw or b"\\uD" in raw
        if fmt in ("chat", "reinforcement"):
            self._fetched_in_line = 0
            fetch = self._fetch if self._fetch_image is not None else None
            checked = check_chat(obj, strict, prompt=fmt == "reinforcement", fetch=fetch)
            if self._fetched_in_line:
                self._inline(sent)
        elif fmt in PREFERENCE_FORMATS:
            checked = check_preference(obj, fmt, strict)
        else:
            checked = check_flat(obj, fmt, strict)
        self._examples += 1
        self._stats.add(checked.chars, checked.messages, checked.flag, checked.tools, checked.images)
        # A 64-bit hash (SipHash of each string, in C) is ~4x cheaper than a digest of a canonical dump;
        # a false duplicate needs a collision (~n^2/2^65: 3e-6 at 10M examples) and only skews a count.
        self._duplicates.add(hash(checked.key))

    def _fetch(self, url: str, at: str) -> bytes:
        assert self._fetch_image is not None
        data = self._fetch_image(url, at)
        self._fetched_in_line += 1
        return data

    def _inline(self, sent: dict[str, Any]) -> None:
        """Keep the line as it is stored: as sent, its fetched images inlined (check_chat wrote them in)."""
        line = json.dumps(sent, ensure_ascii=False).encode()
        if len(line) > self.max_line_bytes:
            raise LineProblem(
                "line_too_long",
                f"is {len(line)} bytes with its fetched image(s) inlined as data: URLs, over the limit of "
                f"{self.max_line_bytes}",
            )
        self._rewrites.add(self._line_no, line)
        self._fetched += self._fetched_in_line

    def stored(self, path: Path) -> DatasetReport:
        """The report of the file as it is stored, after finish(): for a valid upload whose image URLs were
        fetched, the received file at `path` is rewritten with them inlined (and the report gives its size,
        sha256 and stats.images_fetched); else it stays as received."""
        report = self.finish()
        try:
            if not report.valid or not self._rewrites:
                return report
            size, sha256 = self._rewrites.apply(path)
            stats = {**report.stats, "images_fetched": self._fetched}
            return report.model_copy(update={"size_bytes": size, "sha256": sha256, "stats": stats})
        finally:
            self._rewrites.close()

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineProblem(
                "invalid_utf8", f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
            ) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise LineProblem("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise LineProblem("invalid_json", "invalid JSON: nested too deeply") from None
        except ValueError as e:  # e.g. an integer with too many digits
            raise LineProblem("invalid_json", f"invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise LineProblem("not_an_object", f"expected a JSON object; got {json_type(obj)}")
        return obj

    def _line_format(self, obj: dict[str, Any], fmt: Format | None) -> Format:
        """The line's format, which must be the file's; sets the file's format from its first line."""
        guess = fmt or partial_format(obj) or self._format
        if guess is None:
            raise LineProblem("unknown_format", unknown_format_message(obj, self._reverse))
        if self._format is not None and guess != self._format:
            raise LineProblem(
                "mixed_formats",
                f'format is "{guess}" but the file\'s format is "{self._format}" (from line '
                f"{self._format_line}); a file must use one format",
            )
        if fmt is None:
            missing = next(k for k in REQUIRED[guess] if k not in obj)
            raise LineProblem("missing_field", f'is required (format "{guess}")', missing)
        if self._format is None:
            self._format, self._format_line = fmt, self._line_no
        return fmt

    def _user_field(self, field: str | None) -> str | None:
        if field is None or not self._reverse:
            return field
        root, sep, rest = field.partition("[")
        return self._reverse.get(root, root) + sep + rest


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
    validator.feed_file(path)
    return validator.finish()
