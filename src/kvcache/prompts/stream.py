"""An entry's bytes copied to where they belong, its digest computed over every byte on the way.

``copy_and_digest(data, runs, key, secret)`` copies each run (bytes ``[offset, offset + length)``
of ``data`` to a CPU address) and returns the entry's digest over all of ``data``:

- no secret: the entry checksum (``checksum``), folded block by block by ``csrc/entry_stream.cpp``
  as the same pass copies the block, so the bytes are read once; where the library cannot be
  built (or on a big-endian host), ``checksum.block_sums`` in numpy and one ``memmove`` per run;
- a secret: HMAC-SHA256 over every byte (``hashlib``, at its speed), then the copies.

The caller compares the digest with the one the entry states, and uses what was copied only if
they agree: a mismatch leaves its destinations written but not counted, as if never touched.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import struct
import sys
from dataclasses import dataclass

import numpy as np

from ..attention.native_build import library
from . import checksum


@dataclass(frozen=True)
class Runs:
    """Copy runs, int64 ``[N]`` each, sorted by ``offsets``: ``lengths[j]`` bytes from
    ``offsets[j]`` in the entry to the CPU address ``targets[j]``."""

    offsets: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray

    @classmethod
    def none(cls) -> Runs:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, empty)

    def sorted(self) -> Runs:
        order = np.argsort(self.offsets, kind="stable")
        return Runs(*(np.ascontiguousarray(a[order], dtype=np.int64) for a in (self.offsets, self.lengths, self.targets)))

    def check(self, size: int) -> None:
        """Raise ``ValueError`` unless every run lies inside an entry of ``size`` bytes, in order."""
        o, n = self.offsets, self.lengths
        if o.size and (o.min() < 0 or n.min() < 0 or np.any(o + n > size) or np.any(np.diff(o) < 0)):
            raise ValueError(f"copy runs outside the entry's {size} bytes, or out of order")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kv_entry_stream.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr]
    lib.kv_entry_stream.restype = ctypes.c_int
    return lib


def _fused() -> ctypes.CDLL | None:
    """The entry stream library, or None (not built, turned off, or a big-endian host)."""
    return library("entry_stream", _declare) if sys.byteorder == "little" else None


def hmac_digest(secret: bytes, key: str, data: memoryview | bytes) -> bytes:
    """The digest of a signed store: HMAC-SHA256 of the key (length-prefixed) and every byte."""
    name = key.encode()
    h = hmac.new(secret, struct.pack("<Q", len(name)) + name, hashlib.sha256)
    h.update(data)
    return h.digest()


def copy_and_digest(data: memoryview | bytes, runs: Runs, key: str, secret: bytes | None) -> bytes:
    """Copy ``runs`` out of ``data`` (an entry's bytes, stored under ``key``) and return its digest
    (see the module docstring). ``runs`` are checked against ``data`` before anything is copied."""
    raw = np.frombuffer(data, dtype=np.uint8)
    runs.check(raw.size)
    lib = _fused()
    if secret is not None:
        digest = hmac_digest(secret, key, data)
        _copy(lib, raw, runs, None)
        return digest
    if lib is None:
        sums = checksum.block_sums(data)
        _copy(None, raw, runs, None)
    else:
        sums = np.empty((-(-raw.size // checksum.BLOCK), 2), dtype=np.uint64)
        _copy(lib, raw, runs, sums)
    return checksum.digest(key, raw.size, sums)


def _copy(lib: ctypes.CDLL | None, raw: np.ndarray, runs: Runs, sums: np.ndarray | None) -> None:
    """The runs copied (and, given ``sums``, the blocks folded into it) by the library, or one
    ``memmove`` a run without it."""
    if lib is None:
        base = raw.ctypes.data
        for offset, length, target in zip(runs.offsets.tolist(), runs.lengths.tolist(), runs.targets.tolist()):
            ctypes.memmove(target, base + offset, length)
        return
    key = None if sums is None else checksum.KEY.ctypes.data
    done = lib.kv_entry_stream(
        raw.ctypes.data, raw.size, key, None if sums is None else sums.ctypes.data,
        runs.offsets.size, runs.offsets.ctypes.data, runs.lengths.ctypes.data, runs.targets.ctypes.data,
    )
    if done != 0:  # checked above: only a bug gets here
        raise RuntimeError("entry_stream refused the copy runs")
