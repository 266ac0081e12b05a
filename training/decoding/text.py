"""Generated ids -> text released so far, holding back what might still become a stop string.

A row's text is its ids decoded without special tokens (unless kept: tool-call markup), end tokens left
out. Text is released as soon as it cannot be the start of a stop string; a stop string ends the row at
that token, its text cut where the stop string starts. A piece that ends in an incomplete UTF-8 sequence
waits for its next bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field


@dataclass
class TextStream:
    tokenizer: object
    stop: tuple[str, ...]
    eos: Collection[int]
    on_text: Callable[[str], None]
    keep_special: bool = False  # special tokens stay in the text (tool-call markup such as [TOOL_CALLS])
    ids: list[int] = field(default_factory=list)
    released: int = 0
    stopped: bool = False
    text: str = ""

    def add(self, token: int) -> None:
        if self.stopped:
            return
        if token in self.eos:
            self.stopped = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=not self.keep_special)  # type: ignore[attr-defined]
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            return
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text, self.stopped = text[:at], True
        self.text = text
        hold = 0 if self.stopped else _held_back(text, self.stop)
        self._release(len(text) - hold)

    def finish(self) -> None:
        self._release(len(self.text))

    def _release(self, upto: int) -> None:
        if upto > self.released:
            self.on_text(self.text[self.released : upto])
            self.released = upto


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
