"""The default cache on sliding-window models, on the model's own attention (no switch).

``make_cache(model)`` with an unbounded kind keeps a model's sliding layers in position order, as
Hugging Face's ``DynamicSlidingWindowLayer`` does, so the model's own attention and masks apply:
greedy generation of one prompt past the window, a left-padded batch and beam search are
token-identical to ``DynamicCache(config=model.config)``. Tiny configs of ``families.py`` (window 4).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from kvcache.hf.cache import KVCache
from kvcache.layers import SlidingLayer, WindowLayer

from families import build_model

FAMILIES = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
SPECS = ("growable", "static:capacity=80", "concat")
PROMPT, NEW = 30, 24  # both past the window and a sliding layer's spare room (3 + 16 slots)


def inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` rows of ``PROMPT`` tokens, every row after the first left-padded by 5 more than the last."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        ids[row, : 5 * row], mask[row, : 5 * row] = 0, 0
    return ids, mask


def run(model, cache, ids, mask, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=NEW, min_new_tokens=NEW,
        do_sample=False, pad_token_id=0, **kwargs,
    )


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return build_model(request.param)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("batch", (1, 3))
def test_generate_without_the_switch_is_token_identical(model, spec, batch):
    assert model.config._attn_implementation != "kvcache"
    ids, mask = inputs(batch)
    cache = kvcache.make_cache(model, spec)
    assert any(isinstance(s, SlidingLayer) for s in cache.kv_layers) and not cache.needs_kvcache_attention
    assert torch.equal(run(model, cache, ids, mask), run(model, DynamicCache(config=model.config), ids, mask))


def test_beam_search_without_the_switch_is_token_identical(model):
    ids, mask = inputs(2, seed=1)
    kwargs = dict(num_beams=3, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    ref = run(model, DynamicCache(config=model.config), ids, mask, **kwargs)
    ours = run(model, kvcache.make_cache(model), ids, mask, **kwargs)
    assert torch.equal(ours.sequences, ref.sequences)
    # The same computation on the same keys: scores agree to float32 rounding.
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)


def test_a_file_with_rings_for_sliding_layers_loads_in_order(model, tmp_path):
    """kvcache <= 0.1.0 saved a model's sliding layers beside the default kind as rings (kind
    ``window``): such a file loads as this version's layers and goes on token-identically."""
    ids, mask = inputs(1, seed=2)
    made = kvcache.make_cache(model)
    stores = [WindowLayer(window=s.window) if isinstance(s, SlidingLayer) else s for s in made.kv_layers]
    old = KVCache(stores, made.spec, made.config_summary, made.attention_config, dict(made.others))
    with kvcache.use_kvcache_attention(model):  # rings need the kvcache attention
        model(ids, **cache_kwargs(model, old))
    old.save(tmp_path / "old.kv")
    loaded = kvcache.load_cache(tmp_path / "old.kv", model)
    assert [type(s) for s in loaded.kv_layers] == [type(s) for s in made.kv_layers]
    nxt = ids[:, -1:] * 0 + 7
    want = model(torch.cat([ids, nxt], 1), **cache_kwargs(model, DynamicCache(config=model.config))).logits[:, -1]
    got = model(nxt, **cache_kwargs(model, loaded)).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # our kernel for the prefix vs HF's whole pass, fp32
