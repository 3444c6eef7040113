"""What the engine tests compare with: each request's own greedy ``generate`` with ``DynamicCache``
(fp32), and the rule for near-ties.

The engine runs a request's tokens in batches of other rows (one matmul over all rows of a step)
and decodes through its paged kernel, so its logits may differ from a single-row ``generate`` in
the last bits (~1e-6 relative in float32). That changes a greedy token only where the reference's
two best logits are closer than that. The rule: the engine's tokens equal the reference's, except
that at the first step where they differ the reference's top-2 gap must be under ``NEAR_TIE``
(1e-4, two orders above the rounding); past that step the two runs continue from different tokens
and are not compared. ``same_or_near_tie`` returns 1 for such a divergence (tests count them and
bound the count), 0 for equal tokens, and fails the test otherwise.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvcache import cache_kwargs

NEAR_TIE = 1e-4


def ids(length: int, seed: int) -> list[int]:
    """``length`` random token ids in [3, 256) (no pad, bos or eos of the tiny models), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def reference(model, prompt: list[int], new_tokens: int, eos: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``prompt`` with a ``DynamicCache`` and the top-2 logit gap at each step."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            **cache_kwargs(model, DynamicCache(config=model.config)),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    return tokens, gaps


def same_or_near_tie(ours: list[int], expected: tuple[list[int], list[float]], what: str = "") -> int:
    tokens, gaps = expected
    for i, (a, b) in enumerate(zip(ours, tokens)):
        if a != b:
            assert gaps[i] < NEAR_TIE, (
                f"{what}: token {i} is {a}, the reference's {b}, and the reference's top-2 gap there is "
                f"{gaps[i]:.2e} (not a near tie); ours {ours}, reference {tokens}"
            )
            return 1
    assert len(ours) == len(tokens), f"{what}: {len(ours)} tokens, the reference has {len(tokens)}: {ours} vs {tokens}"
    return 0
