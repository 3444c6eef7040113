"""A prompt store entry as bytes: a magic number, a digest that binds the payload to its key, and
the payload (a kvcache file's bytes, ``persist``).

The digest is SHA-256 of ``key || payload``, or, when the store has a ``secret``, HMAC-SHA256 with
it. Without a secret the digest catches accidents: a torn, truncated or bit-flipped value, an entry
copied under another key, another program's value. With a secret it also refuses entries written
by anyone who does not hold it (a shared Redis others can write to). What the payload claims
(shapes, kinds, token ids) is then checked against the model, as a loaded file is.
"""

from __future__ import annotations

import hashlib
import hmac

from ..errors import StoreEntryError

MAGIC = b"KVCPS\x00\x01\x00"
_DIGEST = 32


def _digest(key: str, payload: bytes | memoryview, secret: bytes | None) -> bytes:
    if secret is None:
        h = hashlib.sha256(key.encode())
    else:
        h = hmac.new(secret, key.encode(), hashlib.sha256)
    h.update(payload)
    return h.digest()


def seal(key: str, payload: bytes, secret: bytes | None = None) -> bytes:
    """The entry stored under ``key`` for ``payload``."""
    return MAGIC + _digest(key, payload, secret) + payload


def unseal(key: str, raw: bytes, secret: bytes | None = None) -> bytes:
    """The payload of the entry ``raw`` stored under ``key``; raises ``StoreEntryError`` naming the
    problem if it is not an entry, is damaged, or belongs to another key (or secret)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise StoreEntryError(f"entry {key[:16]}: expected bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) < len(MAGIC) + _DIGEST:
        raise StoreEntryError(f"entry {key[:16]}: {len(raw)} bytes is too short for an entry (truncated)")
    if raw[: len(MAGIC)] != MAGIC:
        raise StoreEntryError(f"entry {key[:16]}: not a kvcache prompt store entry (or of another version)")
    payload = memoryview(raw)[len(MAGIC) + _DIGEST :]
    want = raw[len(MAGIC) : len(MAGIC) + _DIGEST]
    if not hmac.compare_digest(_digest(key, payload, secret), want):
        signed = "signed with this store's secret" if secret is not None else "the one stored"
        raise StoreEntryError(f"entry {key[:16]}: digest mismatch: damaged, stored under another key, or not {signed}")
    return bytes(payload)
