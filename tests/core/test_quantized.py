"""Quantized storage: the KIVI-style ``quantized`` kind and eviction over int8/int4 slots.

References: torch SDPA over the layer's own dequantized content (so the blockwise attention over
codes is checked against an independent attention), the inputs themselves (what must stay exact:
the full-precision residual), the quantization error bound, and Hugging Face's ``DynamicCache``
with its own attention (a residual longer than the sequence keeps everything exact, so generation
must be token-identical).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from helpers import attention_for, hf_attention, model_for, prompt
from kvcache.layers import EvictingLayer, QuantizedLayer
from kvcache.apps.tiny import FAMILIES, PAD_TOKEN_ID

NEW_TOKENS = 12


def sdpa_reference(query, keys, values, first_query, mask=None):
    """SDPA over ``keys``/``values`` (positions 0..T-1) for queries at ``first_query...``."""
    t, n = keys.shape[2], query.shape[2]
    q_pos = torch.arange(first_query, first_query + n).view(-1, 1)
    allowed = torch.arange(t).view(1, -1) <= q_pos
    if mask is not None:
        allowed = allowed & mask[..., :t]
    group = query.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(
        query, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), attn_mask=allowed
    )


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize(("group_size", "residual"), [(4, 3), (8, 0), (16, 8)])
def test_decode_attention_over_codes_equals_sdpa_over_dequantized_content(bits, group_size, residual):
    g = torch.Generator().manual_seed(bits * 100 + group_size + residual)
    layer = QuantizedLayer(bits=bits, group_size=group_size, residual=residual, block=2 * group_size)
    history_k, history_v = [], []
    for n in (1, 2, 1, 1, 1, 5, 1, 1, 3, *([1] * 30)):
        k, v = torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
        history_k.append(k)
        history_v.append(v)
        first = layer.seen
        past_k, past_v = layer.view() if first else (k[:, :, :0], v[:, :, :0])
        layer.update(k, v)
        query = torch.randn(2, 4, n, 16, generator=g)
        keys, values = layer.view()  # dequantized codes + exact residual, in position order
        if n > max(residual, 1):  # a chunk longer than the residual attends the past as it was, and itself exactly
            keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        torch.testing.assert_close(layer.attend(query), sdpa_reference(query, keys, values, first), rtol=1e-5, atol=1e-5)
    assert layer.seen == sum(k.shape[2] for k in history_k)


def test_padding_mask_and_softcap_on_the_store_path():
    g = torch.Generator().manual_seed(3)
    layer = QuantizedLayer(bits=8, group_size=4, residual=2)
    layer.update(torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g))
    layer.settle()
    layer.update(torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g))
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    mask[1, :, :, :5] = False  # row 1: five padding positions
    query = torch.randn(2, 4, 1, 8, generator=g)
    keys, values = layer.view()
    got = layer.attend(query, mask=mask, softcap=2.0, scale=0.3)
    group = 2
    scores = torch.tanh(query @ keys.repeat_interleave(group, 1).transpose(-1, -2) * 0.3 / 2.0) * 2.0
    scores = scores.masked_fill(~mask, -math.inf)
    want = torch.softmax(scores, -1) @ values.repeat_interleave(group, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_residual_stays_exact_and_the_rest_within_the_quantization_bound(bits):
    group_size, residual = 8, 5
    g = torch.Generator().manual_seed(bits)
    layer = QuantizedLayer(bits=bits, group_size=group_size, residual=residual)
    ks, vs = [], []
    for n in (7, 1, 1, 13, *([1] * 20)):
        ks.append(torch.randn(1, 2, n, 16, generator=g))
        vs.append(torch.randn(1, 2, n, 16, generator=g))
        layer.update(ks[-1], vs[-1])
        layer.settle()
        keys, values = layer.view()
        true_k, true_v = torch.cat(ks, 2), torch.cat(vs, 2)
        seen = true_k.shape[2]
        exact_keys = seen - layer.state().tensors["kcodes"].shape[2]
        exact_values = seen - layer.state().tensors["vcodes"].shape[2]
        assert residual <= exact_keys < residual + group_size or exact_keys == seen
        assert exact_values == exact_keys  # keys and values leave the residual together
        assert torch.equal(values[:, :, seen - exact_values :], true_v[:, :, seen - exact_values :])
        assert torch.equal(keys[:, :, seen - exact_keys :], true_k[:, :, seen - exact_keys :])
        levels = 2**bits - 1
        # Keys: per channel over blocks of group_size tokens; values: per token (group = 8 channels).
        tq = seen - exact_keys
        if tq:
            blocks = true_k[:, :, :tq].reshape(1, 2, tq // group_size, group_size, 16)
            span = blocks.amax(3, keepdim=True) - blocks.amin(3, keepdim=True)
            err = (keys[:, :, :tq].reshape(blocks.shape) - blocks).abs()
            assert (err <= span / levels / 2 * 1.001 + 1e-6).all()
        tv = seen - exact_values
        if tv:
            groups = true_v[:, :, :tv].reshape(1, 2, tv, 2, 8)
            span = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
            err = (values[:, :, :tv].reshape(groups.shape) - groups).abs()
            assert (err <= span / levels / 2 * 1.001 + 1e-6).all()


def test_int4_is_at_most_030_of_fp16_at_4k_residual_and_scales_included():
    layer = QuantizedLayer(bits=4)  # defaults: group_size 64, residual 32
    keys = torch.randn(1, 8, 4096, 128, dtype=torch.float16)
    layer.update(keys, keys.clone())
    layer.settle()
    fp16 = 2 * keys.nbytes
    # codes 0.25, scales and minimums 2 fp16 per 64 codes (1/32), the residual buffers of keys and
    # values (residual + group_size = 96 slots each) 96/4096: 0.305 at most
    assert layer.nbytes <= 0.305 * fp16, layer.nbytes / fp16
    assert QuantizedLayer(bits=8).nbytes == 0


def ragged_batch():
    ids = prompt(30, seed=21, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6], ids[1, :6] = 0, PAD_TOKEN_ID
    return ids, mask


def greedy(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    with attention_for(model, cache):
        return model.generate(ids, **cache_kwargs(model, cache), do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_batched_left_padded(family):
    model = model_for(family)
    ids, mask = ragged_batch()
    with hf_attention(model):
        ref = greedy(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    # A residual longer than the sequence keeps everything exact: token-identical.
    exact = kvcache.make_cache(model, "quantized:bits=4,group_size=8,residual=64")
    assert torch.equal(greedy(model, ids, exact, attention_mask=mask), ref)
    for spec in ("quantized:bits=8,group_size=8,residual=4", "quantized:bits=4,group_size=16,residual=0",
                 "h2o:budget=12,storage=int8", "lastrec:budget=12,sinks=2,storage=int4"):
        cache = kvcache.make_cache(model, spec)
        out = greedy(model, ids, cache, attention_mask=mask, output_scores=True, return_dict_in_generate=True)
        assert out.sequences.shape == ref.shape
        assert all(torch.isfinite(s).all() for s in out.scores), spec
        assert cache.seen == ids.shape[1] + NEW_TOKENS - 1


@pytest.mark.parametrize(
    "spec", ["quantized:bits=4,group_size=8,residual=4", "h2o:budget=14,storage=int8", "tova:budget=0.5,storage=int4",
             "tova:budget=0.5,storage=int4h"]
)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_save_load_snapshot_fork_replay_exactly(family, spec, tmp_path):
    model = model_for(family)
    ids = prompt(30, seed=22)
    cache = kvcache.make_cache(model, spec)
    first = greedy(model, ids, cache, max_new_tokens=8)
    snap, fork = cache.snapshot(), cache.fork()
    cache.save(tmp_path / "q.kv")
    loaded = kvcache.load_cache(tmp_path / "q.kv", model)
    runs = [greedy(model, first, c, max_new_tokens=10) for c in (cache, fork, loaded)]
    cache.restore(snap)
    runs.append(greedy(model, first, cache, max_new_tokens=10))
    for other in runs[1:]:
        assert torch.equal(other, runs[0])
    whole = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=18)
    assert torch.equal(runs[0], whole)


def test_crop_within_the_residual_and_refused_beyond():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "quantized:bits=8,group_size=4,residual=6")
    ids = prompt(20, seed=23)
    out = greedy(model, ids, cache, max_new_tokens=5)  # 24 cached, the last 8 exact (blocks of 4 left at 20 and 22)
    before = [s.state().clone() for s in cache.kv_layers]
    with pytest.raises(kvcache.UnsupportedOperation, match="full precision"):
        cache.crop(-9)
    for store, state in zip(cache.kv_layers, before):
        after = store.state()
        assert after.seen == state.seen
        assert all(torch.equal(after.tensors[n], t) for n, t in state.tensors.items())
    cache.crop(-3)
    rest = greedy(model, out[:, :-3], cache, max_new_tokens=4)
    fresh = kvcache.make_cache(model, "quantized:bits=8,group_size=4,residual=6")
    ref = greedy(model, ids, fresh, max_new_tokens=2)
    ref = greedy(model, ref, fresh, max_new_tokens=4)
    assert torch.equal(rest, ref)


def test_eviction_over_int8_slots_keeps_positions_and_bytes():
    g = torch.Generator().manual_seed(5)
    layer = EvictingLayer(6, policy="lastrec", storage="int8")
    history = []
    for _ in range(15):
        k = torch.randn(1, 2, 1, 16, generator=g)
        history.append(k)
        layer.update(k, k.clone())
        layer.attend(torch.randn(1, 4, 1, 16, generator=g))
    full = torch.cat(history, 2)
    pos = layer.positions()
    assert sorted(pos[0, 0].tolist()) == list(range(9, 15))
    keys, values = layer.view()
    want = torch.gather(full, 2, pos.unsqueeze(-1).expand(1, 2, 6, 16))
    span = want.amax(-1, keepdim=True) - want.amin(-1, keepdim=True)
    assert ((keys - want).abs() <= span / 255 / 2 * 1.001 + 1e-6).all()
    assert torch.equal(keys, values)
    # (budget + 1) slots of: 16 + 16 code bytes, fp32 scale and minimum per 16-channel group for
    # keys and values, an int64 position and a float32 score, for 2 heads.
    assert layer.nbytes == 7 * 2 * (16 + 16 + 4 * 4 + 8 + 4)


@pytest.mark.parametrize(
    ("spec", "word"),
    [
        ("quantized:bits=3", "bits"),
        ("quantized:group_size=0", "group_size"),
        ("quantized:residual=-1", "residual"),
        ("h2o:budget=8,storage=int3", "storage"),
    ],
)
def test_bad_options_name_the_option(spec, word):
    with pytest.raises(kvcache.SpecError, match=word):
        kvcache.make_cache(model_for("llama"), spec)


def test_head_dims_that_cannot_be_packed_are_refused_and_nothing_changes():
    layer = QuantizedLayer(bits=2, group_size=4)
    with pytest.raises(kvcache.ShapeError, match="multiples of 4, got 6 and 6"):
        layer.update(torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6))
    assert not layer.initialized and layer.seen == 0 and layer.nbytes == 0
    layer = QuantizedLayer(bits=4, group_size=4)
    with pytest.raises(kvcache.ShapeError, match="multiples of 2"):
        layer.update(torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5))
    assert not layer.initialized and layer.seen == 0 and layer.nbytes == 0
    layer = QuantizedLayer(bits=8, group_size=4)
    with pytest.raises(kvcache.ShapeError, match="group_size"):
        layer.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 6))
    assert not layer.initialized


def test_hf_layer_keys_and_values_dequantize_once_per_change():
    """``HFLayer.keys``/``values`` reuse one view between changes (issue 11): reading them again
    dequantizes nothing, and every mutating call makes the next read see the new content."""
    from kvcache.hf import HFLayer

    layer = QuantizedLayer(bits=4, group_size=4, residual=4)
    views = []
    real_view = layer.view
    layer.view = lambda: views.append(1) or real_view()
    hf = HFLayer(layer)

    def kv(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)

    def reads_fresh(changed=True):
        before = len(views)
        keys, values = hf.keys, hf.values
        assert len(views) == before + changed, "one view per change, none without one"
        assert hf.keys is keys and hf.values is values and len(views) == before + changed
        want_k, want_v = real_view()
        torch.testing.assert_close(keys, want_k, rtol=0, atol=0)
        torch.testing.assert_close(values, want_v, rtol=0, atol=0)

    layer.update(*kv(11, 0))
    assert not views, "nothing is dequantized unless someone reads"
    reads_fresh()
    layer.update(*kv(1, 1))
    reads_fresh()
    layer.settle()  # a bounded layer trims only after its update's attention; the codes stay as they are
    reads_fresh(changed=False)
    layer.trim(1)
    reads_fresh()
    layer.select(torch.tensor([1]))
    reads_fresh()
    layer.repeat(2)
    reads_fresh()
    layer.reorder(torch.tensor([1, 0]))
    reads_fresh()
    saved = layer.state()
    saved = type(saved)(saved.kind, dict(saved.options), saved.seen, {k: t.clone() for k, t in saved.tensors.items()})
    layer.update(*kv(3, 2))
    reads_fresh()
    layer.load_state(saved)
    reads_fresh()
    twin = layer.fork()
    del twin.view  # the counting wrapper came along, bound to the original
    twin.update(*kv(2, 3))
    assert HFLayer(twin).keys.shape[2] == layer.seen + 2 and hf.keys.shape[2] == layer.seen
    layer.reset()
    before = len(views)
    assert hf.keys is None and hf.values is None and len(views) == before + 1


def old_state(layer, values, residual):
    """``layer``'s state with its values coded up to the last ``residual`` (as layers kept them before
    2026-11-29: one value left the residual a token at a time) from the raw ``values`` ``[B, H, T, D]``."""
    state = layer.state()
    t, seen = dict(state.tensors), state.seen
    coded = seen - min(seen, residual)
    t.update(layer.codes.format.encode_values(values[:, :, :coded]), residual_values=values[:, :, coded:seen])
    return type(state)(state.kind, state.options, seen, t)


@pytest.mark.parametrize("bits,group_size,residual,prompt_len", [(8, 4, 3, 9), (4, 8, 0, 5), (2, 4, 6, 1), (4, 4, 2, 14)])
@pytest.mark.parametrize("old", [False, True])
def test_fixed_decode_steps_store_what_the_eager_layer_stores(bits, group_size, residual, prompt_len, old):
    """``FixedQuantizedLayer``'s decode step (decisions as tensors) keeps the eager layer's codes,
    scales and residual bit for bit, step by step across block boundaries; also from a state with
    values coded ahead of the keys."""
    from kvcache.layers.fixed_quantized import FixedQuantizedLayer

    g = torch.Generator().manual_seed(bits + prompt_len)
    steps = 3 * (residual + group_size)
    keys = torch.randn(2, 3, prompt_len + steps, 16, generator=g)
    values = torch.randn(2, 3, prompt_len + steps, 16, generator=g)
    eager = QuantizedLayer(bits=bits, group_size=group_size, residual=residual)
    fixed = FixedQuantizedLayer(bits=bits, group_size=group_size, residual=residual, capacity=prompt_len + steps)
    for layer in (eager, fixed):
        layer.update(keys[:, :, :prompt_len], values[:, :, :prompt_len])
        layer.settle()
    if old:
        state = old_state(eager, values, residual)
        eager.load_state(state)
        fixed.load_state(state)
    for t in range(prompt_len, prompt_len + steps):
        for layer in (eager, fixed):
            layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            layer.settle()
        ours, theirs = fixed.state(), eager.state()
        assert ours.seen == theirs.seen == t + 1
        assert ours.tensors.keys() == theirs.tensors.keys()
        for name, tensor in theirs.tensors.items():
            assert torch.equal(ours.tensors[name], tensor), (t, name)


def test_a_state_past_the_fixed_capacity_is_refused_and_nothing_changes():
    from kvcache.layers.fixed_quantized import FixedQuantizedLayer

    g = torch.Generator().manual_seed(4)
    source = QuantizedLayer(bits=8, group_size=4, residual=2)
    source.update(torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g))
    source.settle()
    small = FixedQuantizedLayer(bits=8, group_size=4, residual=2, capacity=12)
    small.update(torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g))
    small.settle()
    before = small.state().clone()
    with pytest.raises(kvcache.CacheFullError, match="capacity 12 tokens, the state holds 20"):
        small.load_state(source.state())
    after = small.state()
    assert after.seen == before.seen == 5
    assert all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())
