"""``csrc/step_ops.cpp``: the C++ kernels of ``kvcache::paged_decode``, ``paged_decode_lse`` and
``panel_linear``. They give the bits the ctypes paths give (float32 and bfloat16, the bfloat16
library and the float fallback, strided inputs), pass torch's operator checks, refuse what they
cannot take by name, and stay off on a torch older than the stable ABI they are written for."""

import pytest
import torch

from kvcache.attention import graph_ops, native, op_library
from kvcache.hf import linear_ops, panels

pytestmark = pytest.mark.skipif(
    op_library.native() is None or not native.available() or not panels.available(),
    reason="the C++ operators did not build here (torch older than 2.10, or no C++ compiler)",
)

BF16 = panels.available() and panels.bf16_kernel() != "none"


def pools(dtype: torch.dtype, blocks: int = 12, heads: int = 2, bs: int = 32, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks, heads, bs, dim, generator=g).to(dtype), torch.randn(blocks, heads, bs, dim, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("dim", [64, 48])  # 48: no bfloat16 tiles, the float kernel takes bfloat16 too
def test_decode_gives_the_ctypes_paths_bits(dtype, rows, dim):
    ops = graph_ops.register()
    keys, values = pools(dtype, dim=dim)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(4, 2, rows, dim, generator=g).to(dtype)
    tables = torch.tensor([[0, 3, 5, 0], [1, 2, 0, 0], [4, 6, 7, 8], [9, 0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([70, 33, 128, 0])
    want_out, want_lse = native.paged_decode(q, keys, values, tables, lengths, 0.125, lse=True)
    out, lse = ops.paged_decode_lse(q, keys, values, tables, lengths, 0.125)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(ops.paged_decode(q, keys, values, tables, lengths, 0.125), want_out)
    # a strided query (a transposed view) gives the same bits
    strided = q.transpose(0, 2).contiguous().transpose(0, 2)
    assert not strided.is_contiguous()
    assert torch.equal(ops.paged_decode_lse(strided, keys, values, tables, lengths, 0.125)[0], want_out)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16, reason="the panel library takes no bfloat16 here"))])
def test_panel_linear_gives_panels_runs_bits(dtype):
    fast = linear_ops.native_panels()
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 64, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    packed = panels.pack(w)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    for bias in (b, None, b[::1].clone()):
        assert torch.equal(fast(x, packed, 40, bias), panels.run(x, packed, 40, bias))
    strided = torch.randn(5, 2, 64, generator=g).to(dtype).transpose(0, 1)  # rows not evenly strided
    assert torch.equal(fast(strided, packed, 40, b), panels.run(strided, packed, 40, b))
    assert torch.equal(fast(x, packed, 33, None), panels.run(x, packed, 33, None))  # fewer outputs than panels hold
    assert fast(x[:, :0], packed, 40, b).shape == (2, 0, 40)


def test_the_operators_pass_torchs_operator_checks():
    ops = graph_ops.register()
    keys, values = pools(torch.float32)
    q = torch.randn(2, 2, 3, 64)
    tables, lengths = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([40, 64])
    torch.library.opcheck(ops.paged_decode_lse.default, (q, keys, values, tables, lengths, 0.125))
    w = torch.randn(24, 16)
    torch.library.opcheck(linear_ops.native_panels(), (torch.randn(3, 16), panels.pack(w), 24, torch.randn(24)))


def test_bad_calls_are_refused_by_name():
    ops, fast = graph_ops.register(), linear_ops.native_panels()
    packed = panels.pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match=r"kvcache::panel_linear: expected x \[\.\.\., 8\]"):
        fast(torch.randn(3, 9), packed, 20, None)
    with pytest.raises(RuntimeError, match="0 < n <= 32"):
        fast(torch.randn(3, 8), packed, 33, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        fast(torch.randn(3, 8), packed, 20, torch.randn(5))
    with pytest.raises(RuntimeError, match="panels must be contiguous"):
        fast(torch.randn(3, 8), torch.randn(20, 8), 20, None)
    keys, values = pools(torch.float32)
    q, lengths = torch.randn(2, 2, 3, 64), torch.tensor([40, 64])
    with pytest.raises(RuntimeError, match=r"kvcache::paged_decode: the library cannot take queries \[2, 2, 3, 32\]"):
        ops.paged_decode_lse(q[..., :32].contiguous(), keys, values, torch.zeros(2, 2, dtype=torch.int32), lengths, 0.1)
    with pytest.raises(RuntimeError, match="expected int32 tables"):
        ops.paged_decode_lse(q, keys, values, torch.zeros(2, 2, dtype=torch.int64), lengths, 0.1)
    with pytest.raises(RuntimeError, match="the library refused the call"):  # 100 tokens need 4 blocks of 32, not 2
        ops.paged_decode_lse(q, keys, values, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([40, 100]), 0.1)


def test_an_older_torch_keeps_the_python_kernels(monkeypatch):
    op_library.native.cache_clear()
    try:
        monkeypatch.setattr(torch, "__version__", "2.9.1+cpu")
        assert op_library.native() is None
    finally:
        monkeypatch.undo()
        op_library.native.cache_clear()
    assert op_library.native() is not None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_traced_layer_holds_panel_linear_for_a_fixed_row_count_and_the_choice_for_a_dynamic_one():
    """A decode bucket's rows are fixed: its graph calls the panels directly. A prompt graph's token
    count is a dynamic dimension: its graph keeps ``kvcache::linear``'s choice, with no guard on
    the count (one graph past the panels' limit too)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from kvcache.hf.linears import PackedLinears

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8, bias=False))
    packed = PackedLinears(model)
    seen: list[set[str]] = []

    def backend(gm, example_inputs):
        seen.append({str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    for dynamic, sizes in ((False, [3]), (True, [3, linear_ops.PANEL_ROWS + 5])):
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        with torch.inference_mode(), packed.active():
            for rows in sizes:
                x = torch.randn(rows, 24)
                if dynamic:
                    torch._dynamo.mark_dynamic(x, 0)
                want = torch.nn.functional.linear(torch.nn.functional.gelu(model[0](x)), model[2].weight)
                torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
        assert counter.frame_count == 1
        torch._dynamo.reset()
    assert "kvcache.panel_linear" in seen[0] and "kvcache.linear" not in seen[0]
    assert "kvcache.linear" in seen[1] and "kvcache.panel_linear" not in seen[1]
