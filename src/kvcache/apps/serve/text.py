"""A request's prompt as token ids, its generated tokens as text, cut at the first stop string, and
their log-probabilities in the OpenAI API's two shapes (from the engine's, ``engine/logprobs.py``).

``TextStream.update(tokens)`` takes every token generated so far and returns the text not handed
out yet. It decodes the whole output each time (outputs are short next to a prompt; this keeps
multi-token characters whole: text that ends in an unfinished character, U+FFFD, is held back until
the next token completes it). A stop string ends the text before it; text that could be the start
of a stop string is held back until it is known not to be.

Log-probabilities, completions (the legacy shape): ``tokens`` (each token's text),
``token_logprobs``, ``top_logprobs`` (per token a dict text -> log-probability of the ``logprobs``
most likely) and ``text_offset`` (where each token's text starts in the choice's text), with
``echo`` the prompt's tokens first (the first token's entries null: nothing comes before it). Chat:
``content``, one object per generated token with ``token``, ``logprob``, ``bytes`` and
``top_logprobs``. A token's text is the tokenizer's decoding of that token alone, so offsets are
exact for tokenizers whose tokens decode to their share of the text (byte-level BPE) and
approximate where decoding depends on neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """A chat's prompt: ``messages`` through the model's chat template, the assistant's turn opened."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def text_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A completion's prompt given as text."""
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


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
        found = [i for i in (text.find(s, max(0, len(self.sent) - len(s))) for s in self.stop) if i >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        elif not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self._partial_stop(text)]
        if not text.startswith(self.sent):  # a later token changed how earlier ones decode: send only what extends
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def _partial_stop(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


def covered(tokenizer: Any, ids: Sequence[int], text: str, whole: bool = False) -> int:
    """How many of the generated ``ids`` the emitted ``text`` covers: every token that starts in it
    (the final text, which a stop string may cut), or with ``whole`` only those that end in it (a
    stream's text so far, whose last token may still be held back)."""
    length = 0
    for n, t in enumerate(ids):
        if length >= len(text):
            return n
        length += len(tokenizer.decode([t]))
        if whole and length > len(text):
            return n
    return len(ids)


def length_of(tokenizer: Any, ids: Sequence[int]) -> int:
    """Characters the tokens ``ids`` decode to, one by one (where the next token's text starts)."""
    return sum(len(tokenizer.decode([t])) for t in ids)


def completion_logprobs(tokenizer: Any, ids: Sequence[int], scores: Sequence[Any], at: int = 0) -> dict[str, Any]:
    """The completions shape for tokens ``ids`` and their ``scores`` (``TokenLogprob`` or None), the
    first token's text at offset ``at`` of the choice's text."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for t, s in zip(ids, scores):
        tokens.append(tokenizer.decode([t]))
        offsets.append(at)
        at += len(tokens[-1])
        logprobs.append(None if s is None else s.logprob)
        tops.append(None if s is None else {tokenizer.decode([a]): v for a, v in s.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, scores: Sequence[Any]) -> dict[str, Any]:
    """The chat shape for the generated tokens' ``scores``."""
    content = [{**_entry(tokenizer, s.token, s.logprob), "top_logprobs": [_entry(tokenizer, a, v) for a, v in s.top]}
               for s in scores]
    return {"content": content, "refusal": None}
