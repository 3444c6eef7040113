"""Suite ``budget``: the bytes a fractional budget holds, against a count budget of the same size.

A budget below 1 (``snapkv:budget=0.5``) keeps a share of the tokens seen, so its store grows as
the sequence does; a count (``snapkv:budget=2560``) is allocated once. The question is whether
the share's bytes follow what it keeps (``layers/budget.py``: room to grow of 1/16) or what its
allocator grabbed (doubling, before issue 21: up to twice the bytes).

Workload: a real model (SmolLM2-135M-Instruct by default; ``--tiny``: the small model shipped with
kvcache), one prompt of real text (``workload.make_prompts``) of ``prompt`` tokens in one forward
pass, then ``new`` greedy tokens one step at a time, all inside ``use_kvcache_attention``.
Contenders: every kind with a fractional budget at ``share`` of the tokens seen, beside the same
kind with the count that share reaches at the end (``ceil(share * (prompt + new))``), so both keep
the same number of slots when the run ends. kvzip runs without its repetition pass
(``queries=prompt``: an ordinary forward scores slots by the prompt's own queries).

Per contender: cache bytes (``cache.nbytes``, every allocated slot) after the prompt and at the
end, the most it held, the slots it keeps at the end (per KV head, summed over layers), the
reallocations of its stores during the decode (``cache.reallocations``), and decode tokens/s (one
run each: the bytes are deterministic, the speed is indicative). Each share is reported as its
bytes over the count's at the end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kvcache import cache_kwargs

from ... import make_cache, use_kvcache_attention
from ..run_options import RunOptions
from .common import clock, column_table, figure, human_bytes
from .harness import report
from .workload import load_model, make_prompts

#: The kinds whose budget can be a share of the sequence, with the options each runs with.
KINDS = {
    **{k: f"{k}:budget={{budget}}" for k in ("snapkv", "pyramidkv", "adakv", "h2o", "tova", "lastrec")},
    "kvzip": "kvzip:budget={budget},queries=prompt",
    "snapkv-int8": "snapkv:budget={budget},storage=int8",
}
BUDGET_TYPES = ("share", "count")
#: Every contender: a kind with a share of the sequence, or with the count that share reaches.
CONTENDERS = tuple(f"{kind}/{budget_type}" for kind in KINDS for budget_type in BUDGET_TYPES)
DEFAULT_MODEL = "smollm2"
TRACE_EVERY = 8  # decode steps between two points of the bytes trace


def kept_slots(cache) -> int:
    """Slots held, summed over layers (per KV head: a flat Ada-KV store counts its slots / heads)."""
    return sum(store.length // (getattr(store, "kv_heads", 1) or 1) for store in cache.kv_layers if store is not None)


def run_one(model, prompt: torch.Tensor, spec: str, new: int) -> dict[str, Any]:
    """Prefill ``prompt`` ``[1, P]`` into a fresh ``spec`` cache, then ``new`` greedy steps."""
    cache = make_cache(model, spec)
    trace: list[tuple[int, int]] = []
    with torch.inference_mode():
        logits = model(prompt, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
        after_prompt, before = cache.nbytes, cache.reallocations
        trace.append((prompt.shape[1], after_prompt))
        peak = after_prompt
        token = logits[:, -1:].argmax(-1)

        def decode() -> None:
            nonlocal token, peak
            for step in range(new):
                out = model(token, **cache_kwargs(model, cache), use_cache=True).logits
                token = out[:, -1:].argmax(-1)
                peak = max(peak, cache.nbytes)
                if (step + 1) % TRACE_EVERY == 0 or step + 1 == new:
                    trace.append((prompt.shape[1] + step + 1, cache.nbytes))

        seconds = clock(decode)
    return {
        "bytes_after_prompt": after_prompt,
        "bytes_end": cache.nbytes,
        "bytes_peak": peak,
        "kept_slots_end": kept_slots(cache),
        "reallocations_decode": cache.reallocations - before,
        "decode_tokens_per_s": new / seconds if seconds > 0 else float("inf"),
        "trace": trace,
    }


def run(
    options: RunOptions = RunOptions(),
    *,
    model: str | None = None,
    prompt: int | None = None,
    new: int | None = None,
    share: float = 0.5,
    kinds: list[str] | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``budget.json``/``budget.md``/``budget.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    names = list(kinds or KINDS)
    unknown = [k for k in names if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kind(s) {', '.join(unknown)}; valid: {', '.join(KINDS)}")
    prompt = prompt or options.pick(64, 1024, 4096)
    new = new or options.pick(24, 128, 1024)
    count = math.ceil(share * (prompt + new))
    lm, tokenizer, folder = load_model(model or options.pick("tiny", DEFAULT_MODEL, DEFAULT_MODEL), options.device)
    ids = make_prompts(tokenizer, 1, prompt, lm.config.vocab_size).to(options.device)
    rows = []
    bar = tqdm(total=2 * len(names), desc="budget", disable=not options.progress)
    with use_kvcache_attention(lm):
        for kind in names:
            for budget_type, budget in zip(BUDGET_TYPES, (share, count)):
                spec = KINDS[kind].format(budget=budget)
                bar.set_postfix_str(spec)
                contender = {"contender": f"{kind}/{budget_type}", "kind": kind, "budget_type": budget_type, "spec": spec}
                rows.append({**contender, **run_one(lm, ids, spec, new)})
                bar.update()
    bar.close()
    by_key = {(r["kind"], r["budget_type"]): r for r in rows}
    for r in rows:
        r["bytes_vs_count"] = r["bytes_end"] / by_key[(r["kind"], "count")]["bytes_end"]
    config = {
        "model": str(folder),
        "model_name": model or options.pick("tiny", DEFAULT_MODEL, DEFAULT_MODEL),
        "prompt_tokens": prompt,
        "new_tokens": new,
        "share": share,
        "count": count,
        "attention": "kvcache (use_kvcache_attention)",
        "dtype": str(next(lm.parameters()).dtype),
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("budget", options, config, rows, table, plot)


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    columns = {
        "kind": "kind",
        "spec": lambda r: f"`{r['spec']}`",
        "bytes after prompt": lambda r: human_bytes(r["bytes_after_prompt"]),
        "bytes at end": lambda r: human_bytes(r["bytes_end"]),
        "most held": lambda r: human_bytes(r["bytes_peak"]),
        "slots kept at end": "kept_slots_end",
        "bytes vs count": lambda r: f"{r['bytes_vs_count']:.3f}",
        "reallocations (decode, all layers)": "reallocations_decode",
        "decode tok/s": "decode_tokens_per_s",
    }
    return column_table(result["rows"], columns) + (
        f"\n{c['model_name']} ({c['dtype'].removeprefix('torch.')}), a {c['prompt_tokens']}-token prompt then "
        f"{c['new_tokens']} greedy tokens, kvcache attention; share {c['share']} of the tokens seen against the count "
        f"it reaches at the end ({c['count']}). Bytes: `cache.nbytes` (every allocated slot); slots: per KV head, "
        "summed over layers; one run each (tokens/s indicative).\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    rows = result["rows"]
    with figure(path, panels=2, size=(6.5, 4.5)) as (trace_ax, ratio_ax):
        for kind in ("snapkv", "adakv"):
            for r in rows:
                if r["kind"] == kind:
                    xs, ys = zip(*r["trace"])
                    style = "-" if r["budget_type"] == "share" else "--"
                    trace_ax.plot(xs, [y / 2**20 for y in ys], style, label=r["spec"])
        trace_ax.set_xlabel("tokens seen")
        trace_ax.set_ylabel("cache bytes, MiB")
        trace_ax.set_title(f"bytes held while decoding ({c['model_name']})")
        trace_ax.grid(True, alpha=0.3)
        trace_ax.legend(fontsize="small")
        shares = [r for r in rows if r["budget_type"] == "share"]
        ratio_ax.bar([r["kind"] for r in shares], [r["bytes_vs_count"] for r in shares])
        ratio_ax.axhline(1.0, color="black", linewidth=0.8)
        ratio_ax.set_ylabel("bytes at end / count budget's")
        ratio_ax.set_title(f"budget={c['share']} vs budget={c['count']}")
        ratio_ax.tick_params(axis="x", rotation=45)
        ratio_ax.grid(True, axis="y", alpha=0.3)
