"""A request's generated tokens as text, piece by piece, cut at the first stop string.

``TextStream.update(tokens)`` takes every token generated so far and returns the text not handed
out yet. It decodes the whole output each time (outputs are short next to a prompt; this keeps
multi-token characters whole: text that ends in an unfinished character, U+FFFD, is held back until
the next token completes it). A stop string ends the text before it; text that could be the start
of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = ""  # text handed out
        self.stopped = False  # a stop string was found: nothing more comes

    def update(self, tokens: Sequence[int], final: bool = False) -> str:
        """The new text after ``tokens`` (all generated so far); ``final``: no more tokens come, so
        nothing is held back."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        cut = self._first_stop(text)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self._partial_stop(text)]
        if not text.startswith(self.sent):  # a later token changed how earlier ones decode: send only what extends
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, len(self.sent) - len(s))) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _partial_stop(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
