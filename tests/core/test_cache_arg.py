"""``kvcache.cache_kwargs``: the keyword a model takes its cache under, read from its forward."""

import inspect
import warnings

import torch
from transformers import DynamicCache

import kvcache
from kvcache.apps.tiny import tiny_model


class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=None):
        return past_key_values


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=None):
        return cache


class _Both(torch.nn.Module):  # a forward that still lists the old name beside the new
    def forward(self, input_ids, cache=None, past_key_values=None):
        return past_key_values


def test_the_name_is_the_one_the_forward_declares():
    assert kvcache.cache_name(_Old()) == "past_key_values"
    assert kvcache.cache_name(_New()) == "cache"
    assert kvcache.cache_name(_Both()) == "past_key_values"
    marker = object()
    assert _Old()(None, **kvcache.cache_kwargs(_Old(), marker)) is marker
    assert _New()(None, **kvcache.cache_kwargs(_New(), marker)) is marker


def test_a_real_model_gets_its_cache_without_a_deprecation_warning():
    model = tiny_model("llama", seed=1).eval()
    declared = inspect.signature(type(model).forward).parameters
    assert kvcache.cache_name(model) == ("cache" if "cache" in declared else "past_key_values")
    ids = torch.tensor([[3, 4, 5, 6]])
    cache = kvcache.make_cache(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            got = model(ids, **kvcache.cache_kwargs(model, cache), use_cache=True).logits
            out = model.generate(ids, **kvcache.cache_kwargs(model, kvcache.make_cache(model)), max_new_tokens=3,
                                 do_sample=False)  # fmt: skip
    assert cache.seen == 4
    with torch.no_grad():
        want = model(ids, **kvcache.cache_kwargs(model, DynamicCache(config=model.config)), use_cache=True).logits
    torch.testing.assert_close(got, want)
    assert out.shape == (1, 7)
