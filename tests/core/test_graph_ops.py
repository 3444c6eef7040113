"""``attention.graph_ops``: the paged C++ kernels as torch operators. They give the library's
results, pass torch's operator checks (schema, fake implementation, dynamic shapes), and a
compiled step that writes new keys into the pool and attends over it is one graph, equal to the
same step run eagerly, with no recompilation when only the tables' and lengths' values change."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kvcache.attention import graph_ops, native
from kvcache.errors import UnsupportedOperation

pytestmark = pytest.mark.skipif(not native.available(), reason="the float decode library did not build here (no C++ compiler)")

BLOCKS, HKV, BS, D, R = 10, 2, 4, 16, 3
SCALE = D**-0.5


def pools(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, HKV, BS, D, generator=g), torch.randn(BLOCKS, HKV, BS, D, generator=g)


def decode_args(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    keys, values = pools(seed)
    q = torch.randn(3, HKV, R, D, generator=g)
    tables = torch.tensor([[0, 3, 5], [1, 2, 0], [4, 6, 7]], dtype=torch.int32)
    lengths = torch.tensor([11, 6, 9], dtype=torch.int64)
    return q, keys, values, tables, lengths, SCALE


def prefill_args(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    keys, values = pools(seed)
    q = torch.randn(HKV, 5, R, D, generator=g)  # chunk 0: 3 queries after 4 past; chunk 1: 2 after 1
    tables = torch.tensor([[0, 3], [1, 0]], dtype=torch.int32)
    return q, keys, values, tables, torch.tensor([0, 3, 5]), torch.tensor([4, 1]), SCALE


def test_the_operators_give_the_librarys_results():
    ops = graph_ops.register()
    assert torch.equal(ops.paged_decode(*decode_args()), native.paged_decode(*decode_args()))
    assert torch.equal(ops.paged_prefill(*prefill_args()), native.paged_prefill(*prefill_args()))
    out, lse = ops.paged_decode_lse(*decode_args())
    want_out, want_lse = native.paged_decode(*decode_args(), lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", ["paged_decode", "paged_decode_lse", "paged_prefill"])
def test_the_operators_pass_torchs_operator_checks(name):
    op = getattr(graph_ops.register(), name)
    args = prefill_args() if name == "paged_prefill" else decode_args()
    torch.library.opcheck(op.default, args)


def test_register_is_idempotent():
    assert graph_ops.register() is graph_ops.register()


def test_a_compiled_write_and_read_is_one_graph_equal_to_eager():
    ops = graph_ops.register()

    def step(q, new_keys, new_values, key_pool, value_pool, blocks, offsets, tables, lengths):
        key_pool[blocks, :, offsets] = new_keys  # [N, Hkv, D] into their slots
        value_pool[blocks, :, offsets] = new_values
        return ops.paged_decode(q, key_pool, value_pool, tables, lengths, SCALE).sum(dim=2)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for seed in (3, 4):  # the second call: other tables, lengths and slots, the same shapes
        q, keys, values, tables, lengths, _ = decode_args(seed)
        if seed == 4:
            tables, lengths = tables.flip(0).contiguous(), torch.tensor([7, 12, 5])
        g = torch.Generator().manual_seed(seed)
        new_keys, new_values = torch.randn(3, HKV, D, generator=g), torch.randn(3, HKV, D, generator=g)
        last = (lengths - 1).tolist()
        blocks = torch.tensor([int(tables[s, t // BS]) for s, t in enumerate(last)])
        offsets = torch.tensor([t % BS for t in last])
        want_pools, got_pools = (keys.clone(), values.clone()), (keys.clone(), values.clone())
        want = step(q, new_keys, new_values, *want_pools, blocks, offsets, tables, lengths)
        got = compiled(q, new_keys, new_values, *got_pools, blocks, offsets, tables, lengths)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_pools, want_pools))  # the writes happened
    assert counter.frame_count == 1


def test_a_call_the_library_cannot_take_is_refused_by_name(monkeypatch):
    """The Python kernels (the CPU's where the C++ ones do not build; ``test_step_ops.py`` has theirs)."""
    monkeypatch.setattr(native, "paged_decode", lambda *args, **kwargs: None)
    with pytest.raises(UnsupportedOperation, match="kvcache::paged_decode"):
        graph_ops.paged_decode(*decode_args())
    with pytest.raises(UnsupportedOperation, match="kvcache::paged_decode_lse"):
        graph_ops.paged_decode_lse(*decode_args())
    monkeypatch.setattr(native, "paged_prefill", lambda *args, **kwargs: None)
    with pytest.raises(UnsupportedOperation, match="kvcache::paged_prefill"):
        graph_ops.paged_prefill(*prefill_args())
