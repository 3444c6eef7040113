"""Switching a model to the ``"kvcache"`` attention is explicit: ``use_kvcache_attention``.

``make_cache`` and ``load_cache`` leave the model as it is; a bounded cache given to a model that
runs another attention raises on its first update, naming the call that fixes it, with the cache
and the model unchanged.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from helpers import assert_same_tokens, model_for, prompt
from kvcache.apps.tiny import tiny_model

BOUNDED_SPECS = ("window:window=8,sinks=2", "h2o:budget=12", "quantized:bits=4,group_size=8,residual=4")


def fingerprint(cache: kvcache.KVCache) -> list:
    """Sizes, counters and the bytes of every stored tensor (views of coded stores are rebuilt per
    call, so their pointers say nothing)."""
    out = []
    for store in cache.kv_layers:
        state = store.state()
        tensors = {name: t.clone() for name, t in state.tensors.items()}
        out.append((store.length, store.seen, store.capacity, store.nbytes, state.options, tensors))
    return out


def same(a: list, b: list) -> bool:
    return all(
        x[:5] == y[:5] and x[5].keys() == y[5].keys() and all(torch.equal(x[5][k], y[5][k]) for k in x[5])
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("family", ("llama", "gemma2", "mistral"))
@pytest.mark.parametrize("spec", ("growable", *BOUNDED_SPECS))
def test_make_cache_and_load_cache_leave_the_model_as_it_is(family, spec, tmp_path):
    model = model_for(family)
    before = model.config._attn_implementation
    cache = kvcache.make_cache(model, spec)
    assert model.config._attn_implementation == before
    cache.save(tmp_path / "c.kv")
    kvcache.load_cache(tmp_path / "c.kv", model)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("spec", BOUNDED_SPECS)
def test_bounded_cache_on_another_attention_raises_naming_the_fix_and_changes_nothing(spec):
    model = model_for("llama")
    cache = kvcache.make_cache(model, spec)
    with kvcache.use_kvcache_attention(model):  # some content first, so "unchanged" means something
        model(prompt(20, seed=1), **cache_kwargs(model, cache), use_cache=True)
    before = fingerprint(cache)
    attention = model.config._attn_implementation
    with pytest.raises(kvcache.UnsupportedOperation, match=r"kvcache\.use_kvcache_attention\(model\)"):
        model(prompt(3, seed=2), **cache_kwargs(model, cache), use_cache=True)
    assert same(fingerprint(cache), before)
    assert model.config._attn_implementation == attention
    # Switched, the same cache goes on as if nothing had happened.
    with kvcache.use_kvcache_attention(model):
        model(prompt(3, seed=2), **cache_kwargs(model, cache), use_cache=True)
    assert cache.seen == 23


def test_a_sliding_window_model_needs_no_switch_with_the_default_cache_but_does_with_a_bounded_one():
    """The default kinds keep a sliding layer in position order, as Hugging Face does, so the
    model's own attention and masks apply; beside a bounded kind it is a ring, and the switch is
    required (the first update raises, changing nothing)."""
    model = model_for("mistral")
    ids = prompt(30)
    ref = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=8, do_sample=False)
    assert model.config._attn_implementation != "kvcache"
    ours = model.generate(ids, **cache_kwargs(model, kvcache.make_cache(model)), max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, ref)
    bounded = kvcache.make_cache(model, "h2o:budget=64")
    with pytest.raises(kvcache.UnsupportedOperation, match="use_kvcache_attention"):
        model.generate(ids, **cache_kwargs(model, bounded), max_new_tokens=2, do_sample=False)
    assert bounded.seen == 0


def test_use_kvcache_attention_as_a_context_manager_restores_even_on_error():
    model = model_for("llama")
    before = model.config._attn_implementation
    assert before != "kvcache"
    with kvcache.use_kvcache_attention(model) as same:
        assert same is model and model.config._attn_implementation == "kvcache"
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="boom"):
        with kvcache.use_kvcache_attention(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before


def test_use_kvcache_attention_as_a_plain_call_stays_and_generates_like_dynamic_cache():
    model = tiny_model("qwen2")  # a model of this test's own: the switch stays on it
    ids = prompt(24, seed=3)
    ref = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=8, do_sample=False)
    kvcache.use_kvcache_attention(model)
    assert model.config._attn_implementation == "kvcache"
    out = model.generate(ids, **cache_kwargs(model, kvcache.make_cache(model)), max_new_tokens=8, do_sample=False)
    assert_same_tokens(out, ref, "qwen2 after use_kvcache_attention")
    assert model.config._attn_implementation == "kvcache"


def test_use_kvcache_attention_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="transformers model"):
        kvcache.use_kvcache_attention(model_for("llama").config)


def test_fork_keeps_the_attention_check():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "h2o:budget=12")
    with pytest.raises(kvcache.UnsupportedOperation, match="use_kvcache_attention"):
        model(prompt(4), **cache_kwargs(model, cache.fork()), use_cache=True)
    assert cache.seen == 0 and torch.is_grad_enabled()


def test_a_model_without_sdpa_support_gets_eager_masks_inside_the_switch_only():
    """Models written for eager attention alone may add biases to the mask or rely on it for
    causality; the switch gives them eager's additive masks, and takes that back on exit."""
    from kvcache.hf import EAGER_MASKS, kvcache_mask

    model = tiny_model("llama", attn_implementation="eager")
    model._supports_sdpa = False  # this instance only: stands for an eager-only model
    args = dict(batch_size=1, q_length=3, kv_length=3, config=model.config, allow_is_causal_skip=True)
    assert kvcache_mask(**args) is None  # SDPA's: the causal mask is left to is_causal
    with kvcache.use_kvcache_attention(model):
        assert getattr(model.config, EAGER_MASKS) is True
        mask = kvcache_mask(**args)
        assert mask.is_floating_point() and mask.shape == (1, 1, 3, 3)
        future = torch.ones(3, 3, dtype=torch.bool).triu(1)
        assert (mask[0, 0][future] < -1e30).all() and (mask[0, 0][~future] == 0).all()
    assert not hasattr(model.config, EAGER_MASKS)
    assert kvcache_mask(**args) is None


def test_prefill_is_causal_on_a_model_whose_attention_flags_are_not_kept_for_sdpa():
    """BigBird-Pegasus runs no sdpa, and its decoder self-attention says ``is_causal=False``: the
    ``"kvcache"`` mask must not leave causality to that flag. Prefill logits match eager's (fp32:
    the same softmax attention through another kernel, 1e-5)."""
    from families import build_model

    model = build_model("bigbird_pegasus")
    assert not type(model)._supports_sdpa and model.config._attn_implementation == "eager"
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with kvcache.use_kvcache_attention(model):
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, says",
    [("doge", "dynamic attention mask"), ("deepseek_v3", "latent attention"), ("diffllama", "halves of the values"), ("bert", "not causal")],
)
def test_bounded_kinds_are_refused_before_anything_is_written_where_they_cannot_serve(family, says):
    """Bounded layers attend the keys and values they returned, causally, by absolute position
    (``support.py``): models that do otherwise are refused by ``make_cache`` (read from the config)
    or by the first update (what the switch found in the modules), the cache still empty."""
    from families import build_model

    model = build_model(family)
    ids = torch.randint(3, 100, (1, 8))
    with kvcache.use_kvcache_attention(model):
        cache = None
        with pytest.raises(kvcache.UnsupportedOperation, match=says):
            cache = kvcache.make_cache(model, "h2o:budget=64")
            model(ids, **cache_kwargs(model, cache))
        assert cache is None or cache.seen == 0
        out = model.generate(ids, **cache_kwargs(model, kvcache.make_cache(model)), max_new_tokens=3, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    assert out.shape == (1, 11)  # the default cache serves it


def test_overlapping_blocks_on_one_model_restore_when_the_last_ends():
    """Threads sharing a model (a prompt store's prefill from several threads) open overlapping
    blocks: the first to end must not switch the model back under the others, and the last to end
    puts back what the model had before the first began."""
    model = tiny_model("llama")
    before = model.config._attn_implementation
    outer = kvcache.use_kvcache_attention(model)
    inner = kvcache.use_kvcache_attention(model)
    outer.__exit__(None, None, None)  # ends first: the inner block still runs
    assert model.config._attn_implementation == "kvcache"
    inner.__exit__(None, None, None)
    assert model.config._attn_implementation == before


def test_threads_switching_one_model_leave_it_as_it_was():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    start = threading.Barrier(4)
    errors = []

    def work():
        try:
            start.wait()
            for _ in range(50):
                with kvcache.use_kvcache_attention(model):
                    assert model.config._attn_implementation == "kvcache"
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert model.config._attn_implementation == before


def test_a_plain_call_holds_the_switch_past_later_blocks():
    model = tiny_model("llama")
    kvcache.use_kvcache_attention(model)
    with kvcache.use_kvcache_attention(model):
        pass
    assert model.config._attn_implementation == "kvcache"


def test_a_block_after_switching_back_by_hand_puts_back_what_the_model_runs_then():
    model = tiny_model("llama")
    kvcache.use_kvcache_attention(model)
    model.set_attn_implementation("eager")
    with kvcache.use_kvcache_attention(model):
        assert model.config._attn_implementation == "kvcache"
    assert model.config._attn_implementation == "eager"
