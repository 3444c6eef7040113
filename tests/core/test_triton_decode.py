"""The Triton decode kernels (``attention/triton_decode.py``) run in Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set here before the kernel is first compiled) against PyTorch:
SDPA over the keys and values, or over codes dequantized by ``quant.py``. Tolerance float32
``1e-5`` (the kernel sums in another order, tiles of 64 tokens merged by log-sum-exp); a wrong
code, scale, block, slot, mask or split moves an output by far more.

Skipped, with the reason, where Triton is not installed (the ``triton`` extra) or the environment
turned its interpreter off."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.attention import triton_decode as td
from kvcache.formats import quant

pytestmark = pytest.mark.skipif(not td.available(), reason="triton is not installed (pip install kvcache[triton])")
TOL = {"rtol": 1e-5, "atol": 1e-5}
#: 16-bit values on a device: probabilities rounded to TF32 (11 bits) in their product (``_precision``).
HALF = {"rtol": 2e-3, "atol": 2e-3}


@pytest.fixture(
    params=[
        pytest.param("cpu", id="interpreter"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
    ]
)
def device(request):
    """Where the kernels run: CPU tensors in Triton's interpreter (CI), or a CUDA device compiled."""
    if request.param == "cpu" and not td.interpreting():
        pytest.skip("TRITON_INTERPRET is not 1 (conftest.py sets it unless the environment says otherwise)")
    if request.param == "cuda" and (not torch.cuda.is_available() or td.interpreting()):
        pytest.skip("no CUDA device (or Triton's interpreter is on): tools/gpu_check.sh runs these on a lent GPU")
    return torch.device(request.param)


def on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def back(x):
    return x.cpu() if isinstance(x, torch.Tensor) else tuple(t.cpu() for t in x)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def sdpa(q, k, v, scale, keep=None, softcap=None):
    """Reference ``[B, Hkv, R, Dv]`` for rows ``q`` ``[B, Hkv, R, D]`` over ``k``/``v`` ``[B, Hkv, T, D]``."""
    s = torch.einsum("bhrd,bhtd->bhrt", q.float(), k.float()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "heads", "rows", "tokens", "dim"), [(1, 1, 1, 1, 16), (2, 2, 3, 700, 32), (1, 3, 16, 129, 64), (2, 1, 5, 64, 80)])
def test_decode_over_views_equals_sdpa(device, dtype, batch, heads, rows, tokens, dim):
    g = gen(tokens)
    q = torch.randn(batch, heads, rows, dim, generator=g).to(dtype)
    buffer_k = torch.randn(batch, heads, tokens + 9, dim, generator=g).to(dtype)  # a cache's buffer, read as a view
    buffer_v = torch.randn(batch, heads, tokens + 9, dim + 16, generator=g).to(dtype)
    k, v = buffer_k[:, :, :tokens], buffer_v[:, :, :tokens]
    scale = 1 / math.sqrt(dim)
    qd, kd, vd = on(device, q, buffer_k, buffer_v)
    out = back(td.decode_views(qd, kd[:, :, :tokens], vd[:, :, :tokens], None, None, scale))
    tol = TOL if dtype == torch.float32 or device.type != "cuda" else HALF
    torch.testing.assert_close(out, sdpa(q, k, v, scale), **tol)


def test_decode_with_a_key_mask_and_a_softcap_and_a_fully_masked_row(device):
    g = gen(3)
    q, k, v = torch.randn(3, 2, 4, 32, generator=g), torch.randn(3, 2, 300, 32, generator=g), torch.randn(3, 2, 300, 16, generator=g)
    keep = torch.rand(3, 300, generator=g) > 0.3
    keep[2] = False  # a row that sees no key: zeros, as attend says
    out = back(td.decode_views(*on(device, q, k, v, keep), 5.0, 0.2))
    torch.testing.assert_close(out, sdpa(q, k, v, 0.2, keep, 5.0), **TOL)
    assert not out[2].any()


def test_transposed_cache_layouts_are_read_in_place(device):
    g = gen(4)
    storage = torch.randn(2, 90, 3, 32, generator=g)  # [B, C, Hkv, D]: a transposed buffer
    k = storage.transpose(1, 2)
    v = torch.randn(2, 90, 3, 32, generator=g).transpose(1, 2)
    q = torch.randn(2, 3, 2, 32, generator=g)
    qd, sd, vd = on(device, q, storage, v.transpose(1, 2))
    got = back(td.decode_views(qd, sd.transpose(1, 2), vd.transpose(1, 2), None, None, 0.3))
    torch.testing.assert_close(got, sdpa(q, k, v, 0.3), **TOL)


def pool_of(blocks, heads, bs, dim, seed):
    g = gen(seed)
    return torch.randn(blocks, heads, bs, dim, generator=g), torch.randn(blocks, heads, bs, dim, generator=g)


def gathered(pool, table, length):
    """A sequence's first ``length`` tokens ``[Hkv, length, D]`` from ``pool`` ``[NB, Hkv, bs, D]``."""
    blocks = pool[torch.tensor(table, dtype=torch.long)]
    return blocks.transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, :length]


@pytest.mark.parametrize("bs", [16, 24, 64])
def test_paged_decode_over_ragged_tables_equals_sdpa_per_sequence(device, bs):
    kp, vp = pool_of(40, 2, bs, 32, bs)
    order = torch.randperm(40, generator=gen(1)).tolist()
    lengths = [1, bs, bs + 1, 5 * bs - 3, 0, 17 * bs // 2]
    tables, at = [], 0
    for n in lengths:
        need = max(1, -(-n // bs))
        tables.append(order[at : at + need])
        at += need
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lengths), 2, 3, 32, generator=gen(2))
    out = back(td.paged_decode(*on(device, q, kp, vp, table, torch.tensor(lengths)), 0.25))
    for s, n in enumerate(lengths):
        if n == 0:
            assert not out[s].any()
            continue
        ref = sdpa(q[s : s + 1], gathered(kp, tables[s], n)[None], gathered(vp, tables[s], n)[None], 0.25)
        torch.testing.assert_close(out[s : s + 1], ref, **TOL)


def coded_pool(bits, blocks, heads, bs, dim, vdim, group, seed):
    """A pool of coded blocks as the engine keeps them, and what they dequantize to."""
    g = gen(seed)
    k = torch.randn(blocks, heads, bs, dim, generator=g) * 2 + 0.5
    v = torch.randn(blocks, heads, bs, vdim, generator=g)
    qk, qv = quant.quantize_per_channel(k, bits), quant.quantize_per_token(v, bits, group)
    keys = (qk.codes, qk.scale.squeeze(2), qk.minimum.squeeze(2))
    values = (qv.codes, qv.scale, qv.minimum)
    return keys, values, quant.dequantize_per_channel(qk), quant.dequantize_per_token(qv, group)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_paged_coded_decode_equals_sdpa_over_dequantized_blocks_and_the_open_block(device, bits, softcap):
    bs, heads, dim, vdim, group = 16, 2, 32, 64, 16
    keys, values, ref_k, ref_v = coded_pool(bits, 30, heads, bs, dim, vdim, group, bits)
    g = gen(7)
    tails_k, tails_v = torch.randn(4, heads, bs, dim, generator=g), torch.randn(4, heads, bs, vdim, generator=g)
    coded = [0, bs, 3 * bs, 20 * bs]
    tail_len = [5, 0, bs, 1]
    tail_blk = [2, 0, 3, 1]
    order = torch.randperm(30, generator=g).tolist()
    tables, at = [], 0
    for n in coded:
        tables.append(order[at : at + n // bs] or [0])
        at += n // bs
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(4, heads, 3, dim, generator=g)
    out = back(td.paged_coded_decode(
        *on(device, q), on(device, *keys), on(device, *values), bits, group, *on(device, table, torch.tensor(coded), tails_k, tails_v,
        torch.tensor(tail_blk, dtype=torch.int32), torch.tensor(tail_len)), 0.3, softcap,
    ))  # fmt: skip
    for s in range(4):
        k = torch.cat([gathered(ref_k, tables[s], coded[s]), tails_k[tail_blk[s], :, : tail_len[s]]], dim=1)
        v = torch.cat([gathered(ref_v, tables[s], coded[s]), tails_v[tail_blk[s], :, : tail_len[s]]], dim=1)
        torch.testing.assert_close(out[s : s + 1], sdpa(q[s : s + 1], k[None], v[None], 0.3, softcap=softcap), **TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_token_coded_decode_equals_sdpa_over_dequantized_slots_and_gives_the_lse(device, bits):
    g = gen(bits + 10)
    batch, heads, slots, tokens, dim, vdim = 2, 3, 333, 300, 64, 32
    k = torch.randn(batch, heads, slots, dim, generator=g)
    v = torch.randn(batch, heads, slots, vdim, generator=g)
    qk, qv = quant.quantize_per_token(k, bits, 32), quant.quantize_per_token(v, bits, 16)
    q = torch.randn(batch, heads, 4, dim, generator=g)
    keys, values = on(device, qk.codes, qk.scale, qk.minimum), on(device, qv.codes, qv.scale, qv.minimum)
    out, lse = back(td.token_coded_decode(*on(device, q), keys, values, bits, tokens, 32, 16, 0.125))
    rk = quant.dequantize_per_token(qk, 32)[:, :, :tokens]
    rv = quant.dequantize_per_token(qv, 16)[:, :, :tokens]
    torch.testing.assert_close(out, sdpa(q, rk, rv, 0.125), **TOL)
    torch.testing.assert_close(lse, torch.logsumexp(torch.einsum("bhrd,bhtd->bhrt", q, rk) * 0.125, dim=-1), **TOL)


def test_calls_the_kernel_cannot_take_are_declined(device):
    q, k = on(device, torch.randn(1, 1, 17, 16), torch.randn(1, 1, 8, 16))
    assert td.decode_views(q, k, k, None, None, 1.0) is None  # more rows than a decode step has
    assert td.decode_views(q[:, :, :2].requires_grad_(), k, k, None, None, 1.0) is None  # gradients asked for
    assert td.decode_views(q[:, :, :2], k[..., ::2].expand(1, 1, 8, 8), k[..., :8], None, None, 1.0) is None  # last dim strided


def test_cpu_tensors_are_declined_outside_the_interpreter(monkeypatch):  # (no device: CPU tensors by definition)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 8, 16)
    assert td.decode_views(q, k, k, None, None, 1.0) is None


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("seen", "residual", "group"), [(5, 8, 16), (100, 8, 16), (333, 0, 16), (64, 3, 16), (100, 8, 24), (333, 0, 128)])
def test_a_quantized_layers_step_equals_sdpa_over_its_dequantized_view(device, bits, seen, residual, group):
    """Key blocks, value codes and the residual after each (their boundaries differ) in one call;
    groups of 16 take the kernel's scale rows, 24 and 128 (not a power of two, wider than a tile)
    its gathers."""
    from kvcache.layers import QuantizedLayer

    g = gen(seen + bits)
    dim = 48 if group == 24 else 32
    layer = QuantizedLayer(bits=bits, group_size=group, residual=residual)
    k, v = torch.randn(2, 2, seen, dim, generator=g) * 2, torch.randn(2, 2, seen, dim, generator=g)
    for start in range(0, seen, 37):  # appends of several sizes: prefill-like and decode-like
        layer.update(k[:, :, start : start + 37], v[:, :, start : start + 37])
    codes = layer.codes
    assert codes.keys.tensors  # allocated on the first append, whether or not a block is coded yet
    keys, values = codes.keys.tensors, codes.values.tensors
    q = torch.randn(2, 2, 3, dim, generator=g)
    out, lse = back(td.quantized_decode(
        *on(device, q), on(device, keys["kcodes"], keys["kscale"], keys["kmin"]),
        on(device, values["vcodes"], values["vscale"], values["vmin"]), bits, layer.value_group,
        codes.quantized_keys, codes.quantized_values, *on(device, codes.exact_keys, codes.exact_values), seen, 0.2,
    ))  # fmt: skip
    rk, rv = layer.view()
    torch.testing.assert_close(out, sdpa(q, rk, rv, 0.2), **TOL)
    torch.testing.assert_close(lse, torch.logsumexp(q @ rk.transpose(-1, -2) * 0.2, dim=-1), **TOL)


@pytest.mark.parametrize("launch", [td.Launch(block=32), td.Launch(block=128, warps=8, stages=1), td.Launch(dot="tf32")])
def test_every_launch_of_the_sweep_reads_the_same_tokens(device, launch):
    """Tiles of another size move the splits' bounds (``tools/gpu_sweep.py`` tries them); on a
    device ``tf32`` products round, so only there its tolerance is TF32's."""
    g = gen(3)
    q, k, v = torch.randn(2, 2, 4, 32, generator=g), torch.randn(2, 2, 777, 32, generator=g), torch.randn(2, 2, 777, 16, generator=g)
    out = back(td.decode_views(*on(device, q, k, v), None, None, 0.2, launch=launch))
    tol = {"rtol": 2e-3, "atol": 2e-3} if launch.dot == "tf32" and device.type == "cuda" else TOL
    torch.testing.assert_close(out, sdpa(q, k, v, 0.2), **tol)
    keys, values, ref_k, ref_v = coded_pool(8, 12, 2, 16, 32, 32, 16, 8)
    table = torch.tensor([[3, 1, 4, 0], [2, 5, 6, 7]], dtype=torch.int32)
    tails_k, tails_v = torch.randn(2, 2, 16, 32, generator=g), torch.randn(2, 2, 16, 32, generator=g)
    coded, tail_len = torch.tensor([64, 48]), torch.tensor([7, 0])
    out = back(td.paged_coded_decode(
        *on(device, q), on(device, *keys), on(device, *values), 8, 16, *on(device, table, coded, tails_k, tails_v,
        torch.tensor([1, 0], dtype=torch.int32), tail_len), 0.2, launch=launch,
    ))  # fmt: skip
    for s in range(2):
        blocks = table[s].tolist()
        kk = torch.cat([gathered(ref_k, blocks, int(coded[s])), tails_k[1 - s, :, : int(tail_len[s])]], dim=1)
        vv = torch.cat([gathered(ref_v, blocks, int(coded[s])), tails_v[1 - s, :, : int(tail_len[s])]], dim=1)
        torch.testing.assert_close(out[s : s + 1], sdpa(q[s : s + 1], kk[None], vv[None], 0.2), **tol)
