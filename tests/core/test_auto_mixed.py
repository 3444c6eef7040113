"""``auto`` and ``auto-heads`` with ``fine_share``: mixed storages (``layers/tiers.py``) on the ladder.

References: ``weigh``'s estimate of each part of a mixed case (the parts of the ``mass`` rule add
up), the same cache saved and loaded (``save_cache``/``load_cache``), and the kinds' byte budgets.
"""

from __future__ import annotations

import collections

import pytest
import torch

import kvcache
from kvcache import cache_kwargs
from helpers import model_for, prompt
from kvcache.layers import AutoHeadsLayer, AutoLayer
from kvcache.layers.auto import Estimate, weigh, weigh_storage
from kvcache.layers.byte_budget import mixed_ladder
from kvcache.layers.mix import mix_of
from kvcache.layers.tiers import ranked

#: ``drop=1``: compared by distortion, under which the tiny model's layers take mixed storages
#: (tokens first, the default, takes the coarsest storage within its tolerance).
SPECS = ["auto:bytes=0.125,fine_share=0.25,drop=1", "auto-heads:bytes=0.0625,fine_share=0.25,drop=1"]


def test_the_ladder_puts_each_mixed_storage_between_its_two_storages():
    assert mixed_ladder(("full", "int8", "int4", "int2"), 0.25) == (
        "full", "full@0.25+int8", "int8", "int8@0.25+int4", "int4", "int4@0.25+int2", "int2")  # fmt: skip


def filled(spec: str, tokens: int = 200):
    model = model_for("llama")
    cache = kvcache.make_cache(model, spec)
    with torch.no_grad(), kvcache.use_kvcache_attention(model):
        model(prompt(tokens, seed=1), **cache_kwargs(model, cache), use_cache=True)
    return model, cache


@pytest.mark.parametrize("spec", SPECS)
def test_a_mixed_case_is_weighed_as_its_two_parts_and_a_chosen_one_is_held_so(spec):
    model, cache = filled(spec)
    chosen = collections.Counter(m["storage"] for m in mix_of(cache) if m)
    assert any("+" in s for s in chosen), chosen  # the tiny model's attention makes some layer take one
    for layer, m in zip(cache.kv_layers, mix_of(cache)):
        assert set(m["estimates"]) <= set(layer.ladder)
        assert layer.stored_as == m["storage"] and layer.tiered == ("+" in m["storage"])
        assert layer.options()["storage"] == m["storage"] and layer.options()["fine_share"] == 0.25


def test_the_mixed_estimate_adds_its_parts():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    mass = torch.rand(1, 2, 40, generator=g)
    mass = mass / mass.sum(-1, keepdim=True)
    layer = AutoLayer(bytes=0.3, fine_share=0.25, window=4, drop=1)
    layer.append(keys, values)
    layer.settle(mass)  # geometry and scores
    slots = {"keys": keys, "values": values, "positions": torch.arange(40).expand(1, 2, 40), "scores": mass}
    kept = mass.topk(20, dim=-1).indices
    rank = ranked(layer._rank(slots).gather(2, kept), slots["positions"].gather(2, kept))
    top, rest = kept.gather(2, rank[..., :5]), kept.gather(2, rank[..., 5:])
    got = weigh_storage("int8@0.25+int4", 20, kept, layer._rank(slots), slots["positions"], mass, keys, values, 2, layer.geometry)
    a = weigh("int8", 20, top, mass, keys, values, 2, layer.geometry)
    b = weigh("int4", 20, rest, mass, keys, values, 2, layer.geometry)
    whole = weigh("full", 20, kept, mass, keys, values, 2, layer.geometry)
    assert got.coding == pytest.approx(a.coding + b.coding) and got.dropped == pytest.approx(whole.dropped, abs=1e-6)
    worse = max(a.coding / (1 - a.dropped), b.coding / (1 - b.dropped))  # each part's mean error over its own mass
    assert got.worst_part == pytest.approx(worse, rel=1e-5) and got.bounded == got.worst_part
    assert whole.worst_part is None and whole.bounded == pytest.approx(whole.coding / (1 - whole.dropped))


@pytest.mark.parametrize("spec", SPECS)
def test_a_saved_cache_loads_with_its_mixed_choices_and_continues_the_same(spec, tmp_path):
    model, cache = filled(spec)
    kvcache.save_cache(cache, tmp_path / "c.kv")
    loaded = kvcache.load_cache(tmp_path / "c.kv", model)
    for a, b in zip(cache.kv_layers, loaded.kv_layers):
        assert b.stored_as == a.stored_as and b.nbytes == a.nbytes
        assert torch.equal(a.positions(), b.positions()) and torch.equal(a.scores(), b.scores())
    nxt = torch.tensor([[7]])
    with torch.no_grad(), kvcache.use_kvcache_attention(model):
        for _ in range(3):
            x = model(nxt, **cache_kwargs(model, cache), use_cache=True).logits
            y = model(nxt, **cache_kwargs(model, loaded), use_cache=True).logits
            assert torch.equal(x, y)


@pytest.mark.parametrize("cls", [AutoLayer, AutoHeadsLayer])
def test_options_that_cannot_weigh_a_mixed_case_are_refused(cls):
    with pytest.raises(ValueError, match="mass rule"):
        cls(bytes=0.1, fine_share=0.25, rule="output")
    with pytest.raises(ValueError, match="fine_share"):
        cls(bytes=0.1, fine_share=1.0)
    with pytest.raises(ValueError, match="storage must be one of"):
        cls(bytes=0.1, storage="int8@0.25+int4")  # a mixed storage is on the ladder only with fine_share


def test_a_state_in_a_mixed_storage_is_checked_and_refused_without_changing_the_layer():
    model, cache = filled(SPECS[1])
    layer = next(x for x in cache.kv_layers if x.tiered)
    state = layer.state().clone()
    before = layer.state().clone()
    bad = state.clone()
    bad.tensors["fine.positions"] = bad.tensors["fine.positions"] + 10_000
    with pytest.raises(ValueError):
        layer.load_state(bad)
    small = AutoHeadsLayer(bytes=0.01, fine_share=0.25, drop=1)
    with pytest.raises(ValueError, match="budget"):
        small.load_state(state)
    after = layer.state()
    assert after.options == before.options
    assert all(torch.equal(after.tensors[n], before.tensors[n]) for n in before.tensors)


@pytest.mark.parametrize("cls", [AutoLayer, AutoHeadsLayer])
def test_tokens_first_bounds_a_mixed_case_by_its_worse_part(cls):
    """Under a tolerance a mix is judged by its coarse part's error, not by the sum that its fine
    part dilutes: int4@0.25+int2 codes 0.2 in all but its int2 part 0.55 a slot (one storage is
    judged by its kept slots' mean error: int4's 0.12 over the 0.9 it keeps)."""
    layer = cls(bytes=0.1, fine_share=0.25)
    assert layer.tolerance == 0.3
    cases = [Estimate("int8", 10, 0.30, 0.01), Estimate("int4", 20, 0.10, 0.12), Estimate("int4@0.25+int2", 30, 0.05, 0.20, 0.55)]
    assert layer._best(cases).storage == "int4"
    cases[2] = Estimate("int4@0.25+int2", 30, 0.05, 0.20, 0.25)
    assert layer._best(cases).storage == "int4@0.25+int2"
    assert cls(bytes=0.1, fine_share=0.25, drop=1)._best(cases).storage == "int4"  # by distortion: 0.22 against 0.31 and 0.25
