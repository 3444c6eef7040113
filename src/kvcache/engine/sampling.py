"""How the engine picks each request's next token: greedy (temperature 0), or sampled from the
softmax of the logits over ``temperature``, cut to the smallest set of tokens whose probability
reaches ``top_p`` (nucleus sampling), drawn with the request's own seeded generator (the same
seed and logits give the same tokens)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        """The request's generator (None when greedy): seeded by ``seed``, else at random."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.SystemRandom().getrandbits(63)
        return torch.Generator().manual_seed(seed % 2**63)


#: Logits per piece of ``greedy_tokens``' two-level search.
PIECE = 1024


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[n, V]`` logits (the first index of each row's maximum; a NaN
    counts as the maximum, as there), found in two levels: each piece of ``PIECE`` logits' maximum
    (a vectorised reduction), the first piece holding the row's maximum, the first index of it in
    that piece. torch's CPU argmax over a vocabulary is not vectorised: 1.3 ms against 0.18 for 16
    rows of 49,152 float32 logits, 2.0 against 0.33 in bfloat16 (2-core Xeon)."""
    n, vocab = logits.shape
    pieces = -(-vocab // PIECE)
    pad = pieces * PIECE - vocab
    x = logits if pad == 0 else torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    x = x.reshape(n, pieces, PIECE)
    best = x.amax(-1).argmax(-1)  # [n]: a row's first piece holding its maximum
    return best * PIECE + x[torch.arange(n, device=x.device), best].argmax(-1)


def choose(logits: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[n, V]``, row ``i`` by ``samplings[i]`` with ``generators[i]``."""
    greedy = greedy_tokens(logits).tolist()
    out = []
    for i, (s, g) in enumerate(zip(samplings, generators)):
        out.append(greedy[i] if s.greedy else _sample(logits[i], s, g))
    return out


def _sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p < 1:
        ordered, index = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # probability of the tokens ranked above each
        ordered[before >= s.top_p] = 0  # keeps the smallest prefix reaching top_p (the first always)
        probs = torch.zeros_like(probs).scatter_(0, index, ordered)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
