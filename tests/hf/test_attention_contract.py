"""The attention contract: a layer's update keeps a read record, the "kvcache" attention finds it
through the key it receives (the key names its reader; no per-thread record), masks come from positions in one place, coded stores are
read block by block by the one kernel, and nothing waits for a call a caller could forget."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3nTextConfig

import kvcache
from kvcache import DTypeError, UnsupportedOperation, cache_kwargs
from kvcache.attention import BlockReader, attend, attend_weighted, position_rows
from kvcache.hf.cache import kv_attended_by
from kvcache.hf import boolean_mask, hf_attention_forward
from kvcache.layers import EvictingLayer, GrowableLayer, QuantizedLayer, WindowLayer
from kvcache.layers.own_attention import OwnAttentionLayer

from helpers import Recorder, layer_fingerprint, model_for, prompt


class SplitReader(BlockReader):
    """Plain tensors handed out in uneven blocks (keys and values split differently)."""

    def __init__(self, keys, values, key_sizes, value_sizes):
        self.keys, self.values, self.key_sizes, self.value_sizes = keys, values, key_sizes, value_sizes

    shape = property(lambda self: self.keys.shape)
    value_shape = property(lambda self: self.values.shape)
    dtype = property(lambda self: self.keys.dtype)
    device = property(lambda self: self.keys.device)

    def key_blocks(self):
        return iter(self.keys.split(self.key_sizes, dim=2))

    def value_blocks(self):
        return iter(self.values.split(self.value_sizes, dim=2))


@pytest.mark.parametrize("q_len", [1, 2, 9])  # decode path (K @ q^T) and the larger-block path
@pytest.mark.parametrize("weights", [None, "sum", "last"])
def test_the_kernel_reads_a_block_reader_as_it_reads_tensors(q_len, weights):
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(2, 8, q_len, 16, generator=g)
    k, v = torch.randn(2, 2, 23, 16, generator=g), torch.randn(2, 2, 23, 12, generator=g)
    rows = position_rows(23 - q_len, torch.arange(23))
    want, want_w = attend_weighted(q, k, v, mask_rows=rows, weights=weights, softcap=3.0)
    reader = SplitReader(k, v, [8, 8, 7], [5, 0, 18])
    got, got_w = attend_weighted(q, reader, None, mask_rows=rows, weights=weights, softcap=3.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if weights is not None:
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


def test_quantized_decode_builds_no_full_precision_copy_of_the_store():
    """A decode step over 4096 coded tokens: no tensor as large as the store's keys in full precision."""
    layer = QuantizedLayer(bits=4, group_size=64, residual=32, block=512)
    k = torch.randn(1, 2, 4096, 64)
    layer.update(k, k.clone())
    layer.settle()
    step = torch.randn(1, 2, 1, 64)
    layer.update(step, step.clone())
    with Recorder() as rec:
        layer.attend(torch.randn(1, 8, 1, 64))
    biggest = max(n for _, outs, _ in rec.ops for _, n, _ in outs)
    assert biggest <= 2 * 512 * 64 + 8 * 4097, biggest  # one block of K or V, or the scores


def test_the_kvcache_attention_finds_bounded_layers_through_the_cache(monkeypatch):
    """Every attention call of every forward pass reads its layer's record; no tensor carries a tag."""
    calls, returned = [], []
    attend_layer, update_layer = OwnAttentionLayer.attend, OwnAttentionLayer.update

    def counting(self, *args, **kwargs):
        calls.append(self.kind)
        return attend_layer(self, *args, **kwargs)

    monkeypatch.setattr(OwnAttentionLayer, "attend", counting)
    monkeypatch.setattr(OwnAttentionLayer, "update", lambda self, k, v, n=1: _update_and_record(self, k, v, n, update_layer, returned))
    model = model_for("llama")
    cache = kvcache.make_cache(model, "h2o:budget=8")
    with kvcache.use_kvcache_attention(model), torch.no_grad():
        model.generate(prompt(12), **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
    layers = model.config.num_hidden_layers
    assert calls == ["evicting"] * (layers * 4)
    assert returned and not any(hasattr(k, "kvcache_layer") for k in returned)


def _update_and_record(layer, k, v, attended_by, update, returned):
    out = update(layer, k, v, attended_by)
    returned.append(out[0])
    return out


def test_a_stale_cache_never_applies():
    """After a bounded cache wrote, attention over other keys for the same layer index is plain
    attention over the keys given, and the layer's record is left alone."""
    model = model_for("llama")
    cache = kvcache.make_cache(model, "window:window=4")
    with kvcache.use_kvcache_attention(model), torch.no_grad():
        model(prompt(6), **cache_kwargs(model, cache), use_cache=True)
    store = cache.kv_layers[0]
    k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    store.update(k[:, :, :1], v[:, :, :1])  # a record the next call must not read
    before = layer_fingerprint(store)
    module = model.model.layers[0].self_attn
    q = torch.randn(1, model.config.num_attention_heads, 1, 16)
    out, _ = hf_attention_forward(module, q, k, v, None)
    torch.testing.assert_close(out.transpose(1, 2), attend(q, k, v), atol=1e-6, rtol=1e-6)
    assert store.unattended and layer_fingerprint(store) == before


def test_an_update_after_an_unattended_one_settles_it_without_weights():
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)) for n in (7, 1, 1)]
    forgot, settled = EvictingLayer(4, policy="h2o", recent=1), EvictingLayer(4, policy="h2o", recent=1)
    for k, v in chunks:
        forgot.update(k, v)
        settled.update(k, v)
        settled.settle()
        settled.settle()  # nothing left: a no-op
    forgot.settle()
    mine, theirs = forgot.state(), settled.state()
    assert mine.seen == theirs.seen and mine.tensors.keys() == theirs.tensors.keys()
    assert all(torch.equal(t, theirs.tensors[name]) for name, t in mine.tensors.items())
    with pytest.raises(UnsupportedOperation, match="already attended"):
        settled.attend(torch.randn(1, 4, 1, 8))
    plain = GrowableLayer()
    plain.update(*chunks[0])
    plain.settle()  # every layer has it; nothing to do for an unbounded one
    assert plain.seen == 7


def test_a_forward_pass_that_bypassed_the_kvcache_attention_is_refused_changing_nothing():
    """Updates through the cache whose attention never read them: the next forward pass raises."""
    model = model_for("llama")
    cache = kvcache.make_cache(model, "window:window=4")
    with kvcache.use_kvcache_attention(model):
        for i in range(len(cache.kv_layers)):
            cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), i)
        before = [layer_fingerprint(s) for s in cache.kv_layers]
        with pytest.raises(UnsupportedOperation, match="attended without it"):
            cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    assert [layer_fingerprint(s) for s in cache.kv_layers] == before


def test_transformers_masks_become_booleans_in_the_bridge_only():
    additive = torch.tensor([0.0, torch.finfo(torch.float32).min, -1.0])
    assert boolean_mask(additive).tolist() == [True, False, True]
    assert boolean_mask(None) is None
    layer = WindowLayer(4)
    layer.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    with pytest.raises(DTypeError, match="boolean"):
        layer.attend(torch.randn(1, 1, 3, 8), mask=additive.view(1, 1, 1, 3))
    assert layer.unattended  # a refused call changes nothing


def test_a_store_layer_is_attended_by_itself_and_the_reuse_layers_of_its_type():
    """Gemma 3n: each "reuse" layer reads the last "store" layer of its type before it."""
    config = Gemma3nTextConfig(activation_sparsity_pattern=[0.0] * 35)
    readers = kv_attended_by(config, 35)
    modes, types = config.kv_sharing_modes, config.layer_types
    owners, last_store = [], {}
    for i, (mode, kind) in enumerate(zip(modes, types)):
        if mode == "store":
            last_store[kind] = i
        owners.append(last_store[kind] if mode == "reuse" else i)
    assert "reuse" in modes
    assert readers == [owners.count(j) if modes[j] == "store" else 1 for j in range(35)]


def test_a_module_without_a_layer_index_finds_the_layer_that_handed_out_its_key():
    """Models that number their attention modules otherwise: the key's identity still finds the layer."""
    model = model_for("llama")
    cache = kvcache.make_cache(model, "window:window=4")
    with kvcache.use_kvcache_attention(model):
        keys, values = cache.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), 1)
    store = cache.kv_layers[1]
    q = torch.randn(1, 4, 6, 16)
    want = store.fork().attend(q)
    out, _ = hf_attention_forward(torch.nn.Module(), q, keys, values, None)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=0, rtol=0)
    assert store.pending is None  # attended, and settled


def test_interleaved_caches_each_read_their_own_record():
    """Two caches written one after the other in one thread: each key still reaches the layer that
    handed it out (a last-writer record would have sent the first key to the second cache)."""
    model = model_for("llama")
    a, b = kvcache.make_cache(model, "window:window=4"), kvcache.make_cache(model, "h2o:budget=4")
    ka, va = a.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), 1)
    kb, vb = b.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), 1)
    q = torch.randn(1, 4, 6, 16)
    want_a, want_b = a.kv_layers[1].fork().attend(q), b.kv_layers[1].fork().attend(q)
    module = model.model.layers[1].self_attn
    out_a, _ = hf_attention_forward(module, q, ka, va, None)
    out_b, _ = hf_attention_forward(module, q, kb, vb, None)
    torch.testing.assert_close(out_a.transpose(1, 2), want_a, atol=0, rtol=0)
    torch.testing.assert_close(out_b.transpose(1, 2), want_b, atol=0, rtol=0)
    assert a.kv_layers[1].pending is None and b.kv_layers[1].pending is None


def test_a_key_read_in_another_thread_reaches_its_layer():
    """Nothing about the reader is kept per thread: the attention may run where the update did not."""
    import threading

    model = model_for("llama")
    cache = kvcache.make_cache(model, "window:window=4")
    keys, values = cache.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), 1)
    q = torch.randn(1, 4, 6, 16)
    want = cache.kv_layers[1].fork().attend(q)
    got = []
    thread = threading.Thread(target=lambda: got.append(hf_attention_forward(torch.nn.Module(), q, keys, values, None)[0]))
    thread.start()
    thread.join()
    torch.testing.assert_close(got[0].transpose(1, 2), want, atol=0, rtol=0)


def test_a_stale_or_changed_key_is_attended_as_given():
    """A key whose record was already attended, or a tensor the model made from it, names no reader:
    plain attention over what the call received."""
    from kvcache.hf.bridge import reading_layer

    cache = kvcache.make_cache(model_for("llama"), "window:window=4")
    keys, values = cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 1)
    assert reading_layer(keys) is cache.kv_layers[1]
    assert reading_layer(keys * 1) is None and reading_layer(keys.clone()) is None
    cache.kv_layers[1].attend(torch.randn(1, 4, 3, 16))
    assert reading_layer(keys) is None  # attended: stale
    q = torch.randn(1, 4, 3, 16)
    out, _ = hf_attention_forward(torch.nn.Module(), q, keys, values, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.transpose(1, 2), want)


def test_the_bridge_keeps_no_state_per_thread():
    from kvcache.hf import bridge

    import threading

    assert not [name for name, v in vars(bridge).items() if isinstance(v, threading.local)]


def test_a_block_reader_comes_without_a_value_tensor():
    k = torch.randn(1, 1, 4, 8)
    with pytest.raises(DTypeError, match="value=None"):
        attend_weighted(torch.randn(1, 1, 1, 8), SplitReader(k, k, [4], [4]), k)
