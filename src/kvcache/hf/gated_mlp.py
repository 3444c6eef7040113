"""A gated SiLU MLP's gate and up layers with the activation and the product inside oneDNN's calls.

A Llama-style MLP computes ``down(silu(gate(x)) * up(x))``. On a prompt chunk (more rows than the
panels take) ``PackedLinears`` multiplies ``gate`` and ``up`` on oneDNN, and the SiLU and the product
then run as one more pass over two ``[T, I]`` outputs: in a 2,048-token bfloat16 step of SmolLM2
on a 2-core Xeon, 1.2-1.6 ms a layer of a 520-580 ms step. oneDNN applies both inside its own
calls instead: ``silu`` as a post-op of gate's call (its ``swish``), then up's output times that
(a ``mul`` post-op of up's call), and the pass over memory is gone (docs/benchmarks.md,
"The MLP's activation inside oneDNN").

``call`` is the eager choice, by the call's row count at run time: up to the panels' rows, the two
layers as ``linear_ops.call`` makes them and the activation after (what the model's own forward
computes with the packed layers); past that, oneDNN's two calls with the post-ops.
``register()`` declares it as ``kvcache::gated_linear`` for compiled graphs (one node a layer, no
guard on the token count). ``fusable(mlp)`` says which modules take it: bfloat16 weights packed
for oneDNN, SiLU as the activation, and a ``forward`` whose bytecode is the Llama MLP's.

Rounding: the model's own forward rounds ``gate(x)``, its SiLU and ``up(x)`` to bfloat16 before
the product; the post-ops take the float32 sums and round once each (SiLU's output, the product),
so outputs differ by a unit in the last place at most, where bfloat16 outputs may differ anyway
(``linears.py``). Float32 MLPs keep their own forward, whose results stay bit for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..attention import op_library
from . import linear_ops

__all__ = ["call", "fusable", "register"]

SILU_TYPES = ("SiLU", "SiLUActivation")  # torch.nn's and transformers.activations' modules


def _llama_forward(self, x):  # the bytecode a fusable MLP's forward must have (names included)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def fusable(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` computes ``down(silu(gate(x)) * up(x))`` with bfloat16 ``nn.Linear`` layers
    (judged by its forward's bytecode, not its class name, so every family's copy of it counts)."""
    forward = getattr(type(mlp), "forward", None)
    code, want = getattr(forward, "__code__", None), _llama_forward.__code__
    if code is None or (code.co_code, code.co_names, code.co_consts) != (want.co_code, want.co_names, want.co_consts):
        return False
    layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.bfloat16 for layer in layers):
        return False
    return type(getattr(mlp, "act_fn", None)).__name__ in SILU_TYPES


def call(
    x: torch.Tensor,
    gate: torch.Tensor, gate_bias: torch.Tensor | None, gate_panel: torch.Tensor | None, gate_onednn: torch.Tensor | None,
    up: torch.Tensor, up_bias: torch.Tensor | None, up_panel: torch.Tensor | None, up_onednn: torch.Tensor | None,
    n: int,
) -> torch.Tensor:  # fmt: skip
    """``silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias)`` ``[..., n]`` (module docstring; the
    packed copies as ``linear_ops.call`` takes them)."""
    rows = x.numel() // x.shape[-1]
    small = gate_panel is not None and rows <= linear_ops.panel_rows(gate_panel.dtype, x.shape[-1])
    if small or gate_onednn is None or up_onednn is None:
        g = linear_ops.call(x, gate, gate_bias, gate_panel, gate_onednn, n)
        return F.silu(g) * linear_ops.call(x, up, up_bias, up_panel, up_onednn, n)
    g = torch.ops.mkldnn._linear_pointwise(x, gate_onednn, gate_bias, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, g, up_onednn, up_bias, "mul")


@functools.cache
def register() -> torch._ops.OpOverloadPacket:
    """Register ``kvcache::gated_linear`` (``call`` as an operator; once per process) and return it."""

    def fake(x, gate, gate_bias, gate_panel, gate_onednn, up, up_bias, up_panel, up_onednn, n):
        return x.new_empty((*x.shape[:-1], n))

    schema = (
        "(Tensor x, Tensor gate, Tensor? gate_bias, Tensor? gate_panel, Tensor? gate_onednn, "
        "Tensor up, Tensor? up_bias, Tensor? up_panel, Tensor? up_onednn, int n) -> Tensor"
    )
    return op_library.define("gated_linear", schema, call, fake)
