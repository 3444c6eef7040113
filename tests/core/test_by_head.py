"""A flat store's slots laid out per KV head (``layers/by_head.py``): each head's older slots in
store order, empty cells, then the pass's new tokens; weights per cell back on the flat slots."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.layers.by_head import ByHead


def flat_set(batch: int, kv_heads: int, older: list[list[int]], new: int, seen: int):
    """Heads and positions ``[B, 1, N]`` of a flat candidate set: row b's older slots (their heads
    ``older[b]``, positions distinct per head, below ``seen``, the same count in every row), then
    ``new`` tokens per head from ``seen`` on, head-major."""
    heads, positions = [], []
    for row in older:
        next_pos = [0] * kv_heads
        pos = []
        for h in row:
            pos.append(next_pos[h])
            next_pos[h] += 1
        new_heads = [h for h in range(kv_heads) for _ in range(new)]
        new_pos = [seen + t for _ in range(kv_heads) for t in range(new)]
        heads.append(row + new_heads)
        positions.append(pos + new_pos)
    return torch.tensor(heads).view(batch, 1, -1), torch.tensor(positions).view(batch, 1, -1)


@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 4),
    older=st.integers(0, 12),
    new=st.integers(1, 5),
    data=st.data(),
)
def test_layout_holds_each_heads_slots_then_its_new_tokens(batch, kv_heads, older, new, data):
    rows = [data.draw(st.lists(st.integers(0, kv_heads - 1), min_size=older, max_size=older)) for _ in range(batch)]
    heads, positions = flat_set(batch, kv_heads, rows, new, seen=older)
    n_slots = positions.shape[2]
    layout = ByHead.of(heads.to(torch.int16), positions.to(torch.int32), kv_heads, new)
    values = torch.arange(n_slots, dtype=torch.float32).view(1, 1, n_slots, 1).expand(batch, 1, n_slots, 2)
    laid = layout.rows(values)  # each cell holds the flat slot it reads
    width = layout.width
    assert laid.shape == (batch, kv_heads, width, 2)
    widest = max([row.count(h) for row in rows for h in range(kv_heads)], default=0)
    assert width == widest + new
    for b in range(batch):
        for h in range(kv_heads):
            mine = [j for j, head in enumerate(rows[b]) if head == h]  # older slots of head h, store order
            new_slots = [older + h * new + t for t in range(new)]
            cells = laid[b, h, :, 0].long().tolist()
            assert cells[: len(mine)] == mine and cells[width - new :] == new_slots
            cell_pos = layout.positions[b, h].tolist()
            assert cell_pos[len(mine) : width - new] == [-1] * (width - new - len(mine))  # empty cells
            assert cell_pos[width - new :] == list(range(older, older + new))
    assert layout.padded == any(row.count(h) < widest for row in rows for h in range(kv_heads))
    # Per-cell values go back to the slots they came from.
    assert torch.equal(layout.flat(laid[..., 0]), values[:, :, :, 0])


def test_a_first_pass_is_a_view_of_the_flat_run():
    heads = torch.arange(3, dtype=torch.int16).repeat_interleave(4).expand(2, 1, 12)
    positions = torch.arange(4, dtype=torch.int32).repeat(3).expand(2, 1, 12)
    layout = ByHead.of(heads, positions, 3, 4)
    keys = torch.randn(2, 1, 12, 8)
    laid = layout.rows(keys)
    assert laid.data_ptr() == keys.data_ptr() and laid.shape == (2, 3, 4, 8) and not layout.padded
    assert torch.equal(layout.flat(laid[..., 0]), keys[..., 0])
