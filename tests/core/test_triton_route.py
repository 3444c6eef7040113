"""Calls reach the Triton kernel through ``attention.device_kernels``, the one place a decode step's
kernels are chosen: with that choice turned to Triton for CPU tensors (its interpreter runs them),
a model's decode over views, an evicting layer's coded slots and the engine's float and coded
pools give the tokens the C++ kernels give (greedy, tiny models), and each way in is taken.

Skipped, with the reason, where Triton or its interpreter is not there."""

from __future__ import annotations

import pytest
import torch
from helpers import model_for, prompt

import kvcache
from kvcache import Engine
from kvcache.attention import device_kernels, triton_decode

pytestmark = [
    pytest.mark.skipif(not triton_decode.available(), reason="triton is not installed (pip install kvcache[triton])"),
    pytest.mark.skipif(not triton_decode.interpreting(), reason="TRITON_INTERPRET is not 1"),
]
NEW = 6
#: Decoder layers of the tiny Llama here: Triton's interpreter runs each layer's kernels in Python,
#: so two cost about half of the shared models' four, and a layer still feeds the next.
LAYERS = 2


@pytest.fixture
def through_triton(monkeypatch):
    """Route CPU tensors to Triton, counting the calls of each way in."""
    calls: dict[str, int] = {}
    monkeypatch.setattr(device_kernels, "kernels_for", lambda device: "triton")
    for name in ("decode_views", "paged_decode", "paged_coded_decode", "token_coded_decode", "quantized_decode"):
        real = getattr(triton_decode, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            got = _real(*args, **kwargs)
            calls[_name] = calls.get(_name, 0) + (got is not None)
            return got

        monkeypatch.setattr(triton_decode, name, counted)
    return calls


def generated(model, spec: str, ids: torch.Tensor) -> list[int]:
    cache = kvcache.make_cache(model, spec)
    with kvcache.use_kvcache_attention(model):
        out = model.generate(ids, **kvcache.cache_kwargs(model, cache), max_new_tokens=NEW, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    ("spec", "way"),
    [
        ("lastrec:budget=24,storage=int8", "token_coded_decode"),
        ("lastrec:budget=24,storage=int4h", "token_coded_decode"),
        ("window:window=16,sinks=2", "decode_views"),
        ("quantized:bits=4,group_size=8,residual=4", "quantized_decode"),
    ],
)
def test_generate_through_triton_gives_the_native_tokens(through_triton, spec, way):
    model, ids = model_for("llama", num_hidden_layers=LAYERS), prompt(40, seed=3)
    with pytest.MonkeyPatch.context() as native_route:
        native_route.setattr(device_kernels, "kernels_for", lambda device: "native")
        expected = generated(model, spec, ids)
    assert generated(model, spec, ids) == expected
    assert through_triton.get(way, 0) > 0, f"{way} never ran: {through_triton}"


@pytest.mark.parametrize(("spec", "way"), [("growable", "paged_decode"), ("quantized:bits=8", "paged_coded_decode")])
def test_the_engine_through_triton_gives_the_native_tokens(through_triton, spec, way):
    model = model_for("llama", num_hidden_layers=LAYERS)
    prompts = [prompt(n, seed=n).tolist()[0] for n in (19, 33, 8)]

    def run() -> list[list[int]]:
        engine = Engine(model, spec, block_size=8, blocks=64, max_seqs=4)
        handles = [engine.submit(p, max_new_tokens=NEW) for p in prompts]
        while engine.step():
            pass
        return [h.result() for h in handles]

    with pytest.MonkeyPatch.context() as native_route:
        native_route.setattr(device_kernels, "kernels_for", lambda device: "native")
        expected = run()
    assert run() == expected
    assert through_triton.get(way, 0) > 0, f"{way} never ran: {through_triton}"


# ---- on a CUDA device (tools/gpu_check.sh) -----------------------------------------------------------


def on_cuda(model):
    if not torch.cuda.is_available() or triton_decode.interpreting():
        pytest.skip("no CUDA device (or Triton's interpreter is on): tools/gpu_check.sh runs these on a lent GPU")
    import copy

    return copy.deepcopy(model).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["growable", "window:window=16,sinks=2", "lastrec:budget=24,storage=int8", "quantized:bits=8"])
def test_generate_on_cuda_gives_the_cpu_tokens(spec):
    model = model_for("llama", num_hidden_layers=LAYERS)
    gpu = on_cuda(model)
    ids = prompt(40, seed=5)
    assert generated(gpu, spec, ids.cuda()) == generated(model, spec, ids)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["growable", "quantized:bits=8"])
def test_the_engine_on_cuda_gives_the_cpu_tokens(spec):
    model = model_for("llama", num_hidden_layers=LAYERS)
    gpu = on_cuda(model)
    prompts = [prompt(n, seed=n).tolist()[0] for n in (19, 33, 8)]

    def run(m) -> list[list[int]]:
        engine = Engine(m, spec, block_size=8, blocks=64, max_seqs=4)
        handles = [engine.submit(p, max_new_tokens=NEW) for p in prompts]
        while engine.step():
            pass
        return [h.result() for h in handles]

    assert run(gpu) == run(model)


def test_sinks_over_a_quantized_store_through_triton(through_triton):
    """Attention sinks (one logit per query head) over a quantized layer routed to Triton: its one
    call returns each row's log-sum-exp, so the sinks join it, equal to the blockwise path."""
    from kvcache.attention import attend_weighted
    from kvcache.layers import QuantizedLayer, StoreReader

    g = torch.Generator().manual_seed(2)
    layer = QuantizedLayer(bits=4, group_size=8, residual=4)
    layer.update(torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g))
    layer.settle()
    query, sinks = torch.randn(1, 4, 1, 32, generator=g), torch.randn(4, generator=g)
    out, _ = attend_weighted(query, StoreReader(layer), None, sinks=sinks)
    assert through_triton == {"quantized_decode": 1}
    keys, values = (t.repeat_interleave(2, dim=1) for t in layer.view())
    scores = query @ keys.transpose(-1, -2) / 32**0.5
    weights = torch.softmax(torch.cat([scores, sinks.view(1, 4, 1, 1)], dim=-1), dim=-1)
    torch.testing.assert_close(out, weights[..., :-1] @ values, rtol=1e-5, atol=1e-5)
