"""Query-aware eviction (SnapKV, PyramidKV, TOVA with one set per layer) against plain-torch
references written from the papers' descriptions, on crafted attention where which slots survive
per (row, KV head) is known.

References (float64, written here from the papers, not from ``kvcache``): softmax attention per
query head with a causal mask; SnapKV's score is the softmax weight of the last ``window`` queries
summed over them and over the query heads of a KV head, max-pooled over ``pool`` neighbouring
positions, the top of it kept beside the window; PyramidKV's per-layer budgets are the arithmetic
sequence of its paper (top ``k / beta``, bottom ``2k - k / beta``); TOVA's kept set is one per
layer, scored by the last query's weights averaged over all heads.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

import kvcache
from kvcache.errors import SpecError
from kvcache.layers import EvictingLayer
from kvcache.hf.spec import parse_spec, valid_specs

Q_HEADS, KV_HEADS, DIM = 4, 2, 16
SCALE = 1.0 / math.sqrt(DIM)


def crafted(seed: int, total: int, heavy: tuple[set[int], ...], batch: int = 1):
    """q ``[B, Hq, T, D]``, k, v ``[B, Hkv, T, D]`` (float64): the queries of KV head h point along
    e_h, as do its keys at ``heavy[h]`` (different per head and per row: row r shifts them by r)."""
    g = torch.Generator().manual_seed(seed)
    group = Q_HEADS // KV_HEADS
    q = 0.3 * torch.randn(batch, Q_HEADS, total, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, KV_HEADS, total, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, KV_HEADS, total, DIM, generator=g, dtype=torch.float64)
    for b in range(batch):
        for h in range(KV_HEADS):
            q[b, h * group : (h + 1) * group, :, h] += 3.0
            for p in heavy[h]:
                k[b, h, p + b] = 0.3 * k[b, h, p + b]
                k[b, h, p + b, h] += 4.0 + 0.1 * p  # distinct strengths: no ties between heavy slots
    return q, k, v


def probs(q: torch.Tensor, k: torch.Tensor, positions: list[int], rows: range) -> torch.Tensor:
    """Softmax weights ``[len(rows), len(positions)]`` of query rows ``rows`` (absolute positions)
    over the keys at ``positions``, causal. ``q`` ``[T, D]``, ``k`` ``[T, D]``."""
    pos = torch.tensor(positions)
    logits = (q[list(rows)] @ k[pos].T) * SCALE
    visible = pos.view(1, -1) <= torch.tensor(list(rows)).view(-1, 1)
    return torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)


def maxpool(scores: list[float], kernel: int) -> list[float]:
    """Each score replaced by the largest within ``kernel // 2`` places on either side."""
    r = kernel // 2
    return [max(scores[max(0, i - r) : i + r + 1]) for i in range(len(scores))]


def snapkv_reference(q, k, chunks, budget, window, pool, recent):
    """Kept positions per KV head after each chunk, for one batch row (``q`` ``[Hq, T, D]``).

    A chunk of several tokens scores every attended slot (the kept ones and the chunk, in position
    order) by its last ``window`` queries' weights summed over them and the KV head's query heads,
    max-pooled over ``pool`` neighbours; the ``budget`` best stay, the last ``recent`` positions
    always. A single token is not scored (0) and the lowest score leaves. Returns, per chunk, the
    kept sets and the smallest gap between a kept unprotected score and an evicted one."""
    group = q.shape[0] // k.shape[0]
    kept: list[list[int]] = [[] for _ in range(k.shape[0])]
    scores: list[dict[int, float]] = [{} for _ in range(k.shape[0])]
    out, start = [], 0
    for n in chunks:
        stop, gap = start + n, math.inf
        for h in range(k.shape[0]):
            attended = sorted(kept[h] + list(range(start, stop)))
            if n > 1:
                rows = range(max(start, stop - window), stop)
                w = sum(probs(q[g], k[h], attended, rows).sum(0) for g in range(h * group, (h + 1) * group))
                for p, s in zip(attended, maxpool(w.tolist(), pool)):
                    scores[h][p] = s
            else:
                scores[h][start] = 0.0
            free = sorted((p for p in attended if p < stop - recent), key=lambda p: -scores[h][p])
            if len(attended) > budget:
                room = budget - (len(attended) - len(free))
                if 0 < room < len(free):
                    gap = min(gap, scores[h][free[room - 1]] - scores[h][free[room]])
                gone = set(free[room:])
                attended = [p for p in attended if p not in gone]
            kept[h] = attended
        out.append(([set(s) for s in kept], gap))
        start = stop
    return out


def run_layer(layer, q, k, v, chunks):
    """Feed ``chunks`` through ``layer`` (update + attend); kept position sets per (row, head) after each."""
    seen, start = [], 0
    for n in chunks:
        layer.update(k[:, :, start : start + n].float(), v[:, :, start : start + n].float())
        layer.attend(q[:, :, start : start + n].float())
        pos = layer.positions()
        seen.append([[set(pos[b, h].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])])
        start += n
    return seen


HEAVY = ({3, 11, 20}, {6, 15, 24})


def tiny_config(layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM, max_position_embeddings=256,
    )


@pytest.mark.parametrize(("pool", "window", "recent"), [(1, 4, None), (3, 4, None), (5, 6, 2), (7, 8, None)])
def test_snapkv_prefill_keeps_the_references_slots_per_row_and_head(pool, window, recent):
    total, batch = 40, 2
    q, k, v = crafted(seed=3, total=total, heavy=HEAVY, batch=batch)
    budget = 2 * (pool + 0) + (recent if recent is not None else window)  # two pooled groups' worth
    layer_recent = recent if recent is not None else min(window, budget // 2)
    layer = EvictingLayer(budget, policy="snapkv", window=window, pool=pool, recent=recent)
    got = run_layer(layer, q, k, v, [total])[-1]
    for b in range(batch):
        ((want, gap),) = snapkv_reference(q[b], k[b], [total], budget, window, pool, layer_recent)
        assert gap > 1e-6, f"crafted data too close to a tie (row {b}, gap {gap})"
        for h in range(KV_HEADS):
            assert got[b][h] == want[h], f"row {b} head {h}: kept {sorted(got[b][h])}, reference {sorted(want[h])}"
    assert got[0][0] != got[0][1] and got[0][0] != got[1][0], "heads and rows should keep different positions"
    assert layer.length == budget and layer.seen == total


def assert_valid_top(kept: set[int], attended: list[int], scores: dict[int, float], protected: set[int], budget: int, what: str):
    """``kept`` is a best-``budget`` choice of ``attended`` by ``scores`` with ``protected`` always
    kept (exact ties may go either way: pooling gives neighbours the same score)."""
    assert len(kept) == min(budget, len(attended)) and kept <= set(attended), f"{what}: kept {sorted(kept)}"
    assert protected & set(attended) <= kept, f"{what}: dropped a protected position ({sorted(protected - kept)})"
    chosen = [scores[p] for p in kept - protected]
    gone = [scores[p] for p in set(attended) - kept]
    if chosen and gone:
        assert min(chosen) >= max(gone) - 1e-6, f"{what}: kept a score {min(chosen)} below an evicted one {max(gone)}"


def test_snapkv_chunked_prefill_then_decode_follows_the_reference():
    """Each step checked against the reference's scores over the slots the layer held before it;
    a decode step scores its token 0 and keeps the others' (the documented rule)."""
    chunks = [17, 13, 10] + [1] * 12
    budget, window, pool = 16, 4, 3
    total = sum(chunks)
    q, k, v = crafted(seed=4, total=total, heavy=HEAVY, batch=2)
    layer = EvictingLayer(budget, policy="snapkv", window=window, pool=pool)
    group = Q_HEADS // KV_HEADS
    scores = [[{} for _ in range(KV_HEADS)] for _ in range(2)]
    before = [[[] for _ in range(KV_HEADS)] for _ in range(2)]
    start = 0
    for step, (n, got) in enumerate(zip(chunks, run_layer(layer, q, k, v, chunks))):
        stop = start + n
        for b in range(2):
            for h in range(KV_HEADS):
                attended = sorted(before[b][h] + list(range(start, stop)))
                if n > 1:
                    rows = range(max(start, stop - window), stop)
                    w = sum(probs(q[b, g], k[b, h], attended, rows).sum(0) for g in range(h * group, (h + 1) * group))
                    scores[b][h].update(zip(attended, maxpool(w.tolist(), pool)))
                else:
                    scores[b][h][start] = 0.0
                protected = set(range(stop - window, stop))
                assert_valid_top(got[b][h], attended, scores[b][h], protected, budget, f"step {step} row {b} head {h}")
                before[b][h] = sorted(got[b][h])
        start = stop
    prompt_kept = [set(p for p in s if p < 40) for s in before[0]]
    for h in range(KV_HEADS):  # generated tokens live only while recent; prompt slots were chosen at prefill
        assert {p for p in before[0][h] if p >= 40} == set(range(total - window, total))
        assert HEAVY[h] <= prompt_kept[h], f"head {h} lost a heavily attended position"


def test_snapkv_decode_step_asks_for_no_weights_and_keeps_scores():
    q, k, v = crafted(seed=5, total=12, heavy=({2}, {5}))
    layer = EvictingLayer(64, policy="snapkv", window=4)
    layer.update(k[:, :, :10].float(), v[:, :, :10].float())
    assert layer.pending.weights == "window:4"
    layer.attend(q[:, :, :10].float())
    before = layer.scores().clone()
    layer.update(k[:, :, 10:11].float(), v[:, :, 10:11].float())
    assert layer.pending.weights is None
    layer.attend(q[:, :, 10:11].float())
    assert torch.equal(layer.scores()[..., :10], before) and bool((layer.scores()[..., 10] == 0).all())


def pyramid_reference(k: int, reserved: int, beta: float, layers: int) -> list[int]:
    """PyramidKV's budgets (Cai et al., 2024, its budget formula): the chosen share ``k - reserved`` as an
    arithmetic sequence from ``2c - c / beta`` (bottom) to ``c / beta`` (top), plus the reserved."""
    c = k - reserved
    top, bottom = c / beta, 2 * c - c / beta
    return [reserved + max(1, round(bottom - (bottom - top) * i / (layers - 1))) for i in range(layers)]


@pytest.mark.parametrize(("budget", "window", "beta", "layers"), [(64, 8, 20, 30), (100, 32, 4, 7), (20, 4, 2, 4), (40, 8, 1, 5)])
def test_pyramidkv_layer_budgets_sum_to_the_uniform_total_and_shrink_with_depth(budget, window, beta, layers):
    made = [EvictingLayer(budget, policy="pyramidkv", window=window, beta=beta, layer=i, layers=layers) for i in range(layers)]
    sizes = [layer.budget_now(1000) for layer in made]
    assert abs(sum(sizes) - budget * layers) <= layers / 2
    assert sizes == pyramid_reference(budget, window, beta, layers)
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    if beta > 1:
        assert sizes[0] > budget > sizes[-1]


def test_pyramidkv_fractional_budget_scales_per_layer():
    layers = [EvictingLayer(0.25, policy="pyramidkv", window=8, beta=5, layer=i, layers=6) for i in range(6)]
    for seen in (200, 1000, 4096):
        sizes = [layer.budget_now(seen) for layer in layers]
        uniform = math.ceil(0.25 * seen)
        assert abs(sum(sizes) - 6 * uniform) <= 3 and sizes == pyramid_reference(uniform, 8, 5, 6)


def test_pyramidkv_each_layer_keeps_snapkv_slots_at_its_own_budget():
    total, window, pool = 40, 4, 1
    q, k, v = crafted(seed=6, total=total, heavy=HEAVY)
    for index in range(3):
        layer = EvictingLayer(14, policy="pyramidkv", window=window, pool=pool, beta=3, layer=index, layers=3)
        size = pyramid_reference(14, window, 3, 3)[index]
        got = run_layer(layer, q, k, v, [total])[-1][0]
        ((want, gap),) = snapkv_reference(q[0], k[0], [total], size, window, pool, window)
        assert gap > 1e-6, f"crafted data too close to a tie (layer {index})"
        assert layer.length == size and got == want, (index, got, want)


def test_make_cache_tells_each_layer_its_depth_and_only_pyramidkv_records_it():
    config = tiny_config()
    cache = kvcache.make_cache(config, "pyramidkv:budget=24,window=4,beta=4")
    sizes = [s.budget_now() for s in cache.kv_layers]
    assert sizes == pyramid_reference(24, 4, 4, len(sizes)) and abs(sum(sizes) - 24 * len(sizes)) <= len(sizes) / 2
    assert [s.options()["layer"] for s in cache.kv_layers] == list(range(len(sizes)))
    plain = kvcache.make_cache(config, "snapkv:budget=24")
    assert all("layer" not in s.options() for s in plain.kv_layers)


def tova_layer_reference(q, k, chunks, budget):
    """One kept set for all heads: each chunk's last query's weights over the kept positions plus
    the chunk, averaged over all query heads; the lowest leave until ``budget`` remain."""
    group = q.shape[0] // k.shape[0]
    kept, out, start = [], [], 0
    for n in chunks:
        stop = start + n
        attended = kept + list(range(start, stop))
        w = sum(probs(q[g], k[g // group], attended, range(stop - 1, stop))[0] for g in range(q.shape[0])) / q.shape[0]
        order = sorted(range(len(attended)), key=lambda j: -float(w[j]))
        gap = float(w[order[budget - 1]] - w[order[budget]]) if len(attended) > budget else math.inf
        kept = sorted(attended[j] for j in order[:budget])
        out.append((set(kept), gap))
        start = stop
    return out


def test_tova_layer_keeps_one_set_per_layer_equal_to_the_reference():
    chunks = [12, 1, 1, 3, 1, 1, 1, 2, 1, 1]
    budget = 8
    q, k, v = crafted(seed=7, total=sum(chunks), heavy=({1, 5, 9}, {2, 7, 11}), batch=2)
    layer = EvictingLayer(budget, policy="tova-layer")
    per_head = EvictingLayer(budget, policy="tova")
    got, heads = run_layer(layer, q, k, v, chunks), run_layer(per_head, q, k, v, chunks)
    for b in range(2):
        want = tova_layer_reference(q[b], k[b], chunks, budget)
        for step, ((kept, gap), mine) in enumerate(zip(want, got)):
            assert gap > 1e-6, f"crafted data too close to a tie at step {step}"
            assert all(s == kept for s in mine[b]), f"row {b} step {step}: kept {mine[b]}, reference {kept}"
    assert any(h[0][0] != h[0][1] for h in heads), "per-head tova should differ between heads on this data"


# ---- options: one mechanism for parsing, listing, building and saving ---------------------------


def test_policy_options_parse_list_and_build():
    spec = parse_spec("snapkv:budget=0.25,window=32,pool=7")
    assert spec.options == {"budget": 0.25, "window": 32, "pool": 7}
    assert str(spec) == "snapkv:budget=0.25,window=32,pool=7"
    listing = valid_specs()
    assert "snapkv (options: budget=<number>, recent=<int>, sinks=<int>, storage=<str>, fine=<str>, fine_share=<float>, window=<int>, pool=<int>)" in listing
    assert "tova-layer (options: budget=<number>, recent=<int>, sinks=<int>, storage=<str>, fine=<str>, fine_share=<float>)" in listing
    config = tiny_config()
    cache = kvcache.make_cache(config, "snapkv:budget=16", window=5, pool=3)
    layer = cache.kv_layers[0]
    assert (layer.policy.window, layer.policy.pool, layer.recent_now()) == (5, 3, 5)
    assert layer.options() == {"budget": 16, "policy": "snapkv", "recent": None, "sinks": 0, "storage": "full", "window": 5, "pool": 3}
    again = EvictingLayer(**layer.options())
    assert again.options() == layer.options() and again.weights_for(2) == "window:5"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("h2o:budget=4,window=3", ("window", "h2o")),
        ("tova-layer:budget=4,pool=3", ("pool", "tova-layer")),
        ("snapkv:budget=4,window=0", ("window", "snapkv", ">= 1")),
        ("snapkv:budget=4,pool=x", ("pool", "snapkv", "int")),
        ("pyramidkv:budget=4,beta=0.5", ("beta", "pyramidkv", ">= 1")),
        ("snapkv:budget=4,layer=2", ("layer", "snapkv")),
    ],
)
def test_bad_or_unknown_policy_options_are_refused_naming_kind_and_option(spec, words):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert all(w in str(e.value).splitlines()[0] for w in words), str(e.value)


def test_python_constructor_refuses_options_the_policy_does_not_have():
    with pytest.raises(ValueError, match="'h2o' has no option 'window'"):
        EvictingLayer(8, policy="h2o", window=3)
    with pytest.raises(ValueError, match="'window' of eviction policy 'snapkv' must be >= 1"):
        EvictingLayer(8, policy="snapkv", window=0)
    with pytest.raises(ValueError, match="layer must be below layers"):
        EvictingLayer(8, policy="pyramidkv", layer=3, layers=3)
