"""The engine's greedy pick (``sampling.greedy_tokens``) against ``torch.argmax``: the first index
of each row's maximum, ties, NaNs and infinities included, for vocabularies on and off the piece size."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from kvcache.engine.sampling import PIECE, greedy_tokens


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE, 3 * PIECE + 517]),
    levels=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_tokens_equal_argmax(rows, vocab, levels, dtype, specials, seed):
    g = torch.Generator().manual_seed(seed)
    # few distinct values, so that maxima tie within a piece and across pieces
    logits = torch.randint(0, levels, (rows, vocab), generator=g).to(dtype)
    for at, value in specials:
        logits.view(-1)[at % logits.numel()] = value
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_greedy_tokens_all_negative_infinity_rows_pick_the_first():
    logits = torch.full((2, PIECE + 3), float("-inf"))
    logits[1, PIECE + 2] = 0.0
    assert greedy_tokens(logits).tolist() == [0, PIECE + 2]
