"""What the coded-block engine tests compare with: a request's greedy decode through Hugging Face's
own ``DynamicCache`` and attention, with the engine's storage rule applied by hand.

The rule (``kvcache/engine/block_io.py``, ``OpenBlockIO``): a block of ``bs`` tokens is quantized once the step
that filled it is over (keys per channel over the block, values per token in groups of ``group``
channels, as ``kvcache.formats.quant`` defines them); until then its tokens are exact. Here, after each
forward pass, every block that has filled since is replaced in every layer's ``DynamicCache``
tensors by its quantized-then-dequantized self. The prompt runs in the chunks the engine ran it in.

Near ties follow ``engine_reference.py``: the same ``(tokens, top-2 gaps)`` pair for
``same_or_near_tie``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvcache import cache_kwargs
from kvcache.formats import fp8 as e4m3
from kvcache.formats import quant


def coded_reference(
    model, prompt: list[int], new_tokens: int, bs: int, bits: int, group: int, chunks: list[int] | None = None,
    fp8: bool = False,
) -> tuple[list[int], list[float]]:
    """``fp8``: blocks coded as e4m3 (``kvcache.formats.fp8``) instead of ``bits``-bit integers."""
    chunks = chunks or [len(prompt)]
    assert sum(chunks) == len(prompt)
    cache = DynamicCache(config=model.config)
    tokens, gaps, done, coded = list(prompt), [], 0, 0
    with torch.inference_mode():
        for n in chunks:
            logits = _forward(model, cache, tokens[done : done + n], done)
            done += n
            coded = _code_filled(cache, coded, done, bs, bits, group, fp8)
        for _ in range(new_tokens):
            top = logits.float().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if len(gaps) == new_tokens:
                break
            logits = _forward(model, cache, tokens[-1:], done)
            done += 1
            coded = _code_filled(cache, coded, done, bs, bits, group, fp8)
    return tokens[len(prompt) :], gaps


def _forward(model, cache, ids: list[int], start: int) -> torch.Tensor:
    out = model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.arange(start, start + len(ids))[None],
        **cache_kwargs(model, cache),
        use_cache=True,
    )
    return out.logits[0, -1]


def _code_filled(cache: DynamicCache, coded: int, length: int, bs: int, bits: int, group: int, fp8: bool) -> int:
    """Quantize-dequantize blocks ``coded // bs`` up to the last full block of ``length`` tokens."""
    full = length // bs * bs
    if full <= coded:
        return coded
    for layer in cache.layers:
        for side, per_token in ((layer.keys, False), (layer.values, True)):
            for start in range(coded, full, bs):
                block = side[:, :, start : start + bs].float()
                if per_token and fp8:
                    block = e4m3.dequantize_per_token(e4m3.quantize_per_token(block, group), group)
                elif per_token:
                    block = quant.dequantize_per_token(quant.quantize_per_token(block, bits, group), group)
                elif fp8:
                    block = e4m3.dequantize_per_channel(e4m3.quantize_per_channel(block))
                else:
                    block = quant.dequantize_per_channel(quant.quantize_per_channel(block, bits))
                side[:, :, start : start + bs] = block.to(side.dtype)
    return full
