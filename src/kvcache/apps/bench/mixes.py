"""Suite ``mixes``: decode speed of the byte-budget mixes against an fp32 growable cache.

A smaller cache should not decode slower: a mix that keeps fewer tokens, or codes them, reads
fewer bytes per step. Workload: a real model (SmolLM2-135M-Instruct by default; ``--tiny``: the
shipped small model), one prompt of real text (``workload.make_prompts``) of ``context`` tokens
prefilled into each contender's cache in one pass (its own compression, as ``generate`` does),
then greedy decode steps, timed in ``rounds`` of ``steps`` steps, the contenders alternating
within each round (each cache goes on from where its last round stopped). Per contender: median
milliseconds per step over the rounds, that over the growable cache's, and ``cache.nbytes`` after
the last step as a share of an fp32 cache of the same tokens.

Contenders (:data:`CONTENDERS`): ``growable`` (fp32, every token, the reference), ``auto`` at
0.125 and 0.0625 of the fp32 bytes, ``snapkv`` in fp32 at 0.125 (full-precision eviction as
kvpress does it), ``snapkv`` over int4 slots keeping the tokens 0.125 affords, and
``quantized:bits=4`` (every token coded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvcache import cache_kwargs

from ... import make_cache, use_kvcache_attention
from ..run_options import RunOptions
from .common import clock, figure, human_bytes, markdown_table, median
from .harness import report
from .workload import load_model, make_prompts

#: contender -> spec (``{slots:storage:share}``: the tokens ``share`` of the fp32 bytes affords in ``storage``).
CONTENDERS: dict[str, str] = {
    "growable": "growable",
    "auto 0.125": "auto:bytes=0.125",
    "auto 0.0625": "auto:bytes=0.0625",
    "snapkv fp32 0.125": "snapkv/full@0.125",
    "snapkv int4 0.125": "snapkv/int4@0.125",
    "quantized int4": "quantized:bits=4",
}
REFERENCE = "growable"


def spec_of(contender: str, tokens: int, model: Any) -> str:
    """The spec of ``contender`` for a prompt of ``tokens`` (fixed mixes sized as the frontier sizes them)."""
    from ..frontier_points import geometry_of, spec_for

    spec = CONTENDERS[contender]
    if "@" not in spec:
        return spec
    mix, share = spec.split("@")
    return spec_for(mix, float(share), tokens, geometry_of(model))


def fp32_bytes(cache) -> int:
    """Bytes an fp32 cache of every token seen would take."""
    from ...layers import fp32_bytes as per_token

    return sum(per_token(l.geometry) * l.geometry.batch * l.geometry.heads * l.seen
               for l in cache.kv_layers if l is not None and l.geometry is not None)  # fmt: skip


def run(options: RunOptions = RunOptions(), *, model: str | None = None, context: int | None = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    context = context or options.pick(96, 2048, 4096)
    steps, rounds = options.pick((4, 2), (8, 3), (16, 5))
    name = model or options.pick("tiny", "smollm2", "smollm2")
    lm, tokenizer, folder = load_model(name, options.device)
    ids = make_prompts(tokenizer, 1, context, lm.config.vocab_size).to(options.device)
    specs = {c: spec_of(c, context, lm) for c in CONTENDERS}
    caches, tokens, times = {}, {}, {c: [] for c in CONTENDERS}
    bar = tqdm(total=len(CONTENDERS) * (1 + rounds), desc="mixes", disable=not options.progress)
    with torch.inference_mode(), use_kvcache_attention(lm):
        for c, spec in specs.items():
            caches[c] = make_cache(lm, spec)
            logits = lm(ids, **cache_kwargs(lm, caches[c]), use_cache=True, logits_to_keep=1).logits
            tokens[c] = logits[:, -1:].argmax(-1)
            bar.update()
        for _ in range(rounds):
            for c in CONTENDERS:

                def decode(c: str = c) -> None:
                    for _ in range(steps):
                        tokens[c] = lm(tokens[c], **cache_kwargs(lm, caches[c]), use_cache=True).logits[:, -1:].argmax(-1)

                times[c].append(clock(decode, options.device) / steps)
                bar.update()
    bar.close()
    ref = median(times[REFERENCE])
    rows = []
    for c in CONTENDERS:
        ms = median(times[c])
        rows.append({"contender": c, "spec": specs[c], "ms_per_step": 1000 * ms, "vs_growable": ms / ref, "nbytes": caches[c].nbytes,
                     "bytes_share": caches[c].nbytes / fp32_bytes(caches[c]), "samples_ms": [1000 * t for t in times[c]]})  # fmt: skip
    config = {"model": str(folder), "model_name": name, "context": context, "steps_per_round": steps, "rounds": rounds,
              "dtype": str(next(lm.parameters()).dtype), "threads": torch.get_num_threads(), "quick": options.quick, "tiny": options.tiny}  # fmt: skip
    return report("mixes", options, config, rows, table, plot)


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    body = [[r["contender"], f"`{r['spec']}`", f"{r['ms_per_step']:.1f}", f"{r['vs_growable']:.2f}x", human_bytes(r["nbytes"]),
             f"{r['bytes_share']:.3f}"] for r in result["rows"]]  # fmt: skip
    return markdown_table(["contender", "spec", "ms / step (median)", "vs growable", "cache bytes", "of fp32"], body) + (
        f"\n{c['model_name']} ({c['dtype'].removeprefix('torch.')}, {c['threads']} threads), a {c['context']}-token prompt "
        f"prefilled into each cache, then {c['rounds']} rounds of {c['steps_per_round']} greedy steps, contenders alternating; "
        "kvcache attention for every contender.\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["rows"]
    with figure(path, panels=1, size=(7.5, 4.5)) as (ax,):
        ax.scatter([r["bytes_share"] for r in rows], [r["ms_per_step"] for r in rows])
        for r in rows:
            ax.annotate(r["contender"], (r["bytes_share"], r["ms_per_step"]), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache bytes, share of fp32")
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title(f"{result['config']['model_name']}: decode speed against bytes at {result['config']['context']} tokens")
        ax.grid(True, alpha=0.3)
