"""Decode attention over float keys and values in one pass (``csrc/float_decode.cpp``).

For decode steps (a handful of query rows per KV head) over float32 or bfloat16 keys and values
read in place, the float decode library scores, softmaxes and sums the values in one pass over the
keys and values, chunk by chunk across the OpenMP threads, with the query heads of a group packed
together so each key and value is read from memory once. ``decode_attention`` returns None when it
cannot take the call (library off or not built, a mask other than one per batch row, sinks, a
device other than the CPU, shapes beyond it): the caller then takes the PyTorch path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from .native_build import library

#: Query rows per KV head and head dims the library takes.
MAX_ROWS, MAX_DIM = 16, 512
#: Query rows per sequence the paged entry takes (several sequences' rows share a prefix's pass).
PAGED_MAX_ROWS = 64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: Tokens per task: enough to amortise a task, few enough that a long sequence splits across threads.
_MIN_CHUNK, _TASKS_PER_THREAD = 256, 16
#: Tokens a task of the paged decode entry takes (rounded to whole blocks), ``paged_decode``'s default.
PAGED_CHUNK = _MIN_CHUNK


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    f32 = ctypes.c_float
    lib.kv_float_decode.argtypes = [ptr] * 5 + [i32, i64, i64, i32, i32, i32, i64] + [i64] * 6 + [i64, f32, f32, i32]
    lib.kv_float_decode.restype = i32
    lib.kv_paged_decode.argtypes = [ptr] * 7 + [i32, i64, i64, i32, i32, i32] + [i64] * 7 + [f32, f32, i32]
    lib.kv_paged_decode.restype = i32
    lib.kv_paged_prefill.argtypes = [ptr] * 7 + [i32, i64, i64, i32, i32, i32] + [i64] * 6 + [f32, f32, i32]
    lib.kv_paged_prefill.restype = i32
    return lib


def _declare_bf16(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_bf16_prefill.argtypes = [ptr] * 7 + [i64, i64, i32, i32, i32] + [i64] * 6 + [ctypes.c_float, i32]
    lib.kv_bf16_prefill.restype = i32
    lib.kv_bf16_decode.argtypes = [ptr] * 7 + [i64, i64, i32, i32, i32] + [i64] * 7 + [ctypes.c_float, i32]
    lib.kv_bf16_decode.restype = i32
    lib.kv_bf16_attention_kernel.restype = i32
    return lib


def bf16_attention_kernel() -> str:
    """How bfloat16 prompt chunks and decode rows multiply here (``csrc/bf16_attention.cpp``):
    ``"amx"`` (AMX tiles: the CPU has them, the OS granted this process their use, and
    ``$ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below AMX), ``"dot"`` (AVX-512 BF16's ``vdpbf16ps``)
    or ``"none"`` (the library absent or built without AVX-512 BF16: the float kernel takes them)."""
    lib = library("bf16_attention", _declare_bf16)
    return "none" if lib is None else ("none", "dot", "amx")[lib.kv_bf16_attention_kernel()]


def decode_entries() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr | None] | None:
    """The paged decode entry points, the float library's ``kv_paged_decode`` and the bfloat16
    library's ``kv_bf16_decode`` (None without it), for the C++ operators that call them
    (``graph_ops.register``); None without the float library."""
    lib = library("float_decode", _declare)
    if lib is None:
        return None
    bf16 = library("bf16_attention", _declare_bf16)
    return lib.kv_paged_decode, None if bf16 is None else bf16.kv_bf16_decode


def available() -> bool:
    """Whether the float decode library is built and on (building it now if needed)."""
    return library("float_decode", _declare) is not None


def decode_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor | None,
    softcap: float | None,
    scale: float = 1.0,
) -> torch.Tensor | None:
    """Attention of query rows ``q`` ``[B, Hkv, R, D]`` (the rows of a KV head's group packed),
    scores ``scale * q . k``, over ``key`` ``[B, Hkv, T, D]`` and ``value`` ``[B, Hkv, T, Dv]``: float32
    ``[B, Hkv, R, Dv]``, or None (see the module docstring). ``keep`` ``[B, T]`` bool: the keys each
    batch row may attend (None: all). A row with every key masked gets zeros."""
    batch, heads, rows, dim = q.shape
    length, vdim = key.shape[2], value.shape[3]
    if not _fits(q, key, value, rows, dim, vdim):
        return None
    lib = library("float_decode", _declare)
    if lib is None:
        return None
    qf = q.detach().float().contiguous()
    keep_u8 = None if keep is None else keep.to(torch.uint8).expand(batch, length).contiguous()
    out = torch.empty(batch, heads, rows, vdim, dtype=torch.float32)
    return out if _run(lib, qf, key, value, keep_u8, out, scale, softcap) else None


def decode_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor | None:
    """``attend``'s most common call, taken before any of its general machinery: one query row per
    head ``[B, Hq, 1, D]`` over ``key`` ``[B, Hkv, T, D]`` and ``value`` ``[B, Hkv, T, Dv]`` of the
    query's dtype (float32 or bfloat16, CPU), no mask. Returns ``[B, Hq, 1, Dv]`` in the query's
    dtype, or None where anything differs (the general path then checks the call and runs it)."""
    if (
        type(key) is not torch.Tensor
        or query.dim() != 4
        or key.dim() != 4
        or value.dim() != 4
        or query.shape[2] != 1
        or torch.compiler.is_compiling()
    ):
        return None
    batch, q_heads, _, dim = query.shape
    kv_heads, vdim = key.shape[1], value.shape[3]
    if (
        kv_heads == 0
        or q_heads % kv_heads
        or key.shape[0] != batch
        or value.shape[:3] != key.shape[:3]
        or key.shape[3] != dim
        or not (query.dtype == key.dtype == value.dtype)
    ):
        return None
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    if not _fits(q, key, value, q.shape[2], dim, vdim):
        return None
    lib = library("float_decode", _declare)
    if lib is None:
        return None
    qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.detach().float().contiguous()
    out = torch.empty(batch, q_heads, 1, vdim, dtype=torch.float32)
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if not _run(lib, qf, key, value, None, out, scale, None):
        return None
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _run(lib: ctypes.CDLL, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep_u8: torch.Tensor | None,
         out: torch.Tensor, scale: float, softcap: float | None) -> bool:
    """One library call: float32 ``q`` ``[B, Hkv, R, D]`` contiguous into ``out`` (as many floats as
    ``[B, Hkv, R, Dv]``); whether it ran."""
    batch, heads, rows, dim = q.shape
    length = key.shape[2]
    threads = torch.get_num_threads()
    chunk = task_chunk(length, batch * heads, threads, _TASKS_PER_THREAD, _MIN_CHUNK)
    ks, vs = key.stride(), value.stride()
    failed = lib.kv_float_decode(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), 0 if keep_u8 is None else keep_u8.data_ptr(), out.data_ptr(),
        _DTYPES[key.dtype], batch, heads, rows, dim, value.shape[3], length,
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], chunk, scale, float(softcap or 0.0), threads,
    )  # fmt: skip
    return not failed


def task_chunk(items: int, jobs: int, threads: int, tasks_per_thread: int, least: int) -> int:
    """Items (tokens, blocks) a library task takes, so that ``jobs`` sequences of ``items`` make about
    ``tasks_per_thread`` tasks a thread (one sequence too, with B = 1) and no task has fewer than
    ``least`` (too small to pay for itself)."""
    per_job = max(1, math.ceil(tasks_per_thread * threads / max(jobs, 1)))
    return max(least, math.ceil(items / per_job), 1)


def _fits(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int, dim: int, vdim: int) -> bool:
    return (
        key.device.type == "cpu"
        and key.dtype in _DTYPES
        and value.dtype == key.dtype
        and key.shape[2] > 0
        and 1 <= rows <= MAX_ROWS
        and 1 <= dim <= MAX_DIM
        and 1 <= vdim <= MAX_DIM
        and (value.stride(3) == 1 or vdim == 1)
        and (key.stride(3) == 1 or dim == 1)
        and not (torch.is_grad_enabled() and (q.requires_grad or key.requires_grad or value.requires_grad))
    )


def paged_decode(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    blocks_per_task: int | None = None,
    lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Decode attention of query rows ``q`` ``[S, Hkv, R, D]`` (a sequence's grouped rows packed per
    KV head) over keys and values held in pool blocks ``[blocks, Hkv, block_size, D]`` (``Dv``),
    sequence ``s`` reading its first ``lengths[s]`` tokens from blocks ``tables[s, 0], tables[s, 1],
    ...`` (int32 ``[S, max_blocks]``; ``lengths`` int64 ``[S]``): float32 ``[S, Hkv, R, Dv]``, a
    sequence of length 0 getting zeros; None where the library cannot take it (see the module
    docstring). The caller checks that the table's block ids are within the pool. A task of the
    library takes ``blocks_per_task`` blocks of a sequence (default: about ``PAGED_CHUNK`` tokens).
    With ``lse``, ``(out, lse)``: ``lse`` float32 ``[S, Hkv, R]`` is each row's log-sum-exp of its
    scaled scores (-inf for a sequence of length 0), what merging with attention over other keys
    needs. ``R`` may be up to ``PAGED_MAX_ROWS``. bfloat16 queries over bfloat16 blocks take the
    bfloat16 library where ``bf16_attention_kernel()`` names one (the weights rounded to bfloat16,
    as ``paged_prefill``'s; 16 rows and more on packed blocks, fewer read in place); float32 queries,
    a softcap and other CPUs take the float kernel (float32 throughout)."""
    seqs, heads, rows, dim = q.shape
    block_size, vdim = key_pool.shape[2], value_pool.shape[3]
    ok = (
        _pool_fits(q, key_pool, value_pool, heads, rows, dim)
        and tables.dim() == 2 and tables.shape[0] == seqs and lengths.shape == (seqs,)
    )  # fmt: skip
    lib = library("float_decode", _declare) if ok else None
    if lib is None:
        return None
    per_task = blocks_per_task or max(1, PAGED_CHUNK // block_size)
    table = tables.to(torch.int32).contiguous()
    length = lengths.to(torch.int64).contiguous()
    out = torch.empty(seqs, heads, rows, vdim, dtype=torch.float32)
    sums = torch.empty(seqs, heads, rows, dtype=torch.float32) if lse else None
    ks, vs = key_pool.stride(), value_pool.stride()
    if q.dtype == torch.bfloat16 and key_pool.dtype == torch.bfloat16 and not softcap:
        bf16, qb = library("bf16_attention", _declare_bf16), q.detach().contiguous()
        failed = 2 if bf16 is None else bf16.kv_bf16_decode(
            qb.data_ptr(), key_pool.data_ptr(), value_pool.data_ptr(), table.data_ptr(), length.data_ptr(),
            out.data_ptr(), None if sums is None else sums.data_ptr(), seqs, heads, rows, dim, vdim, block_size,
            table.shape[1], ks[0], ks[1], vs[0], vs[1], per_task, float(scale), torch.get_num_threads(),
        )  # fmt: skip
        if failed == 0:
            return (out, sums) if sums is not None else out
    qf = q.detach().float().contiguous()
    failed = lib.kv_paged_decode(
        qf.data_ptr(), key_pool.data_ptr(), value_pool.data_ptr(), table.data_ptr(), length.data_ptr(), out.data_ptr(),
        None if sums is None else sums.data_ptr(), _DTYPES[key_pool.dtype], seqs, heads, rows, dim, vdim, block_size, table.shape[1],
        ks[0], ks[1], vs[0], vs[1], per_task, float(scale), float(softcap or 0.0), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        return None
    return (out, sums) if sums is not None else out


def paged_prefill(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    pasts: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Causal attention of prompt chunks over pool blocks ``[blocks, Hkv, block_size, D]`` (``Dv``)
    that already hold each chunk's past and the chunk itself: ``q`` ``[Hkv, N, R, D]`` are the
    queries of every chunk one after the other, grouped heads packed per KV head (chunk ``s`` is
    ``q[:, starts[s]:starts[s + 1]]``, int64 ``starts`` ``[S + 1]``, its query ``i`` at position
    ``pasts[s] + i`` seeing positions ``0 .. pasts[s] + i`` in blocks ``tables[s]``, int32
    ``[S, max_blocks]``). Float32 ``[Hkv, N, R, Dv]``, or None where the library cannot take it. The
    caller checks that the tables' block ids are within the pool. bfloat16 queries over bfloat16
    blocks take the bfloat16 library where ``bf16_attention_kernel()`` names one
    (``csrc/bf16_attention.cpp``, on AMX tiles or ``vdpbf16ps``: the weights rounded to bfloat16
    before they multiply the values, as a bfloat16 attention rounds them); float32 queries, and other
    CPUs, take the float library's kernel (float32 throughout)."""
    heads, total, rows, dim = q.shape
    block_size, vdim = key_pool.shape[2], value_pool.shape[3]
    seqs = tables.shape[0] if tables.dim() == 2 else -1
    ok = (
        _pool_fits(q, key_pool, value_pool, heads, rows, dim)
        and seqs >= 1 and starts.shape == (seqs + 1,) and pasts.shape == (seqs,)
    )  # fmt: skip
    lib = library("float_decode", _declare) if ok else None
    if lib is None:
        return None
    start, past = starts.to(torch.int64).contiguous(), pasts.to(torch.int64).contiguous()
    if int(start[0]) != 0 or int(start[-1]) != total or bool((start[1:] < start[:-1]).any()):
        raise ValueError(f"paged_prefill: starts must rise from 0 to the {total} queries, got {start.tolist()}")
    table = tables.to(torch.int32).contiguous()
    out = torch.empty(heads, total, rows, vdim, dtype=torch.float32)
    ks, vs = key_pool.stride(), value_pool.stride()
    if q.dtype == torch.bfloat16 and key_pool.dtype == torch.bfloat16 and not softcap:
        bf16, qb = library("bf16_attention", _declare_bf16), q.detach().contiguous()
        failed = 2 if bf16 is None else bf16.kv_bf16_prefill(
            qb.data_ptr(), key_pool.data_ptr(), value_pool.data_ptr(), table.data_ptr(),
            start.data_ptr(), past.data_ptr(), out.data_ptr(), seqs, heads, rows, dim, vdim, block_size, table.shape[1],
            ks[0], ks[1], vs[0], vs[1], float(scale), torch.get_num_threads(),
        )  # fmt: skip
        if failed == 0:
            return out
    qf = q.detach().float().contiguous()
    failed = lib.kv_paged_prefill(
        qf.data_ptr(), key_pool.data_ptr(), value_pool.data_ptr(), table.data_ptr(), start.data_ptr(), past.data_ptr(),
        out.data_ptr(), _DTYPES[key_pool.dtype], seqs, heads, rows, dim, vdim, block_size, table.shape[1],
        ks[0], ks[1], vs[0], vs[1], float(scale), float(softcap or 0.0), torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else out


def _pool_fits(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, heads: int, rows: int, dim: int) -> bool:
    """Whether the paged entries take pools ``[blocks, Hkv, block_size, D]`` (CPU, float32 or
    bfloat16, token rows contiguous) for ``rows`` query rows of ``heads`` KV heads (no autograd)."""
    vdim = value_pool.shape[3]
    return (
        key_pool.device.type == "cpu"
        and key_pool.dtype in _DTYPES
        and value_pool.dtype == key_pool.dtype
        and key_pool.shape[1] == heads
        and value_pool.shape[:3] == key_pool.shape[:3]
        and key_pool.stride(3) == 1 and key_pool.stride(2) == dim
        and value_pool.stride(3) == 1 and value_pool.stride(2) == vdim
        and 1 <= rows <= PAGED_MAX_ROWS and 1 <= dim <= MAX_DIM and 1 <= vdim <= MAX_DIM
        and not (torch.is_grad_enabled() and q.requires_grad)
    )  # fmt: skip
