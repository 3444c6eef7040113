"""The one attention kernel: one path over ``BlockReader``s, the choice of its fast paths in ``route``.

``attend`` takes the SDPA layout and never expands K/V for grouped-query attention: the query heads
that share a KV head are packed into that head's rows (``[B, Hkv, group * Sq, D]``), so each key
and value is read once per KV head. Keys and values laid out as a cache stores them, views
``[:, :, :T]`` of a ``[B, Hkv, C, D]`` buffer, are read in place, never made contiguous. (Other
layouts, e.g. a transposed ``[B, C, Hkv, D]`` buffer with B > 1, may be copied by ``matmul``.)

Keys and values are always read through a ``BlockReader`` (``readers.py``): plain tensors come
wrapped in a ``TensorReader`` (one block, the tensors themselves); a store of codes hands its own
reader, dequantized one block of slots at a time, so no full-precision copy of it is made. The
blockwise path (scores, softmax, weighted values, a block of query rows at a time) is written once
over readers; ``route`` decides, in one place, which calls or rows take torch's SDPA (plain tensors
only) or a one-pass C++ decode instead (plain tensors, or a reader of codes that offers its own).

Long prefills never build a ``max_len x max_len`` score matrix or mask. Rows that go through torch's
fused SDPA with ``causal`` and no mask per row are split as ``causal.py`` does (the keys before the
queries with no mask, the queries' own causal square), so none is built; rows that need a mask
built per row, or whose weights are asked for, run in blocks of query rows, the scores of a block
near ``_CACHE_BYTES`` over plain tensors (at most ``_BLOCK_BYTES``), and a block of fused SDPA
reads only the key columns its mask leaves visible.

Design: docs/architecture.md, "Attention".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import DTypeError
from . import device_kernels, native
from .causal import can_split, causal_attention
from .heads import check_inputs, group_mask, group_sinks, sink_rows, softmax
from .readers import BlockReader, TensorLike, TensorReader
from .weights import Weights, first_weighted_row, is_queries, last_queries, reduce_into, reduced, weight_modes, zeros

_BLOCK_BYTES = 64 * 2**20  # score bytes per query block, at most
#: Score bytes per block of query rows over plain tensors: the block's scores and softmax stay in
#: cache (at batch 1, a 1K-4K prefill's weighted attention ran about 3x faster at 4 MiB than at 64).
_CACHE_BYTES = 4 * 2**20
#: ... but at least this many rows, so the block's matmuls stay efficient (batch 8, 2K tokens: 28
#: rows 0.90 s, 7 rows 1.26 s).
_MIN_CACHE_ROWS = 32
#: At most this many query rows per KV head (group * Sq) take the decode path (``K @ q^T``).
DECODE_ROWS = 16


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, reading K/V in place.

    query ``[B, Hq, Sq, D]``, key ``[B, Hkv, T, D]``, value ``[B, Hkv, T, Dv]`` with ``Hq`` a
    multiple of ``Hkv``; returns ``[B, Hq, Sq, Dv]``. ``mask`` follows SDPA: boolean (True =
    attend) or additive float, broadcastable to ``[B, Hq, Sq, T]``. ``causal`` masks key ``j`` for
    query ``i`` unless ``j <= T - Sq + i`` (aligned to the end, as for queries that follow a cache;
    equal to SDPA's ``is_causal`` when ``Sq == T``). Rows with every key masked return zeros.
    ``softcap`` caps the scaled scores as ``softcap * tanh(score / softcap)`` before the mask
    (gemma2's attention logit softcapping). ``sinks`` ``[Hq]`` are learned attention sinks (gpt-oss
    and others; or ``[B|1, Hq, Sq|1, 1]``, one per query row, Inkling 2): one extra logit per query
    head that takes part in the softmax's normalisation and adds no value, so a row's weights sum to less than one (a row with every key masked attends
    only its sink: zeros).
    """
    if mask is None and softcap is None and sinks is None:
        out = native.decode_one(query, key, value, scale)  # route's step 0: the common decode call
        if out is not None:
            return out
    out, _ = attend_weighted(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap, sinks=sinks)
    return out


class Settings(NamedTuple):
    """What one call asks of every block of query rows: ``scale`` multiplies the scores,
    ``softcap`` caps them (None: no cap), ``causal`` masks keys end-aligned (see ``attend``),
    ``mask`` is the call's SDPA mask grouped under the KV heads ``[B|1, Hkv|1, group|1, Sq|1, T]``
    (``_group_mask``), ``mask_rows`` as for ``attend_weighted``, ``sinks`` grouped
    ``[B|1, Hkv, group, Sq|1, 1]`` (``group_sinks``); None where not given.

    Immutable, like a frozen dataclass, at about a third of its construction cost (one is made
    per call, decode steps included)."""

    scale: float
    softcap: float | None
    causal: bool
    mask: torch.Tensor | None
    mask_rows: Callable[[int, int], torch.Tensor] | None
    sinks: torch.Tensor | None


def attend_weighted(
    query: torch.Tensor,
    key: torch.Tensor | BlockReader,
    value: torch.Tensor | None,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    mask_rows: Callable[[int, int], torch.Tensor] | None = None,
    weights: Weights = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor] | None]:
    """``attend``, plus masks made per block of query rows and reduced attention weights.

    ``mask_rows(start, stop)`` returns a boolean mask ``[B|1, Hkv|1, stop - start, T]``, or per
    query head ``[B|1, Hkv, group, stop - start, T]`` (True = attend) for query rows
    ``start:stop``; it is called once per block, so a mask for a long prefill is never built whole.
    It combines (AND) with ``mask`` and ``causal``. ``sinks``: as for ``attend``.

    ``weights``: None, one of ``WEIGHTS`` (``"window:32"``), or a tuple of them. Returns, besides
    the output ``[B, Hq, Sq, Dv]``, the reduced softmax weights as float32 ``[B, Hkv, T]`` (a
    dict mode -> tensor for a tuple), never the full ``[B, Hq, Sq, T]``; a ``"queries:N"`` mode
    gets the last query rows instead (``weights.last_queries``). With ``sinks`` the
    weights are the keys' real probabilities (the sink's share is not reported).

    ``key`` may be a ``BlockReader`` (with ``value`` None): keys and values are then read one
    block of slots at a time, as the reader hands them out.

    Which path runs is ``route``'s choice: query rows whose weights nobody asked for go through
    torch's fused SDPA (no softcap or sinks, keys a tensor): with ``causal`` and at most a key mask,
    all of them at once, split at the first query (``causal.py``); else a block at a time, each
    reading only the keys it can see. A decode step may take the one-pass C++ library.
    """
    reader = _as_reader(key, value)
    modes = weight_modes(weights)
    plain = reader.tensors()  # (keys, values) as whole tensors, or None: a reader of blocks
    batch, q_heads, q_len, head_dim, kv_heads, kv_len, value_dim = check_inputs(query, reader, plain, mask)
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # [B, Hq, Sq, D] -> [B, Hkv, group, Sq, D]: query head h reads KV head h // group.
    q5 = query.reshape(batch, kv_heads, group, q_len, head_dim)
    mask5 = group_mask(mask, batch, kv_heads, group, q_len, kv_len)

    asked = {mode: last_queries(query, mode, scale, kv_heads) for mode in modes if is_queries(mode)}
    modes = tuple(mode for mode in modes if not is_queries(mode))
    if q_len == 0:
        return query.new_empty(batch, q_heads, 0, value_dim), reduced(weights, (*modes, *asked), reader, asked)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    settings = Settings(scale, softcap, causal, mask5, mask_rows, group_sinks(sinks, kv_heads, group))
    weighted_from = first_weighted_row(modes, q_len)
    try_native, sdpa_rows = route(plain is not None, settings, group, q_len, weighted_from, coded=plain is None)
    if try_native and not asked:
        out = _native_decode(q5, *plain, settings) if plain is not None else _reader_decode(q5, reader, settings)
        if out is not None:
            return out.to(query.dtype).reshape(batch, q_heads, q_len, value_dim), None
    by_mode = {mode: zeros(reader) for mode in modes}
    outs = []
    fused = _fused_rows(query, *plain, settings, sdpa_rows) if sdpa_rows else None
    if fused is not None:
        outs.append(fused)
    row_bytes = batch * q_heads * kv_len * 4
    for start, stop in _blocks(q_len, group, row_bytes, weighted_from, 0 if fused is None else sdpa_rows, plain is not None):
        # With causal, keys past this are in the future of every row of the block.
        limit = kv_len - q_len + stop if causal and plain is not None else kv_len
        if limit <= 0:  # more queries than keys: every row of this block sees no key, so zeros
            outs.append(query.new_zeros(batch, kv_heads, group, stop - start, value_dim))
            continue
        if stop <= sdpa_rows:
            outs.append(_sdpa_block(query, *plain, settings, start, stop, limit))
            continue
        probs = _block_probs(q5, reader, settings, start, stop, limit)
        for mode, acc in by_mode.items():
            reduce_into(acc[..., :limit], mode, probs, start, q_len)
        rows = group * (stop - start)
        flat = probs.to(query.dtype).reshape(batch, kv_heads, rows, limit)
        out = reader.first(limit).weighted_values(flat, rows <= DECODE_ROWS)
        outs.append(out.view(batch, kv_heads, group, stop - start, value_dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(batch, q_heads, q_len, value_dim), reduced(weights, (*modes, *asked), reader, {**by_mode, **asked})


def route(
    plain: bool, settings: Settings, group: int, q_len: int, weighted_from: int, *, coded: bool = False
) -> tuple[bool, int]:
    """Which path attends a call: the one place it is chosen. ``plain``: keys and values are
    tensors (``reader.tensors()``); ``coded``: a reader of blocks, which may run a whole decode step
    itself (``BlockReader.decode_attention``: a quantized store's does, over its codes); ``weighted_from``:
    the first query row whose weights are asked for (``q_len``: none). Returns ``(try_native, sdpa_rows)``:

    0. (Before this, in ``attend``: a call of one query row per head over plain float32 or
       bfloat16 keys and values with no mask, softcap or sinks goes straight to the C++ decode,
       ``native.decode_one``, which is 1 below without the general checks.)
    1. ``try_native``: the one-pass C++ decode (``native.py``) takes the whole call when the keys
       are plain, the call is decode-sized (``group * Sq <= DECODE_ROWS``) and asks no weights, has
       no sinks and no ``mask_rows``, is ``causal`` only with one query, has a boolean ``mask`` of
       at most one row per batch row or none, and ``torch.compile`` is not tracing (a library call
       would break the graph). The library may still decline (dtype, device, not built): then 2, 3.
       Over a ``coded`` reader, ``try_native`` offers the call to the reader's own decode
       (``decode_attention``; a quantized store's: one call of the coded library, ``fused.py``, plus
       its few exact tokens) under the same conditions, but with no mask at all and sinks allowed
       (added through the log-sum-exp the reader returns, ``_reader_decode``); if it declines, 3.
    2. Query rows ``0:sdpa_rows`` go through torch's fused SDPA, a block of rows at a time: plain
       keys, no softcap, no sinks, a boolean mask or none, and only rows whose weights nobody
       asked for (the blocks split at ``weighted_from``).
    3. Every other row runs blockwise over the reader (``_block_probs``, then
       ``weighted_values``). A block of at most ``DECODE_ROWS`` rows per KV head asks the reader
       for decode-shaped products, which a quantized store computes straight from its codes with
       the coded C++ library (``fused.py``, via the reader's ``decode_scores``/``decode_values``).
    """
    mask = settings.mask
    # A reader's own decode gives each row's log-sum-exp, with which the kernel adds sinks.
    no_extras = settings.mask_rows is None and (settings.sinks is None or coded)
    one_pass_mask = mask is None or (plain and mask.dtype == torch.bool and mask.shape[1:4] == (1, 1, 1))
    try_native = (
        (plain or coded)
        and no_extras
        and group * q_len <= DECODE_ROWS
        and weighted_from == q_len
        and (q_len == 1 or not settings.causal)
        and one_pass_mask
        and not torch.compiler.is_compiling()
    )
    sdpa = plain and settings.softcap is None and settings.sinks is None and (mask is None or mask.dtype == torch.bool)
    return try_native, (weighted_from if sdpa else 0)


def _as_reader(key: TensorLike, value: torch.Tensor | None) -> BlockReader:
    """What the kernel reads: a ``BlockReader`` as given (with ``value`` None), tensors wrapped
    (``_check_inputs`` checks them)."""
    if isinstance(key, BlockReader):
        if value is not None:
            raise DTypeError(f"a BlockReader hands out both keys and values: pass value=None, got {type(value).__name__}")
        return key
    return TensorReader(key, value)


def _blocks(
    q_len: int, group: int, row_bytes: int, split_at: int, first: int = 0, in_cache: bool = False
) -> list[tuple[int, int]]:
    """Blocks ``(start, stop)`` of query rows ``first...`` whose scores stay under ``_BLOCK_BYTES``
    (``in_cache``: near ``_CACHE_BYTES``, at least ``_MIN_CACHE_ROWS`` rows: keys read in place cost
    nothing to read again, while a reader of codes decodes its keys once per block), with a
    boundary at ``split_at`` (where the rows whose weights are needed begin); a decode-sized call
    is one block."""
    if first >= q_len:
        return []
    if group * q_len <= DECODE_ROWS:
        return [(first, q_len)]
    row_bytes = max(row_bytes, 1)
    block = _BLOCK_BYTES // row_bytes
    if in_cache:
        block = min(block, max(_MIN_CACHE_ROWS, _CACHE_BYTES // row_bytes))
    block = max(1, min(q_len, block))
    out = []
    for lo, hi in ((first, max(first, split_at)), (max(first, split_at), q_len)):
        out += [(s, min(hi, s + block)) for s in range(lo, hi, block)]
    return out


def _fused_rows(query, key, value, settings: Settings, rows: int) -> torch.Tensor | None:
    """Query rows ``0:rows`` through torch's fused SDPA in one go, ``[B, Hkv, group, rows, Dv]``,
    where no mask per row is needed: no mask, or ``causal`` with at most a boolean key mask (one
    row) split as ``causal.py`` does. None where the rows need masks built per block
    (``_sdpa_block``)."""
    mask, (batch, q_heads, q_len, _), (_, kv_heads, kv_len, _) = settings.mask, query.shape, key.shape
    key_mask = mask is None or (mask.dtype == torch.bool and mask.shape[3:] == (1, kv_len))
    if settings.mask_rows is not None or not key_mask:
        return None
    if settings.causal:
        # A decode-sized call takes one masked block (a mask of a few rows costs less than a second
        # call and the merge); a key mask's data decides how the split goes: not while torch.compile traces.
        decode_sized = q_heads // kv_heads * q_len <= DECODE_ROWS
        if decode_sized or not can_split(query, value) or (mask is not None and torch.compiler.is_compiling()):
            return None
        key_mask = _ungrouped(mask, kv_heads, q_heads)
        out = causal_attention(query[:, :, :rows], key, value, scale=settings.scale, past=kv_len - q_len, key_mask=key_mask)
    elif mask is None:
        out = F.scaled_dot_product_attention(query[:, :, :rows], key, value, scale=settings.scale, enable_gqa=q_heads > kv_heads)
    else:
        return None
    return out.view(batch, kv_heads, q_heads // kv_heads, rows, -1)


def _ungrouped(mask5: torch.Tensor | None, kv_heads: int, q_heads: int) -> torch.Tensor | None:
    """A grouped mask ``[B|1, Hkv|1, group|1, S, T]`` back in SDPA's layout ``[B|1, Hq|1, S, T]``."""
    if mask5 is None:
        return None
    b, kv, group, s, t = mask5.shape
    if kv == group == 1:
        return mask5[:, :, 0]
    return mask5.expand(b, kv_heads, q_heads // kv_heads, s, t).reshape(b, q_heads, s, t)


def _sdpa_block(query, key, value, settings: Settings, start: int, stop: int, limit: int) -> torch.Tensor:
    """Query rows ``start:stop`` through torch's fused SDPA over plain ``key`` and ``value``:
    ``[B, Hkv, group, rows, Dv]``. The block's boolean mask (causal, ``mask``, ``mask_rows``) is
    built for its rows only."""
    batch, q_heads, _, _ = query.shape
    kv_heads = key.shape[1]
    group, rows = q_heads // kv_heads, stop - start
    allowed, mask, mask_rows = None, settings.mask, settings.mask_rows  # [B|1, Hkv|1, group|1, rows, limit]
    if settings.causal:
        allowed = torch.ones(rows, limit, dtype=torch.bool, device=query.device).tril(diagonal=limit - rows)
    if mask is not None:
        m = mask[..., start:stop, :limit] if mask.shape[-2] != 1 else mask[..., :limit]
        allowed = m if allowed is None else allowed & m
    if mask_rows is not None:
        r = mask_rows(start, stop)[..., :limit]
        r = r if r.dim() == 5 else r.unsqueeze(2)
        allowed = r if allowed is None else allowed & r
    lo, hi = 0, limit
    if allowed is not None:
        while allowed.dim() < 5:
            allowed = allowed.unsqueeze(0)
        allowed = allowed.expand(*allowed.shape[:3], rows, limit)  # a mask may broadcast over rows or keys
        if not torch.compiler.is_compiling():  # (the columns depend on the mask's data)
            lo, hi = _visible_columns(allowed)
            allowed = allowed[..., lo:hi]
        allowed = allowed.expand(allowed.shape[0], kv_heads, group, rows, hi - lo).reshape(allowed.shape[0], q_heads, rows, hi - lo)
    out = F.scaled_dot_product_attention(
        query[:, :, start:stop], key[:, :, lo:hi], value[:, :, lo:hi], attn_mask=allowed, scale=settings.scale,
        enable_gqa=group > 1,
    )
    if allowed is not None:
        out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)  # a row with every key masked: zeros, not NaN
    return out.reshape(batch, kv_heads, group, rows, -1)


def _visible_columns(allowed: torch.Tensor) -> tuple[int, int]:
    """The run of key columns ``[lo, hi)`` outside which a block's boolean mask ``[..., rows, T]``
    hides every key from every row (a sliding window's band, a causal block's past): the block
    reads only those. ``(0, 1)`` when it hides everything (one column, as SDPA needs keys; none
    when there are none)."""
    seen = allowed.any(dim=tuple(range(allowed.dim() - 1))).nonzero()
    if seen.numel() == 0:
        return 0, min(1, allowed.shape[-1])
    return int(seen[0]), int(seen[-1]) + 1


def _native_decode(q5, key: torch.Tensor, value: torch.Tensor, settings: Settings) -> torch.Tensor | None:
    """The one-pass decode kernel's result ``[B, Hkv, group * Sq, Dv]`` over plain keys and values
    (``device_kernels``: the C++ library on CPU, Triton on CUDA), or None where it declines (``route``
    has checked everything else)."""
    keep = None if settings.mask is None else settings.mask[:, 0, 0, 0, :]
    batch, kv_heads, group, q_len, head_dim = q5.shape
    q = q5.reshape(batch, kv_heads, group * q_len, head_dim)
    return device_kernels.decode_views(q, key, value, keep, settings.softcap, settings.scale)


def _reader_decode(q5, reader: BlockReader, settings: Settings) -> torch.Tensor | None:
    """A reader's own decode step ``[B, Hkv, group * Sq, Dv]`` (``BlockReader.decode_attention``),
    or None where it declines (``route`` has checked everything else: no mask or weights). Sinks
    join each row's softmax through its log-sum-exp ``lse``: the sink takes ``exp(sink)`` of the
    denominator ``exp(lse) + exp(sink)``, so the output over the keys is scaled by
    ``sigmoid(lse - sink)``."""
    batch, kv_heads, group, q_len, head_dim = q5.shape
    q = q5.reshape(batch, kv_heads, group * q_len, head_dim)
    sinks = settings.sinks
    done = reader.decode_attention(q, settings.scale, settings.softcap)
    if done is None:
        return None
    out, lse = done
    if sinks is None:
        return out
    sinks = sinks.expand(batch, kv_heads, group, q_len, 1).reshape(batch, kv_heads, group * q_len)
    return (out.float() * torch.sigmoid(lse - sinks).unsqueeze(-1)).to(out.dtype)


def _block_probs(q5, reader: BlockReader, settings: Settings, start: int, stop: int, limit: int) -> torch.Tensor:
    """Softmax weights of query rows ``start:stop`` over the first ``limit`` keys (those after
    are masked for every row of the block) as float32 ``[B, Hkv, group, rows, limit]``.

    A decode-sized block (few rows per KV head) asks the reader for its scores in the decode
    order (``BlockReader.key_scores``): they are then viewed as ``[rows, T]`` for the softmax,
    whose output is contiguous, so the caller's ``p @ V`` reads V once in order.
    """
    batch, kv_heads, group, q_len, head_dim = q5.shape
    kv_len = reader.shape[2]
    rows = stop - start
    q = (q5[:, :, :, start:stop] * settings.scale).reshape(batch, kv_heads, group * rows, head_dim)
    scores = reader.first(limit).key_scores(q, group * rows <= DECODE_ROWS)  # [B, Hkv, group*rows, limit]
    scores = _cap(scores, settings.softcap).view(batch, kv_heads, group, rows, limit)
    mask = settings.mask
    masked = mask is not None or settings.mask_rows is not None or (settings.causal and q_len > kv_len)
    if mask is not None:
        m = mask[..., start:stop, :limit] if mask.shape[-2] != 1 else mask[..., :limit]
        scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m
    if settings.mask_rows is not None:
        rows_mask = settings.mask_rows(start, stop)[..., :limit]
        scores = scores.masked_fill(~(rows_mask if rows_mask.dim() == 5 else rows_mask.unsqueeze(2)), -math.inf)
    if settings.causal:
        # Row i sits at key index kv_len - q_len + start + i: only the block's last columns hold
        # keys in some row's future (a triangle), every column before them is visible to all.
        q_pos = torch.arange(start, stop, device=q5.device).view(-1, 1) + (kv_len - q_len)
        lo = max(0, min(limit, kv_len - q_len + start + 1))
        future = torch.arange(lo, limit, device=q5.device).view(1, -1) > q_pos  # [rows, limit - lo]
        scores[..., lo:limit].masked_fill_(future, -math.inf)
    probs = softmax(scores, sink_rows(settings.sinks, start, stop))
    return probs.nan_to_num(0.0) if masked else probs  # a row with every key masked: zeros, not NaN


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap
