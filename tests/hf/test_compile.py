"""Caches made with ``compile=True`` decode under ``torch.compile(model.forward, fullgraph=True)``:
one graph, no recompilation over the decode steps, and the tokens of the eager run with the same
kind. Graphs are counted with dynamo's ``CompileCounter`` backend (no code generation, cheap);
one test runs inductor, as a benchmark would."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from transformers import CompileConfig

import kvcache
from kvcache import cache_kwargs
from kvcache.hf.compiled import compiled_decode
from kvcache.errors import UnsupportedOperation
from tests.helpers import assert_same_tokens, left_padded, model_for, prompt

STEPS = 12
#: Two decoder layers, not the shared models' four: dynamo traces and inductor lowers every layer,
#: so a compile costs about twice as much with four, and two still give a layer after a layer.
LAYERS = {"num_hidden_layers": 2}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def greedy(model, forward, cache, ids, steps=STEPS, after_first=None):
    """Prefill eagerly, then ``steps`` greedy decode steps through ``forward``; returns the tokens
    ``[B, steps + 1]``. ``after_first()`` runs after the first decode step (the warm-up)."""
    out = model(ids, **cache_kwargs(model, cache), use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    tokens = [token]
    for step in range(steps):
        out = forward(input_ids=token, **cache_kwargs(model, cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        if step == 0 and after_first is not None:
            after_first()
    return torch.cat(tokens, dim=1)


def model_running(family, spec):
    model = model_for(family, **LAYERS)
    # compile=True keeps a model's sliding layers as fixed rings, which need the switch
    needs_ours = kvcache.make_cache(model, spec, compile=TOKENS).needs_kvcache_attention
    return model, (kvcache.use_kvcache_attention(model) if needs_ours else None)


CASES = [
    ("llama", "static:capacity=64"),
    ("llama", "window:window=6,sinks=2"),  # the ring wraps during decode (8 prompt + 12 tokens)
    ("llama", "window:window=5"),  # the prompt alone overflows the ring
    ("gemma2", "static:capacity=64"),  # full layers static, its sliding layers (window 16) fixed rings
    # Keys and values leave the residual in blocks during decode (8 prompt + 12 tokens).
    ("llama", "quantized:bits=8,group_size=4,residual=3"),
    ("llama", "quantized:bits=4,group_size=4,residual=0"),
    ("llama", "quantized:bits=4,group_size=8,residual=2"),
    ("llama", "quantized:codes=fp8,group_size=4,residual=3"),  # e4m3 codes: float8 casts in the graph
]

#: Token capacity of the compiled quantized layers in these tests (``compile=`` a number).
TOKENS = 64


@pytest.mark.parametrize("family,spec", CASES)
def test_compiled_decode_is_one_graph_with_eager_tokens(family, spec):
    model, switch = model_running(family, spec)
    try:
        ids = prompt(8)
        reference = greedy(model, model.forward, kvcache.make_cache(model, spec), ids)
        counter = CompileCounter()
        compiled = torch.compile(model.forward, fullgraph=True, backend=counter)
        graphs_after_warmup = []
        cache = kvcache.make_cache(model, spec, compile=TOKENS)
        got = greedy(model, compiled, cache, ids, after_first=lambda: graphs_after_warmup.append(counter.frame_count))
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
    assert graphs_after_warmup == [1]
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs over {STEPS} steps"
    assert_same_tokens(got, reference, f"{family} {spec}")
    assert cache.seen == ids.shape[1] + STEPS


@pytest.mark.parametrize("spec", ["static:capacity=64", "window:window=6,sinks=2"])
def test_generate_compiles_with_our_cache(spec):
    model, switch = model_running("llama", spec)
    try:
        ids = prompt(8, seed=3)
        reference = model.generate(ids, **cache_kwargs(model, kvcache.make_cache(model, spec)), max_new_tokens=10,
                                   do_sample=False)  # fmt: skip
        cache = kvcache.make_cache(model, spec, compile=True)
        assert cache.is_compileable
        got = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=10, do_sample=False,
                             compile_config=compile_config())  # fmt: skip
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
    # generate deep-copies the backend, so dynamo's own counters tell that it compiled (once).
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_tokens(got, reference, spec)
    assert cache.seen == ids.shape[1] + 9  # the last token is never fed back


def compile_config():
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    return config


@pytest.mark.parametrize("spec", ["static:capacity=64", "quantized:bits=4,group_size=4,residual=2"])
def test_compiled_generate_of_a_left_padded_batch(spec):
    """Static and quantized layers attend in position order over their capacity, so the model's
    mask (padding included) applies as it comes."""
    model, switch = model_running("llama", spec)
    try:
        ids, mask = left_padded((5, 8))
        reference = model.generate(ids, attention_mask=mask, **cache_kwargs(model, kvcache.make_cache(model, spec)),
                                   max_new_tokens=8, do_sample=False)  # fmt: skip
        cache = kvcache.make_cache(model, spec, compile=TOKENS)
        got = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=8, do_sample=False,
                             compile_config=compile_config())  # fmt: skip
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_tokens(got, reference, spec)


def test_compiled_window_refuses_a_left_padded_batch():
    model, switch = model_running("llama", "window:window=6,sinks=2")
    with switch:
        ids, mask = left_padded((5, 8))
        cache = kvcache.make_cache(model, "window:window=6,sinks=2", compile=True)
        with pytest.raises(UnsupportedOperation, match="padded differently"):
            model(ids, attention_mask=mask, **cache_kwargs(model, cache))


def test_inductor_decode_equals_eager():
    """What a benchmark runs: ``compiled_decode`` (inductor) over a static cache made to compile."""
    model = model_for("llama", **LAYERS)
    ids = prompt(8, seed=5)
    spec = "static:capacity=32"
    reference = greedy(model, model.forward, kvcache.make_cache(model, spec), ids, steps=6)
    step = compiled_decode(model)
    compiled = lambda input_ids, use_cache, **kwargs: step(input_ids, kwargs[kvcache.cache_name(model)])  # noqa: E731
    got = greedy(model, compiled, kvcache.make_cache(model, spec, compile=True), ids, steps=6)
    assert_same_tokens(got, reference, "inductor")
    assert counters["stats"]["unique_graphs"] == 1


def test_only_fixed_shape_kinds_are_compileable():
    model = model_for("llama")
    assert not kvcache.make_cache(model, "static:capacity=16").is_compileable
    assert not kvcache.make_cache(model, "growable").is_compileable
    assert kvcache.make_cache(model, "window:window=4", compile=True).is_compileable
    assert kvcache.make_cache(model, "quantized:bits=4", compile=True).kv_layers[0].max_length == model.config.max_position_embeddings
    for spec in ("growable", "concat", "h2o:budget=8", "lastrec:budget=8,storage=int8"):
        with pytest.raises(UnsupportedOperation, match="compile=True needs fixed shapes"):
            kvcache.make_cache(model, spec, compile=True)


@pytest.mark.parametrize("spec", ["static:capacity=32", "window:window=6,sinks=2", "quantized:bits=4,group_size=4,residual=2"])
def test_fixed_cache_keeps_the_eager_contract(spec):
    """After compiled steps, the eager calls (sizes, views, positions, crop, save) see what an eager
    cache of the kind sees."""
    model, switch = model_running("llama", spec)
    try:
        ids = prompt(8, seed=7)
        eager = kvcache.make_cache(model, spec)
        greedy(model, model.forward, eager, ids, steps=5)
        fixed = kvcache.make_cache(model, spec, compile=TOKENS)
        greedy(model, torch.compile(model.forward, fullgraph=True, backend="eager"), fixed, ids, steps=5)
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
    assert fixed.seen == eager.seen == 13
    for ours, theirs in zip(fixed.kv_layers, eager.kv_layers):
        assert (ours.seen, ours.length) == (theirs.seen, theirs.length)
        if not spec.startswith("quantized"):  # the compiled quantized layer allocates its capacity at once
            assert ours.capacity == theirs.capacity
        assert torch.equal(ours.positions(), theirs.positions())
        (k, v), (rk, rv) = ours.view(), theirs.view()
        torch.testing.assert_close(k, rk)
        torch.testing.assert_close(v, rv)
        assert ours.state().kind == theirs.kind
    if spec.startswith("window"):  # wrapped: the tokens a crop needs back are overwritten, in both
        with pytest.raises(UnsupportedOperation):
            eager.crop(-2)
        with pytest.raises(UnsupportedOperation):
            fixed.crop(-2)
        return
    fixed.crop(-2)
    eager.crop(-2)
    assert fixed.seen == eager.seen == 11
    assert [s.length for s in fixed.kv_layers] == [s.length for s in eager.kv_layers]
    for ours, theirs in zip(fixed.kv_layers, eager.kv_layers):
        torch.testing.assert_close(ours.view(), theirs.view())


@pytest.mark.parametrize("spec", ["static:capacity=10", "quantized:bits=8,group_size=4,residual=2"])
def test_fixed_cache_refuses_overflow_eagerly_changing_nothing(spec):
    model, switch = model_running("llama", spec)
    try:
        cache = kvcache.make_cache(model, spec, compile=10)
        model(prompt(8), **cache_kwargs(model, cache), use_cache=True)
        before = [s.view() for s in cache.kv_layers]
        with pytest.raises(kvcache.CacheFullError):
            model(prompt(5), **cache_kwargs(model, cache), use_cache=True)  # 13 tokens: past 10 (12 for quantized: blocks of 4)
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
    assert cache.seen == 8
    assert all(s.length == 8 for s in cache.kv_layers)
    for (k, v), s in zip(before, cache.kv_layers):
        assert torch.equal(k, s.view()[0]) and torch.equal(v, s.view()[1])
