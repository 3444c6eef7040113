"""``engine/rotary_tables.py``: a compiled step's rotary tables go through ``kvcache::kept`` while
the block is active, unchanged in value, and the modules are the class's again after it."""

from __future__ import annotations

import pytest
import torch

from helpers import model_for, prompt
from kvcache.attention import graph_ops
from kvcache.engine.rotary_tables import RotaryTables, rotary_modules


def tables(module: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.shape[1], 8)
    return module(x, positions)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2"])
def test_the_tables_come_out_of_kept_with_the_same_values(family):
    model = model_for(family)
    modules = rotary_modules(model)
    assert modules, f"no rotary module found in {family}"
    calls = []

    def kept(t):
        calls.append(t)
        return t.clone()

    rotary = RotaryTables(model, kept)
    positions = torch.arange(7)[None]
    want = [tables(m, positions) for m in modules]
    with rotary.active():
        got = [tables(m, positions) for m in modules]
    assert len(calls) == 2 * len(modules)  # cos and sin of every module
    for (cos, sin), (cos_w, sin_w) in zip(got, want):
        assert torch.equal(cos, cos_w) and torch.equal(sin, sin_w)
        assert cos.data_ptr() != cos_w.data_ptr()
    assert all("forward" not in m.__dict__ for m in modules)


def test_the_modules_are_restored_after_an_error_and_a_foreign_forward_is_left_alone():
    model = model_for("llama")
    (module,) = rotary_modules(model)
    rotary = RotaryTables(model, graph_ops.register().kept)
    with pytest.raises(RuntimeError, match="inside"):
        with rotary.active():
            assert "forward" in module.__dict__
            raise RuntimeError("inside")
    assert "forward" not in module.__dict__

    def foreign(x, position_ids):
        return "foreign"

    module.forward = foreign
    try:
        with rotary.active():
            assert module.forward is foreign
        assert module.forward is foreign
    finally:
        del module.forward


def test_kept_is_a_copy_that_compiles_as_one_node():
    kept = graph_ops.register().kept
    x = torch.randn(3, 5)
    out = kept(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    compiled = torch.compile(lambda t: kept(t.cos()) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x.cos() * 2)


def test_the_model_gives_the_same_logits_with_the_tables_kept():
    model = model_for("llama")
    ids = prompt(9)
    with torch.no_grad():
        want = model(ids).logits
        with RotaryTables(model, graph_ops.register().kept).active():
            got = model(ids).logits
    assert torch.equal(got, want)
