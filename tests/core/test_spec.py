"""Cache specs: ``kvcache.parse_spec`` and ``make_cache`` with a spec string or keywords."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import CacheSpec, SpecError, make_cache, parse_spec
from kvcache.layers import ConcatLayer, GrowableLayer, SlidingLayer, StaticLayer
from kvcache.apps.tiny import tiny_config

VALID_KINDS = ("growable", "static", "concat")


def assert_lists_kinds(error: pytest.ExceptionInfo) -> None:
    message = str(error.value)
    for kind in VALID_KINDS:
        assert kind in message, f"{kind!r} missing from: {message}"


# ---- parsing ------------------------------------------------------------------------------


def test_parse_basic_specs():
    assert parse_spec("growable") == CacheSpec("growable", {})
    assert parse_spec() == CacheSpec("growable", {})
    assert parse_spec("concat") == CacheSpec("concat", {})
    spec = parse_spec("static:capacity=8192")
    assert spec.kind == "static" and spec.options == {"capacity": 8192}
    assert isinstance(spec.options["capacity"], int)
    spec = parse_spec("growable:initial_capacity=64,growth=1.5")
    assert spec.options == {"initial_capacity": 64, "growth": 1.5}
    assert isinstance(spec.options["growth"], float)


@pytest.mark.parametrize(
    "text",
    [
        " static:capacity=8192",
        "static:capacity=8192 ",
        "static : capacity = 8192",
        "\tstatic:\n capacity=8192\n",
        "static:capacity= 8192",
    ],
)
def test_whitespace_is_ignored(text):
    assert parse_spec(text) == CacheSpec("static", {"capacity": 8192})


def test_whitespace_between_options():
    assert parse_spec(" growable : initial_capacity = 32 , growth = 3 ") == CacheSpec(
        "growable", {"initial_capacity": 32, "growth": 3.0}
    )


def test_keyword_overrides_win():
    assert parse_spec("static:capacity=8", capacity=16).options == {"capacity": 16}
    spec = parse_spec("growable:initial_capacity=8,growth=3", growth=1.5)
    assert spec.options == {"initial_capacity": 8, "growth": 1.5}
    # Keyword values are coerced like string ones.
    assert parse_spec("growable", initial_capacity="32").options == {"initial_capacity": 32}
    assert parse_spec("static", capacity=4096).options == {"capacity": 4096}
    # A CacheSpec can be re-parsed with overrides; the original is not changed.
    base = parse_spec("static:capacity=8")
    assert parse_spec(base, capacity=9).options == {"capacity": 9}
    assert base.options == {"capacity": 8}


def test_str_round_trips():
    for text in ("growable", "concat", "static:capacity=8192", "growable:initial_capacity=16,growth=1.5"):
        spec = parse_spec(text)
        assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize("text", ["dynamic", "", "grow", "static8192", "GROWABLE", "sliding"])
def test_unknown_kind(text):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert_lists_kinds(info)


@pytest.mark.parametrize(
    "text, overrides",
    [
        ("growable:capacity=8", {}),
        ("static:capacity=8,window=4", {}),
        ("concat:initial_capacity=8", {}),
        ("growable", {"max_tokens": 8}),
    ],
)
def test_unknown_option(text, overrides):
    with pytest.raises(SpecError) as info:
        parse_spec(text, **overrides)
    assert_lists_kinds(info)
    name = (text.split(":")[1].split(",")[-1].split("=")[0]) if not overrides else next(iter(overrides))
    assert name in str(info.value)


@pytest.mark.parametrize(
    "text, overrides",
    [
        ("static:capacity=abc", {}),
        ("static:capacity=1.5", {}),
        ("growable:growth=fast", {}),
        ("growable:initial_capacity=8.5", {}),
        ("static", {"capacity": 2.5}),
        ("static", {"capacity": None}),
    ],
)
def test_bad_value(text, overrides):
    with pytest.raises(SpecError) as info:
        parse_spec(text, **overrides)
    assert_lists_kinds(info)


def test_missing_capacity_for_static():
    with pytest.raises(SpecError) as info:
        parse_spec("static")
    assert "capacity" in str(info.value)
    assert_lists_kinds(info)


@pytest.mark.parametrize("text", ["static:capacity", "static:capacity=", "static:=8", "static:capacity=8,", "static:,"])
def test_malformed_option(text):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert_lists_kinds(info)


def test_buffers_only_as_keyword():
    with pytest.raises(SpecError):
        parse_spec("static:buffers=x")


def test_non_string_spec():
    with pytest.raises(SpecError):
        parse_spec(8192)


# ---- make_cache: a spec string equals keywords ----------------------------------------------


def layout(cache):
    return [None if s is None else (type(s), s.options()) for s in cache.kv_layers]


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize(
    "text, kwargs",
    [
        ("growable", {}),
        ("growable:initial_capacity=32,growth=1.5", {"initial_capacity": 32, "growth": 1.5}),
        ("static:capacity=64", {"capacity": 64}),
        ("concat", {}),
    ],
)
def test_make_cache_string_equals_keywords(family, text, kwargs):
    config = tiny_config(family)
    kind = text.split(":")[0]
    by_string = make_cache(config, text)
    by_keywords = make_cache(config, kind, **kwargs)
    assert by_string.spec == by_keywords.spec == parse_spec(text)
    assert layout(by_string) == layout(by_keywords)
    expected_full = {"growable": GrowableLayer, "static": StaticLayer, "concat": ConcatLayer}[kind]
    types = {type(s) for s in by_string.kv_layers if s is not None}
    assert types <= {expected_full, SlidingLayer}  # the model's own sliding layers in order (the window less one)
    # Behaviour agrees too: same content, memory and capacity after the same appends.
    g = torch.Generator().manual_seed(0)
    for layer_a, layer_b in zip(by_string.kv_layers, by_keywords.kv_layers):
        for tokens in (5, 1, 1, 20):
            k = torch.randn(1, 2, tokens, 16, generator=g)
            v = torch.randn(1, 2, tokens, 16, generator=g)
            out_a, out_b = layer_a.update(k, v), layer_b.update(k, v)
            assert torch.equal(out_a[0], out_b[0]) and torch.equal(out_a[1], out_b[1])
        assert (layer_a.capacity, layer_a.nbytes, layer_a.reallocations) == (
            layer_b.capacity,
            layer_b.nbytes,
            layer_b.reallocations,
        )


def test_make_cache_keyword_overrides_string():
    config = tiny_config("llama")
    cache = make_cache(config, "static:capacity=8", capacity=32)
    assert all(s.options() == {"capacity": 32} for s in cache.kv_layers)
    assert cache.spec == parse_spec("static:capacity=32")


def test_make_cache_rejects_bad_specs():
    config = tiny_config("llama")
    for text in ("dynamic", "static", "growable:capacity=3", "static:capacity"):
        with pytest.raises(SpecError):
            make_cache(config, text)


@pytest.mark.parametrize(
    "text",
    ["static:capacity=0", "static:capacity=-4", "growable:initial_capacity=0", "growable:growth=0.5"],
)
def test_make_cache_out_of_range_values_are_spec_errors(text):
    """A value of the right type but out of range is a bad spec value too."""
    with pytest.raises(SpecError) as info:
        make_cache(tiny_config("llama"), text)
    assert_lists_kinds(info)


def test_make_cache_static_buffers_keyword():
    config = tiny_config("llama")
    buffers = [(torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)) for _ in range(4)]
    cache = make_cache(config, "static", buffers=buffers)
    assert [s.capacity for s in cache.kv_layers] == [8] * 4
    k = torch.ones(1, 2, 3, 16)
    out_k, _ = cache.kv_layers[2].update(k, k)
    assert out_k.data_ptr() == buffers[2][0].data_ptr()
    with pytest.raises(SpecError):
        make_cache(config, "static", buffers=buffers[:3])
    assert isinstance(kvcache.SpecError("x"), ValueError)


# ---- the registry: one table of kinds; a kind from outside is one explicit call ----------------


def test_every_spec_kind_comes_from_the_registry_table():
    from kvcache.layers import registry

    kinds = registry.spec_kinds()
    assert list(kinds)[:4] == ["growable", "static", "window", "quantized"]
    assert {"h2o", "tova", "lastrec", "concat", "kvzip", "snapkv", "pyramidkv", "adakv", "tova-layer"} <= set(kinds)
    assert {kinds[k].layer.kind for k in ("h2o", "tova", "lastrec", "kvzip")} == {"evicting"}
    assert kinds["h2o"].fixed == {"policy": "h2o"}
    assert "sliding" in registry.LAYERS and "sliding" not in kinds  # placed by make_cache, never named by a spec
    for name, kind in kinds.items():
        assert registry.layer_class(kind.layer.kind) is kind.layer
        assert f"  {name}" in kvcache.hf.spec.valid_specs()


def test_defining_a_class_registers_nothing():
    from kvcache.layers import registry
    from kvcache.layers import ConcatLayer
    from kvcache.layers.policies import POLICIES, Policy

    type("Unlisted", (ConcatLayer,), {"kind": "unlisted-test"})
    type("UnlistedPolicy", (Policy,), {"name": "unlisted-policy-test", "initial": lambda self, positions: positions.float()})
    assert registry.layer_class("unlisted-test") is None and "unlisted-policy-test" not in POLICIES
    with pytest.raises(SpecError):
        parse_spec("unlisted-policy-test:budget=8")


def test_a_new_policy_is_one_class_and_one_call():
    from kvcache.layers import registry
    from kvcache.layers import EvictingLayer
    from kvcache.layers.policies import Policy

    class Oldest(Policy):  # keeps the oldest tokens: the smallest score leaves first
        name = "oldest-test"

        def initial(self, positions):
            return -positions.to(torch.float32)

    registry.register_policy(Oldest)
    try:
        spec = parse_spec("oldest-test:budget=8,sinks=1")
        assert spec.options == {"budget": 8, "sinks": 1}
        cache = make_cache(tiny_config("llama"), spec)
        assert all(isinstance(s, EvictingLayer) and s.policy.name == "oldest-test" for s in cache.kv_layers)
        assert "oldest-test (options: budget=<number>" in kvcache.hf.spec.valid_specs()
        impostor = type("Impostor", (Policy,), {"name": "oldest-test", "initial": Oldest.initial})
        with pytest.raises(TypeError, match="already registered"):
            registry.register_policy(impostor)
        with pytest.raises(TypeError, match="already a cache kind"):
            registry.register_policy(type("Clash", (Policy,), {"name": "growable", "initial": Oldest.initial}))
    finally:
        registry.unregister_policy("oldest-test")
    with pytest.raises(SpecError):
        parse_spec("oldest-test:budget=8")
    with pytest.raises(ValueError, match="built in"):
        registry.unregister_policy("h2o")


def test_a_new_layer_kind_is_one_class_and_one_call():
    from kvcache.layers import registry
    from kvcache.layers import ConcatLayer
    from kvcache.layers.options import Option

    class CappedConcat(ConcatLayer):
        kind = "capped-test"
        spec_options = {"cap": Option(int, least=2)}
        required_options = ("cap",)

        def __init__(self, cap: int) -> None:
            super().__init__()
            self.cap = cap

        def options(self):
            return {"cap": self.cap}

    registry.register_layer(CappedConcat)
    try:
        assert parse_spec("capped-test:cap=4").options == {"cap": 4}
        cache = make_cache(tiny_config("llama"), "capped-test", cap=4)
        assert all(type(s) is CappedConcat and s.cap == 4 for s in cache.kv_layers)
        for bad in ("capped-test", "capped-test:cap=1", "capped-test:cap=x", "capped-test:other=3"):
            with pytest.raises(SpecError) as info:
                parse_spec(bad)
            assert "capped-test (options: cap=<int>)" in str(info.value)
        with pytest.raises(TypeError, match="already registered"):
            registry.register_layer(type("Impostor", (ConcatLayer,), {"kind": "capped-test"}))
    finally:
        registry.unregister_layer("capped-test")
    with pytest.raises(SpecError):
        parse_spec("capped-test:cap=4")
    with pytest.raises(ValueError, match="built in"):
        registry.unregister_layer("growable")


@pytest.mark.parametrize(
    "text, error",
    [
        ("h2o:budget=0", "> 0"),
        ("h2o", "needs option budget"),
        ("window:window=0", ">= 1"),
        ("growable:growth=1", "> 1.0"),
        ("quantized:group_size=0", ">= 1"),
        ("static:capacity=inf", "int"),
        ("growable:growth=nan", "finite"),
    ],
)
def test_declared_bounds_and_requirements_are_spec_errors(text, error):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert error in str(info.value)
    assert_lists_kinds(info)


def test_eviction_specs_round_trip():
    for text in ("h2o:budget=1024", "tova:budget=0.25,recent=4", "lastrec:budget=16,sinks=2,storage=int4"):
        spec = parse_spec(text)
        assert str(spec) == text and parse_spec(str(spec)) == spec
