"""The demo's report: the header line above its table, and the table of its results.

:func:`header_line` says what ran (the model and its key/value shape, the prompt, the sizes, the
library versions, the thread count); :func:`format_table` turns :func:`kvcache.apps.demo.run_demo`'s
result dicts into a plain-text table (decode tokens/s, speed against ``DynamicCache``, cache bytes
in MiB and as a share of the reference's, reallocations, whether the tokens match the
reference's, the answer and, for a bounded kind, why it keeps the key or loses it) with a legend.
``kvcache demo`` prints both, for the tiny models and (through :mod:`kvcache.apps.demo_real`) real ones.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

import kvcache

from .demo import DEPTH, REFERENCE

__all__ = ["format_table", "header_line"]


def _describe(model: PreTrainedModel, family: str | None) -> str:
    if family is not None:
        return f"tiny {family} (random weights; "
    n_params = sum(p.numel() for p in model.parameters())
    return f"kvcache tiny retrieval model (trained, {n_params / 1e6:.2f}M parameters; "


def header_line(
    model: PreTrainedModel,
    family: str | None,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    threads: int | None = None,
    depth: float = DEPTH,
) -> str:
    """One line: the model, the prompt, the sizes, and the library versions."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    attn = getattr(c, "_attn_implementation", None) or "default"
    per_token = 2 * c.num_key_value_heads * head_dim * next(model.parameters()).element_size() * c.num_hidden_layers
    threads = threads or torch.get_num_threads()
    prompt = (
        f"prompt {prompt_tokens}"
        if family is not None
        else f"pass-key prompt {prompt_tokens} (key at depth {depth:g}, held-out text)"
    )
    return (
        f"kvcache demo: {_describe(model, family)}{c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads x {head_dim}, {dtype}; DynamicCache on {attn} attention, kvcache on kvcache attention; "
        f"{per_token / 1024:g} KiB of KV per token) | {prompt} + {new_tokens} new tokens, batch 1, "
        f"greedy, {_plural(repeats, 'repeat')} | kvcache {kvcache.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {_plural(threads, 'thread')}"
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _identical_cell(result: dict[str, Any]) -> str:
    if result["cache"] == REFERENCE:
        return "reference" if result["identical"] else "NO: reference varies between repeats"
    if result["identical"]:
        return "yes"
    return "differs (bounded)" if result.get("bounded") else "NO"


def _answer_cell(result: dict[str, Any]) -> str:
    if result["correct"] is None:  # nothing to check it against (a real model's free answer)
        return repr(result["answer"].strip())
    return f"{'right' if result['correct'] else 'WRONG'}: {result['answer'].strip()!r}"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`run_demo`'s results, with a legend."""
    answers = any(r.get("answer") is not None for r in results)
    reference = next((r["cache_bytes"] for r in results if r["cache"] == REFERENCE), 0)
    head = ("cache", "tokens/s", f"vs {REFERENCE}", "cache bytes", "reallocations", "identical output")
    head += ("answer", "why") if answers else ()
    rows = [
        (
            r["cache"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            _mib(r["cache_bytes"]) + (f" ({r['cache_bytes'] / reference:.0%})" if reference else ""),
            str(r["reallocations"]),
            _identical_cell(r),
        )
        + ((_answer_cell(r), r.get("why", "")) if answers else ())
        for r in results
    ]
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows)]
    lines = []
    for i, row in enumerate([head, *rows]):
        cells = [cell.ljust(w) if j in (0, 6, 7) else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        f"tokens/s: decode, median over repeats; cache bytes: storage held at the end (share of {REFERENCE}'s); "
        "reallocations: times a layer's key/value storage moved, summed over layers (measured from storage pointers)"
    )
    if answers:
        specs = "; ".join(f"{r['cache']} = {r['spec']}" for r in results if r.get("bounded"))
        checked = any(r.get("correct") is not None for r in results)
        lines.append(
            f"answer: the first generated line{', right if it is the pass key' if checked else ''}. "
            f"Bounded caches ({specs}) report their own bytes and reallocations and may change the output."
        )
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
