"""fp8 (e4m3) codes (``formats/fp8.py``; ``Codes(8, fp8=True)``): their coding against its bound,
and every reader of them against PyTorch over the dequantized keys and values: the coded library's
fp8 build (``coded_decode.cpp`` with ``KV_FP8``: the quantized layer's blocks, an evicting layer's
``storage=fp8`` slots, the engine's paged blocks) and the Triton kernel in its interpreter.

Tolerances. The C++ library: ``helpers.CODED_TOL``, as for the integer codes, though the fp8 build
has no 16-bit integer products (e4m3 values are not small integers): it widens each byte to its
float in registers (vcvtph2ps from a float16 made of the byte's bits, or a table of the 256
values) and sums float32 products, so its scores differ from the reference's by float32 rounding
(~1e-5). Triton: ``1e-5`` as in ``test_triton_decode.py``. A byte read as the wrong value moves a
score by at least e4m3's spacing times the scale (>= 1e-3 of a group's range), a wrong scale or
midpoint by far more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import CODED_TOL
from kvcache.attention import attend_weighted, fused, fused_paged
from kvcache.attention import triton_decode as td
from kvcache.attention.native_build import DISABLE_ENV
from kvcache.formats import Codes, format_named
from kvcache.formats import fp8
from kvcache.layers.quantized import QuantizedLayer, StoreReader
from kvcache.layers.slots import Slots

TRITON_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def library(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    lib = fused.library(fp8=True)
    if lib is None:
        pytest.skip("the coded decode library cannot build here (no C++ compiler?)")
    return lib


def gen(seed):
    return torch.Generator().manual_seed(seed)


def skewed(*shape, seed=0):
    """Values with channels of their own spread and offset (a wrong channel's scale or midpoint shows)."""
    g = gen(seed)
    spread, offset = torch.rand(shape[-1], generator=g) * 2.5 + 0.5, torch.randn(shape[-1], generator=g) * 2
    return torch.randn(*shape, generator=g) * spread + offset


# ---- the coding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["per token", "per channel"])
def test_coding_stays_within_its_bound_and_the_bound_is_tight(dtype, layout):
    x = skewed(3, 4, 64, 64).to(dtype)
    if layout == "per token":
        q = fp8.quantize_per_token(x, 32)
        err = (fp8.dequantize_per_token(q, 32).float() - x.float()).abs().reshape(3, 4, 64, 2, 32).amax(-1)
    else:
        q = fp8.quantize_per_channel(x)
        err = (fp8.dequantize_per_channel(q).float() - x.float()).abs().amax(-2, keepdim=True)
    bound = fp8.error_bound(q, dtype)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.5  # a bound far above the errors would let a wrong coder through


def test_the_midpoint_and_scale_cover_each_group_and_no_code_is_nan():
    x = torch.tensor([[[-3.0, 5.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]])  # a spread group, a constant one
    q = fp8.quantize_per_token(x, 4)
    assert q.minimum.flatten().tolist() == [1.0, 2.0]
    assert float(q.scale[0, 0, 0]) * fp8.E4M3_MAX >= 4.0 and float(q.scale[0, 1, 0]) == 0.0
    assert not bool(((q.codes & 0x7F) == 0x7F).any())  # 0x7f / 0xff are e4m3's NaNs
    back = fp8.dequantize_per_token(q, 4)
    assert back[0, 1].tolist() == [2.0] * 4  # a constant group is exact
    assert back[0, 0, 0] == -3.0 and back[0, 0, 1] == 5.0  # the extremes are +-448: codes of their own


def test_the_format_refuses_other_widths_and_names_itself():
    with pytest.raises(ValueError, match="fp8 codes are 8 bits"):
        Codes(4, 64, fp8=True)
    f = format_named("fp8", 32)
    assert (f.name, f.bits, f.fp8, f.key_block) == ("fp8", 8, True, 1)
    assert f.bytes_per_token(64, 64, torch.float32) == Codes(8, 32).bytes_per_token(64, 64, torch.float32)


# ---- the C++ library -------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 128, 96])  # the fast paths, and the plain loops
def test_every_byte_reads_as_torchs_e4m3(library, dim):
    """One-hot query rows against per-token keys of scale 1 and midpoint 0: each score is one
    code's value. Every byte but the two NaNs appears in the 16 channels read."""
    tokens = 32
    values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.zeros(1, 1, tokens, dim, dtype=torch.uint8)
    channels = torch.arange(16) * (dim // 16)
    flat = values.repeat(3)[: 16 * tokens]
    codes[0, 0][:, channels] = flat.reshape(tokens, 16)
    scale, mid = torch.ones(1, 1, tokens, 1), torch.zeros(1, 1, tokens, 1)
    q = torch.zeros(1, 1, 16, dim)
    q[0, 0, torch.arange(16), channels] = 1.0
    scores = fused.token_key_scores(q, codes, scale, mid, 8, dim, tokens, fp8=True)
    expected = codes[0, 0][:, channels].view(torch.float8_e4m3fn).float().T
    assert torch.equal(scores[0, 0], expected)


def test_the_fp8_build_declines_other_widths(library):
    q, codes = torch.randn(1, 1, 1, 64), torch.zeros(1, 1, 4, 32, dtype=torch.uint8)
    scale = torch.ones(1, 1, 4, 1)
    assert fused.token_key_scores(q, codes, scale, scale, 4, 64, 4, fp8=True) is None


def filled(batch, heads, seen, dim, *, group_size=32, residual=8, dtype=torch.float32, seed=0):
    """An fp8 quantized layer after a prefill of all but one token and a decode step."""
    keys, values = skewed(batch, heads, seen, dim, seed=seed).to(dtype), skewed(batch, heads, seen, dim, seed=seed + 1).to(dtype)
    layer = QuantizedLayer(group_size=group_size, residual=residual, codes="fp8")
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    layer.settle()
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    return layer


def sdpa_over_view(query, layer, scale=None):
    keys, values = layer.view()
    return F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), scale=scale, enable_gqa=True)


@pytest.mark.parametrize("dim", [64, 128, 96])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("residual", "seen"), [(0, 128), (8, 8 + 96), (8, 333)])
def test_a_quantized_layers_step_in_one_call_matches_sdpa_over_its_view(library, monkeypatch, dim, group, residual, seen):
    layer = filled(2, 2, seen, dim, residual=residual)
    assert layer.bits == 8 and layer.codes.format.fp8
    query = torch.randn(2, 2 * group, 1, dim, generator=gen(5))
    calls = []
    real = fused.decode_attention
    monkeypatch.setattr(fused, "decode_attention", lambda *a, **k: calls.append(k.get("fp8")) or real(*a, **k))
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls == [True]
    torch.testing.assert_close(out, sdpa_over_view(query, layer), **CODED_TOL)


def test_the_two_products_match_the_dequantized_view(library):
    layer = filled(1, 2, 200, 64)
    reader, query = StoreReader(layer), torch.randn(1, 2, 3, 64, generator=gen(6))
    keys, values = layer.view()
    torch.testing.assert_close(reader.decode_scores(query), query @ keys.transpose(-1, -2), **CODED_TOL)
    weights = torch.softmax(query @ keys.transpose(-1, -2), dim=-1)
    torch.testing.assert_close(reader.decode_values(weights), weights @ values, **CODED_TOL)


def test_a_bfloat16_layer(library):
    layer = filled(1, 2, 150, 64, dtype=torch.bfloat16)
    query = torch.randn(1, 4, 1, 64, generator=gen(7)).to(torch.bfloat16)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    torch.testing.assert_close(out.float(), sdpa_over_view(query, layer), rtol=1e-2, atol=1e-2)  # bf16 output


@pytest.mark.parametrize(("dim", "group"), [(64, 64), (128, 32), (96, 32)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_slots_in_one_pass_match_softmax_over_the_dequantized_slots(library, dim, group, softcap):
    codec = Slots(format_named("fp8", group))
    keys, values = skewed(2, 3, 700, dim, seed=8), skewed(2, 3, 700, dim, seed=9)
    slots = codec.encode(keys, values)
    tokens = 650  # fewer than the slots: only the first are read
    q = torch.randn(2, 3, 4, dim, generator=gen(10))
    out, lse = fused.token_decode_attention(
        q, tuple(slots["k" + p] for p in ("codes", "scale", "min")), tuple(slots["v" + p] for p in ("codes", "scale", "min")),
        8, tokens, group, group, 0.1, softcap, fp8=True,
    )  # fmt: skip
    rk = codec.format.decode_keys({n: t[:, :, :tokens] for n, t in slots.items() if n.startswith("k")})
    rv = codec.format.decode_values({n: t[:, :, :tokens] for n, t in slots.items() if n.startswith("v")})
    scores = q @ rk.transpose(-1, -2) * 0.1
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ rv, **CODED_TOL)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **CODED_TOL)


def paged_pool(blocks, heads, bs, dim, value_group, seed=11):
    """fp8 blocks ``[NB, Hkv, bs, ...]`` (keys per channel over a block, values per token) and their
    reference dequantization."""
    f = Codes(8, value_group, key_block=bs, fp8=True)
    k, v = skewed(blocks, heads, bs, dim, seed=seed), skewed(blocks, heads, bs, dim, seed=seed + 1)
    kp, vp = f.encode_keys(k), f.encode_values(v)
    keys, values = (kp["kcodes"], kp["kscale"], kp["kmin"]), (vp["vcodes"], vp["vscale"], vp["vmin"])
    return keys, values, f.decode_keys(kp), f.decode_values(vp)


def paged_case(device="cpu"):
    bs, heads, dim, group = 16, 2, 64, 32
    keys, values, ref_k, ref_v = paged_pool(24, heads, bs, dim, group)
    g = gen(12)
    tails_k, tails_v = torch.randn(4, heads, bs, dim, generator=g), torch.randn(4, heads, bs, dim, generator=g)
    coded, tail_len, tail_blk = [0, bs, 3 * bs, 18 * bs], [5, 0, bs, 1], [2, 0, 3, 1]
    order = torch.randperm(24, generator=g).tolist()
    tables, at = [], 0
    for n in coded:
        tables.append(order[at : at + n // bs] or [0])
        at += n // bs
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(4, heads, 3, dim, generator=g)
    args = (q, keys, values, 8, group, table, torch.tensor(coded), tails_k, tails_v, torch.tensor(tail_blk, dtype=torch.int32),
            torch.tensor(tail_len), 0.2)  # fmt: skip
    expected = []
    for s in range(4):
        blocks = tables[s][: coded[s] // bs]
        k = torch.cat([*(ref_k[b] for b in blocks), tails_k[tail_blk[s], :, : tail_len[s]]], dim=1)
        v = torch.cat([*(ref_v[b] for b in blocks), tails_v[tail_blk[s], :, : tail_len[s]]], dim=1)
        expected.append(F.scaled_dot_product_attention(q[s], k, v, scale=0.2))
    return args, torch.stack(expected)


def test_paged_blocks_match_sdpa_per_sequence(library):
    args, expected = paged_case()
    torch.testing.assert_close(fused_paged.paged_decode_attention(*args, fp8=True), expected, **CODED_TOL)


# ---- Triton, in its interpreter ----------------------------------------------------------------------


needs_interpreter = pytest.mark.skipif(
    not td.available() or not td.interpreting(), reason="triton is not installed, or TRITON_INTERPRET is not 1"
)


@needs_interpreter
def test_triton_reads_paged_fp8_blocks():
    args, expected = paged_case()
    torch.testing.assert_close(td.paged_coded_decode(*args, fp8=True), expected, **TRITON_TOL)


@needs_interpreter
def test_triton_reads_fp8_slots_and_gives_the_lse():
    codec = Slots(format_named("fp8", 32))
    slots = codec.encode(skewed(2, 2, 300, 64, seed=13), skewed(2, 2, 300, 32, seed=14))
    q = torch.randn(2, 2, 4, 64, generator=gen(15))
    out, lse = td.token_coded_decode(
        q, tuple(slots["k" + p] for p in ("codes", "scale", "min")), tuple(slots["v" + p] for p in ("codes", "scale", "min")),
        8, 280, 32, 32, 0.125, fp8=True,
    )  # fmt: skip
    rk = codec.format.decode_keys({n: t[:, :, :280] for n, t in slots.items() if n.startswith("k")})
    rv = codec.format.decode_values({n: t[:, :, :280] for n, t in slots.items() if n.startswith("v")})
    scores = q @ rk.transpose(-1, -2) * 0.125
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ rv, **TRITON_TOL)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TRITON_TOL)


@needs_interpreter
@pytest.mark.parametrize(("seen", "residual"), [(100, 8), (333, 0)])
def test_triton_takes_an_fp8_layers_whole_step(seen, residual):
    layer = filled(2, 2, seen, 32, group_size=16, residual=residual)
    codes = layer.codes
    k, v = codes.keys.tensors, codes.values.tensors
    q = torch.randn(2, 2, 3, 32, generator=gen(16))
    out, lse = td.quantized_decode(
        q, (k["kcodes"], k["kscale"], k["kmin"]), (v["vcodes"], v["vscale"], v["vmin"]), 8, layer.value_group,
        codes.quantized_keys, codes.quantized_values, codes.exact_keys, codes.exact_values, seen, 0.2, fp8=True,
    )  # fmt: skip
    rk, rv = layer.view()
    torch.testing.assert_close(out, sdpa_over_view(q, layer, scale=0.2), **TRITON_TOL)
    torch.testing.assert_close(lse, torch.logsumexp(q @ rk.transpose(-1, -2) * 0.2, dim=-1), **TRITON_TOL)


# ---- the layer's option, its state -------------------------------------------------------------------


def test_the_codes_option_and_its_errors():
    assert QuantizedLayer(codes="fp8").options()["codes"] == "fp8"
    assert "codes" not in QuantizedLayer(bits=8).options()  # int codes: the options as before
    with pytest.raises(ValueError, match="fp8 codes are 8 bits"):
        QuantizedLayer(bits=4, codes="fp8")
    with pytest.raises(ValueError, match="codes must be one of"):
        QuantizedLayer(codes="e5m2")


def test_a_state_loads_only_into_a_layer_of_its_own_codes():
    layer = filled(1, 2, 100, 64)
    state = layer.state()
    again = QuantizedLayer(group_size=32, residual=8, codes="fp8")
    again.load_state(state)
    assert all(torch.equal(a, b) for a, b in zip(again.view(), layer.view()))
    ints = QuantizedLayer(bits=8, group_size=32, residual=8)
    with pytest.raises(ValueError, match="state holds fp8 codes"):
        ints.load_state(state)
    with pytest.raises(ValueError, match="state holds int codes"):
        again.load_state(filled_int_state())


def test_specs_name_fp8_codes_and_refuse_what_they_cannot_be():
    from kvcache import Engine, make_cache

    from helpers import model_for

    model = model_for("llama")
    layer = make_cache(model, "quantized:codes=fp8,group_size=16").layers[0].layer
    assert layer.fp8 and layer.bits == 8
    with pytest.raises(ValueError, match="fp8 codes are 8 bits"):
        make_cache(model, "quantized:codes=fp8,bits=4")
    with pytest.raises(ValueError, match="codes must be one of"):
        Engine(model, "quantized:codes=e5m2", block_size=8, blocks=8)


@pytest.mark.usefixtures("library")
def test_generation_over_fp8_codes_with_the_library_on_and_off(monkeypatch):
    """A quantized layer's fp8 codes under ``generate``: the same tokens with the coded library and
    with the PyTorch path (blocks dequantized), the logits within the tiny models' float32 tolerance."""
    import kvcache
    from kvcache import cache_kwargs

    from helpers import attention_for, model_for, prompt

    model = model_for("llama")

    def run():
        cache = kvcache.make_cache(model, "quantized:codes=fp8,group_size=16,residual=4")
        with torch.no_grad(), attention_for(model, cache):
            out = model.generate(prompt(60, seed=5), **cache_kwargs(model, cache), max_new_tokens=16, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        return out.sequences, torch.stack(out.logits)

    calls = []
    real = fused.decode_attention
    monkeypatch.setattr(fused, "decode_attention", lambda *a, **k: calls.append(k.get("fp8")) or real(*a, **k))
    tokens, logits = run()
    assert calls and set(calls) == {True}
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain_tokens, plain_logits = run()
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)


def test_a_saved_fp8_cache_loads_as_fp8(tmp_path):
    import kvcache
    from kvcache import cache_kwargs

    from helpers import attention_for, model_for, prompt

    model = model_for("llama")
    cache = kvcache.make_cache(model, "quantized:codes=fp8,group_size=16,residual=4")
    with torch.no_grad(), attention_for(model, cache):
        model(prompt(50), **cache_kwargs(model, cache), use_cache=True)
    cache.save(tmp_path / "fp8.kvc")
    loaded = kvcache.load_cache(tmp_path / "fp8.kvc", model)
    for mine, theirs in zip(cache.layers, loaded.layers):
        assert theirs.layer.fp8 and theirs.layer.options() == mine.layer.options()
        assert all(torch.equal(a, b) for a, b in zip(theirs.layer.view(), mine.layer.view()))


def filled_int_state():
    layer = QuantizedLayer(bits=8, group_size=32, residual=8)
    layer.update(torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64))
    return layer.state()
