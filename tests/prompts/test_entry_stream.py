"""The entry checksum and the one pass that copies an entry and computes its digest: the C++ library
against the numpy definition, the path without the library, signed stores, and that no change to an
entry's bytes or key gets past the digest."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.prompts import checksum, stream
from kvcache.prompts.stream import Runs, copy_and_digest

needs_library = pytest.mark.skipif(stream._fused() is None, reason="the entry_stream library did not build here")


@pytest.fixture(params=["library", "numpy"])
def path(request, monkeypatch):
    """Each way of streaming: the C++ library (where it builds) and the numpy definition without it."""
    if request.param == "library" and stream._fused() is None:
        pytest.skip("the entry_stream library did not build here")
    if request.param == "numpy":
        monkeypatch.setattr(stream, "_fused", lambda: None)
    return request.param


def runs_into(target: np.ndarray, pieces: list[tuple[int, int, int]]) -> Runs:
    """Runs copying ``(offset, length, at)`` pieces of an entry to ``target[at:]``."""
    offsets, lengths, ats = (np.array(column, dtype=np.int64) for column in zip(*pieces)) if pieces else ([np.zeros(0, np.int64)] * 3)
    return Runs(offsets, lengths, target.ctypes.data + ats).sorted()


@needs_library
@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3 * checksum.BLOCK + 100))
def test_the_library_folds_blocks_as_the_definition_does(data):
    lib = stream._fused()
    raw = np.frombuffer(data, dtype=np.uint8)
    sums = np.empty((-(-raw.size // checksum.BLOCK), 2), dtype=np.uint64)
    assert lib.kv_entry_stream(raw.ctypes.data, raw.size, checksum.KEY.ctypes.data, sums.ctypes.data, 0, None, None, None) == 0
    assert np.array_equal(sums, checksum.block_sums(data))


@settings(max_examples=30, deadline=None)
@given(size=st.integers(0, 5 * checksum.BLOCK), cuts=st.lists(st.integers(0, 5 * checksum.BLOCK), max_size=6), secret=st.sampled_from([None, b"s"]))
def test_runs_land_where_they_are_sent_and_the_digest_is_the_same_either_way(size, cuts, secret):
    data = os.urandom(size)
    bounds = sorted({0, size, *(c % (size + 1) for c in cuts)})
    pieces = [(lo, hi - lo, lo) for lo, hi in zip(bounds, bounds[1:])]  # the whole entry, in pieces
    digests = []
    for fused in ([stream._fused] if stream._fused() is not None else []) + [lambda: None]:
        target = np.zeros(size, dtype=np.uint8)
        original, stream._fused = stream._fused, fused
        try:
            digests.append(copy_and_digest(data, runs_into(target, pieces), "key", secret))
        finally:
            stream._fused = original
        assert target.tobytes() == data
    assert len(set(digests)) == 1


def test_the_digest_is_the_checksum_of_key_length_and_blocks(path):
    data = os.urandom(2 * checksum.BLOCK + 7)
    assert copy_and_digest(data, Runs.none(), "k", None) == checksum.digest("k", len(data), checksum.block_sums(data))
    prefix = struct.pack("<Q", 1) + b"k"
    assert copy_and_digest(data, Runs.none(), "k", b"secret") == hmac.new(b"secret", prefix + data, hashlib.sha256).digest()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3 * checksum.BLOCK), at=st.integers(0, 10**9), bit=st.integers(0, 7))
def test_any_flipped_bit_changes_the_digest(size, at, bit):
    data = bytearray(os.urandom(size))
    before = copy_and_digest(bytes(data), Runs.none(), "key", None)
    data[at % size] ^= 1 << bit
    assert copy_and_digest(bytes(data), Runs.none(), "key", None) != before


def test_the_digest_names_the_key_and_the_length(path):
    data = os.urandom(1000)
    digest = copy_and_digest(data, Runs.none(), "key", None)
    assert copy_and_digest(data, Runs.none(), "key2", None) != digest
    assert copy_and_digest(data + b"\x00", Runs.none(), "key", None) != digest  # zero padding is not the same entry
    assert copy_and_digest(data[:-1], Runs.none(), "key", None) != digest


def test_a_block_moved_to_another_place_is_another_entry(path):
    a, b = os.urandom(checksum.BLOCK), os.urandom(checksum.BLOCK)
    assert copy_and_digest(a + b, Runs.none(), "k", None) != copy_and_digest(b + a, Runs.none(), "k", None)


@pytest.mark.parametrize("pieces", [[(-1, 4, 0)], [(90, 20, 0)], [(0, -3, 0)], [(50, 10, 0), (10, 10, 10)]])
def test_runs_outside_the_entry_are_refused_before_anything_is_copied(path, pieces):
    target = np.zeros(200, dtype=np.uint8)
    runs = Runs(*(np.array(column, dtype=np.int64) for column in zip(*pieces)))
    runs = Runs(runs.offsets, runs.lengths, target.ctypes.data + np.maximum(runs.offsets, 0))
    with pytest.raises(ValueError, match="outside the entry"):
        copy_and_digest(os.urandom(100), runs, "k", None)
    assert not target.any()


def test_the_key_stream_never_repeats_a_word_the_two_sums_share():
    key = checksum.KEY
    assert key.size == checksum.WORDS + 2 and not np.any(key[1 : checksum.WORDS : 2] == key[3 : checksum.WORDS + 2 : 2])
