"""A packed linear layer's call, eager and as one torch operator that a compiled graph holds.

``PackedLinears`` (``linears.py``) keeps up to two packed copies of a weight: the panel library's
(``panels.py``, float32 or bfloat16) and oneDNN's (``torch.ops.mkldnn._reorder_linear_weight``).
``call`` chooses between them by the call's row count, at run time: panels for at most
``panel_rows(dtype, K)`` rows, oneDNN past that, the plain weight where neither copy exists. Inside a
``torch.compile`` trace the same choice runs as ``torch.ops.kvcache.linear`` (``register()``), one
opaque node, so a graph whose token count is a dynamic dimension holds one branch-free call per
layer instead of a guard on the row count (which would compile a graph for each side of it).
Opaque on purpose for oneDNN too: inductor's own lowering of ``mkldnn._linear_pointwise`` takes
only weights it froze itself.

The operator changes none of its inputs. Registering is global to the process, so nothing
registers at import: ``register()`` does it once (``PackedLinears`` calls it when it packs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..attention import op_library
from ..attention.native_build import cpu_vendor
from . import panels

#: Most rows a float32 call multiplies on panels; longer calls (prompt chunks) go to oneDNN, which
#: is faster there (docs/benchmarks.md, ``benchmarks/panel_linears.py``
#: at commit d428424).
PANEL_ROWS = 64

#: The same for bfloat16, by the library's kernel (``panels.bf16_kernel()``), measured the same way
#: on an Intel Xeon (``vdpbf16ps``: capped below AMX, compute-bound past 8 rows).
BF16_PANEL_ROWS = {"amx": 32, "dot": 8, "widen": 4, "none": 0}

#: ``vdpbf16ps`` rows on an AMD CPU: a Zen 4's panels beat oneDNN's up to 32 rows (a SmolLM2 decode
#: step's linear layers, 16 rows: 15.7 against 17.2 ms; docs/benchmarks.md).
AMD_DOT_ROWS = 32


@functools.cache
def panel_rows(dtype: torch.dtype, k: int) -> int:
    """Most rows a call of ``dtype`` with ``k`` inputs a row multiplies on panels (``PANEL_ROWS``,
    ``kernel_rows``). The AMX kernel takes ``k`` a multiple of 32 only: the library runs other
    layers on its dot kernel, so they take the dot kernel's limit."""
    if dtype == torch.float32:
        return PANEL_ROWS
    kernel = panels.bf16_kernel()
    return kernel_rows("dot" if kernel == "amx" and k % 32 else kernel)


def kernel_rows(kernel: str) -> int:
    """Most rows a bfloat16 call multiplies on panels when ``kernel`` (a ``panels.bf16_kernel()``
    name) runs it, on this CPU."""
    return AMD_DOT_ROWS if kernel == "dot" and cpu_vendor() == "AuthenticAMD" else BF16_PANEL_ROWS[kernel]



def call(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    panel: torch.Tensor | None, onednn: torch.Tensor | None, n: int,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``[..., n]``) through the packed copy that suits ``x``'s row count
    (``panel``/``onednn``: the copies, None where a layout is not packed)."""
    if panel is not None and x.numel() <= panel_rows(panel.dtype, x.shape[-1]) * x.shape[-1]:
        fast = native_panels()  # (PackedLinears checked the layer)
        return panels.run(x, panel, n, bias) if fast is None else fast(x, panel, n, bias)
    if onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def static_panels(x: torch.Tensor, limit: int) -> bool:
    """Whether a traced call of ``x`` (its row count fixed, not a dynamic dimension) takes the panels
    at every run (``limit``: the layer's ``panel_rows``): the graph can then hold
    ``kvcache::panel_linear`` (where it is built) instead of ``kvcache::linear``'s choice."""
    # statically_known_true: no guard on a dynamic row count (type() of one reads int under dynamo)
    return statically_known_true(x.numel() <= limit * x.shape[-1])


@functools.cache
def native_panels() -> torch._ops.OpOverload | None:
    """``kvcache::panel_linear`` (``op_library.native``'s C++ kernel, ``panels.run`` without
    Python's per-call cost) bound to the panel library, or None where either is not built."""
    kernels = op_library.native()
    if kernels is None or not panels.available():
        return None
    kernels.kv_step_ops_bind_linear(*(op_library.address(f) for f in panels.entries()))
    torch.library.register_fake("kvcache::panel_linear")(lambda x, panel, n, bias: x.new_empty((*x.shape[:-1], n)))
    return torch.ops.kvcache.panel_linear.default


@functools.cache
def register() -> torch._ops.OpOverloadPacket:
    """Register ``kvcache::linear`` (``call`` as an operator; once per process) and return it."""

    def fake(x, weight, bias, panel, onednn, n):
        return x.new_empty((*x.shape[:-1], n))  # every path returns x's dtype (panels: their own, x's)

    schema = "(Tensor x, Tensor weight, Tensor? bias, Tensor? panel, Tensor? onednn, int n) -> Tensor"
    return op_library.define("linear", schema, call, fake)
