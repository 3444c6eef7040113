"""The packed linear layers' calls as torch operators, so that a compiled graph holds them.

``PackedLinears`` (``linears.py``) reaches its kernels through ``ctypes`` (the panel library) and
through oneDNN's operator on a weight oneDNN packed. Inside a ``torch.compile`` trace it calls
these instead:

- ``torch.ops.kvcache.linear(x, panels, bias, n)``: ``panels.run``, float32 ``[..., n]``;
- ``torch.ops.kvcache.onednn_linear(x, weight, bias, n)``: ``torch.ops.mkldnn._linear_pointwise``
  over ``weight`` (``[..., n]``) as one opaque node: inductor's own lowering of that operator takes
  only weights it froze itself, and asserts on any other.

Neither changes its inputs. Registering is global to the process, so nothing registers at import:
``register()`` does it once (``PackedLinears`` calls it when it packs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import panels


class LinearOps(NamedTuple):
    linear: torch._ops.OpOverloadPacket
    onednn_linear: torch._ops.OpOverloadPacket


@functools.cache
def register() -> LinearOps:
    """Register ``kvcache::linear`` and ``kvcache::onednn_linear`` (once per process)."""

    @torch.library.custom_op("kvcache::linear", mutates_args=())
    def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return panels.run(x, packed, n, bias)  # (PackedLinears checked the call)

    @linear.register_fake
    def _(x, packed, bias, n):
        return x.new_empty((*x.shape[:-1], n), dtype=torch.float32)

    @torch.library.custom_op("kvcache::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @onednn_linear.register_fake
    def _(x, weight, bias, n):
        return x.new_empty((*x.shape[:-1], n))

    return LinearOps(torch.ops.kvcache.linear, torch.ops.kvcache.onednn_linear)
