"""Log-probabilities of tokens, as the OpenAI API reports them: each token's own under the model's
distribution (the raw logits' log-softmax, before temperature or top-p), with the ``top`` most
likely alternatives at that place.

The engine computes them from the logits of the forward pass it runs anyway: a generated token's
from the row that chose it, a prompt token's (``prompt_logprobs``) from the logits of the
position before it, kept in the pass that fills the cache with that position (no second pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import Request

#: The most alternatives a request may ask for per token.
MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    """``token``'s log-probability at its place, and the ``top`` alternatives ``(token, logprob)``,
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(name: str, value: int | None) -> int | None:
    """``value`` as a count of alternatives (None: nothing asked), or ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP}] or None, got {value!r}")
    return value


def scored(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under row ``i`` of ``logits`` ``[n, V]``, with ``top``
    alternatives each."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    own = logp.gather(-1, torch.tensor(tokens, device=logp.device).view(-1, 1)).squeeze(-1).tolist()
    if top:
        values, index = logp.topk(top, dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
    else:
        alts = [()] * len(tokens)
    return [TokenLogprob(t, p, a) for t, p, a in zip(tokens, own, alts)]


def record(picked: list[Request], logits: torch.Tensor, chosen: list[int], scoring: list[tuple[Request, int, int]],
           prompt_logits: torch.Tensor) -> None:  # fmt: skip
    """Record the log-probabilities asked for: of each chosen token (``logits`` ``[len(picked), V]``)
    and of the prompt tokens scored in this pass (``scoring``: per request, the row of its chunk's
    first token and how many of its positions score the next prompt token; ``prompt_logits``
    those rows' logits, in that order). Written before the tokens are committed."""
    for i, request in enumerate(picked):
        if request.logprobs is not None:
            request.token_logprobs += scored(logits[i : i + 1], [chosen[i]], request.logprobs)
    row = 0
    for request, _, count in scoring:
        first = request.computed + 1  # the first prompt token this chunk's logits score
        found = scored(prompt_logits[row : row + count], request.prompt[first : first + count], request.prompt_logprobs)
        request.prompt_scores[first : first + count] = found
        row += count
