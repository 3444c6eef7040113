"""Storage formats (``kvcache.formats``) against ``quant.py``'s formulas, the reference every holder
used before they shared one format: what a format encodes decodes as ``quant`` dequantizes it,
its layouts are the shapes it encodes to, its bytes are its layouts', and a pool's block storage
reads back what was written, a whole block or a slot at a time."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.errors import ShapeError
from kvcache.formats import BlockStorage, Codes, FullPrecision, Rotated, format_named, quant
from kvcache.formats.rotated import block_of, hadamard, rotate
from kvcache.formats.base import layout_bytes
from kvcache.formats.blocks import block_bytes


def randn(*shape, seed=0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5).to(dtype)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_codes_are_quant_per_token_for_keys_and_values(bits, dtype):
    fmt = Codes(bits, group=16)
    keys, values = randn(2, 3, 5, 32, seed=1, dtype=dtype), randn(2, 3, 5, 48, seed=2, dtype=dtype)
    k, v = fmt.encode_keys(keys), fmt.encode_values(values)
    for parts, x, prefix in ((k, keys, "k"), (v, values, "v")):
        q = quant.quantize_per_token(x, bits, 16)
        assert torch.equal(parts[prefix + "codes"], q.codes) and torch.equal(parts[prefix + "scale"], q.scale)
        assert torch.equal(parts[prefix + "min"], q.minimum)
    assert torch.equal(fmt.decode_keys(k), quant.dequantize_per_token(quant.quantize_per_token(keys, bits, 16), 16))
    assert fmt.decode_values(v, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_block_codes_are_quant_per_channel_for_keys(bits):
    fmt = Codes(bits, group=8, key_block=4)
    keys = randn(6, 2, 4, 16, seed=3)  # [blocks, Hkv, key_block, D]
    parts = fmt.encode_keys(keys)
    q = quant.quantize_per_channel(keys, bits)
    assert torch.equal(parts["kcodes"], q.codes) and torch.equal(parts["kscale"], q.scale.squeeze(-2))
    assert torch.equal(fmt.decode_keys(parts), quant.dequantize_per_channel(q))
    with pytest.raises(ShapeError, match="blocks of 4 tokens"):
        fmt.encode_keys(keys[:, :, :3])


@pytest.mark.parametrize("fmt", [FullPrecision(), FullPrecision(torch.bfloat16), Codes(8), Codes(4, 32), Codes(2, 16, key_block=8), Rotated(4, 32)])
def test_layouts_are_what_encoding_gives_and_bytes_are_the_layouts(fmt):
    D, Dv, dtype = 64, 32, torch.float32
    unit = () if fmt.key_block == 1 else (fmt.key_block,)
    keys, values = randn(3, 2, *unit, D, seed=4), randn(3, 2, Dv, seed=5)
    for layout, parts in ((fmt.key_layout(D, dtype), fmt.encode_keys(keys)), (fmt.value_layout(Dv, dtype), fmt.encode_values(values))):
        assert set(layout) == set(parts)
        for name, (shape, dt) in layout.items():
            assert parts[name].shape == (3, 2, *shape) and parts[name].dtype == dt, name
    per_token = layout_bytes(fmt.key_layout(D, dtype)) / fmt.key_block + layout_bytes(fmt.value_layout(Dv, dtype))
    assert math.isclose(fmt.bytes_per_token(D, Dv, dtype), per_token)


def test_full_precision_reads_back_the_same_tensors():
    fmt = FullPrecision()
    keys = randn(1, 2, 3, 8)
    assert fmt.decode_keys(fmt.encode_keys(keys)) is keys
    assert format_named("full").exact and not format_named("int4").exact
    with pytest.raises(ValueError, match="unknown slot storage 'int3'"):
        format_named("int3")


# ---- codes of rotated keys and values -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_the_hadamard_matrix_is_orthonormal_and_its_own_inverse(n):
    h = hadamard(n).double()
    torch.testing.assert_close(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)


@pytest.mark.parametrize("dim,block", [(64, 64), (96, 32), (80, 16), (6, 2), (7, 1)])
def test_the_rotation_turns_each_block_of_channels_and_turns_back(dim, block):
    assert block_of(dim) == block
    x = randn(2, 3, dim, seed=6).double()
    turned = rotate(x)
    expected = (x.view(2, 3, dim // block, block) @ hadamard(block).double()).view(2, 3, dim)
    torch.testing.assert_close(turned, expected)
    torch.testing.assert_close(rotate(turned), x)  # H is its own inverse
    torch.testing.assert_close(turned.norm(dim=-1), x.norm(dim=-1))  # and keeps lengths


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rotated_codes_are_per_token_codes_of_the_turned_tensors(bits):
    fmt = Rotated(bits, 16)
    keys, values = randn(2, 3, 5, 32, seed=7), randn(2, 3, 5, 48, seed=8)
    k, v = fmt.encode_keys(keys), fmt.encode_values(values)
    plain = Codes(bits, 16)
    for parts, x, prefix in ((k, keys, "k"), (v, values, "v")):
        q = quant.quantize_per_token(rotate(x), bits, 16)
        assert torch.equal(parts[prefix + "codes"], q.codes) and torch.equal(parts[prefix + "scale"], q.scale)
    torch.testing.assert_close(fmt.decode_keys(k), rotate(plain.decode_keys(k)))
    torch.testing.assert_close(fmt.decode_values(v), rotate(plain.decode_values(v)))
    assert fmt.name == f"int{bits}h" and format_named(f"int{bits}h").bits == bits
    assert fmt.decode_keys(k, torch.bfloat16).dtype == torch.bfloat16


def test_rotation_codes_keys_with_outlier_channels_finer():
    """What it is for: keys with a few large channels (as models' keys have) lose less to 4 bits."""
    keys = randn(1, 2, 200, 64, seed=9)
    keys[..., :3] *= 20
    error = {}
    for fmt in (Codes(4), Rotated(4)):
        back = fmt.decode_keys(fmt.encode_keys(keys))
        error[fmt.name] = float(((back - keys).norm(dim=-1) / keys.norm(dim=-1)).mean())
    assert error["int4h"] < 0.6 * error["int4"], error


def test_a_query_turned_like_the_keys_scores_the_codes_as_the_keys_read_back():
    fmt = Rotated(4)
    keys, query = randn(1, 2, 30, 64, seed=10), randn(1, 2, 3, 64, seed=11)
    parts = fmt.encode_keys(keys)
    plain = Codes(4).decode_keys(parts)  # the codes as stored: turned keys
    turned = fmt.rotate(query) @ plain.transpose(-1, -2)
    torch.testing.assert_close(turned, query @ fmt.decode_keys(parts).transpose(-1, -2), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Codes(3), "bits must be one of"),
        (lambda: format_named("int4x"), "int8h"),
        (lambda: Codes(8, 0), "group must be a positive"),
        (lambda: Codes(8, key_block=0), "key_block must be a positive"),
    ],
)
def test_bad_formats_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dims_a_format_cannot_pack_are_refused():
    with pytest.raises(ShapeError, match="multiples of 4"):
        Codes(2, 4).check_dims(6, 8)
    with pytest.raises(ShapeError, match="group_size 16"):
        Codes(8, 16).check_dims(16, 24)
    Codes(8, 16, key_block=4).check_dims(12, 32)  # keys per channel: no key group to split into


@pytest.mark.parametrize("fmt", [FullPrecision(torch.float32), Codes(4, 8, key_block=4), Codes(8, 8)])
def test_block_storage_reads_back_what_the_format_decodes(fmt):
    storage = BlockStorage(fmt, 2, 5, 2, 4, 16, 8, torch.float32, torch.device("cpu"))
    assert storage.nbytes == 5 * storage.block_nbytes
    assert storage.block_nbytes == block_bytes(fmt, 2, 2, 4, 16, 8, torch.float32)
    keys, values = randn(3, 2, 4, 16, seed=6), randn(3, 2, 4, 8, seed=7)
    index = torch.tensor([4, 0, 2])
    storage.write_blocks(1, index, keys, values)
    got_k, got_v = storage.read_blocks(1, index)
    assert torch.equal(got_k, fmt.decode_keys(fmt.encode_keys(keys))) and torch.equal(got_v, fmt.decode_values(fmt.encode_values(values)))
    assert not any(t[0].any() for t in storage.tensors.values())  # layer 0 untouched
    storage.copy(1, 4)
    assert all(torch.equal(a, b) for a, b in zip(storage.read_blocks(1, torch.tensor([1])), storage.read_blocks(1, torch.tensor([4]))))


def test_single_slots_are_written_where_keys_are_kept_per_token_only():
    full = BlockStorage(FullPrecision(), 1, 3, 1, 4, 8, 8, torch.float32, torch.device("cpu"))
    k, v = randn(2, 1, 8, seed=8), randn(2, 1, 8, seed=9)
    full.write_slots(0, torch.tensor([2, 0]), torch.tensor([3, 1]), k, v)
    assert torch.equal(full.tensors["keys"][0, 2, :, 3], k[0]) and torch.equal(full.tensors["values"][0, 0, :, 1], v[1])
    coded = BlockStorage(Codes(8, 8, key_block=4), 1, 3, 1, 4, 8, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ShapeError, match="cannot be written alone"):
        coded.write_slots(0, torch.tensor([0]), torch.tensor([0]), k[:1], v[:1])
    with pytest.raises(ShapeError, match="over 3 tokens"):
        BlockStorage(Codes(8, 8, key_block=3), 1, 3, 1, 4, 8, 8, torch.float32, torch.device("cpu"))
