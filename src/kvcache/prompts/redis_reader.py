"""Replies to ``GET`` read from a Redis connection's socket straight into a caller's buffer.

redis-py's own parser reads a value 64 KiB at a time into a ``BytesIO``, then copies it out: at
a few hundred MB/s it was the Redis backend's bottleneck for entries of megabytes. ``read_bulk``
reads the length line of a reply, then the value with ``recv_into`` into a buffer the caller
reuses, so the bytes are copied once, from the kernel. It speaks just what ``GET`` answers in
RESP2 and RESP3: a bulk string, a null (``$-1`` or ``_``), or an error (a key of another type:
a miss). A value over ``limit`` bytes is refused before it is read (``TooLarge``): the caller
then drops the connection, which still holds it.
"""

from __future__ import annotations

import socket

#: The longest reply line read (a bulk string's length, an error message).
MAX_LINE = 64 * 1024


class TooLarge(Exception):
    """A reply announces a value longer than the reader may take."""


class ProtocolError(ConnectionError):
    """The server sent something ``GET`` never answers (the connection is of no further use)."""


class BulkReader:
    """Reads ``GET`` replies in order from ``sock`` (a connected socket, TLS included), keeping
    the bytes read past a reply's line (``_pending``) for what follows."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending = bytearray()

    def _line(self) -> bytes:
        while True:
            end = self._pending.find(b"\r\n")
            if end >= 0:
                line = bytes(self._pending[:end])
                del self._pending[: end + 2]
                return line
            if len(self._pending) > MAX_LINE:
                raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            self._pending += self._recv(4096)

    def _recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def read_bulk(self, buffer: bytearray, limit: int) -> memoryview | None:
        """The next reply's value: a view of ``buffer``, or of a new bytearray when ``buffer`` is
        too small (``view.obj`` is then the buffer to reuse); None for a null or an error."""
        line = self._line()
        kind = line[:1]
        if kind in (b"_", b"-"):
            return None
        if kind != b"$" or not line[1:].lstrip(b"-").isdigit():
            raise ProtocolError(f"not a reply to GET: {line[:40]!r}")
        size = int(line[1:])
        if size < 0:
            return None
        if size > limit:
            raise TooLarge(f"a value of {size} bytes, more than {limit}")
        target = buffer if len(buffer) >= size else bytearray(size)
        view = memoryview(target)[:size]
        got = min(size, len(self._pending))
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the server closed the connection")
            got += n
        while len(self._pending) < 2:
            self._pending += self._recv(2 - len(self._pending))
        if self._pending[:2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        del self._pending[:2]
        return view
