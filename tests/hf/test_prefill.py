"""Bounded prefill (``kvcache.prefill``, and ``generate(..., prefill_chunk_size=N)``) on tiny models.

References: Hugging Face's own attention (SDPA) over the whole prompt with an explicit 4-D boolean
mask written here in plain torch from each kind's rule (which keys a query sees when the prompt
comes in chunks), unchunked runs of the same cache kind, and ``DynamicCache``. Memory: every
layer's ``nbytes`` after every chunk, and (``Recorder``) every tensor the ops of a prefill create.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from helpers import LOGITS_TOL, Recorder, assert_same_tokens, hf_attention, left_padded, model_for, prompt
from kvcache.attention import kernel
from kvcache.layers import EvictingLayer, WindowLayer
from kvcache.layers.policies import POLICIES

PROMPT = 45
CHUNK = 8
NEW = 6

#: Each bounded kind with room for the whole run (prompt + new tokens): nothing is dropped.
#: What a policy's spec must say besides its budget (kvzip: which queries score, docs/kinds.md).
REQUIRED = {"kvzip": ",queries=prompt"}
ROOMY = ["window:window=64", "quantized:bits=8,residual=64", *(f"{name}:budget=64{REQUIRED.get(name, '')}" for name in sorted(POLICIES))]


def last_logits(model, ids, cache, **kwargs) -> torch.Tensor:
    with kvcache.use_kvcache_attention(model), torch.no_grad():
        return model(ids, **cache_kwargs(model, cache), use_cache=True, **kwargs).logits[:, -1]


def greedy(model, ids, cache, **kwargs) -> torch.Tensor:
    with kvcache.use_kvcache_attention(model):
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("spec", ["growable", *ROOMY])
def test_chunked_prefill_with_room_for_everything_equals_an_unchunked_one_token_for_token(spec):
    model = model_for("llama")
    ids = prompt(PROMPT, seed=3)
    whole = greedy(model, ids, kvcache.make_cache(model, spec))
    cache = kvcache.make_cache(model, spec)
    kvcache.prefill(model, ids[:, :-1], cache, chunk=CHUNK)
    assert cache.seen == PROMPT - 1
    assert_same_tokens(greedy(model, ids, cache), whole, f"{spec} chunked")
    with hf_attention(model):
        reference = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=NEW,
                                   do_sample=False)  # fmt: skip
    assert_same_tokens(whole, reference, spec)


def chunked_mask(length: int, chunk: int, visible) -> torch.Tensor:
    """``[1, 1, S, S]`` booleans: query ``q`` (in the chunk starting at ``q - q % chunk``) sees key
    ``k`` when ``visible(q, k, chunk_start)``."""
    q = torch.arange(length).view(-1, 1)
    k = torch.arange(length).view(1, -1)
    return visible(q, k, q - q % chunk).view(1, 1, length, length)


#: What a query sees with the prompt fed in chunks, per kind (k <= q always): a window sees its last
#: ``window`` positions and the sinks whatever the chunking; lastrec keeps the last ``budget``
#: tokens before the chunk, and the chunk sees those and its own tokens.
RULES = {
    "window:window=12,sinks=3": lambda q, k, c: (k <= q) & ((k > q - 12) | (k < 3)),
    "lastrec:budget=12": lambda q, k, c: (k <= q) & (k >= c - 12),
}


@pytest.mark.parametrize("chunk", [5, 16])
@pytest.mark.parametrize("spec", sorted(RULES))
def test_window_and_lastrec_chunked_prefill_equals_sdpa_with_the_rule_as_a_mask(spec, chunk):
    model = model_for("llama")
    ids = prompt(PROMPT, seed=4)
    cache = kvcache.make_cache(model, spec)
    got = kvcache.prefill(model, ids, cache, chunk=chunk)
    mask = chunked_mask(PROMPT, chunk, RULES[spec])
    with hf_attention(model), torch.no_grad():
        want = model(ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(got, want, **LOGITS_TOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The rule is not plain causal (what the full cache, or lastrec unchunked, sees): the reference can tell.
    assert not torch.allclose(got, last_logits(model, ids, kvcache.make_cache(model)), **LOGITS_TOL)


def slot_bytes(layer) -> int:
    """Bytes one slot of ``layer`` takes, over the batch and its KV heads: keys and values, plus an
    eviction layer's position (int64) and score (float32)."""
    g = layer.geometry
    kv = g.batch * g.heads * (g.key_dim + g.value_dim) * g.dtype.itemsize
    return kv + (g.batch * g.heads * (8 + 4) if isinstance(layer, EvictingLayer) else 0)


@pytest.mark.parametrize("spec", ["window:window=12,sinks=2", *(f"{name}:budget=12{REQUIRED.get(name, '')}" for name in sorted(POLICIES))])
def test_every_layer_holds_at_most_budget_plus_one_chunk_after_every_chunk(spec):
    model = model_for("llama")
    budget, chunk, length = 14 if spec.startswith("window") else 12, 10, 120
    cache = kvcache.make_cache(model, spec)
    seen_after = []

    def check(done: int) -> None:
        seen_after.append(done)
        for layer in cache.kv_layers:
            assert isinstance(layer, (EvictingLayer, WindowLayer))
            assert layer.seen == done
            assert layer.nbytes <= (budget + chunk) * slot_bytes(layer), f"{spec} after {done} tokens"

    kvcache.prefill(model, prompt(length, seed=5), cache, chunk=chunk, after_chunk=check)
    assert seen_after == list(range(chunk, length + 1, chunk))
    full = length * slot_bytes(cache.kv_layers[0])
    assert all(layer.nbytes < full / 4 for layer in cache.kv_layers)  # the bound is far below the whole prompt


def test_a_left_padded_batch_prefills_in_chunks_as_dynamic_cache_does_in_one_pass():
    model = model_for("llama")
    ids, mask = left_padded((37, 26))
    cache = kvcache.make_cache(model)
    got = kvcache.prefill(model, ids, cache, chunk=CHUNK, attention_mask=mask)
    # generate's position ids for a left-padded batch (GenerationMixin._prepare_position_ids_for_generation)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with hf_attention(model), torch.no_grad():
        past = DynamicCache(config=model.config)
        want = model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, past)).logits[:, -1]
    torch.testing.assert_close(got, want, **LOGITS_TOL)


def test_a_left_padded_prefill_then_generate_gives_generates_own_tokens():
    """The prefill numbers a padded row's positions as generate does, so generate can go on from it."""
    model = model_for("llama")
    ids, mask = left_padded((37, 26, 31))
    cache = kvcache.make_cache(model)
    kvcache.prefill(model, ids[:, :-1], cache, chunk=CHUNK, attention_mask=mask[:, :-1])
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False)
        want = model.generate(ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                              max_new_tokens=6, do_sample=False)  # fmt: skip
    assert_same_tokens(got, want, "left-padded prefill + generate")


@pytest.mark.parametrize("spec", ["growable", "h2o:budget=16", "window:window=12,sinks=2", "tova:budget=16"])
def test_generate_prefill_chunk_size_works_with_our_caches_as_kvcache_prefill_does(spec):
    """transformers' own chunked prefill feeds the chunks as ``kvcache.prefill`` does: the same tokens
    (with the same chunk boundaries: ours stops at the last whole chunk, generate feeds the rest)."""
    model = model_for("llama")
    ids = prompt(PROMPT, seed=6)
    theirs = greedy(model, ids, kvcache.make_cache(model, spec), prefill_chunk_size=CHUNK)
    cache = kvcache.make_cache(model, spec)
    kvcache.prefill(model, ids[:, : PROMPT // CHUNK * CHUNK], cache, chunk=CHUNK)
    assert_same_tokens(greedy(model, ids, cache), theirs, f"{spec} generate(prefill_chunk_size)")


@pytest.mark.parametrize("spec", ["growable", "h2o:budget=64", "window:window=64"])
def test_no_tensor_of_chunk_x_context_is_made_while_prefilling(spec, monkeypatch):
    """The chunk's attention runs a block of query rows at a time, and no mask of the chunk over the
    context exists. Score blocks are sized by bytes (``kernel._BLOCK_BYTES``, 64 MiB): made small
    here, so a tiny model's blocks are as much shorter than its chunk as a real model's are at 32K."""
    monkeypatch.setattr(kernel, "_BLOCK_BYTES", 2**17)
    model = model_for("llama")
    length, chunk = 1536, 128
    ids = prompt(length, seed=7)
    limit = chunk * length  # elements of a chunk x context tensor

    def biggest(run) -> tuple[int, tuple]:
        with Recorder() as rec:
            run()
        return max((numel, shape) for _, outs, _ in rec.ops for shape, numel, _ in outs)

    numel, shape = biggest(lambda: kvcache.prefill(model, ids, kvcache.make_cache(model, spec), chunk=chunk))
    assert numel < limit, f"{spec}: a tensor of shape {shape} ({numel} elements >= chunk x context = {limit})"

    def sdpa_chunks() -> None:  # the same chunks through transformers' SDPA: its mask is chunk x context
        cache = DynamicCache(config=model.config)
        with hf_attention(model), torch.no_grad():
            for start in range(0, length, chunk):
                model(ids[:, start : start + chunk], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)

    assert biggest(sdpa_chunks)[0] >= limit  # the check can see one


def test_progress_bar_counts_tokens(capsys):
    model = model_for("llama")
    kvcache.prefill(model, prompt(20), kvcache.make_cache(model), chunk=8, progress=True)
    assert "20/20" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (dict(chunk=0), ValueError, "chunk must be a whole number of tokens >= 1, got 0"),
        (dict(chunk=2.0), ValueError, "chunk must be"),
        (dict(chunk=True), ValueError, "chunk must be"),
        (dict(ids=torch.arange(5)), ValueError, r"ids must be token ids \[B, S\] \(a 2-D integer tensor\), got a 1-D"),
        (dict(ids=torch.rand(1, 5)), ValueError, "torch.float32"),
        (dict(ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "at least one token"),
        (dict(cache="dynamic"), TypeError, "expects a kvcache.KVCache .* got DynamicCache"),
        (dict(attention_mask=torch.ones(1, 4)), ValueError, r"attention_mask must be \[B, seen \+ S\] = \[1, 5\]"),
    ],
)
def test_bad_arguments_are_refused_changing_nothing(args, error, match):
    model = model_for("llama")
    cache = kvcache.make_cache(model, "h2o:budget=8")
    given = {"ids": prompt(5), "cache": cache, **args}
    if given["cache"] == "dynamic":
        given["cache"] = DynamicCache(config=model.config)
    attn = model.config._attn_implementation
    with pytest.raises(error, match=match):
        kvcache.prefill(model, given.pop("ids"), given.pop("cache"), **given)
    assert cache.seen == 0 and cache.nbytes == 0 and model.config._attn_implementation == attn
