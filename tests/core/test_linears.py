"""``PackedLinears``: a model's linear layers on prepacked weights inside ``active()`` (the panel
library's up to ``PANEL_ROWS`` rows, oneDNN's past them), equal to ``F.linear`` within float32
rounding, the model left as it was, never stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.hf import panels
from kvcache.hf.linears import PANEL_ROWS, PackedLinears, can_pack
from kvcache.hf.linears import _native_bf16 as native_bf16

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="this torch build has no oneDNN linear packing")


def mlp(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8, bias=False)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_packed_forward_equals_linear(rows):
    model = mlp()
    x = torch.randn(2, rows, 24)
    want = model(x)
    packed = PackedLinears(model)
    panel_bytes = (3 * 24 * 16 + 1 * 40 * 16) * 4 if panels.available() else 0  # whole panels of 16 columns
    assert len(packed) == 2 and packed.bytes == (24 * 40 + 40 * 8) * 4 + panel_bytes
    with torch.inference_mode(), packed.active():
        got = model(x)
        assert "forward" in model[0].__dict__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in model)  # restored


@pytest.mark.skipif(not panels.available(), reason="the panel library cannot be built here")
def test_few_rows_run_on_panels_and_more_on_onednn():
    model = mlp()
    layer = model[0]
    packed = PackedLinears(model)
    with torch.inference_mode(), packed.active():
        few, many = torch.randn(PANEL_ROWS, 24), torch.randn(PANEL_ROWS + 1, 24)
        on_panels = panels.linear(few, panels.pack(layer.weight), 40, layer.bias)
        assert torch.equal(layer(few), on_panels)
        mkldnn = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), batch_size=packed.rows_hint)
        assert torch.equal(layer(many), torch.ops.mkldnn._linear_pointwise(many, mkldnn, layer.bias, "none", [], ""))


@pytest.mark.skipif(not native_bf16(), reason="oneDNN has no native bfloat16 kernels for this CPU")
@pytest.mark.parametrize("rows", [1, 16, 70])
def test_bfloat16_packed_forward_equals_linear_within_its_rounding(rows):
    model = mlp(torch.bfloat16)
    x = torch.randn(rows, 24).to(torch.bfloat16)
    want = model(x)
    packed = PackedLinears(model)
    panel_bytes = (3 * 24 + 1 * 40) * 16 * 2 if panels.available() and panels.fits(model[0].weight) else 0
    assert len(packed) == 2 and packed.bytes == (24 * 40 + 40 * 8) * 2 + panel_bytes
    with torch.inference_mode(), packed.active():
        got = model(x)
        assert "forward" in model[0].__dict__ and got.dtype == torch.bfloat16
    # the products accumulate in float32 either way; the outputs differ by bfloat16 rounding at most
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
    assert all("forward" not in m.__dict__ for m in model)


def test_a_changed_weight_is_repacked_never_stale():
    model = mlp()
    packed = PackedLinears(model)
    x = torch.randn(5, 24)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # in place
    model[2].weight = torch.nn.Parameter(torch.randn(8, 40))  # replaced
    want = model(x)
    with torch.inference_mode(), packed.active():
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grad_mode_other_dtypes_and_own_forwards_keep_their_path():
    model = mlp()
    packed = PackedLinears(model)
    with packed.active():  # grad enabled: the packed op has no backward
        assert all("forward" not in m.__dict__ for m in model)
        model(torch.randn(3, 24)).sum().backward()
    assert model[0].weight.grad is not None
    assert len(PackedLinears(mlp(torch.float16))) == 0
    assert len(PackedLinears(mlp(torch.bfloat16))) == (2 if native_bf16() else 0)
    own = lambda x: x  # noqa: E731
    model[0].forward = own
    with torch.inference_mode(), packed.active():
        assert model[0].forward is own and "forward" in model[2].__dict__
    assert model[0].forward is own and "forward" not in model[2].__dict__


def test_an_error_inside_restores_the_model():
    model = mlp()
    packed = PackedLinears(model)
    with pytest.raises(RuntimeError, match="inside"), torch.inference_mode(), packed.active():
        raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in model)
    assert torch.equal(model[0](torch.ones(1, 24)), F.linear(torch.ones(1, 24), model[0].weight, model[0].bias))


def test_a_block_inside_another_changes_nothing_and_the_outer_one_restores():
    model = mlp()
    packed = PackedLinears(model)
    with torch.inference_mode(), packed.active():
        swapped = model[0].__dict__["forward"]
        with packed.active():
            assert model[0].__dict__["forward"] is swapped
        assert model[0].__dict__["forward"] is swapped  # the inner block left the outer one's swap
    assert all("forward" not in m.__dict__ for m in model)
    with torch.inference_mode(), packed.active():  # and a later block swaps again
        assert "forward" in model[0].__dict__
