"""Suite ``bounded``: what bounded caches (window, eviction, quantized storage) buy in speed and bytes.

Three parts, one report:

1. ``decode``: end-to-end ``generate`` tokens/s at long context with a budget, against the full
   ``growable`` cache, on suite ``decode``'s model (``decode.build_model``, 4 layers, GQA with 32
   query heads and MHA with 8) and its one untimed prefill per context. Every contender gets a
   fresh ``make_cache(model, spec)`` filled with that prefill's keys and values by
   ``KVCache.extend``, then ``new_tokens`` greedy decode steps with the ``"kvcache"`` attention,
   timed, contenders alternating; medians, the ratio to ``growable``, the cache's ``nbytes`` after
   the run and whether the tokens equal ``growable``'s.

   The bounded caches received the prefill without attention scores (``extend`` runs no attention
   pass): each kept what its policy keeps with no scores (H2O and TOVA: the recent tokens their
   defaults protect, the rest by ties), so their tokens say nothing about quality here. Decode
   speed does not depend on which slots were kept, only on how many there are and how they are
   stored, so the timings stand.

2. ``bytes``: bytes per token of each kind (the decode contenders plus ``static``), for the same
   geometry in fp16 (4 layers x 8 KV heads x 128), no model: a cache is filled by ``extend`` with
   ``T`` tokens of random keys/values and its ``nbytes`` (everything allocated: codes, scales,
   minimums, the full-precision residual, positions and scores) is compared with an fp16 cache
   holding exactly ``T`` tokens (``T x layers x 2 x 8 x 128 x 2`` bytes).

3. ``bandwidth``: one decode attention call over quantized storage against the memory-bandwidth
   limit. ``QuantizedLayer(bits=8|4)`` holding ``T`` tokens (fp32 geometry, B=1, 8 KV heads x
   128), timed as ``update`` of one token then ``attend(query)`` (the bounded layers' API), against
   the fp32 ``GrowableLayer``'s ``update`` then ``kvcache.attend(query, *layer.view())``; GQA (32
   query heads) and MHA (8). The appended token is trimmed after each call, so every call attends
   ``T + 1`` tokens. Bytes read: for the quantized layer the used part of its codes, scales,
   minimums and residual keys/values (its ``state()`` tensors), for the growable the K and V views.
   Reported as GB/s and as the fraction of the read bandwidth measured in the same run
   (``common.read_bandwidth``), with the largest difference of each output from the fp32 one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...attention import attend
from ... import make_cache
from ...hf import register_attention
from ...layers import GrowableLayer, QuantizedLayer
from .. import contenders
from ..contenders import SINKS
from .common import cache_config, clock, column_table, figure, finish_axes, human_bytes, median, read_bandwidth
from .decode import compare_decode, decode_table, prefilled
from .harness import alternate, report, timed_generate
from ..run_options import RunOptions

#: Part 1's contenders, the baseline first.
DECODE_CONTENDERS = (
    "growable",
    "window",
    "lastrec",
    "h2o",
    "tova",
    "h2o-int8",
    "quantized-int8",
    "quantized-int4",
)
#: Part 2's kinds: the decode contenders and the fixed-capacity cache.
BYTES_CONTENDERS = (*DECODE_CONTENDERS, "static")
#: Part 3's contenders: the fp32 reference and the quantized layers.
BANDWIDTH_CONTENDERS = ("growable", "quantized-int8", "quantized-int4")
#: Tiny runs only: an H2O cache whose budget covers the whole sequence, so nothing is evicted and
#: its tokens must equal ``growable``'s (a check of the bounded attention path).
KEEP_ALL = "h2o-keepall"
#: Every name a row may carry.
CONTENDERS = (*BYTES_CONTENDERS, KEEP_ALL)
PARTS = ("decode", "bytes", "bandwidth")
VARIANTS = {"gqa": 32, "mha": 8}  # query heads over 8 KV heads
LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128


def spec_for(name: str, budget: int, tokens: int = 0) -> str:
    """The cache spec of contender ``name`` with ``budget`` slots (``tokens``: the sequence length,
    for ``static``'s capacity and the keep-all budget)."""
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")
    if name == KEEP_ALL:
        return contenders.spec_for("h2o", slots=max(tokens, 1))
    return contenders.spec_for(name, slots=budget, capacity=max(tokens, 1))


# ---- part 1: decode ------------------------------------------------------------------------


def decode_once(model, spec: str, past, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor, int]:
    """(seconds, all tokens, cache bytes after) of ``new_tokens`` greedy steps from ``ids`` with a fresh
    ``spec`` cache that ``extend`` filled with ``past`` (untimed, no attention pass)."""
    cache = make_cache(model, spec)
    cache.extend(past)
    seconds, out = timed_generate(model, cache, ids, new_tokens, "kvcache")
    return seconds, out, int(cache.nbytes)


def run_decode(contexts, budget, new_tokens, repeats, layers, device, tiny, bar) -> list[dict[str, Any]]:
    rows = []
    names = DECODE_CONTENDERS + ((KEEP_ALL,) if tiny else ())
    for variant, heads, ctx, model, past, ids in prefilled(VARIANTS, contexts, layers, device):
        specs = {name: spec_for(name, budget, ids.shape[1] + new_tokens) for name in names}
        decode_once(model, "growable", past, ids, 1)  # warm-up, untimed
        decode = lambda name: decode_once(model, specs[name], past, ids, new_tokens)  # noqa: E731
        fields = compare_decode(names, repeats, decode, new_tokens, "growable", bar)
        row = {"part": "decode", "variant": variant, "query_heads": heads, "context": ctx}
        rows += [{**row, "contender": name, "spec": specs[name], **fields[name]} for name in names]
    return rows


# ---- part 2: bytes per token ---------------------------------------------------------------


def fp16_bytes(tokens: int, layers: int = LAYERS) -> int:
    """An fp16 cache holding exactly ``tokens``: keys and values, every layer."""
    return tokens * layers * 2 * KV_HEADS * HEAD_DIM * 2


def run_bytes(lengths, budget, device, bar) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    for total in lengths:
        config = cache_config(LAYERS, KV_HEADS, HEAD_DIM, total)
        shape = (1, KV_HEADS, total, HEAD_DIM)
        fp16 = lambda: torch.randn(shape, generator=gen).to(device, torch.float16)  # noqa: E731
        past = [(fp16(), fp16()) for _ in range(LAYERS)]
        for name in BYTES_CONTENDERS:
            spec = spec_for(name, budget, total)
            cache = make_cache(config, spec)
            cache.extend(past)
            nbytes = int(cache.nbytes)
            rows.append(
                {
                    "part": "bytes",
                    "contender": name,
                    "spec": spec,
                    "tokens": total,
                    "cache_bytes": nbytes,
                    "bytes_per_token": nbytes / total,
                    "ratio_to_fp16": nbytes / fp16_bytes(total),
                }
            )
            del cache
            bar.update()
        del past
    return rows


# ---- part 3: decode attention bandwidth -----------------------------------------------------


def make_layer(name: str):
    if name not in BANDWIDTH_CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(BANDWIDTH_CONTENDERS)}")
    return GrowableLayer() if name == "growable" else QuantizedLayer(bits=int(name[-1]))


def decode_step(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One decode attention call: append one token, attend the query over everything stored."""
    layer.update(key, value)
    return attend(query, *layer.view()) if isinstance(layer, GrowableLayer) else layer.attend(query)


def bytes_read(layer) -> int:
    """What a decode call reads: the used part of every stored tensor (``state()`` views)."""
    return sum(t.nbytes for t in layer.state().tensors.values())


def run_bandwidth(lengths, repeats, bandwidth, device, bar) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(2)
    rand = lambda *shape: torch.randn(shape, generator=gen).to(device)  # noqa: E731
    for variant, heads in VARIANTS.items():
        for total in lengths:
            keys, values = rand(1, KV_HEADS, total, HEAD_DIM), rand(1, KV_HEADS, total, HEAD_DIM)
            layers = {name: make_layer(name) for name in BANDWIDTH_CONTENDERS}
            for layer in layers.values():
                layer.update(keys, values)
                layer.settle()  # the prompt goes unattended
            del keys, values
            query = rand(1, heads, 1, HEAD_DIM)
            key, value = rand(1, KV_HEADS, 1, HEAD_DIM), rand(1, KV_HEADS, 1, HEAD_DIM)

            outputs, nbytes = {}, {}
            for name, layer in layers.items():  # warm-up, the output for the check, the bytes read
                outputs[name] = decode_step(layer, query, key, value)
                nbytes[name] = bytes_read(layer)
                layer.trim(1)

            def timed_step(name: str) -> float:
                layer = layers[name]
                seconds = clock(lambda: decode_step(layer, query, key, value), device)
                layer.trim(1)
                return seconds

            times = alternate(BANDWIDTH_CONTENDERS, repeats, timed_step)
            for name in BANDWIDTH_CONTENDERS:
                seconds = median(times[name])
                rate = nbytes[name] / seconds
                diff = (outputs[name].float() - outputs["growable"].float()).abs().max().item()
                rows.append(
                    {
                        "part": "bandwidth",
                        "variant": variant,
                        "query_heads": heads,
                        "tokens": total,
                        "contender": name,
                        "spec": str(layers[name].kind) + ("" if name == "growable" else f":bits={name[-1]}"),
                        "ms": seconds * 1e3,
                        "bytes_read": nbytes[name],
                        "GBps": rate / 1e9,
                        "bandwidth_fraction": rate / bandwidth,
                        "max_abs_diff_vs_growable": diff,
                        "samples_ms": [t * 1e3 for t in times[name]],
                    }
                )
            del layers, outputs
            bar.update()
    return rows


# ---- the suite ---------------------------------------------------------------------------------


def run(
    options: RunOptions = RunOptions(),
    *,
    contexts: list[int] | None = None,
    budget: int | None = None,
    new_tokens: int | None = None,
    repeats: int | None = None,
    lengths: list[int] | None = None,
    parts: list[str] | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``bounded.json``/``.md``/``.png`` into ``options.out`` if given.

    ``contexts``, ``budget``, ``new_tokens``, ``repeats`` are part 1's (part 3 repeats 2/10/20
    times: tiny/quick/full); ``lengths`` the token counts of parts 2 and 3; ``parts`` a subset of
    ``PARTS``.
    """
    from tqdm.auto import tqdm

    parts = list(parts or PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; valid: {', '.join(PARTS)}")
    register_attention()
    # tiny: 128 tokens, past what a quantized layer keeps exact (up to residual + group_size - 1 = 95)
    contexts = contexts or options.pick([128], [4096], [4096, 16384])
    budget = budget or (16 if options.tiny else 1024)
    new_tokens = new_tokens or options.pick(4, 16, 32)
    repeats = repeats or options.pick(1, 1, 3)
    layers = 1 if options.tiny else LAYERS
    bytes_lengths = lengths or ([128] if options.tiny else [1024, 4096, 16384])
    bw_lengths = lengths or options.pick([128], [1024, 4096], [1024, 4096, 16384])
    bw_repeats = options.pick(2, 10, 20)

    rows: list[dict[str, Any]] = []
    bandwidth = None
    if "decode" in parts:
        names = len(DECODE_CONTENDERS) + (1 if options.tiny else 0)
        total = len(VARIANTS) * len(contexts) * repeats * names
        with tqdm(total=total, desc="bounded decode", disable=not options.progress) as bar:
            rows += run_decode(contexts, budget, new_tokens, repeats, layers, options.device, options.tiny, bar)
    if "bytes" in parts:
        with tqdm(total=len(bytes_lengths) * len(BYTES_CONTENDERS), desc="bounded bytes", disable=not options.progress) as bar:
            rows += run_bytes(bytes_lengths, budget, options.device, bar)
    if "bandwidth" in parts:
        bandwidth = read_bandwidth(options.device, mib=16 if options.tiny else 512)
        with tqdm(total=len(VARIANTS) * len(bw_lengths), desc="bounded bandwidth", disable=not options.progress) as bar:
            rows += run_bandwidth(bw_lengths, bw_repeats, bandwidth, options.device, bar)

    config = {
        "parts": parts,
        "decode": {
            "model": "llama-shaped, hidden 256, 8 KV heads x 128, fp32, random weights",
            "layers": layers,
            "contexts": contexts,
            "budget": budget,
            "sinks": SINKS,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "variants": VARIANTS,
            "prefill": "once per context with the model; caches filled by extend (no attention scores)",
        },
        "bytes": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float16",
            "lengths": bytes_lengths,
            "budget": budget,
        },
        "bandwidth": {
            "batch": 1,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "lengths": bw_lengths,
            "repeats": bw_repeats,
            "variants": VARIANTS,
        },
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("bounded", options, config, rows, table, plot, read_bandwidth_bytes_per_s=bandwidth)


def _part(result: dict[str, Any], part: str) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["part"] == part]


def _variant(row: dict[str, Any]) -> str:
    return f"{row['variant']} ({row['query_heads']}q/8kv)"


def table(result: dict[str, Any]) -> str:
    sections = []
    rows = _part(result, "decode")
    if rows:
        c = result["config"]["decode"]
        sections.append(
            f"Decode, {c['new_tokens']} tokens after a prefill (budget {c['budget']}, "
            f"{c['layers']} layers; bounded caches filled without attention scores, so 'identical' "
            f"says nothing about their quality)\n\n" + decode_table(rows, "growable", "growable", _variant, differs="no")
        )
    rows = _part(result, "bytes")
    if rows:
        columns = {
            "T": "tokens",
            "contender": "contender",
            "cache bytes": lambda r: human_bytes(r["cache_bytes"]),
            "bytes/token": "bytes_per_token",
            "x fp16 of T tokens": lambda r: f"{r['ratio_to_fp16']:.3f}",
        }
        sections.append("Bytes per token, fp16, 4 layers x 8 KV heads x 128\n\n" + column_table(rows, columns))
    rows = _part(result, "bandwidth")
    if rows:
        bw = result["read_bandwidth_bytes_per_s"] / 1e9
        columns = {
            "variant": _variant,
            "T": "tokens",
            "contender": "contender",
            "ms": "ms",
            "bytes read": lambda r: human_bytes(r["bytes_read"]),
            "GB/s": "GBps",
            "fraction of read bandwidth": lambda r: f"{r['bandwidth_fraction']:.0%}",
            "max |diff| vs fp32": lambda r: f"{r['max_abs_diff_vs_growable']:.1e}",
        }
        sections.append(
            f"Decode attention (update 1 token + attend), fp32; measured read bandwidth {bw:.1f} GB/s\n\n"
            + column_table(rows, columns)
        )
    return "\n".join(sections)


def _lines(ax, rows: list[dict[str, Any]], x: str, y: str, scale: float = 1, styles=(("gqa", "-"), ("mha", "--"))):
    """One line per contender (a colour each) and variant (a line style each; the bytes part has none)."""
    for i, name in enumerate(CONTENDERS):
        for variant, style in styles:
            mine = [r for r in rows if (r["contender"], r.get("variant", "")) == (name, variant)]
            pts = sorted((r[x], scale * r[y]) for r in mine)
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", marker="o", label=f"{name} {variant}".strip())


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, panels=3, size=(7, 4.5)) as (ax1, ax2, ax3):
        if rows := _part(result, "decode"):
            _lines(ax1, rows, "context", "tokens_per_s")
            title = f"generate decode, budget {result['config']['decode']['budget']}"
            finish_axes(ax1, "context tokens", "decode tokens/s", title, log_y=True)
        if rows := _part(result, "bytes"):
            _lines(ax2, rows, "tokens", "bytes_per_token", styles=(("", "-"),))
            finish_axes(ax2, "tokens (T)", "cache bytes / T", "bytes per token, fp16 geometry", log_y=True)
        if rows := _part(result, "bandwidth"):
            _lines(ax3, rows, "tokens", "bandwidth_fraction", scale=100)
            title = f"decode attention ({result['read_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s read)"
            finish_axes(ax3, "tokens in cache (T)", "% of measured read bandwidth", title)
