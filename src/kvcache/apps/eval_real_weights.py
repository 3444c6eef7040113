"""The attention weights of the real-model eval, and what they and the caches say about a needle.

A bounded cache with the question in the prompt is built by ``scoring.compress`` from weights
recorded over the whole prompt, but the eval records them in two passes: the document once, then
each question on a fork. :func:`modes_for` says which weights (``scoring`` modes: ``"sum"``,
``"last"``, ``"window:N"``, ``"queries:N"``, ...) each pass must record so that every spec's can be
put together, and :func:`prompt_weights` puts them together. The rest is about the needle (a pass key in the
document): where its tokens sit (:func:`needle_span`), whether a cache still holds them
(:func:`needle_kept`), and how much of each head's attention they draw (:func:`attention_profile`).
Weights are per mode and layer, each ``[1, Hkv, T]`` (query rows ``[1, Hkv, group, N, D]``; None
for a layer that records none).
"""

from __future__ import annotations

import torch

from .. import make_cache
from ..attention import is_queries
from ..hf import scoring


def modes_for(model, specs: list[str], question_lengths: list[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modes the document pass records, modes a question pass records) so that every spec's
    weights can be put together: a ``window:N`` longer than a question reaches into the document."""
    wanted: set[str] = set()
    for spec in specs:
        try:
            cache = make_cache(model, spec)
        except Exception:
            continue
        for store in cache.kv_layers:
            mode = store.weights_for(2) if hasattr(store, "weights_for") else None  # what a prompt pass asks for
            wanted.update((mode,) if isinstance(mode, str) else mode or ())
    wanted.discard(scoring.KVZIP_MODE)  # kvzip's scores come from its own repetition pass
    document = set(wanted) | {"sum", "last"}
    for mode in wanted:
        kind, _, n = mode.partition(":")
        if kind in ("window", "queries"):
            document |= {f"{kind}:{int(n) - q}" for q in question_lengths if q < int(n)}
    return tuple(sorted(document)), tuple(sorted(wanted | {"sum", "last"}))


def _pad(w: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, length - w.shape[-1]))


def prompt_weights(doc: dict[str, list], question: dict[str, list], q_len: int) -> dict[str, list]:
    """Weights of the whole prompt (document + question) per mode and layer, from the two passes."""
    out: dict[str, list] = {}
    for mode, per_layer in question.items():
        layers = []
        for i, w in enumerate(per_layer):
            if w is None:
                layers.append(None)
                continue
            total = w.shape[-1]
            if mode == "sum":
                w = w + _pad(doc["sum"][i], total)
            elif mode.startswith("window:") and int(mode[7:]) > q_len:
                w = w + _pad(doc[f"window:{int(mode[7:]) - q_len}"][i], total)
            elif mode.startswith("queries:") and int(mode[8:]) > q_len:  # the document's last rows, then the question's
                w = torch.cat([doc[f"queries:{int(mode[8:]) - q_len}"][i], w], dim=3)
            layers.append(w)
        out[mode] = layers
    return out


def recorded_weights(cache, modes) -> dict[str, list]:
    """Copies of what the recording ``cache`` (``scoring.recording_cache``) holds, per mode in ``modes`` and layer."""
    return {m: [None if w is None else w.clone() for w in scoring.recorded(cache, m)] for m in modes}


def needle_span(prefix: list[int], key_ids: list[int]) -> tuple[int, int] | None:
    """Where the key's tokens first sit in the document, or None."""
    n = len(key_ids)
    for start in range(len(prefix) - n + 1):
        if prefix[start : start + n] == key_ids:
            return start, start + n
    return None


def needle_kept(cache, span: tuple[int, int] | None) -> float | None:
    """The share of (layer, KV head) pairs of batch row 0 that still hold every token of the
    needle's key; None for caches that keep every token or do not say which (full, quantized)."""
    if span is None:
        return None
    wanted = torch.arange(*span)
    kept, pairs = 0, 0
    for store in cache.kv_layers:
        kind = getattr(store, "kind", None)
        if kind == "evicting":
            per_head = list(store.positions()[0])  # Hkv x [N]
        elif kind in ("adakv", "auto-heads"):  # a flat store: each slot names its head
            pos, head = store.positions()[0, 0], store.heads()[0, 0]
            per_head = [pos[head == h] for h in range(int(store.head_lengths().shape[-1]))]
        else:
            continue
        for pos in per_head:
            kept += bool((pos.unsqueeze(-1) == wanted.to(pos.device)).any(dim=0).all())
            pairs += 1
    return kept / pairs if pairs else None


def attention_profile(weights: dict[str, list], span: tuple[int, int], total: int) -> dict[str, list[list[float]]]:
    """Per mode, per layer and KV head: the share of the mode's attention mass on the needle's
    tokens divided by its share of the slots (1 = no preference), and the needle's best rank
    among all slots (0 = the most attended) as a fraction of them."""
    out: dict[str, list[list[float]]] = {}
    lo, hi = span
    for mode, per_layer in weights.items():
        if is_queries(mode):  # query rows, not weights over the slots
            continue
        lift, rank = [], []
        for w in per_layer:
            if w is None:
                continue
            w = w[0, :, :total].float()  # [Hkv, T]
            mass = w[:, lo:hi].sum(-1) / w.sum(-1).clamp_min(1e-12)
            lift.append((mass / ((hi - lo) / total)).tolist())
            order = w.argsort(dim=-1, descending=True).argsort(dim=-1)  # rank of each slot
            rank.append((order[:, lo:hi].min(dim=-1).values.float() / total).tolist())
        out[mode] = {"lift": lift, "rank": rank}
    return out
