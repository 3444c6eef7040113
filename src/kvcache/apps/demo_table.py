"""The demo's report (:mod:`kvcache.apps.demo`): a header line and the table of its contenders."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

import kvcache

from .cli_options import text_table
from .demo import DEPTH, REFERENCE


def _kv_shape(model: Any) -> tuple[str, str]:
    """For a header line: the attention heads and the weights' dtype; the keys and values per token."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = next(model.parameters())
    per_token = 2 * c.num_key_value_heads * head_dim * weights.element_size() * c.num_hidden_layers
    dtype = str(weights.dtype).removeprefix("torch.")
    heads = f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads x {head_dim}, {dtype}"
    return heads, f"{per_token / 1024:g} KiB of KV per token"


def _versions() -> str:
    return f"kvcache {kvcache.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


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
    if family is not None:
        described = f"tiny {family} (random weights; "
        prompt = f"prompt {prompt_tokens}"
    else:
        n_params = sum(p.numel() for p in model.parameters())
        described = f"kvcache tiny retrieval model (trained, {n_params / 1e6:.2f}M parameters; "
        prompt = f"pass-key prompt {prompt_tokens} (key at depth {depth:g}, held-out text)"
    heads, per_token = _kv_shape(model)
    attn = getattr(c, "_attn_implementation", None) or "default"
    return (
        f"kvcache demo: {described}{c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads}; "
        f"DynamicCache on {attn} attention, kvcache on kvcache attention; {per_token}) | {prompt} + {new_tokens} new "
        f"tokens, batch 1, greedy, {_plural(repeats, 'repeat')} | {_versions()}, "
        f"{_plural(threads or torch.get_num_threads(), 'thread')}"
    )


def real_header_line(model: Any, where: str, prompt: torch.Tensor, text: str, new_tokens: int, repeats: int) -> str:
    """:func:`header_line` for :func:`run_real_demo`: the model, the prompt, the sizes, the versions."""
    heads, per_token = _kv_shape(model)
    n_params = sum(p.numel() for p in model.parameters())
    return (
        f"kvcache demo: {where} ({type(model).__name__}, {n_params / 1e6:.0f}M parameters, "
        f"{model.config.num_hidden_layers} layers, {heads}; {per_token}) | "
        f"prompt {text!r}, {prompt.shape[1]} tokens, + {new_tokens} new tokens, batch 1, greedy, "
        f"{_plural(repeats, 'repeat')} | {_versions()}, {torch.get_num_threads()} threads"
    )


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
    rows = [head + (("answer", "why") if answers else ())]
    rows += [
        (
            r["cache"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['cache_bytes'] / 2**20:.2f} MiB" + (f" ({r['cache_bytes'] / reference:.0%})" if reference else ""),
            str(r["reallocations"]),
            _identical_cell(r),
        )
        + ((_answer_cell(r), r.get("why", "")) if answers else ())
        for r in results
    ]
    lines = text_table(rows, right=(1, 2, 3, 4, 5))
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
