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

import contextlib
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from ..build import make_cache
from ..hf import ATTENTION_NAME, register_attention, use_kvcache_attention
from ..tiny import tiny_model
from .common import clock, figure, finish_axes, human_bytes, machine_info, markdown_table, median, write_outputs

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


def make_contender(name: str, model, capacity: int):
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "hf_static":
        return StaticCache(config=model.config, max_cache_len=capacity)
    if name in ("growable", "growable+attend"):
        return make_cache(model)
    if name == "static":
        return make_cache(model, "static", capacity=capacity)
    raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")


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
        logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    first = logits.argmax(-1, keepdim=True)
    return [(layer.keys, layer.values) for layer in cache.layers], torch.cat([prompt, first], dim=1)


def decode_once(model, name: str, past, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor, int]:
    """(seconds for ``new_tokens`` greedy decode steps, all tokens, cache bytes) for one contender.

    The contender's cache is filled with the shared prefill's keys/values (untimed), then
    ``generate`` continues from ``ids`` (prompt + first token), feeding only the uncached token.
    """
    cache = make_contender(name, model, ids.shape[1] + new_tokens + 8)
    for layer_idx, (keys, values) in enumerate(past):
        cache.update(keys, values, layer_idx)
    attention = "kvcache" if name.endswith("+attend") else "sdpa"
    seconds, out = timed_generate(model, cache, ids, new_tokens, attention)
    return seconds, out, cache_bytes(cache)


def timed_generate(model, cache, ids: torch.Tensor, new_tokens: int, attention: str) -> tuple[float, torch.Tensor]:
    """(seconds, all tokens) of ``new_tokens`` greedy steps continuing ``ids`` with ``cache``.

    ``attention="kvcache"`` runs inside ``use_kvcache_attention(model)``, the call the README
    recommends; any other name runs the model on that implementation. The model is back on sdpa after.
    """
    model.set_attn_implementation("sdpa")
    context = use_kvcache_attention(model) if attention == ATTENTION_NAME else _attention(model, attention)
    result = {}

    def decode() -> None:
        result["out"] = model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, past_key_values=cache
        )

    with context:
        seconds = clock(decode, ids.device)
    return seconds, result["out"]


@contextlib.contextmanager
def _attention(model, name: str):
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


def run(
    quick: bool = False,
    out: Path | None = None,
    device: str = "cpu",
    repeats: int | None = None,
    contexts: list[int] | None = None,
    new_tokens: int | None = None,
    variants: list[str] | None = None,
    layers: int = 4,
    progress: bool = True,
    tiny: bool = False,
) -> dict[str, Any]:
    """Run the suite; write ``decode.json``/``decode.md``/``decode.png`` into ``out`` if given."""
    from tqdm.auto import tqdm

    register_attention()
    contexts = contexts or ([64] if tiny else [1024, 4096] if quick else [1024, 4096, 8192, 16384])
    new_tokens = new_tokens or (4 if tiny else 16 if quick else 32)
    repeats = repeats or (1 if tiny or quick else 3)
    layers = 1 if tiny else layers
    variants = variants or list(VARIANTS)
    bar = tqdm(total=len(variants) * len(contexts) * repeats * len(CONTENDERS), desc="decode", disable=not progress)
    rows = []
    for variant in variants:
        model = build_model(VARIANTS[variant], layers, device)
        gen = torch.Generator().manual_seed(0)
        for ctx in contexts:
            prompt = torch.randint(3, model.config.vocab_size, (1, ctx), generator=gen).to(device)
            past, ids = prefill(model, prompt)
            seconds: dict[str, list[float]] = {n: [] for n in CONTENDERS}
            outs, nbytes = {}, {}
            for r in range(repeats):
                order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
                for name in order:
                    s, tokens, nb = decode_once(model, name, past, ids, new_tokens)
                    seconds[name].append(s)
                    outs[name], nbytes[name] = tokens, nb
                    bar.update()
            base = new_tokens / median(seconds["dynamic"])
            for name in CONTENDERS:
                tps = new_tokens / median(seconds[name])
                rows.append(
                    {
                        "variant": variant,
                        "query_heads": VARIANTS[variant],
                        "context": ctx,
                        "contender": name,
                        "tokens_per_s": tps,
                        "speedup_vs_dynamic": tps / base,
                        "identical_to_dynamic": bool(torch.equal(outs[name], outs["dynamic"])),
                        "cache_bytes": nbytes[name],
                        "samples_s": seconds[name],
                    }
                )
    bar.close()
    result = {
        "suite": "decode",
        "machine": machine_info(device),
        "config": {
            "model": "llama-shaped, hidden 256, 8 KV heads x 128, fp32, random weights",
            "layers": layers,
            "contexts": contexts,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "variants": {v: VARIANTS[v] for v in variants},
            "quick": quick,
        },
        "rows": rows,
    }
    if out is not None:
        write_outputs(result, Path(out), table, plot)
    return result


def table(result: dict[str, Any]) -> str:
    header = ["variant", "context", "contender", "tokens/s", "x DynamicCache", "identical", "cache bytes"]
    body = [
        [
            r["variant"],
            r["context"],
            r["contender"],
            r["tokens_per_s"],
            r["speedup_vs_dynamic"],
            "yes" if r["identical_to_dynamic"] else "NO",
            human_bytes(r["cache_bytes"]),
        ]
        for r in result["rows"]
    ]
    return markdown_table(header, body)


def plot(result: dict[str, Any], path: Path) -> None:
    variants = result["config"]["variants"]
    with figure(path, panels=len(variants), size=(6, 4.5)) as axes:
        for ax, (variant, heads) in zip(axes, variants.items()):
            for name in CONTENDERS:
                pts = [(r["context"], r["tokens_per_s"]) for r in result["rows"] if (r["variant"], r["contender"]) == (variant, name)]
                ax.plot(*zip(*pts), marker="o", label=name)
            title = f"generate decode, {variant} ({heads} q heads / 8 KV heads)"
            finish_axes(ax, "context tokens", "decode tokens/s", title)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    print(table(run(quick=args.quick, out=args.out, contexts=args.contexts)))
