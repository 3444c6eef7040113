"""Log-probabilities in the OpenAI API's two shapes, from the engine's (``engine/logprobs.py``).

Completions (the legacy shape): ``tokens`` (each token's text), ``token_logprobs``,
``top_logprobs`` (per token a dict text -> log-probability of the ``logprobs`` most likely) and
``text_offset`` (where each token's text starts in the choice's text), with ``echo`` the prompt's
tokens first (the first token's entries null: nothing comes before it). Chat: ``content``, one
object per generated token with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``.

A token's text is the tokenizer's decoding of that token alone, so offsets are exact for
tokenizers whose tokens decode to their share of the text (byte-level BPE) and approximate where
decoding depends on neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
        text = tokenizer.decode([t])
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        logprobs.append(None if s is None else s.logprob)
        tops.append(None if s is None else {tokenizer.decode([a]): v for a, v in s.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, scores: Sequence[Any]) -> dict[str, Any]:
    """The chat shape for the generated tokens' ``scores``."""
    content = [
        {**_entry(tokenizer, s.token, s.logprob), "top_logprobs": [_entry(tokenizer, a, v) for a, v in s.top]} for s in scores
    ]
    return {"content": content, "refusal": None}
