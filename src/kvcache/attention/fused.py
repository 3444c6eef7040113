"""Decode attention's two products straight from int8/int4/int2 codes, never widening a block of them.

A quantized store (``layers/codes.py``) keeps keys per channel over blocks of ``G`` tokens and
values per token in groups of channels. For a decode step (a handful of query rows per KV head)
the coded decode library (``csrc/coded_decode.cpp``, built by ``native_build``) reads the codes
once: scores as ``(q * scale) . codes + q . minimum`` per key block, and the weighted sum of
values as ``sum_t (p_t * scale_t) codes_t + sum_t p_t * minimum_t``, unpacking and converting
codes in registers, in float32, with OpenMP over batch rows, KV heads and chunks of tokens.

``key_scores`` and ``weighted_values`` are those two products, for the kernel's blockwise path
(``kernel.py``), which does the cap, masks, sinks and softmax between them. ``decode_attention``
does a plain decode step in one pass over the codes ("flash decoding": scores, cap, an online
softmax and the weighted values, chunk by chunk, the chunks merged at the end), returning each
row's normalised output and the log-sum-exp of its scores; ``merge_attention`` folds in the
attention over further keys (a quantized layer's exact tail) by those log-sum-exps.
``fused_paged.paged_decode_attention`` is the same pass for a decode step of many sequences whose
coded blocks lie in a pool (each read through its block table), each with an exact tail block.

An eviction layer's coded slots (``layers/slots.py``) keep keys per token too, in groups of channels
like the values, so that a slot can be overwritten alone: ``token_key_scores`` and
``token_decode_attention`` are ``key_scores`` and ``decode_attention`` for such keys (scores as
``sum_g scale_g (q_g . codes_g) + minimum_g sum(q_g)`` per token); ``weighted_values`` serves their
values as it is.

Every function takes ``fp8``: the codes are e4m3 bytes (``formats/fp8.py``; ``bits`` 8), read by
the library's fp8 build, with the same scales and minimums (midpoints).

Scales and minimums may come in the model's dtype: the library reads float32, so others are
converted first (a copy of ``D / group`` numbers a token, small beside the codes).

The library functions return None when the library is off or cannot build, or the shapes are
beyond it (more than ``MAX_ROWS`` rows, head dims over ``MAX_DIM``): the caller then takes the pure
PyTorch path, which dequantizes a block at a time.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native_build
from .native import task_chunk

#: Query rows per KV head (group * queries) and head dims the library takes.
MAX_ROWS, MAX_DIM = 16, 512


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_coded_key_scores.argtypes = [ptr] * 5 + [i64, i64, i32, i32, i32, i32, i64] + [i64] * 7 + [i64, i32]
    lib.kv_coded_key_scores.restype = i32
    lib.kv_coded_weighted.argtypes = [ptr] * 6 + [i64, i64, i32, i32, i32, i32, i64] + [i64] * 7 + [i64, i32]
    lib.kv_coded_weighted.restype = i32
    lib.kv_coded_decode_attention.argtypes = (
        [ptr] * 9 + [i64, i64] + [i32] * 6 + [i64] + [i64] * 8 + [i64, ctypes.c_float, ctypes.c_float, i32]
        + [ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64]
    )
    lib.kv_coded_decode_attention.restype = i32
    lib.kv_paged_coded_decode.argtypes = (
        [ptr] * 14 + [i64, i64] + [i32] * 6 + [i64] * 3 + [i64] * 14 + [i64, ctypes.c_float, ctypes.c_float, i32]
    )
    lib.kv_paged_coded_decode.restype = i32
    lib.kv_token_coded_key_scores.argtypes = lib.kv_coded_key_scores.argtypes
    lib.kv_token_coded_key_scores.restype = i32
    lib.kv_token_coded_decode_attention.argtypes = (
        [ptr] * 9 + [i64, i64] + [i32] * 6 + [i64] + [i64] * 8 + [i64, ctypes.c_float, ctypes.c_float, i32]
    )
    lib.kv_token_coded_decode_attention.restype = i32
    return lib


def library(fp8: bool = False) -> ctypes.CDLL | None:
    """The coded decode library, built on first use; None when off or when it cannot build. With
    ``fp8``, its build for e4m3 codes (``KV_FP8``: bytes read as e4m3 floats; 8 bits only)."""
    return native_build.library("coded_decode", _declare, defines=("KV_FP8",) if fp8 else ())


#: Tasks per thread the tokens are split into, and the fewest tokens a task gets.
_TASKS_PER_THREAD, _MIN_CHUNK = 8, 256


def key_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    bits: int,
    blocks: int,
    width: int | None = None,
    fp8: bool = False,
) -> torch.Tensor | None:
    """Scores float32 ``[B, Hkv, R, width]`` of query rows ``[B, Hkv, R, D]`` against the first
    ``blocks`` blocks of keys held as per-channel codes ``[B, Hkv, n, G, D * bits / 8]`` with
    scale and minimum ``[B, Hkv, n, D]`` (a store's whole buffers: no view of them is taken), in
    the first ``blocks * G`` columns; the columns after them (``width``, default ``blocks * G``)
    are left for the caller to fill (e.g. with a residual's scores). None: see the module docstring."""
    batch, heads, rows, dim = query.shape
    group = codes.shape[3]
    width = blocks * group if width is None else width
    lib = library(fp8)
    if lib is None or not fits(rows, dim, bits, query.device, fp8) or width < blocks * group or blocks > codes.shape[2]:
        return None
    out = torch.empty(batch, heads, rows, width, dtype=torch.float32)
    if blocks * group * out.shape[0] * heads * rows == 0:
        return out
    q = query.detach().float().contiguous()
    codes = inner_contiguous(codes)
    scale, minimum = same_strides(scale, minimum)
    threads = torch.get_num_threads()
    chunk = task_chunk(blocks, batch * heads, threads, _TASKS_PER_THREAD, max(1, _MIN_CHUNK // group))
    failed = lib.kv_coded_key_scores(
        q.data_ptr(), codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), out.data_ptr(),
        batch, heads, rows, dim, group, bits, blocks,
        codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1), out.stride(2), chunk, threads,
    )  # fmt: skip
    return None if failed else out


def weighted_values(
    weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, group: int,
    fp8: bool = False,
) -> torch.Tensor | None:
    """``weights @ values`` float32 ``[B, Hkv, R, Dv]`` for weights ``[B, Hkv, R, T]`` and the
    first ``T`` values held as per-token codes ``[B, Hkv, C, Dv * bits / 8]`` (``C >= T``: a
    store's whole buffer) with scale and minimum ``[B, Hkv, C, Dv / group]``, or None (see the
    module docstring)."""
    batch, heads, rows, tokens = weights.shape
    dim = codes.shape[3] * 8 // bits
    lib = library(fp8)
    if lib is None or not fits(rows, dim, bits, weights.device, fp8) or group % (8 // bits) or dim % group or tokens > codes.shape[2]:
        return None
    p = weights.detach().float()
    if p.stride(3) != 1:
        p = p.contiguous()
    codes = inner_contiguous(codes)
    scale, minimum = same_strides(scale, minimum)
    threads = torch.get_num_threads()
    chunk = task_chunk(tokens, batch * heads, threads, _TASKS_PER_THREAD, _MIN_CHUNK)
    chunks = max(1, math.ceil(tokens / chunk))
    out = torch.empty(batch, heads, rows, dim, dtype=torch.float32)
    scratch = torch.empty(batch * heads * chunks, rows, dim + dim // group, dtype=torch.float32)
    failed = lib.kv_coded_weighted(
        p.data_ptr(), codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        batch, heads, rows, dim, group, bits, tokens,
        p.stride(0), p.stride(1), p.stride(2), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        chunk, threads,
    )  # fmt: skip
    return None if failed else out


def decode_attention(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bits: int,
    blocks: int,
    value_group: int,
    scale: float,
    softcap: float | None = None,
    tail: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of query rows ``[B, Hkv, R, D]`` over the first ``blocks * G`` tokens of a coded
    store, in one library call: ``(out, lse)``, the normalised output float32 ``[B, Hkv, R, Dv]`` and
    the log-sum-exp float32 ``[B, Hkv, R]`` of each row's scores ``scale * q . k`` (capped as
    ``softcap * tanh(score / softcap)`` when ``softcap`` is given). ``keys``: codes
    ``[B, Hkv, n, G, D * bits / 8]``, scale and minimum ``[B, Hkv, n, D]`` (``n >= blocks``);
    ``values``: codes ``[B, Hkv, C, Dv * bits / 8]``, scale and minimum ``[B, Hkv, C, Dv / value_group]``
    (``C >= blocks * G``): a store's whole buffers. ``tail``: ``(keys, values, vcoded)``, the tokens
    after the coded blocks, attended in the same call: exact float32 keys ``[B, Hkv, n, D]``, whose
    first ``vcoded`` tokens have their values coded (right after the blocks' tokens) and the rest
    exact float32 ``values`` ``[B, Hkv, n - vcoded, Dv]`` (last dims contiguous). None: see the module
    docstring (also for a tail of another dtype or layout)."""
    batch, heads, rows, dim = query.shape
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    group, vdim = kcodes.shape[3], vcodes.shape[3] * 8 // bits
    lib = library(fp8)
    if (
        lib is None
        or not fits(rows, max(dim, vdim), bits, query.device, fp8)
        or blocks < 1
        or blocks > kcodes.shape[2]
        or blocks * group > vcodes.shape[2]
        or value_group % (8 // bits)
        or vdim % value_group
        or (torch.is_grad_enabled() and query.requires_grad)  # the library computes no gradients
        or (tail is not None and not _tail_fits(tail, query, blocks * group, vcodes.shape[2], vdim))
    ):
        return None
    tail_keys, tail_values, vcoded = tail if tail is not None else (None, None, 0)
    tail_len = 0 if tail_keys is None else tail_keys.shape[2]
    exact_values = tail_values is not None and tail_len > vcoded
    q = query.detach().float().contiguous()
    kcodes, vcodes = inner_contiguous(kcodes), inner_contiguous(vcodes)
    kscale, kmin = same_strides(kscale, kmin)
    vscale, vmin = same_strides(vscale, vmin)
    out = torch.empty(batch, heads, rows, vdim, dtype=torch.float32)
    lse = torch.empty(batch, heads, rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    chunk = task_chunk(blocks, batch * heads, threads, _TASKS_PER_THREAD, max(1, _MIN_CHUNK // group))
    failed = lib.kv_coded_decode_attention(
        q.data_ptr(), kcodes.data_ptr(), kscale.data_ptr(), kmin.data_ptr(),
        vcodes.data_ptr(), vscale.data_ptr(), vmin.data_ptr(), out.data_ptr(), lse.data_ptr(),
        batch, heads, rows, dim, vdim, group, value_group, bits, blocks,
        *kcodes.stride()[:2], *kscale.stride()[:2], *vcodes.stride()[:2], *vscale.stride()[:2],
        chunk, scale, float(softcap or 0.0), threads,
        tail_keys.data_ptr() if tail_len else None, *(tail_keys.stride()[:3] if tail_len else (0, 0, 0)),
        tail_values.data_ptr() if exact_values else None, *(tail_values.stride()[:3] if exact_values else (0, 0, 0)),
        tail_len, vcoded,
    )  # fmt: skip
    return None if failed else (out, lse)


def token_key_scores(
    query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, group: int, tokens: int,
    fp8: bool = False,
) -> torch.Tensor | None:
    """Scores float32 ``[B, Hkv, R, tokens]`` of query rows ``[B, Hkv, R, D]`` against the first
    ``tokens`` keys held as per-token codes ``[B, Hkv, C, D * bits / 8]`` in groups of ``group``
    channels, with scale and minimum ``[B, Hkv, C, D / group]`` (``C >= tokens``: a store's whole
    buffers, of which no view is taken). None: see the module docstring."""
    batch, heads, rows, dim = query.shape
    lib = library(fp8)
    if lib is None or not _token_keys_fit(query, (codes, scale, minimum), bits, group, tokens, fp8):
        return None
    out = torch.empty(batch, heads, rows, tokens, dtype=torch.float32)
    if out.numel() == 0:
        return out
    q = query.detach().float().contiguous()
    codes = inner_contiguous(codes)
    scale, minimum = same_strides(scale, minimum)
    threads = torch.get_num_threads()
    chunk = task_chunk(tokens, batch * heads, threads, _TASKS_PER_THREAD, _MIN_CHUNK)
    failed = lib.kv_token_coded_key_scores(
        q.data_ptr(), codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), out.data_ptr(),
        batch, heads, rows, dim, group, bits, tokens,
        codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1), out.stride(2), chunk, threads,
    )  # fmt: skip
    return None if failed else out


def token_decode_attention(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bits: int,
    tokens: int,
    key_group: int,
    value_group: int,
    scale: float,
    softcap: float | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``decode_attention`` over the first ``tokens`` slots of a store whose keys are coded per token:
    ``(out, lse)``, the normalised output float32 ``[B, Hkv, R, Dv]`` of query rows ``[B, Hkv, R, D]``
    and the log-sum-exp float32 ``[B, Hkv, R]`` of each row's scores ``scale * q . k`` (capped as
    ``softcap * tanh(score / softcap)`` when ``softcap`` is given), in one library call. ``keys``:
    codes ``[B, Hkv, C, D * bits / 8]``, scale and minimum ``[B, Hkv, C, D / key_group]``; ``values``:
    codes ``[B, Hkv, C, Dv * bits / 8]``, scale and minimum ``[B, Hkv, C, Dv / value_group]``
    (``C >= tokens``: a store's whole buffers). None: see the module docstring (also for no tokens)."""
    batch, heads, rows, dim = query.shape
    vcodes, vscale, vmin = values
    vdim = vcodes.shape[3] * 8 // bits
    lib = library(fp8)
    if (
        lib is None
        or tokens < 1
        or not _token_keys_fit(query, keys, bits, key_group, tokens, fp8)
        or not fits(rows, vdim, bits, query.device, fp8)
        or vcodes.shape[:2] != (batch, heads)
        or tokens > vcodes.shape[2]
        or value_group < 1
        or value_group % (8 // bits)
        or vdim % value_group
        or vscale.shape[3] != vdim // value_group
    ):
        return None
    q = query.detach().float().contiguous()
    kcodes, vcodes = inner_contiguous(keys[0]), inner_contiguous(vcodes)
    kscale, kmin = same_strides(keys[1], keys[2])
    vscale, vmin = same_strides(vscale, vmin)
    out = torch.empty(batch, heads, rows, vdim, dtype=torch.float32)
    lse = torch.empty(batch, heads, rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    chunk = task_chunk(tokens, batch * heads, threads, _TASKS_PER_THREAD, _MIN_CHUNK)
    failed = lib.kv_token_coded_decode_attention(
        q.data_ptr(), kcodes.data_ptr(), kscale.data_ptr(), kmin.data_ptr(),
        vcodes.data_ptr(), vscale.data_ptr(), vmin.data_ptr(), out.data_ptr(), lse.data_ptr(),
        batch, heads, rows, dim, vdim, key_group, value_group, bits, tokens,
        kcodes.stride(0), kcodes.stride(1), kscale.stride(0), kscale.stride(1),
        vcodes.stride(0), vcodes.stride(1), vscale.stride(0), vscale.stride(1),
        chunk, scale, float(softcap or 0.0), threads,
    )  # fmt: skip
    return None if failed else (out, lse)


def _token_keys_fit(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, group: int, tokens: int,
    fp8: bool = False,
) -> bool:
    """Whether the library takes these query rows against the first ``tokens`` of these per-token
    coded keys (codes, scale, minimum; see ``token_key_scores``)."""
    codes, scale, minimum = keys
    batch, heads, rows, dim = query.shape
    return (
        fits(rows, dim, bits, query.device, fp8)
        and codes.dtype == torch.uint8
        and codes.dim() == scale.dim() == 4
        and codes.shape[:2] == (batch, heads)
        and codes.shape[3] * 8 == dim * bits
        and group >= 1
        and group % (8 // bits) == 0
        and dim % group == 0
        and scale.shape == minimum.shape == (*codes.shape[:3], dim // group)
        and 0 <= tokens <= codes.shape[2]
        and not (torch.is_grad_enabled() and query.requires_grad)  # the library computes no gradients
    )


def _tail_fits(tail: tuple[torch.Tensor, torch.Tensor, int], query: torch.Tensor, coded: int, value_slots: int, vdim: int) -> bool:
    """Whether ``decode_attention`` can take this tail (see its docstring) in the library."""
    keys, values, vcoded = tail
    batch, heads, _, dim = query.shape
    n = keys.shape[2]
    return (
        keys.dtype == values.dtype == torch.float32
        and keys.shape[:2] == values.shape[:2] == (batch, heads)
        and keys.shape[3] == dim
        and values.shape[3] == vdim
        and 0 <= vcoded <= n
        and values.shape[2] == n - vcoded
        and coded + vcoded <= value_slots
        and keys.stride(3) == 1
        and values.stride(3) == 1
    )


def merge_attention(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """The attention over two sets of keys from each set's own: normalised outputs ``[..., Dv]``
    and the log-sum-exps ``[...]`` of their scores. The second set's share of a row is
    ``exp(l2) / (exp(l1) + exp(l2)) = sigmoid(l2 - l1)``: exact, and no exponent overflows."""
    share2 = torch.sigmoid(lse2 - lse1).unsqueeze(-1)
    return torch.lerp(out1, out2, share2)


def fits(rows: int, dim: int, bits: int, device: torch.device, fp8: bool = False) -> bool:
    """Whether the library takes ``rows`` query rows per KV head of head dim ``dim`` at ``bits`` on
    ``device`` (``fp8``: e4m3 codes, 8 bits only)."""
    return device.type == "cpu" and 1 <= rows <= MAX_ROWS and 1 <= dim <= MAX_DIM and bits in ((8,) if fp8 else (8, 4, 2))


def inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B, Hkv, ...]`` with every dim after the first two contiguous (a store's view already is)."""
    if t.is_contiguous():  # a store's whole buffer: the common case, checked in one call
        return t
    expected, step = [], 1
    for size in reversed(t.shape[2:]):
        expected.append(step)
        step *= size
    return t if list(t.stride()[2:]) == expected[::-1] else t.contiguous()


def same_strides(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and minimum as float32 with inner dims contiguous and equal strides (one pair of
    strides reaches both)."""
    if scale.dtype == minimum.dtype == torch.float32 and scale.is_contiguous() and minimum.is_contiguous():
        if scale.shape == minimum.shape:
            return scale, minimum
    scale, minimum = inner_contiguous(scale.float()), inner_contiguous(minimum.float())
    if scale.stride() != minimum.stride():
        scale, minimum = scale.contiguous(), minimum.contiguous()
    return scale, minimum
