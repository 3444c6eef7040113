"""The panel linear library (``hf.panels``, ``csrc/linear.cpp``): ``x W^T + b`` against float64
matrix products at every row count its tiles split differently (one tile, a tile and a remainder,
many tiles), column counts that are not whole panels, strided rows; a row's result independent of
the rows beside it; the ``kvcache::linear`` operator inside a compiled graph; bad calls refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.hf import linear_ops, panels

pytestmark = pytest.mark.skipif(not panels.available(), reason="the panel library cannot be built here")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return (out + b.double() if b is not None else out).float()


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 16, 25, 64, 70])
@pytest.mark.parametrize(("n", "k"), [(40, 24), (16, 7), (200, 96), (3, 130)])
def test_linear_equals_the_matrix_product(rows, n, k):
    torch.manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    packed = panels.pack(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    torch.testing.assert_close(panels.linear(x, packed, n, b), reference(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)
    torch.testing.assert_close(panels.linear(x, packed, n), reference(x, w, None), rtol=1e-5, atol=1e-5 * k**0.5)


def test_leading_dimensions_strided_rows_and_no_rows():
    torch.manual_seed(1)
    w = torch.randn(33, 20)
    packed = panels.pack(w)
    x = torch.randn(2, 3, 20)
    got = panels.linear(x, packed, 33)
    assert got.shape == (2, 3, 33)
    torch.testing.assert_close(got, reference(x.reshape(6, 20), w, None).reshape(2, 3, 33), rtol=1e-5, atol=1e-4)
    wide = torch.randn(7, 50)
    view = wide[:, 10:30]  # rows 50 floats apart
    torch.testing.assert_close(panels.linear(view, packed, 33), reference(view, w, None), rtol=1e-5, atol=1e-4)
    assert panels.linear(torch.randn(0, 20), packed, 33).shape == (0, 33)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), row=st.integers(0, 39), seed=st.integers(0, 2**16))
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(rows, row, seed):
    row = row % rows
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(50, 37, generator=gen), torch.randn(rows, 37, generator=gen)
    packed = panels.pack(w)
    assert torch.equal(panels.linear(x, packed, 50)[row], panels.linear(x[row : row + 1], packed, 50)[0])


@pytest.mark.parametrize("rows", [5, linear_ops.PANEL_ROWS + 3])
def test_the_operator_in_a_compiled_graph_equals_the_eager_call(rows):
    """One graph of a dynamic row count: panels up to ``PANEL_ROWS`` rows, oneDNN past them."""
    torch.manual_seed(2)
    w, b = torch.randn(48, 24), torch.randn(48)
    packed = panels.pack(w)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=16) if torch.backends.mkldnn.is_available() else None
    op = linear_ops.register()

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(op(x, w, b, packed, onednn, 48)) * 2.0

    x = torch.randn(rows, 24)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    want = torch.relu(linear_ops.call(x, w, b, packed, onednn, 48)) * 2.0
    torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    if rows <= linear_ops.PANEL_ROWS:
        torch.testing.assert_close(want, torch.relu(panels.linear(x, packed, 48, b)) * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(want, torch.relu(torch.nn.functional.linear(x, w, b)) * 2.0, rtol=1e-5, atol=1e-5)


def test_bad_calls_are_refused_by_name():
    w = torch.randn(20, 8)
    packed = panels.pack(w)
    with pytest.raises(ValueError, match=r"expected float32 x \[\.\.\., 8\]"):
        panels.linear(torch.randn(3, 9), packed, 20)
    with pytest.raises(ValueError, match="expected float32"):
        panels.linear(torch.randn(3, 8, dtype=torch.float64), packed, 20)
    with pytest.raises(ValueError, match="0 < n <= 32"):
        panels.linear(torch.randn(3, 8), packed, 33)
    with pytest.raises(ValueError, match="panels must be contiguous float32"):
        panels.linear(torch.randn(3, 8), w, 20)
    with pytest.raises(ValueError, match=r"bias must be float32 \[20\] on the CPU, got torch.float32 \[5\]"):
        panels.linear(torch.randn(3, 8), packed, 20, torch.randn(5))
    with pytest.raises(ValueError, match="cannot pack a torch.float16 weight"):
        panels.pack(w.half())
