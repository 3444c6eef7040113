"""An eviction layer's coded slots (``layers/slots.py``: keys and values quantized per token in
groups of channels) read straight from their codes: the coded library's per-token key scores
(``fused.token_key_scores``) and one-pass decode (``fused.token_decode_attention``) against PyTorch
over the dequantized slots (``quant.dequantize_per_token``, the reference); the ``SlotCodesReader``
an update that fits the store hands the attention, whose fallback blocks are ``view()``'s numbers;
and generation through it with the library on and off.

Tolerances. Scores: ``helpers.CODED_TOL``. The library and the reference compute from the
same codes but in another order: the reference dequantizes (``codes * scale + minimum``,
rounded per element) and then sums D products in float32; the library sums ``scale * (q . codes)``
per group and adds ``minimum * sum(q)``, and on x86, for keys with one group a token, takes
``q . codes`` in 16-bit integers, the query rounded against its largest channel
(``test_coded_dots.py`` checks that bound): scores up to ~8 move by up to ~2e-4 (elsewhere float32
rounding, ~5e-6). Outputs and log-sum-exps: ``helpers.CODED_TOL`` (as in
``test_fused_coded_decode.py``): an output is a convex combination of values up to ~4, moved by the
scores' error times a weight, by the polynomial ``exp`` (relative error ~1e-7) and by the library's
16-bit rounding of ``weights * scale`` on x86 (``test_coded_dots.py``). A wrong code, group, scale, minimum, token or chunk merge moves a score
or an output by at least a quantization step (>= 1e-2 at 8 bits), far beyond them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcache
from kvcache import cache_kwargs
from helpers import CODED_TOL, attention_for, model_for, prompt
from kvcache.attention import fused
from kvcache.attention.fused import MAX_ROWS
from kvcache.attention.native_build import DISABLE_ENV
from kvcache.layers import EvictingLayer
from kvcache.layers.checks import Geometry
from kvcache.formats import Codes
from kvcache.layers.slots import SlotCodesReader, Slots

#: (head dim, channels a group): the fast paths (64 and 128 with groups of 16-byte multiples) and
#: the plain loops (96; and 4/2-bit groups under 16 bytes, e.g. 32 channels at 2 bits).
DIMS = [(64, 64), (64, 32), (128, 64), (128, 32), (96, 32)]
#: Tokens: a multiple of no chunk (256), tile (512) or run of 16 sums.
T = 1337


@pytest.fixture(autouse=True)
def needs_library(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    if fused.library() is None:
        pytest.skip("the coded decode library cannot build here (no C++ compiler?)")


def coded_slots(bits, dim, group, tokens, *, batch=2, heads=3, value_dim=None, spare=7, dtype=torch.float32, seed=0):
    """``Slots`` of ``Codes``: tensors of ``tokens + spare`` slots (a store's whole buffers, more than are read)
    and the geometry of their keys and values."""
    gen = torch.Generator().manual_seed(seed)
    value_dim = value_dim or dim
    keys = torch.randn(batch, heads, tokens + spare, dim, generator=gen).to(dtype)
    values = torch.randn(batch, heads, tokens + spare, value_dim, generator=gen).to(dtype)
    codec = Slots(Codes(bits, group))
    g = Geometry(batch, heads, dim, value_dim, dtype, torch.device("cpu"))
    return codec, codec.encode(keys, values), g


def dequantized(codec, slots, tokens, g):
    """The reference keys and values of the first ``tokens`` slots, float32."""
    k, v = codec.decode(slots, tokens, g)
    return k.float(), v.float()


def parts(slots, prefix):
    return tuple(slots[prefix + part] for part in ("codes", "scale", "min"))


def rows(batch, heads, r, dim, seed=1):
    return torch.randn(batch, heads, r, dim, generator=torch.Generator().manual_seed(seed))


def reference_attention(q, keys, values, scale, softcap=None):
    """softmax(scale * q k^T, capped) v and each row's log-sum-exp, float32."""
    scores = q @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores, dim=-1) @ values, torch.logsumexp(scores, dim=-1)


# ---- the library against PyTorch over the dequantized slots ----------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim,group", DIMS)
@pytest.mark.parametrize("r", [1, 3, 4, 7, MAX_ROWS])
def test_key_scores_match_the_dequantized_keys(bits, dim, group, r):
    codec, slots, g = coded_slots(bits, dim, group, T)
    keys, _ = dequantized(codec, slots, T, g)
    q = rows(2, 3, r, dim) * dim**-0.5
    scores = fused.token_key_scores(q, *parts(slots, "k"), bits, group, T)
    assert scores.shape == (2, 3, r, T) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, q @ keys.transpose(-1, -2), **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim,group", DIMS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_one_pass_decode_matches_softmax_over_the_dequantized_slots(bits, dim, group, softcap):
    codec, slots, g = coded_slots(bits, dim, group, T)
    keys, values = dequantized(codec, slots, T, g)
    for r in (1, 5, MAX_ROWS):
        q = rows(2, 3, r, dim, seed=r)
        out, lse = fused.token_decode_attention(q, parts(slots, "k"), parts(slots, "v"), bits, T, group, group, 0.3, softcap)
        ref_out, ref_lse = reference_attention(q, keys, values, 0.3, softcap)
        torch.testing.assert_close(out, ref_out, **CODED_TOL)
        torch.testing.assert_close(lse, ref_lse, **CODED_TOL)


@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 256, 513])
def test_short_and_odd_lengths(tokens):
    codec, slots, g = coded_slots(4, 128, 64, tokens)
    keys, values = dequantized(codec, slots, tokens, g)
    q = rows(2, 3, 4, 128)
    scores = fused.token_key_scores(q, *parts(slots, "k"), 4, 64, tokens)
    torch.testing.assert_close(scores, q @ keys.transpose(-1, -2), **CODED_TOL)
    out, lse = fused.token_decode_attention(q, parts(slots, "k"), parts(slots, "v"), 4, tokens, 64, 64, 0.1)
    ref_out, ref_lse = reference_attention(q, keys, values, 0.1)
    torch.testing.assert_close(out, ref_out, **CODED_TOL)
    torch.testing.assert_close(lse, ref_lse, **CODED_TOL)


def test_values_of_another_width_and_group():
    """Keys and values need not share a head dim (nor, then, a group size)."""
    codec, slots, g = coded_slots(8, 64, 32, T, value_dim=128)
    keys, values = dequantized(codec, slots, T, g)
    q = rows(2, 3, 6, 64)
    out, lse = fused.token_decode_attention(q, parts(slots, "k"), parts(slots, "v"), 8, T, 32, 32, 0.125)
    ref_out, ref_lse = reference_attention(q, keys, values, 0.125)
    assert out.shape == (2, 3, 6, 128)
    torch.testing.assert_close(out, ref_out, **CODED_TOL)
    torch.testing.assert_close(lse, ref_lse, **CODED_TOL)


def test_only_the_first_tokens_are_read():
    """Slots past ``tokens`` (a store's spare room) never reach a score or an output."""
    codec, slots, g = coded_slots(4, 64, 32, 100, spare=30)
    for name in ("kscale", "kmin", "vscale", "vmin"):
        slots[name][:, :, 100:] = float("nan")
    q = rows(2, 3, 4, 64)
    assert torch.isfinite(fused.token_key_scores(q, *parts(slots, "k"), 4, 32, 100)).all()
    out, lse = fused.token_decode_attention(q, parts(slots, "k"), parts(slots, "v"), 4, 100, 32, 32, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_scales_in_the_model_dtype_are_read_as_float32():
    """bfloat16 scales and minimums (a bfloat16 model's slots) are widened, not declined: the result is
    the float32 attention over the same codes and widened scales."""
    codec, slots, g = coded_slots(4, 64, 64, 300, dtype=torch.bfloat16)
    assert slots["kscale"].dtype == torch.bfloat16
    keys, values = dequantized(codec, slots, 300, replace(g, dtype=torch.float32))  # codes * widened scale + minimum
    q = rows(2, 3, 4, 64)
    out, lse = fused.token_decode_attention(q, parts(slots, "k"), parts(slots, "v"), 4, 300, 64, 64, 0.125)
    ref_out, ref_lse = reference_attention(q, keys, values, 0.125)
    torch.testing.assert_close(out, ref_out, **CODED_TOL)
    torch.testing.assert_close(lse, ref_lse, **CODED_TOL)


def test_declines(monkeypatch):
    codec, slots, g = coded_slots(4, 64, 32, 50)
    keys, values = parts(slots, "k"), parts(slots, "v")
    q = rows(2, 3, 4, 64)
    assert fused.token_key_scores(q, *keys, 4, 32, 0).shape == (2, 3, 4, 0)  # no tokens: no scores
    assert fused.token_decode_attention(q, keys, values, 4, 0, 32, 32, 0.1) is None  # no tokens: nothing to attend
    too_many = rows(2, 3, MAX_ROWS + 1, 64)
    assert fused.token_key_scores(too_many, *keys, 4, 32, 50) is None
    assert fused.token_decode_attention(too_many, keys, values, 4, 50, 32, 32, 0.1) is None
    assert fused.token_key_scores(q, *keys, 4, 32, 58) is None  # more tokens than slots
    assert fused.token_key_scores(q, *keys, 4, 64, 50) is None  # a group the scales do not have
    assert fused.token_key_scores(q, *keys, 8, 32, 50) is None  # codes of another width
    needs_grad = q.clone().requires_grad_()
    assert fused.token_key_scores(needs_grad, *keys, 4, 32, 50) is None
    assert fused.token_decode_attention(needs_grad, keys, values, 4, 50, 32, 32, 0.1) is None
    with torch.no_grad():
        assert fused.token_decode_attention(needs_grad, keys, values, 4, 50, 32, 32, 0.1) is not None
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert fused.token_key_scores(q, *keys, 4, 32, 50) is None
    assert fused.token_decode_attention(q, keys, values, 4, 50, 32, 32, 0.1) is None


# ---- the reader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_reader_blocks_are_the_dequantized_view(bits):
    codec, slots, g = coded_slots(bits, 64, 32, 45)
    reader = SlotCodesReader(slots, 45, g, codec, block=8)
    keys, values = codec.decode(slots, 45, g)
    assert reader.shape == keys.shape and reader.value_shape == values.shape and reader.dtype == torch.float32
    assert [b.shape[2] for b in reader.key_blocks()] == [8, 8, 8, 8, 8, 5]
    assert torch.equal(torch.cat(list(reader.key_blocks()), dim=2), keys)
    assert torch.equal(torch.cat(list(reader.value_blocks()), dim=2), values)


def filled_layer(spec_policy, storage, *, budget=40, prompt_len=70, dim=64, batch=2, heads=2, **options):
    """An evicting layer after a prompt that overflowed it and a decode step that fitted (pending)."""
    gen = torch.Generator().manual_seed(3)
    layer = EvictingLayer(budget, policy=spec_policy, storage=storage, **options)
    k, v = (torch.randn(batch, heads, prompt_len + 1, dim, generator=gen) for _ in range(2))
    layer.update(k[:, :, :-1], v[:, :, :-1])
    layer.settle()
    layer.update(k[:, :, -1:], v[:, :, -1:])
    return layer


def test_a_decode_step_over_coded_slots_reads_the_codes():
    coded = filled_layer("snapkv", "int4", window=8)
    reads = coded.pending
    assert isinstance(reads.keys, SlotCodesReader) and reads.values is None
    assert reads.keys.shape[2] == coded.length == 41
    # The model is handed the step's own key and value (``_fitted_view``): no slot is dequantized.
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 2, 71, 64, generator=gen) for _ in range(2))
    assert torch.equal(reads.returned[0], k[:, :, -1:]) and torch.equal(reads.returned[1], v[:, :, -1:])
    full = filled_layer("snapkv", "full", window=8)
    assert isinstance(full.pending.keys, torch.Tensor)


def test_an_update_that_overflows_reads_full_precision():
    layer = EvictingLayer(40, policy="h2o", storage="int8")
    k = torch.randn(1, 2, 70, 64)
    reads = layer.append(k, k)
    assert isinstance(reads.keys, torch.Tensor) and reads.keys.shape[2] == 70


class Spy:
    """Counts the calls of ``fused``'s per-token functions that returned a result."""

    def __init__(self, monkeypatch):
        self.calls = {}
        for name in ("token_key_scores", "token_decode_attention", "weighted_values"):
            monkeypatch.setattr(fused, name, self._counted(name, getattr(fused, name)))

    def _counted(self, name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out is not None:
                self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return call


@pytest.mark.parametrize(
    "policy,options,fused_calls",
    [
        ("snapkv", {"window": 8}, {"token_decode_attention": 1}),  # no weights asked: one pass
        ("h2o", {}, {"token_key_scores": 1, "weighted_values": 1}),  # weights asked: the two products
    ],
)
@pytest.mark.parametrize("storage", ["int8", "int4", "int2", "int8h", "int4h", "int2h", "fp8"])
def test_layer_attention_over_the_codes_matches_the_dequantized_slots(monkeypatch, policy, options, fused_calls, storage):
    layer = filled_layer(policy, storage, **options)
    keys, values = (t.repeat_interleave(2, dim=1) for t in layer.view())
    query = rows(2, 4, 1, 64)  # 4 query heads on 2 KV heads
    ref_out, _ = reference_attention(query, keys, values, 0.125)
    spy = Spy(monkeypatch)
    out = layer.attend(query)
    assert spy.calls == fused_calls
    torch.testing.assert_close(out, ref_out, **CODED_TOL)


@pytest.mark.parametrize("storage", ["int8", "int4h"])
def test_sinks_over_the_codes_take_the_one_pass(monkeypatch, storage):
    """Attention sinks (one logit per query head) join the one pass over the codes through its
    log-sum-exp: equal to the softmax with each head's sink as one more logit, written out."""
    layer = filled_layer("snapkv", storage, window=8)
    keys, values = (t.repeat_interleave(2, dim=1) for t in layer.view())
    query = rows(2, 4, 1, 64)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9))
    scores = query @ keys.transpose(-1, -2) * 0.125
    weights = torch.softmax(torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 1, 1)], dim=-1), dim=-1)
    spy = Spy(monkeypatch)
    out = layer.attend(query, sinks=sinks)
    assert spy.calls == {"token_decode_attention": 1}
    torch.testing.assert_close(out, weights[..., :-1] @ values, **CODED_TOL)


@pytest.mark.parametrize("storage", ["int4", "int4h"])
def test_layer_attention_with_the_library_off(monkeypatch, storage):
    layer = filled_layer("h2o", storage)
    query = rows(2, 4, 1, 64)
    keys, values = (t.repeat_interleave(2, dim=1) for t in layer.view())
    monkeypatch.setenv(DISABLE_ENV, "1")
    torch.testing.assert_close(layer.attend(query), reference_attention(query, keys, values, 0.125)[0], **CODED_TOL)


# ---- generation -----------------------------------------------------------------------------------

#: Prompt past the budget (the prefill overflows and evicts), then decode steps that fit and evict.
PROMPT_LEN, NEW_TOKENS = 60, 24


def decode_logits(model, spec):
    """Greedy decoding of a fixed prompt with a fresh ``spec`` cache: the tokens and each step's logits."""
    cache = kvcache.make_cache(model, spec)
    ids = prompt(PROMPT_LEN, seed=5)
    with torch.no_grad(), attention_for(model, cache):
        out = model.generate(
            ids, **cache_kwargs(model, cache), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize(
    "spec,read_by",
    [("snapkv:budget=40,storage=int4", "token_decode_attention"), ("h2o:budget=40,storage=int8", "token_key_scores"),
     ("snapkv:budget=40,storage=int4h", "token_decode_attention"), ("snapkv:budget=40,storage=fp8", "token_decode_attention")],
)
def test_generation_with_the_library_on_and_off(monkeypatch, spec, read_by):
    """The same tokens either way; the logits within the tiny models' float32 tolerance (``helpers``:
    the two paths sum the same products in another order, 1e-4 after four layers and the head)."""
    model = model_for("llama")
    spy = Spy(monkeypatch)
    fused_tokens, fused_logits = decode_logits(model, spec)
    # Every decode step (the prompt's pass overflows the budget) of every layer read the codes.
    assert spy.calls[read_by] == (NEW_TOKENS - 1) * model.config.num_hidden_layers
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain_tokens, plain_logits = decode_logits(model, spec)
    assert torch.equal(fused_tokens, plain_tokens)
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-4, atol=1e-4)
