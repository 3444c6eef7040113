"""A model's linear layers on prepacked weights, while a ``with`` block runs.

On the CPU, ``torch.nn.functional.linear`` multiplies by the weight as stored (``[out, in]``, row
major) through the BLAS, which re-blocks the weight on every call. ``PackedLinears(model)`` packs
every ``torch.nn.Linear`` of ``model`` it can once, in one or both of two layouts:

- **panels** (``panels.py``, kvcache's own C++ library; float32, and bfloat16 on AVX-512): for
  calls of at most ``PANEL_ROWS`` rows in float32 (``linear_ops.BF16_PANEL_ROWS`` in bfloat16),
  the decode steps, which it multiplies near the memory bandwidth (float32: 1.6x oneDNN at 16 rows
  on SmolLM2's weights; bfloat16 on AMX: 1.5-1.9x at 1-16 rows; docs/benchmarks.md);
- **oneDNN** (``torch.ops.mkldnn._reorder_linear_weight``, the packing ``torch.compile`` uses
  when it freezes a CPU model; float32, and bfloat16 where oneDNN runs it natively: AVX-512 with
  bfloat16 instructions or AMX): for more rows (prompt chunks), and for any row count where
  the panel library is not built.

``with packed.active():`` routes those layers' forward through the packed copies and restores them
on exit, so the model is left as it was. Each call picks its layout by its row count at run time
(``linear_ops.call``); inside a ``torch.compile`` trace it is the ``kvcache::linear`` operator,
so the graph holds one call per layer and no guard on the row count. A packed copy is remade when
its weight was changed in place or replaced (checked on entry), so it never computes with stale
weights. The copies cost the packed layers' weight bytes once per layout
(``packed.bytes``).

Results differ from the BLAS path by rounding only (another summation order: about 1e-6 relative in
float32; in bfloat16 the products accumulate in float32 either way and the outputs round to
bfloat16, so a difference is one unit in the last place), which is why ``generate`` does not use it
unless asked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import linear_ops
from .linear_ops import PANEL_ROWS
from . import panels as panel_linear

__all__ = ["PANEL_ROWS", "PackedLinears", "can_pack"]


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack ``weight`` ``[out, in]`` for oneDNN (on the CPU; float32,
    or bfloat16 where oneDNN runs it natively)."""
    return _fits(weight) and _built_with_packing() and (weight.dtype == torch.float32 or _native_bf16())


@functools.cache
def _built_with_packing() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def _native_bf16() -> bool:
    """oneDNN has bfloat16 kernels for this CPU (not an emulation slower than float32)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


def _fits(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _DTYPES and weight.dim() == 2


_DTYPES = (torch.float32, torch.bfloat16)


class _Packed:
    """One linear layer's packed copies (``weight``: oneDNN's or None; ``panels``: the panel
    library's or None), what they were made from, and the ``forward`` that uses them."""

    __slots__ = ("weight", "panels", "source", "version", "forward")

    def __init__(self, module: torch.nn.Linear, rows_hint: int):
        weight = module.weight
        self.source, self.version = weight, weight._version
        with torch.no_grad():
            self.weight = (
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=rows_hint) if can_pack(weight) else None
            )
            self.panels = panel_linear.pack(weight) if panel_linear.fits(weight) else None
        # made once, so a compiled graph traced through it sees the same function at every step
        self.forward = _forward(self, module)

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.panels) if t is not None)


class PackedLinears:
    """Prepacked oneDNN copies of ``model``'s ``nn.Linear`` weights (see the module docstring).

    ``rows_hint``: the number of input rows oneDNN chooses the packing for (decode steps: the
    requests decoding at once); any row count computes correctly."""

    def __init__(self, model: torch.nn.Module, rows_hint: int = 16):
        self.model, self.rows_hint = model, rows_hint
        self._packed: dict[torch.nn.Linear, _Packed] = {}
        self._depth = 0  # active() blocks entered and not left
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and _packable(module):
                self._packed[module] = _Packed(module, rows_hint)

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def bytes(self) -> int:
        """Bytes the packed copies hold."""
        return sum(p.bytes for p in self._packed.values())

    @contextmanager
    def active(self) -> Iterator[PackedLinears]:
        """Inside the block, each packed layer's forward uses its packed weight (grad mode off only:
        the packed op has no backward, so under autograd the layers keep their own forward). A block
        inside another on this object changes nothing: the outer one swapped and checked the
        layers (an engine holds one over a run of steps, each step enters its own)."""
        if torch.is_grad_enabled() or not self._packed or self._depth:
            yield self
            return
        swapped = []
        self._depth += 1
        try:
            for module, packed in self._packed.items():
                if not _packable(module):
                    continue  # moved to another device or dtype since: its own forward
                if packed.stale(module.weight):
                    packed = self._packed[module] = _Packed(module, self.rows_hint)
                if "forward" in module.__dict__:
                    continue  # someone else's instance-level forward: left alone
                module.forward = packed.forward
                swapped.append(module)
            yield self
        finally:
            self._depth -= 1
            for module in swapped:
                del module.forward


def _packable(module: torch.nn.Linear) -> bool:
    """Its weight can be packed in some layout and its bias (if any) is of the weight's dtype."""
    weight = module.weight
    return (can_pack(weight) or panel_linear.fits(weight)) and (module.bias is None or module.bias.dtype == weight.dtype)


def _forward(packed: _Packed, module: torch.nn.Linear):
    op, fast = linear_ops.register(), linear_ops.native_panels()  # resolved here: a trace cannot load libraries
    limit = 0 if packed.panels is None else linear_ops.panel_rows(packed.panels.dtype, module.in_features)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != packed.source.dtype or x.device.type != "cpu":
            return F.linear(x, module.weight, module.bias)
        if not torch.compiler.is_compiling():
            return linear_ops.call(x, module.weight, module.bias, packed.panels, packed.weight, module.out_features)
        if fast is not None and packed.panels is not None and linear_ops.static_panels(x, limit):
            return fast(x, packed.panels, module.out_features, module.bias)
        return op(x, module.weight, module.bias, packed.panels, packed.weight, module.out_features)

    return forward
