"""Eviction policies: how a budgeted layer scores its slots. The lowest scores leave first.

A policy is a small object: ``initial`` scores new slots, ``observe`` folds in what one attention
pass saw. ``weights_for(queries)`` says what a pass of that many queries must report (see
``attention.attend_weighted``): the attention mass per KV head and slot summed over the pass's
queries (``"sum"``), the last query's alone (``"last"``), the last N queries' (``"window:N"``), or
nothing. A policy may declare options of its own (``spec_options``: SnapKV's ``window`` and
``pool``), which specs, saved files and ``--help`` read through the layer (``EvictingLayer``);
``shared_heads`` keeps one set of positions per layer instead of one per KV head, and
``layer_budget`` lets the budget depend on the layer's depth (PyramidKV).

``POLICIES`` at the bottom lists every policy: each is an eviction spec kind (``registry.py``).
Adding a scorer is one new class here and one entry in that table (or, from outside the package,
``kvcache.layers.registry.register_policy``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .options import Option, number


class Policy(ABC):
    name: ClassVar[str]
    #: What ``observe`` needs from a multi-token attention pass: None, "sum", "last" or "window:N"
    #: (a policy whose window is an option sets it per instance).
    weights: str | None = None
    #: The share of the budget kept for the most recent tokens when the caller does not say.
    default_recent: ClassVar[float] = 0.0
    #: The policy's own options (name -> type and bound), with their defaults in ``defaults``.
    spec_options: ClassVar[dict[str, Option]] = {}
    defaults: ClassVar[dict[str, Any]] = {}
    #: One kept set per layer: the scores are averaged over the layer's KV heads after every pass,
    #: so every head of a row keeps the same positions (TOVA as its paper has it).
    shared_heads: ClassVar[bool] = False
    #: Whether the budget depends on the layer's depth (``layer_budget``), so a layer records it.
    by_depth: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.spec_options))
        if unknown:
            known = ", ".join(sorted(self.spec_options)) or "none"
            raise ValueError(f"eviction policy {self.name!r} has no option {unknown[0]!r} (its options: {known})")
        checked = {**self.defaults}
        for key, value in options.items():
            try:
                checked[key] = self.spec_options[key].coerce(value)
            except ValueError as e:
                raise ValueError(f"option {key!r} of eviction policy {self.name!r} {e}") from None
        self.settings: dict[str, Any] = checked

    def options(self) -> dict[str, Any]:
        """The policy's own options, defaults filled in (saved with the layer's)."""
        return dict(self.settings)

    def weights_for(self, queries: int) -> str | None:
        """What a pass of ``queries`` new tokens must report for ``observe`` (None: no observation)."""
        return self.weights

    def recent_for(self, budget: int) -> int:
        """Recent tokens protected when the caller does not say, under a budget of ``budget`` slots."""
        return int(self.default_recent * budget)

    def layer_budget(self, budget: int, reserved: int, depth: tuple[int, int] | None) -> int:
        """This layer's budget, given the uniform one (``budget`` slots, ``reserved`` of them
        protected) and the layer's ``depth`` (index, count of layers; None when unknown)."""
        return budget

    @abstractmethod
    def initial(self, positions: torch.Tensor) -> torch.Tensor:
        """Scores of new slots at ``positions`` ``[B, Hkv, n]``: float32 ``[B, Hkv, n]``."""

    def observe(self, scores: torch.Tensor, weights: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Scores after an attention pass: ``scores``, ``weights`` (float32) and ``positions``
        are ``[B, Hkv, N]`` over the slots that pass attended."""
        return scores

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.settings.items())})"


def _zeros(positions: torch.Tensor) -> torch.Tensor:
    return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)


class LastRecent(Policy):
    """Keep the most recent tokens: the score is the position (StreamingLLM without sinks)."""

    name = "lastrec"

    def initial(self, positions):
        return positions.to(torch.float32)


class HeavyHitters(Policy):
    """H2O (Zhang et al., 2023): the attention mass each slot has received, accumulated over every
    query since it arrived. Half the budget goes to recent tokens by default, as in the paper."""

    name = "h2o"
    weights = "sum"
    default_recent = 0.5

    def initial(self, positions):
        return _zeros(positions)

    def observe(self, scores, weights, positions):
        return scores + weights


class LastQuery(Policy):
    """TOVA (Oren et al., 2024): the attention the newest query pays each slot, summed over the
    query heads that share the KV head; older queries are forgotten."""

    name = "tova"
    weights = "last"

    def initial(self, positions):
        return _zeros(positions)

    def observe(self, scores, weights, positions):
        return weights.clone()


def pooled(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """``scores`` ``[B, H, N]`` max-pooled over each head's slots in position order (``positions``
    ``[B, H, N]``, distinct within a head), ``kernel`` slots wide and centred (SnapKV's clustering:
    a slot next to a strongly attended one is kept with it). ``kernel`` 1 returns the scores."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    order = positions.argsort(dim=-1)
    by_position = scores.gather(-1, order)
    b, h, n = by_position.shape
    padded = torch.nn.functional.max_pool1d(
        by_position.reshape(b * h, 1, n), kernel_size=kernel, stride=1, padding=kernel // 2, ceil_mode=False
    )[..., :n].reshape(b, h, n)
    return torch.empty_like(scores).scatter_(-1, order, padded)


class LayerLastQuery(LastQuery):
    """TOVA as its paper has it (Oren et al., 2024, "Transformers are Multi-State RNNs"): one kept
    set per layer, scored by the newest query's attention averaged over all the layer's heads (the
    mean over KV heads of each one's sum over its query heads: the same order), so every KV head
    of a row keeps the same positions. ``tova`` is the per-head variant."""

    name = "tova-layer"
    shared_heads = True


class ObservationWindow(Policy):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    At the end of every pass of several tokens (a prefill, or each chunk of a chunked prefill),
    each slot's score becomes the attention the pass's last ``window`` queries pay it (summed over
    those queries and the query heads of its KV head), max-pooled over the ``pool`` neighbouring
    positions of the same head (``pooled``); the layer then keeps the best ``budget`` per (row, KV
    head), the observation window itself protected (``recent`` defaults to ``window``, at most half
    the budget, so the scores always choose at least half of it).

    A decode step (one query) does not rescore: SnapKV compresses the prompt. When a fixed budget
    forces evictions later, the prompt's scores stay frozen and every generated token scores 0, so
    a generated token leaves as soon as it falls out of the protected recent tokens, before any
    prompt slot: the cache holds the prompt's chosen slots plus the last ``recent`` tokens.
    """

    name = "snapkv"
    spec_options = {"window": Option(int, least=1), "pool": Option(int, least=1)}
    defaults = {"window": 32, "pool": 7}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.window, self.pool = self.settings["window"], self.settings["pool"]
        self.weights = f"window:{self.window}"

    def weights_for(self, queries):
        return self.weights if queries > 1 else None

    def recent_for(self, budget):
        return min(self.window, budget // 2)

    def initial(self, positions):
        return _zeros(positions)

    def observe(self, scores, weights, positions):
        return pooled(weights, positions, self.pool)


class DepthPyramid(ObservationWindow):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling"): SnapKV's scoring, with budgets that shrink with depth.

    The slots the scores choose (a layer's budget less its protected ``reserved`` ones: the
    observation window, sinks) form an arithmetic sequence over the ``m`` layers, by the paper's
    budget formula: the top layer gets ``k^{m-1} = k / beta`` of the uniform share ``k``, the
    bottom one ``k^0 = 2k - k^{m-1}``, the layers between evenly spaced (steps of
    ``(k^0 - k^{m-1}) / (m - 1)``, as the authors' code has it, so the sequence's mean is ``k``;
    like that code, the window is kept in every layer on top of its share). The same total as a uniform budget
    over all layers, within rounding; a fraction of the tokens seen scales per layer the same way.
    ``beta`` (default 20, the paper's) flattens the pyramid as it grows; 1 makes it uniform.
    """

    name = "pyramidkv"
    spec_options = {**ObservationWindow.spec_options, "beta": Option(number, least=1)}
    defaults = {**ObservationWindow.defaults, "beta": 20}
    by_depth = True

    def layer_budget(self, budget, reserved, depth):
        chosen = budget - reserved
        if depth is None or depth[1] <= 1 or chosen <= 0:
            return budget
        index, count = depth
        top = 1 / self.settings["beta"]
        share = (2 - top) - (2 - 2 * top) * index / (count - 1)  # 2 - 1/beta at the bottom, 1/beta on top
        return reserved + max(1, math.floor(chosen * share + 0.5))


class RepeatScores(Policy):
    """KVzip's score read in one pass (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
    Compression with Context Reconstruction"): the largest attention weight each slot received from
    any query, summed over the query heads of its KV head, kept as a running maximum over passes.

    KVzip scores a context by the weights the model pays it while reconstructing it, and chooses
    once over every layer and head (``kvcache.hf.kvzip``); a layer in a pass of ``generate`` can do
    neither, and its only queries are the prompt's own. So the kind asks for that to be said:
    ``kvzip:budget=N,queries=prompt`` scores by the prompt's own queries (query-aware like H2O,
    with a maximum for a sum), and ``kvzip:budget=N`` alone is refused with a message that says
    how to run KVzip itself (:data:`REFUSAL`).

    The most recent ``RECENT`` tokens (at most half the budget) are protected, as SnapKV protects
    its observation window. Without that, a plain ``generate`` lost its question and every token it
    generated: under causal attention a query early in the prompt spreads its weight over few
    keys, so the early slots' maxima (0.5 and more) beat anything one later query pays a new token,
    and each generated token was evicted on arrival (the model answered "TheTheThe..."). KVzip
    itself compresses the context alone and never evicts the question or the answer; the
    protected tokens are what stands for that in a fixed budget."""

    name = "kvzip"
    weights = "max"
    spec_options = {"queries": Option(str)}
    #: Recent tokens protected by default (a question and the start of its answer).
    RECENT: ClassVar[int] = 32
    #: Why ``kvzip`` without ``queries=prompt`` is refused, and what to do instead.
    REFUSAL: ClassVar[str] = (
        "KVzip scores a context by having the model reconstruct it and chooses over every layer and head, which "
        "a cache in generate cannot do: compress the context with kvcache.hf.kvzip.compress_context(model, tokenizer, "
        "context_ids, ratio) and generate from a fork of it (docs/kinds.md); or add queries=prompt "
        "(kvzip:budget=N,queries=prompt) to score by the prompt's own queries, an approximation"
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.settings.get("queries") != "prompt":
            given = self.settings.get("queries")
            raise ValueError(self.REFUSAL if given is None else f"kvzip's queries= takes 'prompt' only, got {given!r}")

    def recent_for(self, budget):
        return min(self.RECENT, budget // 2)

    def initial(self, positions):
        return _zeros(positions)

    def observe(self, scores, weights, positions):
        return torch.maximum(scores, weights)


#: Every policy by name, as specs (``"h2o:budget=1024"``) and saved files name it: each one is an
#: eviction spec kind. The one table of policies; nothing is added by importing a module.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (LastRecent, HeavyHitters, LastQuery, LayerLastQuery, ObservationWindow, DepthPyramid, RepeatScores)
}


def get_policy(name: str, **options: Any) -> Policy:
    """The policy ``name`` with its own ``options`` (checked; ``ValueError`` naming a bad one)."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**options)
