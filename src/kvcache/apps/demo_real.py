"""``kvcache demo --model NAME|DIR``: the demo's contenders on a real pretrained model.

The prompt is one short user message, put through the tokenizer's chat template where it has one
(SmolLM2-Instruct does), else the plain text. The contenders are the demo's unbounded ones
(``DynamicCache`` the reference, ``concat``, ``growable``, ``static``), whose replies must be
DynamicCache's token for token, and the quantized caches of :data:`QUANTIZED`, which round what
they hold and may reply differently. Timing, bytes and reallocations are measured as in
:mod:`kvcache.apps.demo`, and the results make its table (:mod:`kvcache.apps.demo_table`).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

import kvcache

from .contenders import spec_for
from .demo import Contender, contenders, results_of, run_contenders, torch_threads

__all__ = ["DEFAULT_PROMPT", "QUANTIZED", "chat_prompt", "header_line", "reply_of", "run_real_demo"]

#: The user message the real model answers by default.
DEFAULT_PROMPT = "In two sentences, why do language models cache keys and values when they generate text?"

#: Table name -> contender name of the quantized caches that run beside the unbounded ones.
QUANTIZED: dict[str, str] = {"quantized int8": "quantized-int8", "quantized int4": "quantized-int4"}


def chat_prompt(tokenizer: Any, text: str) -> torch.Tensor:
    """``text`` as a user turn of the tokenizer's chat template (generation prompt added), else as
    plain text: token ids ``[1, T]``."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
    else:
        ids = tokenizer.encode(text)
    return torch.tensor([list(ids)], dtype=torch.long)


def run_real_demo(
    model: Any,
    tokenizer: Any,
    text: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    repeats: int = 3,
    *,
    progress: bool = True,
    threads: int | None = None,
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Each contender ``repeats`` times, round-robin, answering ``text``: the result dicts of
    :func:`kvcache.apps.demo.run_demo` (``answer`` the reply's first line, ``correct`` None) and the
    prompt ids ``[1, T]``."""
    for name, value, least in (("new_tokens", new_tokens, 2), ("repeats", repeats, 1)):
        if int(value) < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    prompt = chat_prompt(tokenizer, text)
    entries = contenders(model, prompt.shape[1], new_tokens, bounded=False)
    for name, contender in QUANTIZED.items():
        spec = spec_for(contender)
        entries[name] = Contender(spec, lambda spec=spec: kvcache.make_cache(model, spec), bounded=True)
    with torch_threads(threads):
        runs, caches = run_contenders(model, prompt, entries, new_tokens, repeats, progress)
    results = results_of(entries, runs, caches, None, tokenizer)
    for result in results:
        tokens = runs[result["cache"]][-1]["tokens"]
        result["reply"] = reply_of(tokenizer, tokens)
        result["answer"], result["correct"] = result["reply"].strip().split("\n", 1)[0], None
    return results, prompt


def reply_of(tokenizer: Any, tokens: list[int]) -> str:
    """The generated text up to the first end-of-sequence token (``generate`` ran on past it)."""
    eos = tokenizer.eos_token_id
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def header_line(model: Any, where: str, prompt: torch.Tensor, text: str, new_tokens: int, repeats: int) -> str:
    """One line: the model, the prompt, the sizes, and the library versions."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = next(model.parameters())
    per_token = 2 * c.num_key_value_heads * head_dim * weights.element_size() * c.num_hidden_layers
    n_params = sum(p.numel() for p in model.parameters())
    return (
        f"kvcache demo: {where} ({type(model).__name__}, {n_params / 1e6:.0f}M parameters, "
        f"{c.num_hidden_layers} layers, {c.num_attention_heads} query / {c.num_key_value_heads} KV heads x "
        f"{head_dim}, {str(weights.dtype).removeprefix('torch.')}; {per_token / 1024:g} KiB of KV per token) | "
        f"prompt {text!r}, {prompt.shape[1]} tokens, + {new_tokens} new tokens, batch 1, greedy, "
        f"{repeats} repeat{'s' * (repeats != 1)} | kvcache {kvcache.__version__}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads"
    )
