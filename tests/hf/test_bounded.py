"""Bounded caches (sliding window with sinks, H2O / TOVA / last-recent eviction) against references
written by others.

References: torch's ``scaled_dot_product_attention`` with an explicit boolean mask built from the
visibility rule, plain concatenation of the full history, softmax weights computed with plain
torch (float64), and Hugging Face's ``DynamicCache`` driving the same model with Hugging Face's
own attention (``helpers.hf_attention``). Tiny models: 4 layers, 2 KV heads, 4 query heads,
head_dim 16; mistral slides every layer (16), gemma2 alternates sliding (16) and full layers.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

import kvcache
from kvcache import cache_kwargs
from helpers import assert_same_tokens, attention_for, layer_fingerprint, left_padded, model_for, prompt
from kvcache.layers import EvictingLayer, WindowLayer
from kvcache.apps.tiny import FAMILIES, tiny_model

KINDS = ("window", "h2o", "tova", "lastrec")

#: Small bounds: (spec, slots a full-attention layer keeps).
SMALL = {
    "window": ("window:window=12,sinks=4", 16),
    "h2o": ("h2o:budget=20", 20),
    "tova": ("tova:budget=20,sinks=2", 20),
    "lastrec": ("lastrec:budget=16", 16),
}
#: Bounds of 10 slots per full-attention layer for the memory runs (10x = 100 tokens).
MEMORY = {
    "window": ("window:window=8,sinks=2", 10),
    "h2o": ("h2o:budget=10", 10),
    "tova": ("tova:budget=10,sinks=2", 10),
    "lastrec": ("lastrec:budget=10", 10),
}
#: Bounds at least the whole sequence of the generate tests (prompt 40 + 16 new): nothing is dropped.
LARGE = {
    "window": "window:window=64,sinks=4",
    "h2o": "h2o:budget=64",
    "tova": "tova:budget=64,sinks=2",
    "lastrec": "lastrec:budget=64",
}
#: Tighter bounds for the ragged-batch runs (prompt 40, 16 new tokens).
TIGHT = {
    "window": "window:window=8,sinks=2",
    "h2o": "h2o:budget=12",
    "tova": "tova:budget=12,sinks=2",
    "lastrec": "lastrec:budget=12",
}

HEAD_DIM = 16
PROMPT_LEN = 40
NEW_TOKENS = 16
RAGGED = (40, 31)  # row 1 is left-padded with 9 pad tokens


# ---- shared helpers -----------------------------------------------------------------------------


def uses_our_cache(cache) -> bool:
    return isinstance(cache, kvcache.KVCache)


def greedy(model, ids, cache, max_new_tokens=NEW_TOKENS, **kwargs):
    """Greedy ``generate``; a reference (DynamicCache) runs with Hugging Face's own attention."""
    context = attention_for(model, cache)
    with context:
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def reference_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def ragged_batch(lengths=RAGGED, seed: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(lengths, seed)


def forward_loop(model, ids, cache, feed, check=None) -> torch.Tensor:
    """Prefill ``ids``, then feed ``feed`` one token at a time. Returns the last-position logits
    of every call, ``[calls, B, V]``. ``check(seen)`` runs after every call."""
    out = []
    context = attention_for(model, cache)
    seen = 0
    with torch.no_grad(), context:
        chunks = [ids] + [feed[:, t : t + 1] for t in range(feed.shape[1])]
        for chunk in chunks:
            out.append(model(chunk, **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
            seen += chunk.shape[1]
            if check is not None:
                check(seen)
    return torch.stack(out)


def slot_bytes(dtype_size: int = 4) -> int:
    return 2 * HEAD_DIM * dtype_size


def analytic_nbytes(model, spec: str, batch: int) -> list[int]:
    """Bytes each layer must hold once full, from the spec and Hugging Face's reading of the config:
    sliding layers a ring of the model's window, window layers ``window + sinks`` slots, evicting
    layers ``budget + 1`` slots each with an int64 position and a float32 score."""
    parsed = kvcache.parse_spec(spec)
    heads = model.config.num_key_value_heads
    types, per_layer = get_layer_types_and_kwargs(model.config)
    out = []
    for layer_type, kw in zip(types, per_layer):
        if layer_type == "sliding_attention":
            out.append(kw["sliding_window"] * batch * heads * slot_bytes())
        elif parsed.kind == "window":
            slots = parsed.options["window"] + parsed.options.get("sinks", 0)
            out.append(slots * batch * heads * slot_bytes())
        else:
            slots = parsed.options["budget"] + 1
            out.append(slots * batch * heads * (slot_bytes() + 8 + 4))
    return out


def store_state(store) -> dict[str, torch.Tensor]:
    """A store's full observable content, cloned."""
    state = store.state()
    out = {name: t.clone() for name, t in state.tensors.items()}
    out["positions()"] = store.positions().clone()
    out["seen"] = torch.tensor(store.seen)
    return out


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


# ---- 1. memory stays at its bound ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_memory_stays_at_bound_over_ten_times_the_budget(family, kind):
    spec, slots = MEMORY[kind]
    model = model_for(family)
    cache = kvcache.make_cache(model, spec)
    # A prompt longer than the bound (the overflowing-chunk path), then decode steps to ~1.5x.
    ids = prompt(slots + slots // 4, seed=1)
    early_target = slots + slots // 2
    out = greedy(model, ids, cache, max_new_tokens=early_target - ids.shape[1] + 1)
    assert cache.seen == early_target
    early = [s.nbytes for s in cache.kv_layers]
    late_target = 10 * slots
    out = greedy(model, out, cache, max_new_tokens=late_target - early_target)
    assert cache.seen == late_target
    late = [s.nbytes for s in cache.kv_layers]

    bound = analytic_nbytes(model, spec, batch=1)
    assert early == bound, f"after {early_target} tokens: {early} bytes per layer, analytic bound {bound}"
    assert late == bound, f"after {late_target} tokens: {late} bytes per layer, analytic bound {bound}"
    assert cache.nbytes == sum(bound)
    types, per_layer = get_layer_types_and_kwargs(model.config)
    for store, layer_type, kw in zip(cache.kv_layers, types, per_layer):
        limit = kw["sliding_window"] if layer_type == "sliding_attention" else slots
        assert store.length == limit, (layer_type, store.length, limit)
        assert store.seen == late_target


def test_fractional_budget_keeps_its_share_of_the_tokens():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "h2o:budget=0.5")
    out = greedy(model, prompt(30, seed=2), cache, max_new_tokens=40)
    seen = cache.seen
    assert seen == out.shape[1] - 1
    heads = model.config.num_key_value_heads
    for store in cache.kv_layers:
        keep = math.ceil(0.5 * seen)
        assert store.length == keep, (store.length, seen)
        pos = store.positions()
        assert (pos < seen).all() and (pos >= 0).all() and (pos.max(-1).values == seen - 1).all()
        # A share that grows with the sequence is allocated geometrically: at most twice what it needs.
        assert keep + 1 <= store.capacity <= 2 * (keep + 1), (store.capacity, keep)
        assert store.nbytes == store.capacity * heads * (slot_bytes() + 8 + 4)


# ---- 2. positions stay absolute -----------------------------------------------------------------


def positions_checker(cache):
    def check(seen: int) -> None:
        assert cache.get_seq_length() == seen
        for i, store in enumerate(cache.kv_layers):
            assert store.seen == seen, f"layer {i}: seen {store.seen}, fed {seen}"
            pos = store.positions()
            assert pos.shape[-1] == store.length
            assert (pos < seen).all() and (pos >= 0).all(), f"layer {i}: positions {pos[0, 0].tolist()} after {seen}"
            # The newest token stays, except under TOVA without a protected recent range, which may
            # drop a token its own query paid little attention to.
            if not (isinstance(store, EvictingLayer) and store.policy.name == "tova"):
                assert (pos.max(dim=-1).values == seen - 1).all(), f"layer {i}: newest token not stored at {seen - 1}"
            for row in pos.reshape(-1, pos.shape[-1]):
                assert len(set(row.tolist())) == row.numel(), f"layer {i}: duplicate positions {row.tolist()}"
            if isinstance(store, WindowLayer):
                want = {p for p in range(seen) if p > seen - 1 - store.window or p < store.sinks}
                assert set(pos[0, 0].tolist()) == want
                assert (pos == pos[:1, :1]).all()

    return check


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_positions_absolute_and_keys_match_dynamic_cache_by_position(family, kind):
    """After every step: seq length is tokens seen, positions are absolute; and the stored keys of
    the first bounded layer (whose inputs do not depend on what was evicted) equal DynamicCache's
    keys at those positions, so RoPE was applied at the token's absolute position."""
    spec, _ = SMALL[kind]
    model = model_for(family)
    ids = prompt(24, seed=3)
    feed = prompt(24, seed=4)
    cache = kvcache.make_cache(model, spec)
    forward_loop(model, ids, cache, feed, check=positions_checker(cache))
    ref = reference_cache(model)
    forward_loop(model, ids, ref, feed)
    types, _ = get_layer_types_and_kwargs(model.config)
    first_full = types.index("full_attention")
    for i in range(first_full + 1):  # every layer up to the first one of the spec's kind
        store, layer = cache.kv_layers[i], ref.layers[i]
        keys, values = store.view()
        pos = store.positions()
        first = store.seen - layer.keys.shape[2]  # HF's sliding layer keeps only its last tokens
        if types[i] == "full_attention":
            assert first == 0
        for h in range(pos.shape[1]):
            p = pos[0, h]
            both = p >= first
            assert both.sum() >= min(store.length, layer.keys.shape[2] - 1)
            torch.testing.assert_close(
                keys[0, h, both], layer.keys[0, h, p[both] - first], rtol=1e-5, atol=1e-5,
                msg=lambda m: f"layer {i} head {h} keys by position: {m}",
            )
            torch.testing.assert_close(
                values[0, h, both], layer.values[0, h, p[both] - first], rtol=1e-5, atol=1e-5,
                msg=lambda m: f"layer {i} head {h} values by position: {m}",
            )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_bound_above_total_length_gives_dynamic_cache_logits(family, kind):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=5)
    feed = prompt(NEW_TOKENS, seed=6)
    ref = forward_loop(model, ids, reference_cache(model), feed)
    cache = kvcache.make_cache(model, LARGE[kind])
    ours = forward_loop(model, ids, cache, feed, check=positions_checker(cache))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@functools.lru_cache(maxsize=None)
def mistral_pair(window: int):
    """The same mistral weights twice: all-full attention, and Hugging Face's sliding ``window``."""
    full = tiny_model("mistral", sliding_window=0)
    sliding = tiny_model("mistral", sliding_window=window)
    for (name, a), (_, b) in zip(full.state_dict().items(), sliding.state_dict().items()):
        assert torch.equal(a, b), name
    assert not any(t == "sliding_attention" for t in get_layer_types_and_kwargs(full.config)[0])
    return full, sliding


@pytest.mark.parametrize("spec", ("window:window=9", "lastrec:budget=8"))
def test_small_bounds_match_hugging_face_sliding_window_after_wrapping(spec):
    """With the bound far below the sequence, a plain window (and last-recent eviction of ``w - 1``
    slots, which attends ``w`` keys per decode step) is Hugging Face's sliding-window attention: this
    holds only if every new token is rotated at position ``seen`` (not at the slot count)."""
    full, sliding = mistral_pair(9)
    ids = prompt(6, seed=7)  # within the bound: the prefill attends like a sliding window too
    feed = prompt(40, seed=8)
    ref = forward_loop(sliding, ids, reference_cache(sliding), feed)
    cache = kvcache.make_cache(full, spec)
    ours = forward_loop(full, ids, cache, feed, check=positions_checker(cache))
    assert cache.seen == 46 and all(s.length <= 9 for s in cache.kv_layers)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---- 3. crafted attention: which slots H2O and TOVA keep, per KV head ----------------------------


def simulate_eviction(policy, q, k, v, chunks, budget, sinks, recent, scale):
    """Plain-torch (float64) model of score-based eviction, per KV head.

    q ``[Hq, T, D]``, k ``[Hkv, T, D]``, v ``[Hkv, T, Dv]``. Each chunk's queries attend, causally,
    the kept positions plus the chunk; h2o adds every query's weight (summed over the group's query
    heads) to a slot's score, tova replaces it by the last query's; then the lowest-scoring
    unprotected slots go until ``budget`` remain. Returns per step (kept sets, scores, outputs,
    smallest margin between a kept unprotected score and an evicted one).
    """
    heads, group = k.shape[0], q.shape[0] // k.shape[0]
    kept = [[] for _ in range(heads)]
    scores = [dict() for _ in range(heads)]
    steps = []
    start = 0
    for n in chunks:
        stop = start + n
        out = torch.zeros(q.shape[0], n, v.shape[-1], dtype=torch.float64)
        margin = math.inf
        for h in range(heads):
            attended = kept[h] + list(range(start, stop))
            pos = torch.tensor(attended)
            w_sum = torch.zeros(len(attended), dtype=torch.float64)
            w_last = torch.zeros(len(attended), dtype=torch.float64)
            for g in range(h * group, (h + 1) * group):
                logits = (q[g, start:stop] @ k[h, pos].T) * scale  # [n, N]
                visible = pos.view(1, -1) <= torch.arange(start, stop).view(-1, 1)
                probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
                out[g] = probs @ v[h, pos]
                w_sum += probs.sum(0)
                w_last += probs[-1]
            for j, p in enumerate(attended):
                if policy == "h2o":
                    scores[h][p] = scores[h].get(p, 0.0) + float(w_sum[j])
                else:
                    scores[h][p] = float(w_last[j])
            extra = len(attended) - budget
            if extra > 0:
                free = [p for p in attended if not (p < sinks or p >= stop - recent)]
                free.sort(key=lambda p: scores[h][p])
                gone = set(free[:extra])
                if len(free) > extra:
                    margin = min(margin, scores[h][free[extra]] - scores[h][free[extra - 1]])
                attended = [p for p in attended if p not in gone]
                for p in gone:
                    del scores[h][p]
            kept[h] = attended
        steps.append(([set(s) for s in kept], [dict(s) for s in scores], out, margin))
        start = stop
    return steps


HEAVY = ({1, 5, 10}, {2, 7, 13})  # the positions each KV head's queries attend strongly


def crafted_inputs(seed: int, total: int, q_heads: int = 4, kv_heads: int = 2, dim: int = 16):
    """Keys that the queries of KV head h attend strongly at ``HEAVY[h]``: query and heavy keys point
    along e_h (different directions per head), the other keys are noise."""
    g = torch.Generator().manual_seed(seed)
    group = q_heads // kv_heads
    q = 0.3 * torch.randn(q_heads, total, dim, generator=g, dtype=torch.float64)
    k = torch.randn(kv_heads, total, dim, generator=g, dtype=torch.float64)
    v = torch.randn(kv_heads, total, dim, generator=g, dtype=torch.float64)
    for h in range(kv_heads):
        q[h * group : (h + 1) * group, :, h] += 3.0
        for p in HEAVY[h]:
            k[h, p] = 0.3 * k[h, p]
            k[h, p, h] += 4.0
    return q, k, v


@pytest.mark.parametrize(
    ("policy", "sinks", "recent"),
    [("h2o", 0, 0), ("h2o", 1, None), ("tova", 0, None), ("tova", 2, 1)],
)
def test_scores_choose_the_slots_plain_softmax_weights_choose_per_kv_head(policy, sinks, recent):
    budget = 8
    chunks = [10, 1, 1, 1, 3, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    total = sum(chunks)
    q, k, v = crafted_inputs(seed=10, total=total)
    scale = 1.0 / math.sqrt(k.shape[-1])
    layer_recent = recent if recent is not None else {"h2o": budget // 2, "tova": 0}[policy]  # the documented defaults
    steps = simulate_eviction(policy, q, k, v, chunks, budget, sinks, layer_recent, scale)
    layer = EvictingLayer(budget, policy=policy, recent=recent, sinks=sinks)

    start = 0
    for step, (n, (kept, scores, want_out, margin)) in enumerate(zip(chunks, steps)):
        assert margin > 1e-4, f"test data too close to a tie at step {step} ({margin})"
        stop = start + n
        layer.update(k[None, :, start:stop].float(), v[None, :, start:stop].float())
        out = layer.attend(q[None, :, start:stop].float())
        torch.testing.assert_close(out[0].double(), want_out, rtol=1e-5, atol=1e-5)
        pos, got_scores = layer.positions()[0], layer.scores()[0]
        for h in range(2):
            got = pos[h].tolist()
            assert set(got) == kept[h], f"step {step} (tokens {stop}), KV head {h}: kept {sorted(got)}, expected {sorted(kept[h])}"
            want = torch.tensor([scores[h][p] for p in got], dtype=torch.float32)
            torch.testing.assert_close(got_scores[h], want, rtol=1e-5, atol=1e-5)
        start = stop
    final = [set(layer.positions()[0, h].tolist()) for h in range(2)]
    assert final[0] != final[1], "the two KV heads should keep different positions"
    for h in range(2):
        assert HEAVY[h] <= final[h], f"KV head {h} dropped a heavily attended position: kept {sorted(final[h])}"
        assert len(final[h]) == budget
    assert layer.length == budget and layer.seen == total


def test_h2o_keeps_largest_accumulated_weight_in_one_overflowing_prefill():
    """A single chunk longer than the budget: h2o keeps the top-``budget`` column sums of the causal
    softmax (summed over queries and the group's query heads), tova the last query's top weights."""
    q, k, v = crafted_inputs(seed=12, total=16)
    scale = 1.0 / math.sqrt(16)
    for policy in ("h2o", "tova"):
        layer = EvictingLayer(6, policy=policy, recent=0)
        layer.update(k[None].float(), v[None].float())
        layer.attend(q[None].float())
        for h in range(2):
            causal = torch.ones(16, 16, dtype=torch.bool).tril()
            w = torch.zeros(16, dtype=torch.float64)
            for g in (2 * h, 2 * h + 1):
                probs = torch.softmax((q[g] @ k[h].T * scale).masked_fill(~causal, -math.inf), dim=-1)
                w += probs.sum(0) if policy == "h2o" else probs[-1]
            top = w.topk(7)
            assert top.values[5] - top.values[6] > 1e-4, "test data too close to a tie"
            want = set(top.indices[:6].tolist())
            assert set(layer.positions()[0, h].tolist()) == want, (policy, h)


# ---- 4. window attention equals SDPA over the full history with an explicit mask ----------------


def window_mask(first: int, n: int, total: int, window: int, sinks: int) -> torch.Tensor:
    """``[n, total]``: query at ``first + i`` sees key k iff k <= q and (k > q - window or k < sinks)."""
    q = torch.arange(first, first + n).view(-1, 1)
    kk = torch.arange(total).view(1, -1)
    return (kk <= q) & ((kk > q - window) | (kk < sinks))


def chunk_sizes(seed: int, window: int, sinks: int, count: int = 10) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes = [window + sinks + 3]  # a prefill longer than the whole layer
    for _ in range(count):
        sizes.append(1 if torch.rand(1, generator=g) < 0.4 else int(torch.randint(1, 2 * (window + sinks) + 2, (1,), generator=g)))
    return sizes


@pytest.mark.parametrize(("window", "sinks"), [(5, 0), (5, 2), (1, 0), (3, 4), (7, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_window_updates_match_sdpa_over_full_history(window, sinks, seed):
    batch, kv_heads, q_heads, dim, vdim = 2, 2, 4, 8, 6
    g = torch.Generator().manual_seed(seed)
    layer = WindowLayer(window, sinks=sinks, initial_capacity=2)
    hist_k = torch.empty(batch, kv_heads, 0, dim)
    hist_v = torch.empty(batch, kv_heads, 0, vdim)
    for n in chunk_sizes(seed, window, sinks):
        k = torch.randn(batch, kv_heads, n, dim, generator=g)
        v = torch.randn(batch, kv_heads, n, vdim, generator=g)
        q = torch.randn(batch, q_heads, n, dim, generator=g)
        first = hist_k.shape[2]
        hist_k, hist_v = torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2)
        layer.update(k, v)
        out = layer.attend(q)
        mask = window_mask(first, n, first + n, window, sinks)
        ref = F.scaled_dot_product_attention(q, hist_k, hist_v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"chunk of {n} at {first}: {m}")
        # What is stored: exactly the sinks and the last `window`, holding the history at those positions.
        seen = first + n
        pos = layer.positions()
        want = {p for p in range(seen) if p >= seen - window or p < sinks}
        assert layer.seen == seen and layer.length == len(want)
        assert set(pos[0, 0].tolist()) == want and (pos == pos[:1, :1]).all()
        keys, values = layer.view()
        assert torch.equal(keys, hist_k[:, :, pos[0, 0]]) and torch.equal(values, hist_v[:, :, pos[0, 0]])
        assert layer.nbytes <= (window + sinks) * batch * kv_heads * (dim + vdim) * 4


@pytest.mark.parametrize(("window", "sinks"), [(4, 0), (4, 2)])
def test_window_with_padding_mask_scale_and_softcap(window, sinks):
    """Hugging Face's padding mask (over absolute positions), a custom scale and a softcap, against
    plain torch: softmax(softcap * tanh(scale * q.k / softcap)) under the window AND padding mask;
    a query row that sees no key returns zeros."""
    batch, kv_heads, q_heads, dim = 2, 2, 4, 8
    g = torch.Generator().manual_seed(3)
    layer = WindowLayer(window, sinks=sinks)
    pad = torch.ones(batch, 64, dtype=torch.bool)
    pad[1, :3] = False  # row 1 is left-padded by 3 tokens
    hist_k = torch.empty(batch, kv_heads, 0, dim)
    hist_v = torch.empty(batch, kv_heads, 0, dim)
    scale, softcap = 0.37, 2.5
    for n in (9, 1, 1, 5, 1, 3):
        k = torch.randn(batch, kv_heads, n, dim, generator=g) * 3
        v = torch.randn(batch, kv_heads, n, dim, generator=g)
        q = torch.randn(batch, q_heads, n, dim, generator=g) * 3
        first = hist_k.shape[2]
        seen = first + n
        hist_k, hist_v = torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2)
        hf_mask = pad[:, None, None, :seen] & torch.ones(1, 1, n, 1, dtype=torch.bool)  # [B, 1, n, seen]
        layer.update(k, v)
        out = layer.attend(q, scale=scale, softcap=softcap, mask=hf_mask)
        allowed = window_mask(first, n, seen, window, sinks)[None, None] & hf_mask  # [B, 1, n, seen]
        kk = hist_k.double().repeat_interleave(2, dim=1)
        vv = hist_v.double().repeat_interleave(2, dim=1)
        logits = (q.double() @ kk.transpose(-1, -2)) * scale
        logits = softcap * torch.tanh(logits / softcap)
        probs = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        ref = probs @ vv
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"chunk at {first}: {m}")


def test_window_prefill_rows_for_padding_only_are_zero():
    layer = WindowLayer(4, sinks=1)
    k = torch.randn(2, 2, 6, 8)
    layer.update(k, k)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, :, :3] = False
    out = layer.attend(torch.randn(2, 4, 6, 8), mask=mask)
    assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    assert not torch.isnan(out).any()


# ---- 5. every kind in generate on every family, ragged left-padded batch --------------------------


@functools.lru_cache(maxsize=None)
def reference_ragged(family: str) -> torch.Tensor:
    model = model_for(family)
    ids, mask = ragged_batch()
    return greedy(model, ids, reference_cache(model), attention_mask=mask)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_generates_on_every_family(family, kind):
    model = model_for(family)
    ids, mask = ragged_batch()
    total = ids.shape[1] + NEW_TOKENS
    # A bound at least the whole sequence: token-identical to DynamicCache.
    cache = kvcache.make_cache(model, LARGE[kind])
    ours = greedy(model, ids, cache, attention_mask=mask)
    assert_same_tokens(ours, reference_ragged(family), f"{family}/{LARGE[kind]} ragged batch")
    assert cache.seen == total - 1

    # A small bound (the prompt alone overflows it): runs, finite scores, memory at the analytic bound.
    spec = TIGHT[kind]
    cache = kvcache.make_cache(model, spec)
    out = greedy(
        model, ids, cache, attention_mask=mask, max_new_tokens=10, output_scores=True, return_dict_in_generate=True
    )
    assert out.sequences.shape == (2, ids.shape[1] + 10)
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert cache.seen == ids.shape[1] + 9
    assert [s.nbytes for s in cache.kv_layers] == analytic_nbytes(model, spec, batch=2)
    parsed = kvcache.parse_spec(spec).options
    bound = parsed["window"] + parsed.get("sinks", 0) if kind == "window" else parsed["budget"]
    for store in cache.kv_layers:
        limit = store.window + store.sinks if isinstance(store, WindowLayer) else bound
        assert store.length <= limit


@pytest.mark.parametrize("family", ("mistral", "gemma2"))
def test_a_bounded_kinds_windows_are_token_identical_to_dynamic_cache(family):
    """Beside a bounded kind (a budget never reached here) a model's sliding layers are rings."""
    model = model_for(family)
    cache = kvcache.make_cache(model, "h2o:budget=4096")
    assert any(isinstance(s, WindowLayer) for s in cache.kv_layers)
    ids, mask = ragged_batch()
    ours = greedy(model, ids, cache, attention_mask=mask, max_new_tokens=30)
    ref = greedy(model, ids, reference_cache(model), attention_mask=mask, max_new_tokens=30)
    assert_same_tokens(ours, ref, f"{family} default cache")
    for store in cache.kv_layers:
        if isinstance(store, WindowLayer):
            assert store.length == store.window == 16 and store.seen > 40


@pytest.mark.parametrize("kind", ("h2o", "tova", "lastrec"))
def test_eviction_with_one_kv_head_and_batch_one(kind):
    """Multi-query attention (one KV head), one sequence: the most common shape for a chat session
    on such a model. Eviction must run past the budget, per step, like with several heads."""
    model = model_for("llama", num_key_value_heads=1)
    spec = f"{kind}:budget=8"
    cache = kvcache.make_cache(model, spec)
    out = greedy(model, prompt(6, seed=25), cache, max_new_tokens=12)
    assert out.shape == (1, 18)
    for store in cache.kv_layers:
        assert store.length == 8 and store.seen == 17
        pos = store.positions()
        assert pos.shape == (1, 1, 8) and (pos < 17).all()
    assert [s.nbytes for s in cache.kv_layers] == [9 * (slot_bytes() + 8 + 4)] * 4


@pytest.mark.parametrize("policy", ("h2o", "tova", "lastrec"))
def test_evicting_layer_direct_decode_with_one_row_and_one_head(policy):
    layer = EvictingLayer(3, policy=policy, recent=0)
    g = torch.Generator().manual_seed(26)
    hist = []
    for _ in range(6):
        k = torch.randn(1, 1, 1, 4, generator=g)
        hist.append(k)
        layer.update(k, k)
        layer.attend(torch.randn(1, 2, 1, 4, generator=g))
    assert layer.length == 3 and layer.seen == 6
    keys, _ = layer.view()
    full = torch.cat(hist, dim=2)
    assert torch.equal(keys[0, 0], full[0, 0, layer.positions()[0, 0]])


@pytest.mark.parametrize(
    "layer", [lambda: EvictingLayer(4, policy="lastrec"), lambda: WindowLayer(4, sinks=1)], ids=["evicting", "window"]
)
def test_first_append_of_zero_tokens_fixes_the_geometry(layer):
    """What Hugging Face's ``lazy_initialization`` / ``early_initialization`` does: an empty
    ``[B, Hkv, 0, D]`` append before any token. It fixes the geometry and stores nothing."""
    layer = layer()
    empty = torch.zeros(2, 2, 0, 8)
    keys, values = layer.update(empty, empty)
    assert keys.shape[2] == 0 and values.shape[2] == 0
    assert layer.initialized and layer.length == 0 and layer.seen == 0
    assert layer.attend(torch.zeros(2, 4, 0, 8)).shape == (2, 4, 0, 8)
    k = torch.randn(2, 2, 6, 8)
    layer.update(k, k)
    q = torch.randn(2, 4, 6, 8)
    out = layer.attend(q)
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    if isinstance(layer, WindowLayer):
        visible = window_mask(0, 6, 6, 4, 1)
    ref = F.scaled_dot_product_attention(q, k, k, attn_mask=visible, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_early_initialization_then_generate(kind):
    """``Cache.early_initialization`` (transformers' export path; ``HFLayer.supports_early_init``)
    allocates every layer up front; generation must then run as without it."""
    spec, _ = SMALL[kind]
    model = model_for("llama")
    ids = prompt(24, seed=27)
    want = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=8)
    cache = kvcache.make_cache(model, spec)
    cache.early_initialization(
        batch_size=1, num_heads=model.config.num_key_value_heads, head_dim=HEAD_DIM,
        dtype=torch.float32, device=torch.device("cpu"),
    )
    assert all(s.initialized and s.seen == 0 for s in cache.kv_layers)
    got = greedy(model, ids, cache, max_new_tokens=8)
    assert_same_tokens(got, want, f"{spec} after early_initialization")


# ---- 6. persistence, snapshots, forks, crop, beam search ------------------------------------------


SAVE_CASES = [(family, SMALL[kind][0]) for family in ("llama", "gemma2") for kind in KINDS] + [
    ("llama", "h2o:budget=0.5"),
    ("llama", "h2o:budget=12,recent=3,sinks=1"),
]


@pytest.mark.parametrize(("family", "spec"), SAVE_CASES)
def test_save_load_continue_equals_uninterrupted(family, spec, tmp_path):
    model = model_for(family)
    ids = prompt(30, seed=13)
    whole = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=24)
    cache = kvcache.make_cache(model, spec)
    first = greedy(model, ids, cache, max_new_tokens=10)
    path = tmp_path / "bounded.kv"
    cache.save(path)
    loaded = kvcache.load_cache(path, model)
    assert [s.kind for s in loaded.kv_layers] == [s.kind for s in cache.kv_layers]
    for a, b in zip(cache.kv_layers, loaded.kv_layers):
        assert_states_equal(store_state(a), store_state(b), f"{family}/{spec} loaded")
        if "0." not in spec:  # a fractional budget's store has room to grow: a load allocates what it needs now
            assert a.nbytes == b.nbytes
    rest = greedy(model, first, loaded, max_new_tokens=14)
    assert_same_tokens(rest, whole, f"{family}/{spec} saved and loaded")


@pytest.mark.parametrize(("family", "kind"), [("llama", "h2o"), ("gemma2", "window")])
def test_load_into_a_fresh_model_instance_continues(family, kind, tmp_path):
    """What a new process does: load a saved bounded cache into a freshly built model (still on its
    default attention) and continue. make_cache switches the model to the "kvcache" attention that
    bounded layers need; load_cache must leave the model able to use the cache, too."""
    spec, _ = SMALL[kind]
    model = model_for(family)
    ids = prompt(30, seed=14)
    whole = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=25)
    cache = kvcache.make_cache(model, spec)
    first = greedy(model, ids, cache, max_new_tokens=10)
    cache.save(tmp_path / "c.kv")
    fresh = tiny_model(family)  # same weights, default attention
    loaded = kvcache.load_cache(tmp_path / "c.kv", fresh)
    rest = greedy(fresh, first, loaded, max_new_tokens=15)
    assert_same_tokens(rest, whole, f"{family}/{spec} loaded into a fresh model")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_snapshot_restore_and_fork_replay_bit_exactly(family, kind):
    spec, _ = SMALL[kind]
    model = model_for(family)
    cache = kvcache.make_cache(model, spec)
    forward_loop(model, prompt(26, seed=15), cache, prompt(6, seed=16))  # past the bound
    xs, ys = prompt(8, seed=17), prompt(8, seed=18)
    snap = cache.snapshot()
    before = [store_state(s) for s in cache.kv_layers]
    fork = cache.fork()

    def feed(c, tokens):
        return forward_loop(model, tokens[:, :1], c, tokens[:, 1:])

    logits_y = feed(cache, ys)
    logits_x = feed(fork, xs)  # the fork, after the original moved on
    after_y = [store_state(s) for s in cache.kv_layers]
    cache.restore(snap)
    for s, want in zip(cache.kv_layers, before):
        assert_states_equal(store_state(s), want, f"{spec} restored")
    assert torch.equal(feed(cache, xs), logits_x), "restore + replay differs from the fork"
    cache.restore(snap)
    assert torch.equal(feed(cache, ys), logits_y), "restore + replay differs from the first run"
    for s, want in zip(cache.kv_layers, after_y):
        assert_states_equal(store_state(s), want, f"{spec} replayed")
    # The snapshot is a copy: nothing since has changed it.
    cache.restore(snap)
    for s, want in zip(cache.kv_layers, before):
        assert_states_equal(store_state(s), want, f"{spec} restored twice")


def cache_fingerprint(cache) -> list:
    return [(layer_fingerprint(s), store_state(s)) for s in cache.kv_layers]


def assert_cache_unchanged(cache, before) -> None:
    after = cache_fingerprint(cache)
    for i, ((fa, sa), (fb, sb)) in enumerate(zip(after, before)):
        assert fa == fb, f"layer {i} changed by a refused call"
        assert_states_equal(sa, sb, f"layer {i} after a refused call")


@pytest.mark.parametrize("kind", KINDS)
def test_crop_before_anything_dropped_then_continue_matches_fresh_cache(kind):
    spec, _ = SMALL[kind]
    model = model_for("llama")
    ids, feed = prompt(8, seed=19), prompt(6, seed=20)
    cache = kvcache.make_cache(model, spec)
    forward_loop(model, ids, cache, feed)  # 14 tokens: under every bound
    assert all(s.length == s.seen == 14 for s in cache.kv_layers)
    cache.crop(-3)
    assert cache.get_seq_length() == 11
    more = prompt(5, seed=21)
    ours = forward_loop(model, more[:, :1], cache, more[:, 1:])
    fresh = kvcache.make_cache(model, spec)
    fed = torch.cat([ids, feed[:, :3]], dim=1)
    forward_loop(model, fed, fresh, fed[:, :0])
    ref = forward_loop(model, more[:, :1], fresh, more[:, 1:])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "spec", "message", "fed"),
    [
        ("llama", "window:window=12,sinks=4", "overwritten", 22),
        ("llama", "window:window=12,sinks=4", "overwritten", 17),  # one token past the ring
        ("llama", "lastrec:budget=16", "evicted", 17),
        ("llama", "h2o:budget=20", "evicted", 22),
        ("llama", "tova:budget=20,sinks=2", "evicted", 22),
        ("llama", "lastrec:budget=16", "evicted", 22),
        ("gemma2", "h2o:budget=8", "evicted", 14),  # the sliding layers (16) have not wrapped: only eviction refuses
    ],
)
def test_crop_refused_once_something_was_dropped_and_changes_nothing(family, spec, message, fed):
    model = model_for(family)
    cache = kvcache.make_cache(model, spec)
    forward_loop(model, prompt(8, seed=22), cache, prompt(fed - 8, seed=23))  # past the bound
    assert cache.seen == fed and any(s.length < s.seen for s in cache.kv_layers)
    if family == "gemma2":
        assert all(s.length == s.seen for s in cache.kv_layers if isinstance(s, WindowLayer))
    before = cache_fingerprint(cache)
    with pytest.raises(kvcache.UnsupportedOperation, match=message) as info:
        cache.crop(-2)
    assert "2" in str(info.value)
    assert_cache_unchanged(cache, before)
    cache.crop(0)  # nothing to remove: allowed
    assert_cache_unchanged(cache, before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_beam_search(family, kind):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=24)
    kwargs = dict(max_new_tokens=8, num_beams=2, num_return_sequences=2)
    ref = greedy(model, ids, reference_cache(model), **kwargs)
    ours = greedy(model, ids, kvcache.make_cache(model, LARGE[kind]), **kwargs)
    assert_same_tokens(ours, ref, f"{family}/{LARGE[kind]} beam search")
    spec, slots = SMALL[kind]
    cache = kvcache.make_cache(model, spec)
    out = greedy(model, ids, cache, **kwargs)
    assert out.shape == (2, PROMPT_LEN + 8)
    assert cache.kv_layers[0].geometry.batch == 2
    assert [s.nbytes for s in cache.kv_layers] == analytic_nbytes(model, spec, batch=2)


# ---- 7. bad options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: WindowLayer(0), "window"),
        (lambda: WindowLayer(4, sinks=-1), "sinks"),
        (lambda: EvictingLayer(0), "budget"),
        (lambda: EvictingLayer(-3, policy="tova"), "budget"),
        (lambda: EvictingLayer(1.5), "budget"),
        (lambda: EvictingLayer(-0.5), "budget"),
        (lambda: EvictingLayer(8, sinks=4, recent=4), "recent"),
        (lambda: EvictingLayer(8, sinks=8), "sinks"),
        (lambda: EvictingLayer(8, policy="lastrec", recent=9), "recent"),
        (lambda: EvictingLayer(8, recent=-1), "recent"),
        (lambda: EvictingLayer(8, sinks=-1), "sinks"),
        (lambda: EvictingLayer(8, policy="no-such-policy"), "policy"),
    ],
)
def test_bad_layer_options_raise_value_error_naming_the_option(build, name):
    with pytest.raises(ValueError) as info:
        build()
    assert name in str(info.value).splitlines()[0], str(info.value)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("window:window=0", "window"),
        ("window", "window"),
        ("window:window=8,sinks=-2", "sinks"),
        ("h2o:budget=0", "budget"),
        ("h2o", "budget"),
        ("tova:budget=1.5", "budget"),
        ("lastrec:budget=-4", "budget"),
        ("h2o:budget=8,sinks=4,recent=4", "recent"),
        ("tova:budget=4,sinks=4", "sinks"),
        ("h2o:budget=8,recent=-1", "recent"),
        ("h2o:budget=8,policy=tova", "policy"),
        ("no-such-kind:budget=8", "no-such-kind"),
        ("window:window=8,budget=4", "budget"),
    ],
)
def test_bad_specs_raise_naming_the_option_and_leave_the_model_alone(spec, name):
    model = tiny_model("llama")  # a fresh model: a refused make_cache must not switch its attention
    before = model.config._attn_implementation
    with pytest.raises(ValueError) as info:
        kvcache.make_cache(model, spec)
    # The first line names the option (a SpecError then lists every valid spec, naming them all),
    # and not only because it quotes the spec.
    first = str(info.value).splitlines()[0].replace(repr(spec), "")
    assert name in first, str(info.value)
    assert model.config._attn_implementation == before
