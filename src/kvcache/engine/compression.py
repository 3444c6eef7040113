"""Requests whose context, once their prompt is computed, lives in a bounded cache of their own.

A request of a bounded kind (``h2o``, ``tova``, ``snapkv``, ``adakv``, ``auto``, a ``storage=``
on any of them: every kind whose prompt pass attends every earlier token) computes its prompt in
the pool's full-precision blocks like any other, so its leading blocks are shared and registered.
The pass that computes the prompt's last chunk reports the attention weights its policy scores
by; the engine then makes the kind's own cache from the prompt's keys and values and those weights
(``scoring.compress``: the layers' own ``append`` then ``settle``, what ``generate`` does in the
prefill), and the prompt's blocks go back to the pool. From then on every step attends the
request's one new token through that cache's layers, which evict as they do under ``generate``:
what a request keeps is what ``make_cache`` of its spec keeps.

The prompt's weights come from the queries each mode reduces (``attend_weighted``): ``window:N``
(SnapKV and its kin) the last ``N``, so the prompt's last chunk holds at least ``N`` tokens;
``last`` (TOVA) the last one; ``sum`` (H2O) every query, so every chunk of the prompt reports and
adds its share, and no prompt block is reused (a reused block's queries were never run).

A ``window`` cache (StreamingLLM's sinks and sliding window) masks its prompt's own attention, so
its prompt is not computed in the pool: the request's own cache is made when it joins and takes
every chunk of the prompt itself (``prefills``), which a sliding window computes exactly chunk by
chunk; its blocks are never shared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.weights import first_weighted_row
from ..errors import UnsupportedOperation
from ..hf.build import make_cache
from ..hf.spec import CacheSpec
from ..layers.own_attention import OwnAttentionLayer

#: Kinds the engine does not build this way, and why.
REFUSED = {"kvzip": "KVzip scores the prompt by a second pass that reconstructs it, which the engine does not run; compress a "
                     "context once with kvcache.hf.kvzip.compress_context and generate from a fork of it"}


@dataclass(frozen=True)
class Compression:
    """How a prompt becomes a bounded cache of kind ``spec``: the weights ``modes`` its layers'
    prompt pass reports, the queries its last chunk must hold (``window``), whether every
    query of the prompt counts (``whole``: the ``sum`` mode), or whether the cache takes the prompt
    itself from the first chunk (``prefills``: a sliding window)."""

    spec: str
    modes: tuple[str, ...]
    window: int
    whole: bool
    prefills: bool = False

    def first_observed(self, prompt: int) -> int:
        """The first prompt position whose query this compression reads: no earlier block may be
        taken from the pool or the store without being computed."""
        return first_weighted_row(self.modes, prompt)

    def chunk_modes(self, last: bool) -> tuple[str, ...] | None:
        """The weights a prompt chunk reports (None: nothing): every mode, and its keys and values,
        in the last chunk (an empty tuple where no mode is read), ``sum`` in the others."""
        if last:
            return self.modes
        return ("sum",) if self.whole else None


def compression_for(model: Any, spec: CacheSpec, max_batch_tokens: int) -> Compression | None:
    """How ``spec``'s prompts are compressed (None: ``growable`` or ``quantized``, the pool's own
    block formats), or ``UnsupportedOperation`` naming why the engine cannot hold it."""
    if spec.kind in ("growable", "quantized"):
        return None
    if spec.kind in REFUSED:
        raise UnsupportedOperation(f"the engine does not serve {spec.kind!r} caches: {REFUSED[spec.kind]}")
    layers = [layer for layer in make_cache(model, spec).kv_layers if layer is not None]
    if not layers or not all(isinstance(layer, OwnAttentionLayer) for layer in layers):
        raise UnsupportedOperation(f"the engine serves growable blocks or bounded kinds; {spec.kind!r} is neither")
    if spec.kind == "window":
        return Compression(str(spec), (), 0, False, prefills=True)
    if any(layer.is_sliding for layer in layers):
        raise UnsupportedOperation("the engine compresses prompts of models whose layers all attend every earlier token")
    modes: set[str] = set()
    for layer in layers:
        asked = layer.weights_for(2)  # a prompt pass: more than one query
        modes.update((asked,) if isinstance(asked, str) else (asked or ()))
    unread = sorted(m for m in modes if m not in ("sum", "last") and not m.startswith("window:"))
    if unread:
        raise UnsupportedOperation(f"the engine does not report attention weights {unread} for {spec.kind!r}")
    window = max([int(m.split(":")[1]) for m in modes if re.fullmatch(r"window:\d+", m)] + [1 if modes else 0])
    if max_batch_tokens < window:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} cannot hold {spec.kind}'s observation window of {window} tokens")
    return Compression(str(spec), tuple(sorted(modes)), window, "sum" in modes)


def accumulate(held: dict[str, list[torch.Tensor]], reported: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """``held`` weights with one more chunk's ``reported`` added: ``sum`` adds over the keys both
    cover (the chunk's cover more: its own), any other mode is the newest chunk's."""
    out = dict(held)
    for mode, layers in reported.items():
        if mode != "sum" or mode not in held:
            out[mode] = layers
            continue
        summed = []
        for old, new in zip(held[mode], layers):
            total = new.clone()
            total[..., : old.shape[-1]] += old
            summed.append(total)
        out[mode] = summed
    return out
