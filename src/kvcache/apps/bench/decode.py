"""Suite ``decode``: end-to-end ``generate`` tokens/s at long contexts, and identical tokens.

The model is Llama-shaped where the cache is concerned (8 KV heads x 128 per layer, fp32) but has
a small hidden size, so that on a CPU the cache, not the weights, dominates each decode step, as it
does for a real model at long context. Two variants: MHA (8 query heads) and GQA (32 query heads on
8 KV heads). Weights are random; tokens are compared between contenders, not judged.

Contenders: Hugging Face ``DynamicCache`` and ``StaticCache``; ours ``growable`` and ``static``
with the model's default attention (sdpa), and ``growable+attend`` with ``kvcache.attend`` as the
attention implementation (``attend`` for decode steps). For each context length the prompt is
prefilled once with the model (untimed; a 16K prefill costs minutes on 2 cores); every contender's
fresh cache receives that prefill's keys and values, then ``generate`` runs ``new_tokens`` greedy
decode steps, timed. Contenders alternate per repeat; the report gives median tokens/s, the ratio
to ``DynamicCache``, and whether every contender's tokens equal ``DynamicCache``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvcache import cache_kwargs

from ...hf import register_attention
from ..contenders import make_contender
from ..run_options import RunOptions
from ..tiny import tiny_model
from .common import column_table, figure, finish_axes, human_bytes, median
from .harness import alternate, report, timed_generate

CONTENDERS = ("dynamic", "hf_static", "growable", "static", "growable+attend")
VARIANTS = {"mha": 8, "gqa": 32}  # query heads over 8 KV heads


def build_model(query_heads: int, layers: int = 4, device: str = "cpu"):
    model = tiny_model(
        "llama",
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=query_heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=65536,
    )
    return model.to(device)


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return sum(
        layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None) is not None
    )


def prefill(model, prompt: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """One real prefill of ``prompt``: each layer's keys/values and the prompt plus its greedy next token."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(prompt, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    first = logits.argmax(-1, keepdim=True)
    return [(layer.keys, layer.values) for layer in cache.layers], torch.cat([prompt, first], dim=1)


def decode_once(model, name: str, past, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor, int]:
    """(seconds, all tokens, cache bytes) of ``new_tokens`` greedy steps from ``ids`` (prompt + first
    token) with a fresh cache of contender ``name`` holding ``past`` (filled untimed)."""
    cache = make_contender(name.removesuffix("+attend"), model, capacity=ids.shape[1] + new_tokens + 8)
    for layer_idx, (keys, values) in enumerate(past):
        cache.update(keys, values, layer_idx)
    attention = "kvcache" if name.endswith("+attend") else "sdpa"
    seconds, out = timed_generate(model, cache, ids, new_tokens, attention)
    return seconds, out, cache_bytes(cache)


def prefilled(variants: dict[str, int], contexts: list[int], layers: int, device: str):
    """``(variant, query heads, context, model, past, ids)`` for every variant and context: one
    model per variant, one shared prefill (``prefill``) of a seeded random prompt per context."""
    for variant, heads in variants.items():
        model = build_model(heads, layers, device)
        gen = torch.Generator().manual_seed(0)
        for ctx in contexts:
            prompt = torch.randint(3, model.config.vocab_size, (1, ctx), generator=gen).to(device)
            past, ids = prefill(model, prompt)
            yield variant, heads, ctx, model, past, ids
            del past, ids  # before the next prefill: at long contexts one is hundreds of MiB


def compare_decode(names, repeats: int, decode, new_tokens: int, reference: str, bar=None) -> dict[str, dict[str, Any]]:
    """Alternate ``decode(name) -> (seconds, tokens, cache bytes)`` over the contenders; per name
    the row fields: median tokens/s, its ratio to ``reference``'s, whether the last round's tokens
    equal the reference's, the cache bytes after it, and the seconds of every round."""
    runs = alternate(names, repeats, decode, bar)
    seconds = {name: [s for s, _, _ in samples] for name, samples in runs.items()}
    rate = {name: new_tokens / median(samples) for name, samples in seconds.items()}
    last = {name: samples[-1] for name, samples in runs.items()}  # (seconds, tokens, cache bytes)
    return {
        name: {
            "tokens_per_s": rate[name],
            f"speedup_vs_{reference}": rate[name] / rate[reference],
            f"identical_to_{reference}": bool(torch.equal(tokens, last[reference][1])),
            "cache_bytes": nbytes,
            "samples_s": seconds[name],
        }
        for name, (_, tokens, nbytes) in last.items()
    }


def run(
    options: RunOptions = RunOptions(),
    *,
    repeats: int | None = None,
    contexts: list[int] | None = None,
    new_tokens: int | None = None,
    variants: list[str] | None = None,
    layers: int = 4,
) -> dict[str, Any]:
    """Run the suite; write ``decode.json``/``decode.md``/``decode.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    register_attention()
    contexts = contexts or options.pick([64], [1024, 4096], [1024, 4096, 8192, 16384])
    new_tokens = new_tokens or options.pick(4, 16, 32)
    repeats = repeats or options.pick(1, 1, 3)
    layers = 1 if options.tiny else layers
    variants = variants or list(VARIANTS)
    bar = tqdm(total=len(variants) * len(contexts) * repeats * len(CONTENDERS), desc="decode", disable=not options.progress)
    rows = []
    chosen = {v: VARIANTS[v] for v in variants}
    for variant, heads, ctx, model, past, ids in prefilled(chosen, contexts, layers, options.device):
        decode = lambda name: decode_once(model, name, past, ids, new_tokens)  # noqa: E731
        fields = compare_decode(CONTENDERS, repeats, decode, new_tokens, "dynamic", bar)
        row = {"variant": variant, "query_heads": heads, "context": ctx}
        rows += [{**row, "contender": name, **fields[name]} for name in CONTENDERS]
    bar.close()
    config = {
        "model": "llama-shaped, hidden 256, 8 KV heads x 128, fp32, random weights",
        "layers": layers,
        "contexts": contexts,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "variants": chosen,
        "quick": options.quick,
    }
    return report("decode", options, config, rows, table, plot)


def table(result: dict[str, Any]) -> str:
    return decode_table(result["rows"], "dynamic", "DynamicCache", lambda r: r["variant"], differs="NO")


def decode_table(rows, reference: str, reference_label: str, variant_cell, differs: str) -> str:
    """The markdown table of ``compare_decode`` rows; ``differs`` is the word for tokens unlike the reference's."""
    columns = {
        "variant": variant_cell,
        "context": "context",
        "contender": "contender",
        "tokens/s": "tokens_per_s",
        f"x {reference_label}": f"speedup_vs_{reference}",
        "identical": lambda r: "yes" if r[f"identical_to_{reference}"] else differs,
        "cache bytes": lambda r: human_bytes(r["cache_bytes"]),
    }
    return column_table(rows, columns)


def plot(result: dict[str, Any], path: Path) -> None:
    variants = result["config"]["variants"]
    with figure(path, panels=len(variants), size=(6, 4.5)) as axes:
        for ax, (variant, heads) in zip(axes, variants.items()):
            for name in CONTENDERS:
                pts = [(r["context"], r["tokens_per_s"]) for r in result["rows"] if (r["variant"], r["contender"]) == (variant, name)]
                ax.plot(*zip(*pts), marker="o", label=name)
            title = f"generate decode, {variant} ({heads} q heads / 8 KV heads)"
            finish_axes(ax, "context tokens", "decode tokens/s", title)
