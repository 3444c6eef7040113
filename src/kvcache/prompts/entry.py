"""A prompt store entry as bytes: a magic number, a digest that binds the payload to its key, and
the payload (a kvcache file's bytes, ``persist``).

The digest (``stream``): without a secret, the entry checksum of the key and the payload
(``checksum``: a fast fold of every byte, then SHA-256), which catches accidents: a torn,
truncated or bit-flipped value, an entry copied under another key, another program's value.
With a ``secret``, HMAC-SHA256 of the key and every byte, which also refuses entries written by
anyone who does not hold it (a shared Redis others can write to). What the payload claims
(shapes, kinds, token ids) is then checked against the model, as a loaded file is.

``unseal`` checks a whole entry before its payload is read; a chunk entry is instead checked as
it is copied into a cache (``chunk_fill``), with ``split`` and ``check_digest`` from here.
"""

from __future__ import annotations

import hmac

from ..errors import StoreEntryError
from .stream import Runs, copy_and_digest

MAGIC = b"KVCPS\x00\x02\x00"
DIGEST_BYTES = 32


def seal(key: str, payload: bytes, secret: bytes | None = None) -> bytes:
    """The entry stored under ``key`` for ``payload``."""
    return MAGIC + copy_and_digest(payload, Runs.none(), key, secret) + payload


def split(key: str, raw: object) -> tuple[bytes, memoryview]:
    """The digest an entry states and its payload (a view of ``raw``); raises ``StoreEntryError``
    if ``raw`` is not bytes, too short for an entry, or not an entry of this version."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise StoreEntryError(f"entry {key[:16]}: expected bytes, got {type(raw).__name__}")
    view = memoryview(raw).cast("B")
    if len(view) < len(MAGIC) + DIGEST_BYTES:
        raise StoreEntryError(f"entry {key[:16]}: {len(view)} bytes is too short for an entry (truncated)")
    if view[: len(MAGIC)] != MAGIC:
        raise StoreEntryError(f"entry {key[:16]}: not a kvcache prompt store entry (or of another version)")
    return bytes(view[len(MAGIC) : len(MAGIC) + DIGEST_BYTES]), view[len(MAGIC) + DIGEST_BYTES :]


def check_digest(key: str, stated: bytes, computed: bytes, secret: bytes | None) -> None:
    """Raise ``StoreEntryError`` unless the digest an entry states is the one its bytes give."""
    if not hmac.compare_digest(stated, computed):
        signed = "signed with this store's secret" if secret is not None else "the one stored"
        raise StoreEntryError(f"entry {key[:16]}: digest mismatch: damaged, stored under another key, or not {signed}")


def unseal(key: str, raw: object, secret: bytes | None = None) -> memoryview:
    """The payload of the entry ``raw`` stored under ``key`` (a view of it), its digest checked;
    raises ``StoreEntryError`` naming the problem if it is not an entry, is damaged, or belongs to
    another key (or secret)."""
    stated, payload = split(key, raw)
    check_digest(key, stated, copy_and_digest(payload, Runs.none(), key, secret), secret)
    return payload
