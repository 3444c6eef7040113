"""The quality harness on a real model: ``kvcache eval --model smollm2``.

Needles in natural prose (``needles.py``: three pass keys per context at depths 0.1/0.5/0.9, one
question each, through the chat template), at several context lengths, for every cache kind and
budget; KL divergence and top-1 agreement with the full cache on held-out prose; bytes per token.

Two ways to use a bounded cache, both measured:

- ``question``: the question is part of the prompt, the cache compresses at the end of the prompt
  (the protocol of SnapKV, Ada-KV, PyramidKV: the compression may look at the question);
- ``context``: the document is compressed once, at its end, and each question is then appended
  to (a fork of) the compressed cache: what a prompt store serving many requests does. KVzip
  (``scoring.compress_context``) runs only this way.

How the model runs: each context's document is prefilled once into a ``scoring.recording_cache``
that records the attention weights every policy scores by; each question is fed once on a fork.
A bounded cache with the question in the prompt is then built by ``scoring.compress`` from the
keys, values and recorded weights, exactly as its own one-pass prefill would have left it (tests/
hf/test_scoring.py checks slots and tokens against each kind's own prefill); its answer is
decoded from the prompt's next token with the bounded cache itself. A sliding window masks its
own prompt pass, so it is prefilled for real. ``context`` runs compress the document, then feed
the question through the bounded cache. Greedy answers, scored by the first number in them.

Output: ``eval.json`` (``runs``: one row per answer or text sample; ``costs``: measured seconds
of a plain prefill, KVzip's repetition and a question pass, per length), ``eval.md``, ``eval.png``.

The pieces: :mod:`.eval_real_plan` (the kinds, their specs, the sizes, the plan of runs),
:mod:`.eval_real_weights` (the recorded attention weights and the needle's bookkeeping),
:mod:`.eval_real_context` (the model passes) and :mod:`.eval_real_report` (the tables and files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import needles
from .eval_real_context import measure_costs, run_context, text_runs
from .eval_real_plan import ANSWER_TOKENS, DEFAULT_CONTEXT_KINDS, DEFAULT_KINDS, SINKS, runs_for, setting, spec_of
from .eval_real_report import write
from .eval_real_weights import modes_for
from .run_options import RunOptions


def run(
    options: RunOptions = RunOptions(),
    *,
    model_name: str = "smollm2",
    needles_per_context: int = 1,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
    context_kinds: tuple[str, ...] = DEFAULT_CONTEXT_KINDS,
    budgets: tuple[float, ...] | None = None,
    lengths: tuple[int, ...] | None = None,
    contexts: int | None = None,
    text: bool = True,
) -> dict[str, Any]:
    """Run the harness (see the module docstring); ``text=False`` skips the held-out text runs
    (KL / top-1), e.g. for a run that adds lengths to another (``combine``)."""
    from tqdm.auto import tqdm

    from ..models import load

    s = setting(options)
    budgets = s.budgets if budgets is None else tuple(budgets)
    lengths = s.lengths if lengths is None else tuple(lengths)
    contexts = s.contexts if contexts is None else contexts
    model, tokenizer = load(model_name, device=options.device, progress=options.progress)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise ValueError(f"--lengths: {model_name} reads at most {limit} tokens, got {max(lengths)}")
    plan = runs_for(kinds, context_kinds, budgets)
    if needles_per_context not in (1, 3):
        raise ValueError(f"--needles: a context holds 1 or 3 needles, got {needles_per_context}")
    bar = tqdm(total=len(lengths) * contexts * needles_per_context * len(plan) + s.text_samples, desc="eval", disable=not options.progress)
    rows: list[dict[str, Any]] = []
    costs: dict[str, Any] = {}
    profiles: list[dict] = []
    for length in lengths:
        for c in range(contexts):
            ctx = needles.make_context(tokenizer, length, seed=c, count=needles_per_context)
            T = len(ctx.prefix_ids)
            capacity = T + max(len(q.ids) for q in ctx.questions) + ANSWER_TOKENS
            specs = {(k, b): spec_of(k, T if b is None else max(SINKS + 1, round(b * T)), capacity) for k, _, b in plan}
            doc_modes, q_modes = modes_for(model, list(specs.values()), [len(q.ids) for q in ctx.questions])
            bar.set_postfix_str(f"{length} tokens, context {c + 1}/{contexts}")
            got, info = run_context(model, tokenizer, ctx, plan, specs, doc_modes, q_modes, bar)
            rows += got
            profiles += [{"length": length, **p} for p in info["profiles"]]
            if c == 0:
                costs[str(length)] = {"document_tokens": T, **measure_costs(model, ctx), "repeat_seconds": info["repeat_seconds"]}
    text_rows = []
    for i in range(s.text_samples if text else 0):
        text_rows += text_runs(model, tokenizer, plan, s, seed=i)
        bar.update()
    bar.close()
    result = {
        "suite": "eval",
        "config": {"model": model_name, "lengths": list(lengths), "contexts": contexts, "questions_per_context": needles_per_context,
                   "depths": list(needles.DEPTHS), "budgets": list(budgets), "text": vars(s) | {"budgets": None},
                   "quick": options.quick, "tiny": options.tiny, "prose": "Python standard library docstrings (PSF License)"},
        "runs": rows,
        "text": text_rows,
        "costs": costs,
        "profiles": profiles,
    }
    if options.out is not None:
        write(result, Path(options.out))
    return result


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs over different lengths of the same kinds and budgets (rows, text
    rows, costs and profiles put together; the config of the first, with every length)."""
    out = json.loads(json.dumps(results[0], default=str))
    for r in results[1:]:
        out["runs"] += r["runs"]
        out["text"] += r["text"]
        out["costs"].update(r["costs"])
        out["profiles"] += r["profiles"]
        out["config"]["lengths"] = sorted(set(out["config"]["lengths"]) | set(r["config"]["lengths"]))
        out["config"]["contexts"] = {**_as_map(out["config"]), **_as_map(r["config"])}
    return out


def _as_map(config: dict[str, Any]) -> dict[str, int]:
    c = config["contexts"]
    return dict(c) if isinstance(c, dict) else {str(L): c for L in config["lengths"]}
