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
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: Tokens per task: enough to amortise a task, few enough that a long sequence splits across threads.
_MIN_CHUNK, _TASKS_PER_THREAD = 256, 16


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_float_decode.argtypes = [ptr] * 5 + [i32, i64, i64, i32, i32, i32, i64] + [i64] * 6 + [i64, ctypes.c_float, i32]
    lib.kv_float_decode.restype = i32
    return lib


def available() -> bool:
    """Whether the float decode library is built and on (building it now if needed)."""
    return library("float_decode", _declare) is not None


def decode_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor | None:
    """Attention of scaled query rows ``q`` ``[B, Hkv, R, D]`` (the rows of a KV head's group
    packed) over ``key`` ``[B, Hkv, T, D]`` and ``value`` ``[B, Hkv, T, Dv]``: float32
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
    threads = torch.get_num_threads()
    chunk = task_chunk(length, batch * heads, threads, _TASKS_PER_THREAD, _MIN_CHUNK)
    failed = lib.kv_float_decode(
        qf.data_ptr(), key.data_ptr(), value.data_ptr(), 0 if keep_u8 is None else keep_u8.data_ptr(), out.data_ptr(),
        _DTYPES[key.dtype], batch, heads, rows, dim, vdim, length,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        chunk, float(softcap or 0.0), threads,
    )  # fmt: skip
    return None if failed else out


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
