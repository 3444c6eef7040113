"""The panel linear library (``hf.panels``, ``csrc/linear.cpp``): ``x W^T + b`` against float64
matrix products at every row count its tiles split differently (one tile, a tile and a remainder,
many tiles), column counts that are not whole panels, strided rows, in float32 and in bfloat16
(whichever bfloat16 kernel this CPU runs: AMX tiles, ``vdpbf16ps`` or widened FMAs); a row's result
independent of the rows beside it; the ``kvcache::linear`` operator inside a compiled graph; bad
calls refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention import native_build
from kvcache.attention.native_build import cpu_flags, isa
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


def bf16_taken() -> bool:
    return panels.bf16_kernel() != "none"


needs_bf16 = pytest.mark.skipif(not panels.available() or not bf16_taken(), reason="this build of the library takes no bfloat16 (narrower vectors than AVX-512)")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 70])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (16, 6), (200, 96), (3, 130)])
def test_bfloat16_linear_is_the_float32_sum_rounded_once(rows, n, k):
    """Products exact, sums in float32, one rounding to bfloat16: within 2**-8 of the float64
    result plus float32's summation error (``k`` multiples of 32 take the AMX tiles where usable)."""
    torch.manual_seed(rows * 1000 + n + k)
    x, w, b = (torch.randn(*shape).bfloat16() for shape in ((rows, k), (n, k), (n,)))
    packed = panels.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == ((n + 15) // 16, k, 16)
    for bias in (b, None):
        got = panels.linear(x, packed, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        want = reference(x, w, bias).double()
        scale = x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0)
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6 * k * scale + 1e-30).all()


@needs_bf16
def test_bfloat16_rows_do_not_depend_on_the_rows_beside_them():
    torch.manual_seed(3)
    w, x = torch.randn(70, 64).bfloat16(), torch.randn(37, 64).bfloat16()
    packed = panels.pack(w)
    whole = panels.linear(x, packed, 70)
    for row in (0, 15, 16, 36):
        assert torch.equal(whole[row], panels.linear(x[row : row + 1], packed, 70)[0])
        assert torch.equal(whole[row], panels.linear(x[row : row + 5], packed, 70)[0])


@pytest.mark.skipif("amx_bf16" not in cpu_flags().split() or isa() != "native",
                    reason="no AMX in this build of the library (the CPU has none, or KVCACHE_ISA caps it): nothing to keep off")
def test_amx_is_left_alone_where_onednn_is_capped_below_it():
    """Where torch's AMX kernels crash a CPU, kvcache caps oneDNN (``ONEDNN_MAX_CPU_ISA``); the
    library then keeps off AMX too, in a process of its own (the choice is made once a process)."""
    code = "from kvcache.hf import panels; print(panels.bf16_kernel())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] in ("dot", "widen", "none")


def test_bfloat16_is_refused_where_the_library_does_not_take_it():
    w = torch.randn(20, 8).bfloat16()
    assert not panels.fits(torch.randn(20, 7).bfloat16())  # K odd: the pairs layout needs it even
    assert panels.fits(w) == bf16_taken()
    if not bf16_taken():
        with pytest.raises(ValueError, match="bfloat16 with K even where the library takes it"):
            panels.pack(w)


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
    with pytest.raises(ValueError, match="expected float32 x"):
        panels.linear(torch.randn(3, 8).bfloat16(), packed, 20)


@needs_bf16
@pytest.mark.parametrize("k", [64, 40])
def test_a_bfloat16_call_takes_panels_up_to_the_limit_of_the_kernel_that_runs_it(k, monkeypatch):
    """The AMX kernel takes K a multiple of 32 only; the library runs other layers on its dot
    kernel, so their calls take the dot kernel's row limit, not AMX's."""
    kernel = panels.bf16_kernel()
    ran = "dot" if kernel == "amx" and k % 32 else kernel
    limit = linear_ops.panel_rows(torch.bfloat16, k)
    assert limit == linear_ops.kernel_rows(ran)
    torch.manual_seed(4)
    w = torch.randn(24, k).bfloat16()
    packed, onednn = panels.pack(w), None
    calls = []
    monkeypatch.setattr(panels, "run", lambda *args: calls.append(args[0].shape[0]) or torch.zeros(args[0].shape[0], 24))
    monkeypatch.setattr(linear_ops, "native_panels", lambda: None)  # the panels' call through panels.run, seen here
    for rows in (limit, limit + 1):
        linear_ops.call(torch.randn(rows, k).bfloat16(), w, None, packed, onednn, 24)
    assert calls == [limit]


@pytest.mark.parametrize("vendor, dot", [("AuthenticAMD", linear_ops.AMD_DOT_ROWS), ("GenuineIntel", 8), ("", 8)])
def test_the_dot_kernels_row_limit_follows_the_cpu_vendor_and_no_other_kernel_does(vendor, dot, monkeypatch):
    monkeypatch.setattr(linear_ops, "cpu_vendor", lambda: vendor)
    assert linear_ops.kernel_rows("dot") == dot
    assert [linear_ops.kernel_rows(k) for k in ("amx", "widen", "none")] == [32, 4, 0]


def test_the_cpu_vendor_is_read_from_proc_cpuinfo():
    try:
        lines = open("/proc/cpuinfo", encoding="utf-8").read().splitlines()
    except OSError:
        lines = []
    named = [line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")]
    assert native_build.cpu_vendor() == (named[0] if named else "")
