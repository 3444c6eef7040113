"""The demo's second part: many sessions at once through the engine, against ``generate`` one
session after another (:mod:`kvcache.apps.demo`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import PreTrainedModel

from .. import Engine, cache_kwargs
from . import tasks
from .bench.harness import alternate
from .contenders import make_contender
from .demo import first_line


#: Sessions the demo runs at once by default.
SESSIONS = 16

#: Prompt tokens of each session (the trained model's pass-key task).
SESSION_PROMPT_TOKENS = 512

#: Tokens each session generates (the answer is a few tokens; the rest shows decode speed).
SESSION_NEW_TOKENS = 24


def run_sessions(
    model: PreTrainedModel, tokenizer: Any, sessions: int = SESSIONS, repeats: int = 1, depth: float = 0.5,
    new_tokens: int = SESSION_NEW_TOKENS,
) -> dict[str, Any]:  # fmt: skip
    """The demo's second part: ``sessions`` pass-key prompts (one document each, its own key; the
    trained model) answered by ``model.generate`` with a ``DynamicCache``, one prompt after the other
    (what a script that loops over its users does), and by one ``kvcache.Engine`` that takes them all
    at once (continuous batching over one paged pool). Both are greedy, so the engine's tokens must be
    ``generate``'s for every session.

    Both ways over the same prompts, ``repeats`` times alternating (after one untimed run of
    each): ``sessions``, ``new_tokens`` (at most; both stop at the model's end of sequence),
    ``prompt_tokens``, ``generate_s`` / ``engine_s`` (medians), ``generate_tokens_per_s`` /
    ``engine_tokens_per_s`` (tokens made over the median time), ``speedup`` (their ratio), ``identical`` (the engine's
    tokens are ``generate``'s for every session, every repeat) and ``right`` / ``right_engine``
    (sessions whose first line is their key)."""
    if sessions < 1 or repeats < 1:
        raise ValueError(f"sessions and repeats must be >= 1, got {sessions} and {repeats}")
    # Seeds 100 on: not the first part's prompt.
    instances = [tasks.passkey(100 + i, length=SESSION_PROMPT_TOKENS - 1, depth=depth) for i in range(sessions)]
    prompts = [tokenizer.encode(i.prompt) for i in instances]
    engine = Engine(model, max_seqs=sessions, max_batch_tokens=1024)

    def one_after_another() -> list[list[int]]:
        out = []
        for ids in prompts:
            kwargs = cache_kwargs(model, make_contender("dynamic", model))
            got = model.generate(torch.tensor([ids]), **kwargs, max_new_tokens=new_tokens, do_sample=False)
            out.append(got[0, len(ids) :].tolist())
        return out

    ways = {"generate": one_after_another, "engine": lambda: engine.generate_batch(prompts, max_new_tokens=new_tokens)}

    def timed(name: str) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = ways[name]()
        return time.perf_counter() - start, tokens

    with torch.inference_mode():
        for way in ways.values():  # warm-up, untimed
            way()
        runs = alternate(list(ways), repeats, timed)
    seconds = {name: statistics.median(s for s, _ in runs[name]) for name in ways}
    # Tokens made: both ways stop at the model's end of sequence.
    rate = {name: sum(len(t) for t in runs[name][-1][1]) / seconds[name] for name in ways}

    def right(name: str) -> int:
        return sum(tasks.score(i.answer, first_line(tokenizer, t)) for i, t in zip(instances, runs[name][-1][1]))

    return {
        "sessions": sessions,
        "prompt_tokens": SESSION_PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "generate_s": seconds["generate"],
        "engine_s": seconds["engine"],
        "generate_tokens_per_s": rate["generate"],
        "engine_tokens_per_s": rate["engine"],
        "speedup": rate["engine"] / rate["generate"],
        "identical": all(e == g for (_, e), (_, g) in zip(runs["engine"], runs["generate"])),
        "right": right("generate"),
        "right_engine": right("engine"),
    }


def sessions_lines(result: dict[str, Any]) -> str:
    """The second part's lines: both ways' times and tokens/s, the ratio, the tokens check."""
    n, new = result["sessions"], result["new_tokens"]
    same = "yes" if result["identical"] else "NO"
    return "\n".join([
        f"{n} sessions at once, each its own {result['prompt_tokens']}-token document and pass key, up to {new} new tokens each:",
        f"  generate, one session after another (DynamicCache)  {result['generate_s']:6.2f} s  "
        f"{result['generate_tokens_per_s']:7.1f} tokens/s  keys right {result['right']}/{n}",
        f"  kvcache.Engine, all at once (one paged pool)         {result['engine_s']:6.2f} s  "
        f"{result['engine_tokens_per_s']:7.1f} tokens/s  keys right {result['right_engine']}/{n}",
        f"  the engine: {result['speedup']:.2f}x generate's throughput; its tokens identical to generate's: {same}",
    ])  # fmt: skip
