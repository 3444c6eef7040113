"""Eviction policies: how a budgeted layer scores its slots. The lowest scores leave first.

A policy is a small object: ``initial`` scores new slots, ``observe`` folds in what one attention
pass saw. ``weights`` says what that pass must report (see ``attention.attend_weighted``): the
attention mass per KV head and slot summed over the pass's queries (``"sum"``), the last query's
alone (``"last"``), or nothing. Adding a scorer (SnapKV, a learned one) is one new class here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


#: Every policy by name, as used in specs (``"h2o:budget=1024"``) and saved files; each subclass
#: that names itself is added when it is defined, and is a spec kind at once (``registry.py``).
POLICIES: dict[str, type[Policy]] = {}


class Policy(ABC):
    name: ClassVar[str]
    #: What ``observe`` needs from the attention pass: None, "sum" or "last".
    weights: ClassVar[str | None] = None
    #: The share of the budget kept for the most recent tokens when the caller does not say.
    default_recent: ClassVar[float] = 0.0

    @abstractmethod
    def initial(self, positions: torch.Tensor) -> torch.Tensor:
        """Scores of new slots at ``positions`` ``[B, Hkv, n]``: float32 ``[B, Hkv, n]``."""

    def observe(self, scores: torch.Tensor, weights: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Scores after an attention pass: ``scores``, ``weights`` (float32) and ``positions``
        are ``[B, Hkv, N]`` over the slots that pass attended."""
        return scores

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            POLICIES[cls.name] = cls

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

    def observe(self, scores, weights, positions):
        return scores + weights


class LastQuery(Policy):
    """TOVA (Oren et al., 2024): the attention the newest query pays each slot, summed over the
    query heads that share the KV head; older queries are forgotten."""

    name = "tova"
    weights = "last"

    def initial(self, positions):
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

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


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
