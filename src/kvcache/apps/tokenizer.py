"""Tokenizers for the command line: a byte-level one for the tiny random model, and streaming.

``ByteTokenizer`` maps text to its UTF-8 bytes (ids 0..255), the vocabulary of
:func:`kvcache.apps.tiny.tiny_model`. Ids 0, 1 and 2 are that model's pad, BOS and EOS tokens, which
as bytes are control characters; nothing special is done about them.

Streaming output one token at a time must not print half a character: a UTF-8 character can span
several byte tokens, and a multi-byte piece of a BPE vocabulary can be split across tokens too.
:func:`stream_decoder` gives, for any tokenizer, an object with ``feed(ids) -> str`` (the text
that is now final) and ``flush() -> str`` (whatever is still held back, at the end).
"""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from transformers.generation.streamers import BaseStreamer

__all__ = ["ByteTokenizer", "StreamDecoder", "TokenStreamer", "stream_decoder"]

REPLACEMENT = "\ufffd"


class StreamDecoder(Protocol):
    def feed(self, ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class ByteTokenizer:
    """Text <-> UTF-8 bytes; token id ``i`` is the byte ``i``."""

    vocab_size = 256
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``. ``add_special_tokens`` is accepted for parity with
        Hugging Face tokenizers and ignored: no BOS is added."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        """Bytes decoded as UTF-8; invalid or incomplete sequences become U+FFFD."""
        return bytes(_byte_ids(ids)).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def stream_decoder(self) -> _ByteStreamDecoder:
        return _ByteStreamDecoder()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _byte_ids(ids: Iterable[int] | Any) -> list[int]:
    if hasattr(ids, "tolist"):  # a tensor or an array
        ids = ids.tolist()
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < 256]
    if bad:
        raise ValueError(f"byte token ids must be in 0..255, got {bad[0]}")
    return out


class _ByteStreamDecoder:
    """Incremental UTF-8: a character's leading bytes are held until it is complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self._decoder.decode(bytes(_byte_ids(ids)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _DiffStreamDecoder:
    """Any tokenizer with ``decode(ids)``: decode the pending ids, print what is new.

    Text ending in U+FFFD is held back (an unfinished multi-byte character). After a newline the
    pending ids start afresh, so the cost stays linear in practice (as ``TextStreamer`` does).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._printed = 0

    def _decode(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)

    def feed(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        text = self._decode()
        if text.endswith(REPLACEMENT):
            return ""
        new = text[self._printed :]
        if text.endswith("\n"):
            self._ids, self._printed = [], 0
        else:
            self._printed = len(text)
        return new

    def flush(self) -> str:
        new = self._decode()[self._printed :]
        self._ids, self._printed = [], 0
        return new


def stream_decoder(tokenizer: Any) -> StreamDecoder:
    """An incremental decoder for ``tokenizer`` (its own ``stream_decoder()`` if it has one)."""
    own = getattr(tokenizer, "stream_decoder", None)
    if callable(own):
        return own()
    return _DiffStreamDecoder(tokenizer)


class TokenStreamer(BaseStreamer):
    """Prints generated text as ``generate`` produces it (a ``transformers`` streamer).

    ``generate`` first hands over the prompt (skipped), then each new token. Text is written to
    ``stream`` and flushed as soon as it is final (see :func:`stream_decoder`); ``end()`` writes
    what was held back and a newline. On a terminal, control characters other than newline and
    tab are shown escaped (``\\x1b``) so random models cannot send terminal commands.
    Counts tokens and notes when the first one arrived (the end of the prefill).
    """

    def __init__(self, tokenizer: Any, stream: Any = None) -> None:
        self._decoder = stream_decoder(tokenizer)
        self._stream = stream if stream is not None else sys.stdout
        self._prompt_seen = False
        self.tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        ids = value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens += len(ids)
        self._write(self._decoder.feed(ids))

    def end(self) -> None:
        self._write(self._decoder.flush() + "\n")
        self._prompt_seen = False

    def _write(self, text: str) -> None:
        if not text:
            return
        try:
            tty = bool(self._stream.isatty())
        except (AttributeError, ValueError):
            tty = False
        if tty:
            text = text.translate(_CONTROL_ESCAPES)
        try:
            self._stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            self._stream.write(text.encode(encoding, errors="replace").decode(encoding))
        self._stream.flush()


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\n\t"}
