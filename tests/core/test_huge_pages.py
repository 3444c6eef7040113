"""``formats/huge_pages.py``: zeroed tensors as ``torch.zeros`` gives them, 2 MiB-aligned where
large (on huge pages where Linux offers them), kept alive by the tensor alone, written and read as
any tensor; small ones, other devices' and a platform without the request take ``torch.zeros``."""

from __future__ import annotations

import gc

import pytest
import torch

from kvcache.formats import huge_pages
from kvcache.formats.blocks import BlockStorage
from kvcache.formats.full import FullPrecision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_zeros_as_torch_gives_them(dtype):
    t = huge_pages.zeros(3, 1024, 700, dtype=dtype)
    assert t.shape == (3, 1024, 700) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert torch.equal(t, torch.zeros(3, 1024, 700, dtype=dtype))
    if huge_pages._ADVICE is not None:
        assert t.data_ptr() % huge_pages.HUGE == 0


def test_the_tensor_alone_keeps_its_memory():
    t = huge_pages.zeros(4 << 20, dtype=torch.float32)
    gc.collect()
    t[::4096] = torch.arange(1024, dtype=torch.float32)
    gc.collect()
    assert torch.equal(t[::4096], torch.arange(1024, dtype=torch.float32)) and t.sum() == sum(range(1024))
    view = t[100:200]
    del t
    gc.collect()
    view.fill_(2.0)
    assert view.sum() == 200.0


def test_small_tensors_and_a_platform_without_huge_pages_take_torch_zeros(monkeypatch):
    small = huge_pages.zeros(10, 10, dtype=torch.float32)
    assert torch.equal(small, torch.zeros(10, 10)) and small.untyped_storage().nbytes() == 400
    monkeypatch.setattr(huge_pages, "_ADVICE", None)
    big = huge_pages.zeros(1 << 20, dtype=torch.float32)
    assert big.untyped_storage().nbytes() == 4 << 20 and torch.equal(big, torch.zeros(1 << 20))


def test_a_pool_storage_on_huge_pages_writes_and_reads_blocks():
    storage = BlockStorage(FullPrecision(torch.bfloat16), 2, 64, 3, 32, 64, 64, torch.bfloat16, torch.device("cpu"))
    keys = torch.randn(2, 3, 32, 64).bfloat16()
    values = torch.randn(2, 3, 32, 64).bfloat16()
    storage.write_blocks(1, torch.tensor([5, 60]), keys, values)
    layer = storage.layer(1)
    assert torch.equal(layer["keys"][5], keys[0]) and torch.equal(layer["values"][60], values[1])
    assert layer["keys"][6].abs().sum() == 0 and storage.layer(0)["keys"].abs().sum() == 0
