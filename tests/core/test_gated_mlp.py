"""``hf/gated_mlp.py``: a gated SiLU MLP's gate and up layers with the activation and the product
as oneDNN post-ops on prompt-sized calls. Which MLPs take it (by their forward's bytecode, the
activation and the dtype), its output against float64 within bfloat16's rounding and, on decode
rows, the model's own bits, ``PackedLinears`` swapping and restoring the MLP's forward, and one
operator node in a compiled graph of a dynamic token count (none where the rows are few)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import model_for
from kvcache.hf import gated_mlp, linear_ops, panels
from kvcache.hf.linears import PackedLinears, can_pack

BF16_PACKED = can_pack(torch.zeros(8, 32, dtype=torch.bfloat16))
pytestmark = pytest.mark.skipif(not BF16_PACKED, reason="oneDNN has no native bfloat16 kernels on this CPU")


def llama_mlp(dtype=torch.bfloat16, **overrides) -> torch.nn.Module:
    model = model_for("llama", hidden_size=64, intermediate_size=160, **overrides)
    return _copy(model.model.layers[0].mlp).to(dtype)


def _copy(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module)


def inputs(mlp: torch.nn.Module, rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, mlp.gate_proj.in_features, generator=g).to(mlp.gate_proj.weight.dtype)


def test_which_mlps_fuse():
    assert gated_mlp.fusable(llama_mlp())
    assert not gated_mlp.fusable(llama_mlp(torch.float32))  # float32 keeps its bits
    assert not gated_mlp.fusable(llama_mlp(hidden_act="gelu"))

    class Other(type(llama_mlp())):  # another forward: same layers, not the same computation
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    other = llama_mlp()
    other.__class__ = Other
    assert not gated_mlp.fusable(other)
    assert not gated_mlp.fusable(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("rows", [40, 300])
def test_prompt_rows_are_silu_gate_times_up_within_bfloat16_rounding(rows):
    mlp = llama_mlp()
    packed = PackedLinears(mlp)
    gate, up = packed._packed[mlp.gate_proj], packed._packed[mlp.up_proj]
    x = inputs(mlp, rows)
    got = gated_mlp.call(x, mlp.gate_proj.weight, None, gate.panels, gate.weight, mlp.up_proj.weight, None, up.panels,
                         up.weight, mlp.gate_proj.out_features)  # fmt: skip
    xd = x.double()
    want = F.silu(xd @ mlp.gate_proj.weight.double().T) * (xd @ mlp.up_proj.weight.double().T)
    # SiLU's output rounded to bfloat16, then the product: two roundings of 2^-9 relative each, and
    # float32 sums of the products (1e-5 relative, with this K)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-7 + 1e-3).all()


def panel_limit() -> int:
    """Most rows a bfloat16 call with 64 inputs takes on panels here (0: no panel library)."""
    return linear_ops.panel_rows(torch.bfloat16, 64) if panels.available() else 0


NO_PANELS = "no bfloat16 panel library here: every row count takes oneDNN's post-ops"


@pytest.mark.skipif(panel_limit() < 1, reason=NO_PANELS)
def test_decode_rows_give_the_models_own_bits():
    mlp = llama_mlp()
    x = inputs(mlp, min(4, panel_limit()))
    packed = PackedLinears(mlp)
    with torch.no_grad():
        with packed.active():
            fused = mlp(x)
        gate, up = packed._packed[mlp.gate_proj], packed._packed[mlp.up_proj]
        own = mlp.down_proj(mlp.act_fn(gate.forward(x)) * up.forward(x))
    assert torch.equal(fused, own)


def test_packed_linears_swap_the_mlp_and_restore_it():
    model = model_for("llama", hidden_size=64, intermediate_size=160)
    model = _copy(model).to(torch.bfloat16)
    packed = PackedLinears(model)
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits.float()
        with packed.active():
            assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
            fused = model(ids).logits.float()
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    assert (fused - plain).abs().max() <= 0.05 * plain.abs().max()


def traced_targets(mlp: torch.nn.Module, packed: PackedLinears, x: torch.Tensor, dynamic: bool) -> set[str]:
    """The operators dynamo's graph of ``mlp(x)`` calls (``x``'s rows a dynamic dimension or not);
    the compiled call's output equals the eager one's."""
    seen: list[set[str]] = []

    def backend(gm, example):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    try:
        f = torch.compile(lambda v: mlp(v), backend=backend, fullgraph=True, dynamic=dynamic)
        with torch.no_grad(), packed.active():
            if dynamic:
                torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(f(x), mlp(x))
    finally:
        torch._dynamo.reset()
    return seen[0]


def test_a_dynamic_token_count_traces_one_operator_node():
    mlp = llama_mlp()
    targets = traced_targets(mlp, PackedLinears(mlp), inputs(mlp, 100), dynamic=True)
    assert "kvcache.gated_linear" in targets


@pytest.mark.skipif(panel_limit() < 1, reason=NO_PANELS)
def test_a_fixed_count_of_few_rows_traces_the_models_own_forward():
    mlp = llama_mlp()
    targets = traced_targets(mlp, PackedLinears(mlp), inputs(mlp, min(4, panel_limit())), dynamic=False)
    assert "kvcache.gated_linear" not in targets


def test_the_operator_passes_torchs_checks():
    """On plain weights (oneDNN's packed ones are opaque tensors, which the checks cannot read)."""
    mlp = llama_mlp()
    x = inputs(mlp, 50)
    args = (x, mlp.gate_proj.weight.detach(), None, None, None, mlp.up_proj.weight.detach(), None, None, None, 160)
    torch.library.opcheck(gated_mlp.register().default, args)
