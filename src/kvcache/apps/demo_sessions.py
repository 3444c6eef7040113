"""The demo's second part: many sessions at once through the engine, against ``generate`` one
session after the other.

``sessions`` pass-key prompts (one document each, its own key; the trained model) are answered
twice, alternating which goes first over the repeats: by ``model.generate`` with a
``DynamicCache``, one prompt after the other (what a script that loops over its users does), and
by one ``kvcache.Engine`` that takes them all at once (continuous batching over one paged pool).
Both are greedy, so the engine's tokens must equal ``generate``'s for every session. Measured as it
runs: the wall time of each way (median over repeats), output tokens per second, and the answers
that are the session's pass key.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import PreTrainedModel

from .. import Engine, cache_kwargs
from . import tasks
from .contenders import make_contender

__all__ = ["SESSIONS", "run_sessions", "sessions_lines"]

#: Sessions the demo runs at once by default.
SESSIONS = 16

#: Prompt tokens of each session (the trained model's pass-key task).
SESSION_PROMPT_TOKENS = 512

#: Tokens each session generates (the answer is a few tokens; the rest shows decode speed).
SESSION_NEW_TOKENS = 24


def _prompts(tokenizer: Any, sessions: int, depth: float) -> tuple[list[list[int]], list[str]]:
    """``sessions`` prompts' token ids and their keys (seeds 100 on: not the first part's prompt)."""
    instances = [tasks.passkey(100 + i, length=SESSION_PROMPT_TOKENS - 1, depth=depth) for i in range(sessions)]
    return [tokenizer.encode(i.prompt) for i in instances], [i.answer for i in instances]


def _sequential(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        cache = make_contender("dynamic", model)
        got = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=new_tokens, do_sample=False)
        out.append(got[0, prompt.shape[1] :].tolist())
    return out


def run_sessions(
    model: PreTrainedModel, tokenizer: Any, sessions: int = SESSIONS, repeats: int = 1, depth: float = 0.5,
    new_tokens: int = SESSION_NEW_TOKENS,
) -> dict[str, Any]:  # fmt: skip
    """Both ways over the same prompts, ``repeats`` times alternating (after one untimed run of
    each): ``sessions``, ``new_tokens`` (at most; both stop at the model's end of sequence),
    ``prompt_tokens``, ``generate_s`` / ``engine_s`` (medians), ``generate_tokens_per_s`` /
    ``engine_tokens_per_s`` (tokens made over the median time), ``speedup`` (their ratio), ``identical`` (the engine's
    tokens are ``generate``'s for every session, every repeat) and ``right`` / ``right_engine``
    (sessions whose first line is their key)."""
    if sessions < 1 or repeats < 1:
        raise ValueError(f"sessions and repeats must be >= 1, got {sessions} and {repeats}")
    prompts, keys = _prompts(tokenizer, sessions, depth)
    engine = Engine(model, max_seqs=sessions, max_batch_tokens=1024)

    ways = {
        "generate": lambda: _sequential(model, prompts, new_tokens),
        "engine": lambda: engine.generate_batch(prompts, max_new_tokens=new_tokens),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[list[list[int]]]] = {name: [] for name in ways}
    with torch.inference_mode():
        for name, way in ways.items():  # warm-up, untimed
            way()
        for r in range(repeats):
            for name in list(ways)[r % 2 :] + list(ways)[: r % 2]:
                start = time.perf_counter()
                tokens[name].append(ways[name]())
                times[name].append(time.perf_counter() - start)
    generate_s, engine_s = statistics.median(times["generate"]), statistics.median(times["engine"])
    made = {name: sum(len(t) for t in runs[-1]) for name, runs in tokens.items()}  # both stop at the model's eos

    def right(runs: list[list[int]]) -> int:
        return sum(tasks.score(key, tokenizer.decode(t, skip_special_tokens=True).split("\n", 1)[0]) for key, t in zip(keys, runs))

    return {
        "sessions": sessions,
        "prompt_tokens": SESSION_PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "generate_s": generate_s,
        "engine_s": engine_s,
        "generate_tokens_per_s": made["generate"] / generate_s,
        "engine_tokens_per_s": made["engine"] / engine_s,
        "speedup": (made["engine"] / engine_s) / (made["generate"] / generate_s),
        "identical": all(e == g for e, g in zip(tokens["engine"], tokens["generate"])),
        "right": right(tokens["generate"][-1]),
        "right_engine": right(tokens["engine"][-1]),
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
