"""What an import did, item by item: a progress line as each one is decided, and the end report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class Outcome(Enum):
    MOVED = "moved"
    THERE = "already there"
    NOT_MOVED = "not moved"


# What a progress line says for each outcome, in a real run and in a dry run.
VERBS = {
    (Outcome.MOVED, False): "copied",
    (Outcome.MOVED, True): "would copy",
    (Outcome.THERE, False): "already there",
    (Outcome.THERE, True): "already there",
    (Outcome.NOT_MOVED, False): "NOT moved",
    (Outcome.NOT_MOVED, True): "would NOT move",
}


@dataclass(frozen=True)
class Entry:
    kind: str  # "file" | "job"
    source_id: str
    outcome: Outcome
    dest_id: str | None  # the copy in ftune (None: not moved, or not yet in a dry run)
    detail: str  # what it is, or why it was not moved


def _say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Report:
    dry_run: bool
    say: Callable[[str], None] = _say
    entries: list[Entry] = field(default_factory=list)

    def add(self, kind: str, source_id: str, outcome: Outcome, dest_id: str | None, detail: str) -> None:
        entry = Entry(kind, source_id, outcome, dest_id, detail)
        self.entries.append(entry)
        arrow = f" -> {dest_id}" if dest_id else ""
        self.say(f"{kind:<4} {source_id}: {VERBS[outcome, self.dry_run]}{arrow}  {detail}".rstrip())

    def note(self, line: str) -> None:
        """A line under the item just reported (a memory plan, a warning)."""
        self.say(f"       {line}")

    def of(self, outcome: Outcome) -> list[Entry]:
        return [e for e in self.entries if e.outcome == outcome]

    def _tally(self, entries: list[Entry]) -> str:
        moved = "would copy" if self.dry_run else "copied"
        counts = {o: sum(e.outcome == o for e in entries) for o in Outcome}
        there, not_moved = counts[Outcome.THERE], counts[Outcome.NOT_MOVED]
        return f"{counts[Outcome.MOVED]} {moved}, {there} already there, {not_moved} not moved"

    def summary(self) -> list[str]:
        head = "dry run (nothing was changed)" if self.dry_run else "done"
        lines = [f"{head}: {self._tally(self.entries)}"]
        for kind in ("file", "job"):
            lines.append(f"  {kind}s: {self._tally([e for e in self.entries if e.kind == kind])}")
        if self.dry_run and any(e.outcome is Outcome.MOVED for e in self.entries):
            lines.append(
                "  (a dry run knows a file is in ftune only when a job imported before uses it; a real run "
                "skips every file and job it copied before)"
            )
        if self.of(Outcome.NOT_MOVED):
            lines.append("not moved, and why:")
            lines += [f"  {e.kind} {e.source_id}: {e.detail}" for e in self.of(Outcome.NOT_MOVED)]
        return lines

    def finish(self) -> int:
        """Print the end report; the exit status: 0 when everything is in ftune, 1 when something is not."""
        for line in self.summary():
            self.say(line)
        return 1 if self.of(Outcome.NOT_MOVED) else 0
