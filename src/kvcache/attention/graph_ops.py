"""The paged C++ kernels as torch operators, so that a compiled graph holds them.

``torch.compile`` cannot trace into a ``ctypes`` call. Reached from a traced function, the
``native`` kernels break the graph there, and the code after each break is compiled again for every
layer (docs/benchmarks.md, "A decode step on an Intel Xeon"). Declared through ``torch.library``
with a fake implementation (the output's shape and dtype, computed without running the kernel),
they become single nodes that dynamo, AOT autograd and inductor pass through:

- ``torch.ops.kvcache.paged_decode(q, key_pool, value_pool, tables, lengths, scale)``: as
  ``native.paged_decode``, float32 ``[S, Hkv, R, Dv]``;
- ``torch.ops.kvcache.paged_decode_lse(...)``: the same arguments, ``(out, lse)`` as
  ``native.paged_decode(..., lse=True)`` (``lse`` float32 ``[S, Hkv, R]``), what merging a shared
  prefix's pass with each row's own blocks needs (``engine/shared_prefix.py``);
- ``torch.ops.kvcache.paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale)``: as
  ``native.paged_prefill``, float32 ``[Hkv, N, R, Dv]``;
- ``torch.ops.kvcache.linear(x, panels, bias, n)``: as ``hf.panels.linear``, float32 ``[..., n]``
  (a linear layer over its weight packed in column panels, ``hf/linears.py``);
- ``torch.ops.kvcache.onednn_linear(x, weight, bias)``: oneDNN's linear over a weight it packed
  (``torch.ops.mkldnn._linear_pointwise``), as one opaque node: inductor's own lowering of that
  operator takes only weights it froze itself.

None changes its inputs. Each raises ``UnsupportedOperation`` where the library cannot take the
call (no compiler, another device, a shape it does not serve); the eager callers check
``native.available()`` and the shapes before they choose these.

Registering an operator is global to the process, so nothing registers at import: ``register()``
does it once and returns the five operators.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..errors import UnsupportedOperation
from . import native

__all__ = ["GraphOps", "register"]


class GraphOps(NamedTuple):
    paged_decode: torch._ops.OpOverloadPacket
    paged_decode_lse: torch._ops.OpOverloadPacket
    paged_prefill: torch._ops.OpOverloadPacket
    linear: torch._ops.OpOverloadPacket
    onednn_linear: torch._ops.OpOverloadPacket


@functools.cache
def register() -> GraphOps:
    """Register ``kvcache::paged_decode``, ``paged_decode_lse``, ``paged_prefill``, ``linear`` and
    ``onednn_linear`` (once per process)."""
    from ..hf import panels as panel_linear

    @torch.library.custom_op("kvcache::paged_decode", mutates_args=())
    def paged_decode(
        q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
        lengths: torch.Tensor, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        out = native.paged_decode(q, key_pool, value_pool, tables, lengths, scale)
        if out is None:
            raise UnsupportedOperation(_refused("paged_decode", q, key_pool))
        return out

    @paged_decode.register_fake
    def _(q, key_pool, value_pool, tables, lengths, scale):
        return _output(q, value_pool)

    @torch.library.custom_op("kvcache::paged_decode_lse", mutates_args=())
    def paged_decode_lse(
        q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
        lengths: torch.Tensor, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        got = native.paged_decode(q, key_pool, value_pool, tables, lengths, scale, lse=True)
        if got is None:
            raise UnsupportedOperation(_refused("paged_decode_lse", q, key_pool))
        return got

    @paged_decode_lse.register_fake
    def _(q, key_pool, value_pool, tables, lengths, scale):
        return _output(q, value_pool), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.custom_op("kvcache::paged_prefill", mutates_args=())
    def paged_prefill(
        q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
        starts: torch.Tensor, pasts: torch.Tensor, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        out = native.paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale)
        if out is None:
            raise UnsupportedOperation(_refused("paged_prefill", q, key_pool))
        return out

    @paged_prefill.register_fake
    def _(q, key_pool, value_pool, tables, starts, pasts, scale):
        return _output(q, value_pool)

    @torch.library.custom_op("kvcache::linear", mutates_args=())
    def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return panel_linear.run(x, panels, n, bias)  # (PackedLinears checked the call)

    @linear.register_fake
    def _(x, panels, bias, n):
        return x.new_empty((*x.shape[:-1], n), dtype=torch.float32)

    @torch.library.custom_op("kvcache::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @onednn_linear.register_fake
    def _(x, weight, bias, n):
        return x.new_empty((*x.shape[:-1], n))

    ops = torch.ops.kvcache
    return GraphOps(ops.paged_decode, ops.paged_decode_lse, ops.paged_prefill, ops.linear, ops.onednn_linear)


def _output(q: torch.Tensor, value_pool: torch.Tensor) -> torch.Tensor:
    """An empty float32 output of every kernel here: ``q``'s shape with the values' head dim last."""
    return q.new_empty((*q.shape[:-1], value_pool.shape[-1]), dtype=torch.float32)


def _refused(name: str, q: torch.Tensor, pool: torch.Tensor) -> str:
    return (
        f"kvcache::{name}: the C++ library cannot take queries {list(q.shape)} ({q.dtype}, {q.device}) over "
        f"blocks {list(pool.shape)} ({pool.dtype}); native.available() is {native.available()}"
    )
