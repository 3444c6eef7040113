"""A model's linear layers on prepacked oneDNN weights, while a ``with`` block runs.

On the CPU, ``torch.nn.functional.linear`` multiplies by the weight as stored (``[out, in]``, row
major) through the BLAS, which for the few rows of a decode step (1-64) reaches about a third of the
machine's floating-point peak: each call re-blocks the weight. oneDNN can block a weight once, for
all later calls (``torch.ops.mkldnn._reorder_linear_weight``, the packing ``torch.compile`` uses when
it freezes a CPU model), and its matrix products on such a weight run about twice as fast at decode
sizes and somewhat faster on prompt chunks (measured in docs/benchmarks.md, "The engine's step").

``PackedLinears(model)`` packs every ``torch.nn.Linear`` of ``model`` it can (float32 weights on the
CPU, oneDNN present; bfloat16 weights too where oneDNN runs bfloat16 natively: AVX-512 with
bfloat16 instructions or AMX) once; ``with packed.active():`` routes those layers' forward through the packed
copies and restores them on exit, so the model is left as it was. A packed copy is remade when its
weight was changed in place or replaced (checked on entry), so it never computes with stale
weights. The copies cost the packed layers' weight bytes again (``packed.bytes``).

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

__all__ = ["PackedLinears", "can_pack"]


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
    """One linear layer's packed weight and what it was made from."""

    __slots__ = ("weight", "source", "version")

    def __init__(self, weight: torch.Tensor, rows_hint: int):
        self.source, self.version = weight, weight._version
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=rows_hint)

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version


class PackedLinears:
    """Prepacked oneDNN copies of ``model``'s ``nn.Linear`` weights (see the module docstring).

    ``rows_hint``: the number of input rows oneDNN chooses the packing for (decode steps: the
    requests decoding at once); any row count computes correctly."""

    def __init__(self, model: torch.nn.Module, rows_hint: int = 16):
        self.model, self.rows_hint = model, rows_hint
        self._packed: dict[torch.nn.Linear, _Packed] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and _packable(module):
                self._packed[module] = _Packed(module.weight, rows_hint)

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def bytes(self) -> int:
        """Bytes the packed copies hold."""
        return sum(p.weight.numel() * p.weight.element_size() for p in self._packed.values())

    @contextmanager
    def active(self) -> Iterator[PackedLinears]:
        """Inside the block, each packed layer's forward uses its packed weight (grad mode off only:
        the packed op has no backward, so under autograd the layers keep their own forward)."""
        if torch.is_grad_enabled() or not self._packed:
            yield self
            return
        swapped = []
        try:
            for module, packed in self._packed.items():
                if not _packable(module):
                    continue  # moved to another device or dtype since: its own forward
                if packed.stale(module.weight):
                    packed = self._packed[module] = _Packed(module.weight, self.rows_hint)
                if "forward" in module.__dict__:
                    continue  # someone else's instance-level forward: left alone
                module.forward = _forward(packed.weight, module)
                swapped.append(module)
            yield self
        finally:
            for module in swapped:
                del module.forward


def _packable(module: torch.nn.Linear) -> bool:
    """Its weight can be packed and its bias (if any) is of the weight's dtype."""
    return can_pack(module.weight) and (module.bias is None or module.bias.dtype == module.weight.dtype)


def _forward(weight: torch.Tensor, module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != weight.dtype or x.device.type != "cpu":
            return F.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, module.bias, "none", [], "")

    return forward
