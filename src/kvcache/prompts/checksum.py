"""The entry checksum: what finds a damaged entry in a store no secret signs.

Without a secret the digest can only catch accidents (a torn, truncated or bit-flipped value, an
entry under another key): anyone who can write the store can also recompute any public digest.
So it need not be a cryptographic hash of every byte, only one no accident gets past, and it must
cost next to nothing beside the copy the bytes take anyway (SHA-256 runs at about 2 GB/s a core,
a tenth of a copy). It is built in two steps:

- each 4096-byte block (1024 little-endian 32-bit words, the last block zero-padded) folds into
  two 64-bit sums ``s_t = sum_i (w[2i] + K[2i + 2t]) * (w[2i + 1] + K[2i + 2t + 1])`` (additions
  mod 2^32, products and sums mod 2^64; ``K`` is a fixed key stream), the NH hash of UMAC, twice
  with the key shifted by one pair: a change to any one word changes each sum unless its partner
  word plus the key is 0 mod 2^32, and never both (``K`` is chosen so), a random change passes
  one block with odds of about 2^-64;
- SHA-256 over the entry's key, its length and every block's sums, in order, binds the blocks to
  their places, the entry to its key and its length to the bytes.

A block folds in a few cycles (vector multiplies, no carries between lanes), so the fused copy in
``csrc/entry_stream.cpp`` runs at the speed of the copy; ``block_sums`` here is the definition, in
numpy, which that code is held to and which runs where the library cannot be built.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

BLOCK = 4096
WORDS = BLOCK // 4
_DOMAIN = b"kvcache-entry-checksum/1"


def _key_stream() -> np.ndarray:
    """``K``: ``WORDS + 2`` words of SHA-256 in counter mode (fixed, so every process agrees)."""
    raw = b"".join(hashlib.sha256(_DOMAIN + struct.pack("<I", i)).digest() for i in range((WORDS + 2) * 4 // 32 + 1))
    key = np.frombuffer(raw, dtype="<u4")[: WORDS + 2].copy()
    # The two sums use key words 2i+1 and 2i+3 beside word 2i+1 of a block: equal, one change could pass both.
    assert not np.any(key[1:WORDS:2] == key[3 : WORDS + 2 : 2])
    return key


KEY = _key_stream()


def block_sums(data: memoryview | bytes, *, slab: int = 256) -> np.ndarray:
    """Each block's two sums, ``[ceil(len(data) / BLOCK), 2]`` uint64 (the definition above;
    ``slab`` blocks at a time, to bound the temporaries)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    blocks = -(-raw.size // BLOCK)
    out = np.empty((blocks, 2), dtype=np.uint64)
    for first in range(0, blocks, slab):
        piece = raw[first * BLOCK : (first + slab) * BLOCK]
        count = -(-piece.size // BLOCK)
        if piece.size != count * BLOCK:
            piece = np.concatenate([piece, np.zeros(count * BLOCK - piece.size, dtype=np.uint8)])
        words = piece.view("<u4").reshape(count, WORDS)
        even, odd = words[:, 0::2], words[:, 1::2]
        for t in (0, 1):
            a = (even + KEY[2 * t : 2 * t + WORDS : 2]).astype(np.uint64)  # uint32 additions wrap
            b = (odd + KEY[2 * t + 1 : 2 * t + 1 + WORDS : 2]).astype(np.uint64)
            out[first : first + count, t] = (a * b).sum(axis=1, dtype=np.uint64)
    return out


def digest(key: str, length: int, sums: np.ndarray) -> bytes:
    """The checksum of an entry of ``length`` bytes stored under ``key``, from its ``block_sums``."""
    name = key.encode()
    h = hashlib.sha256(_DOMAIN + struct.pack("<Q", len(name)) + name + struct.pack("<Q", length))
    h.update(np.ascontiguousarray(sums, dtype="<u8").data)
    return h.digest()
