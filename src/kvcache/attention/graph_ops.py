"""The paged C++ kernels as torch operators, so that a compiled graph holds them.

``torch.compile`` cannot trace into a ``ctypes`` call. Reached from a traced function, the
``native`` kernels break the graph there, and the code after each break is compiled again for every
layer (docs/benchmarks.md, "A decode step on an Intel Xeon"). Declared through ``torch.library``
(``op_library.define``) with a fake implementation (the output's shape and dtype, computed without running the kernel),
they become single nodes that dynamo, AOT autograd and inductor pass through:

- ``torch.ops.kvcache.paged_decode(q, key_pool, value_pool, tables, lengths, scale)``: as
  ``native.paged_decode``, float32 ``[S, Hkv, R, Dv]``;
- ``torch.ops.kvcache.paged_decode_lse(...)``: the same arguments, ``(out, lse)`` as
  ``native.paged_decode(..., lse=True)`` (``lse`` float32 ``[S, Hkv, R]``), what merging a shared
  prefix's pass with each row's own blocks needs (``engine/shared_prefix.py``);
- ``torch.ops.kvcache.paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale)``: as
  ``native.paged_prefill``, float32 ``[Hkv, N, R, Dv]``;
- ``torch.ops.kvcache.kept(x)``: a copy of ``x``, which the compiler cannot inline into the loops
  that read it (``engine/rotary_tables.py``).

None changes its inputs. Each raises ``UnsupportedOperation`` where the library cannot take the
call (no compiler, another device, a shape it does not serve; a ``RuntimeError`` naming the
operator from the C++ kernels of the two decode operators, which take CPU calls where
``op_library.native()`` builds: ``csrc/step_ops.cpp``); the eager callers check
``native.available()`` and the shapes before they choose these.

Registering an operator is global to the process, so nothing registers at import: ``register()``
does it once and returns the four operators.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..errors import UnsupportedOperation
from . import native, op_library

__all__ = ["GraphOps", "register"]


class GraphOps(NamedTuple):
    paged_decode: torch._ops.OpOverloadPacket
    paged_decode_lse: torch._ops.OpOverloadPacket
    paged_prefill: torch._ops.OpOverloadPacket
    kept: torch._ops.OpOverloadPacket


def paged_decode(q, key_pool, value_pool, tables, lengths, scale):
    """``kvcache::paged_decode``'s Python kernel (the CPU's where ``op_library.native()`` is None)."""
    out = native.paged_decode(q, key_pool, value_pool, tables, lengths, scale)
    if out is None:
        raise UnsupportedOperation(_refused("paged_decode", q, key_pool))
    return out


def paged_decode_lse(q, key_pool, value_pool, tables, lengths, scale):
    """``kvcache::paged_decode_lse``'s Python kernel (as ``paged_decode``'s)."""
    got = native.paged_decode(q, key_pool, value_pool, tables, lengths, scale, lse=True)
    if got is None:
        raise UnsupportedOperation(_refused("paged_decode_lse", q, key_pool))
    return got


def paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale):
    """``kvcache::paged_prefill``'s kernel."""
    out = native.paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale)
    if out is None:
        raise UnsupportedOperation(_refused("paged_prefill", q, key_pool))
    return out


@functools.cache
def register() -> GraphOps:
    """Register ``kvcache::paged_decode``, ``paged_decode_lse``, ``paged_prefill`` and ``kept``
    (once per process), the first two with C++ kernels for the CPU where ``op_library.native()``
    builds."""

    def decode_fake(q, key_pool, value_pool, tables, lengths, scale):
        return _output(q, value_pool)

    def decode_lse_fake(q, key_pool, value_pool, tables, lengths, scale):
        return _output(q, value_pool), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def prefill_fake(q, key_pool, value_pool, tables, starts, pasts, scale):
        return _output(q, value_pool)

    kernels, entries = op_library.native(), native.decode_entries()
    if kernels is not None and entries is not None:  # C++ kernels take the CPU's decode calls
        kernels.kv_step_ops_bind_decode(*(op_library.address(f) for f in entries), native.PAGED_MAX_ROWS,
                                        native.MAX_DIM, native.PAGED_CHUNK)  # fmt: skip
    pools = "Tensor q, Tensor key_pool, Tensor value_pool, Tensor tables"
    return GraphOps(
        op_library.define("paged_decode", f"({pools}, Tensor lengths, float scale) -> Tensor", paged_decode, decode_fake),
        op_library.define("paged_decode_lse", f"({pools}, Tensor lengths, float scale) -> (Tensor, Tensor)",
                          paged_decode_lse, decode_lse_fake),  # fmt: skip
        op_library.define("paged_prefill", f"({pools}, Tensor starts, Tensor pasts, float scale) -> Tensor",
                          paged_prefill, prefill_fake),  # fmt: skip
        op_library.define("kept", "(Tensor x) -> Tensor", torch.clone, torch.empty_like),
    )


def _output(q: torch.Tensor, value_pool: torch.Tensor) -> torch.Tensor:
    """An empty float32 output of every kernel here: ``q``'s shape with the values' head dim last."""
    return q.new_empty((*q.shape[:-1], value_pool.shape[-1]), dtype=torch.float32)


def _refused(name: str, q: torch.Tensor, pool: torch.Tensor) -> str:
    return (
        f"kvcache::{name}: the C++ library cannot take queries {list(q.shape)} ({q.dtype}, {q.device}) over "
        f"blocks {list(pool.shape)} ({pool.dtype}); native.available() is {native.available()}"
    )
