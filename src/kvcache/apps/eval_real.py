"""The quality harness on a real model: ``kvcache eval --model smollm2``.

Needles in natural prose (``needles.py``: three pass keys per context at depths 0.1/0.5/0.9, one
question each, through the chat template), at several context lengths, for every cache kind and
budget; KL divergence and top-1 agreement with the full cache on held-out prose; bytes per token.

Two ways to use a bounded cache, both measured:

- ``question``: the question is part of the prompt, the cache compresses at the end of the prompt
  (the protocol of SnapKV, Ada-KV, PyramidKV: the compression may look at the question);
- ``context``: the document is compressed once, at its end, and each question is then appended
  to (a fork of) the compressed cache: what a prompt store serving many requests does. KVzip
  (``hf/kvzip.py``: the model reconstructs the document, one choice over every layer and head)
  runs only this way, its budget the share of the document kept.

How the model runs: each context's document is prefilled once into a ``scoring.recording_cache``
that records the attention weights every policy scores by; each question is fed once on a fork.
A bounded cache with the question in the prompt is then built by ``scoring.compress`` from the
keys, values and recorded weights, exactly as its own one-pass prefill would have left it (tests/
hf/test_scoring.py checks slots and tokens against each kind's own prefill); its answer is
decoded from the prompt's next token with the bounded cache itself. A sliding window masks its
own prompt pass, so it is prefilled for real. ``context`` runs compress the document, then feed
the question through the bounded cache. Greedy answers, scored by the first number in them.

The weights of the two passes (per ``scoring`` mode: ``"sum"``, ``"last"``, ``"window:N"``,
``"queries:N"``, ...; per layer ``[1, Hkv, T]``, query rows ``[1, Hkv, group, N, D]``, None for a
layer that records none) add up to the whole prompt's (:func:`modes_for`, :func:`prompt_weights`).
Token ids are ``[1, T]`` tensors on the model's device; times are seconds of ``time.perf_counter``.

Output: ``eval.json`` (``runs``: one row per answer or text sample; ``costs``: measured seconds
of a plain prefill, KVzip's repetition and a question pass, per length), ``eval.md``, ``eval.png``.
The report (:func:`.eval_real_report.summary`) folds the rows into one line per ``(cache, mode, budget)``: the share
of needles found per context length and per depth, the share of (layer, KV head) pairs that kept
the needle, KL divergence (nats) and top-1 agreement with the full cache, and bytes per token.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import torch

from kvcache import cache_kwargs

from .. import make_cache, use_kvcache_attention
from ..attention import is_queries
from ..errors import KVCacheError
from ..hf import kvzip, scoring
from ..layers import mix_of
from . import needles
from .eval import kl_and_top1
from .eval_real_plan import ANSWER_TOKENS, DEFAULT_CONTEXT_KINDS, DEFAULT_KINDS, SINKS, Setting, runs_for, setting, spec_of
from .eval_real_report import write
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
            bar.set_postfix_str(f"{length} tokens, context {c + 1}/{contexts}")
            got, info = run_context(model, tokenizer, ctx, plan, specs, bar)
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


# ---- the recorded weights, and the needle ------------------------------------------------------


def modes_for(model, specs: list[str], question_lengths: list[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modes the document pass records, modes a question pass records) so that every spec's
    weights can be put together: a ``window:N`` longer than a question reaches into the document."""
    wanted: set[str] = set()
    for spec in specs:
        try:
            cache = make_cache(model, spec)
        except KVCacheError:  # a spec this model refuses records nothing; its own run says why
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


def prompt_weights(doc: dict[str, list], question: dict[str, list], q_len: int) -> dict[str, list]:
    """Weights of the whole prompt (document + question) per mode and layer, from the two passes."""
    out: dict[str, list] = {}
    for mode, per_layer in question.items():
        kind, _, n = mode.partition(":")
        layers = []
        for i, w in enumerate(per_layer):
            if w is not None and (mode == "sum" or kind == "window" and int(n) > q_len):
                before = doc["sum" if mode == "sum" else f"window:{int(n) - q_len}"][i]
                w = w + torch.nn.functional.pad(before, (0, w.shape[-1] - before.shape[-1]))
            elif w is not None and kind == "queries" and int(n) > q_len:  # the document's rows, then the question's
                w = torch.cat([doc[f"queries:{int(n) - q_len}"][i], w], dim=3)
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


# ---- the model passes --------------------------------------------------------------------------


def chosen_storages(cache) -> dict[str, int] | None:
    """For an ``auto`` cache, how many layers chose each storage; None for other kinds."""
    return dict(collections.Counter(m["storage"] for m in mix_of(cache) if m is not None)) or None


def _decode(model, cache, first: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``first`` ``[1, 1]`` (inclusive of it), one pass each."""
    out, token = [int(first)], first
    for _ in range(steps - 1):
        logits = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
    return out


def answer_after(model, cache, ids: list[int], steps: int) -> list[int]:
    """Feed ``ids`` through ``cache`` (a real pass), then decode greedily."""
    logits = model(torch.tensor([ids], device=model.device), **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    return _decode(model, cache, logits.argmax(-1, keepdim=True), steps)


@torch.inference_mode()
def run_context(
    model, tokenizer, ctx: needles.Context, plan, specs, bar=None, judge=None, answer_tokens: int = ANSWER_TOKENS
) -> tuple[list[dict], dict]:
    """Every run's answers for one context (``specs``: each ``(kind, budget)``'s spec); and the
    measured costs and attention profiles. ``judge(question, text)``: whether a generated text
    answers a question (default: its first whole number is the key); ``answer_tokens``: tokens
    decoded per answer."""
    if judge is None:
        judge = lambda q, text: needles.answer_of(text) == q.key  # noqa: E731
    doc_modes, q_modes = modes_for(model, list(specs.values()), [len(q.ids) for q in ctx.questions])
    device = model.device
    rows: list[dict[str, Any]] = []
    prefix = torch.tensor([ctx.prefix_ids], device=device)
    T = len(ctx.prefix_ids)
    info: dict[str, Any] = {"profiles": []}
    with use_kvcache_attention(model):
        wants_kvzip = any(k == "kvzip" for k, _, _ in plan)
        rec = scoring.recording_cache(model, doc_modes + ((kvzip.ALL_QUERIES,) if wants_kvzip else ()))
        model(prefix, **cache_kwargs(model, rec), use_cache=True)
        doc_weights = recorded_weights(rec, doc_modes)
        started = time.perf_counter()
        start = kvzip.opening(tokenizer, ctx.prefix_ids)
        zipped = kvzip.score_recorded(model, tokenizer, rec, ctx.prefix_ids, start) if wants_kvzip else None
        info["repeat_seconds"] = time.perf_counter() - started
        doc_kv = scoring.keys_values(rec)

        spans = {q.key: needle_span(ctx.prefix_ids, tokenizer(" " + q.key, add_special_tokens=False)["input_ids"]) for q in ctx.questions}

        def emit(kind, mode, budget, spec, q, tokens, cache, kept):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            rows.append({
                "length": ctx.length, "context": ctx.seed, "tokens": T + len(q.ids), "cache": kind, "mode": mode,
                "budget": budget, "spec": spec, "depth": q.depth, "door": q.door,
                "correct": bool(judge(q, text)), "answer": text.strip(),
                "bytes_per_token": cache.nbytes / cache.seen, "needle_kept": kept, "storages": chosen_storages(cache),
            })
            if bar is not None:
                bar.update()

        # The reuse way: compress the document once, then each question through the bounded cache.
        for kind, mode, budget in plan:
            if mode != "context":
                continue
            spec = specs[(kind, budget)]
            room = max(len(q.ids) for q in ctx.questions) + answer_tokens  # what follows the document
            shared = _document_cache(model, kind, spec, prefix, doc_kv, doc_weights, zipped, budget, room)
            for q in ctx.questions:
                cache = shared.fork()
                tokens = answer_after(model, cache, q.ids, answer_tokens)
                emit(kind, mode, budget, spec, q, tokens, cache, needle_kept(shared, spans[q.key]))

        # The question in the prompt: one recorded question pass, then every kind compressed from it.
        windows = {}
        for q in ctx.questions:
            fork = rec.fork()
            started = time.perf_counter()
            logits = model(torch.tensor([q.ids], device=device), **cache_kwargs(model, fork), use_cache=True).logits[:, -1]
            info.setdefault("question_seconds", []).append(time.perf_counter() - started)
            first = logits.argmax(-1, keepdim=True)
            weights = prompt_weights(doc_weights, recorded_weights(fork, q_modes), len(q.ids))
            kv = scoring.keys_values(fork)
            span = spans[q.key]
            if span is not None:
                info["profiles"].append({"depth": q.depth, **attention_profile(weights, span, T)})
            for kind, mode, budget in plan:
                if mode != "question":
                    continue
                spec = specs[(kind, budget)]
                if kind == "window":
                    if spec not in windows:  # the document prefilled once, a fork per question
                        windows[spec] = _document_cache(model, kind, spec, prefix)
                    cache = windows[spec].fork()
                    tokens, kept = answer_after(model, cache, q.ids, answer_tokens), None
                else:
                    cache = scoring.compress(model, spec, kv, weights)
                    kept = needle_kept(cache, span)
                    tokens = _decode(model, cache, first, answer_tokens)
                emit(kind, mode, budget, spec, q, tokens, cache, kept)
            del fork, kv
    return rows, info


def _document_cache(model, kind: str, spec: str, prefix: torch.Tensor, kv=None, weights=None, zipped=None, share=None, room=None):
    """A cache of ``spec`` holding the document ``prefix`` ``[1, T]``: a window prefilled for real
    (its prompt pass is masked), kvzip the ``share`` of the context its scores choose (``zipped``:
    a ``kvzip.Scored``; ``room``: the tokens that will follow it, default ``kvzip.ROOM``), every
    other kind compressed from the
    recording's keys and values ``kv`` with the document's ``weights``."""
    if kind == "window":
        cache = make_cache(model, spec)
        model(prefix, **cache_kwargs(model, cache), use_cache=True)
        return cache
    if kind == "kvzip":
        return zipped.compressed(model, share, room=room or kvzip.ROOM)
    return scoring.compress(model, spec, kv, weights)


@torch.inference_mode()
def text_runs(model, tokenizer, plan, s: Setting, seed: int, spec_for=None) -> list[dict]:
    """KL(full || ours) and top-1 agreement over ``s.text_steps`` teacher-forced tokens after a
    prefix of held-out prose, for every run (``context`` and ``question`` alike: no question here).
    ``spec_for(kind, budget, tokens)``: a run's spec for a prefix of ``tokens`` (default: the
    eval's kinds, ``budget`` a share of the tokens kept)."""
    ids = needles.heldout_text(tokenizer, s.text_tokens // 2 + s.text_steps + 1, seed)
    half = s.text_tokens // 2
    prefix = torch.tensor([ids[:half]], device=model.device)
    rest = ids[half:]
    if spec_for is None:
        spec_for = lambda kind, budget, n: spec_of(kind, n if budget is None else max(SINKS + 1, round(budget * n)), capacity=len(ids))  # noqa: E731
    doc_modes, _ = modes_for(model, [spec_for(k, b, 64) for k, _, b in plan if k != "full"], [])
    out, reference = [], None
    with use_kvcache_attention(model):
        wants_kvzip = any(k == "kvzip" for k, _, _ in plan)
        rec = scoring.recording_cache(model, doc_modes + ((kvzip.ALL_QUERIES,) if wants_kvzip else ()))
        first = model(prefix, **cache_kwargs(model, rec), use_cache=True).logits[:, -1].float().log_softmax(-1)
        weights = recorded_weights(rec, doc_modes)
        zipped = kvzip.score_recorded(model, tokenizer, rec, ids[:half], 0) if wants_kvzip else None
        kv = scoring.keys_values(rec)
        for kind, budget in dict.fromkeys((kind, budget) for kind, _, budget in plan):
            spec = spec_for(kind, budget, half)
            cache = _document_cache(model, kind, spec, prefix, kv, weights, zipped, budget, len(rest))
            logps = [first]
            for t in rest[:-1]:
                logits = model(torch.tensor([[t]], device=model.device), **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
                logps.append(logits.float().log_softmax(-1))
            logps = torch.cat(logps)
            if reference is None:
                reference = logps
            kl, top1 = kl_and_top1(reference, logps)
            out.append({"cache": kind, "budget": budget, "spec": spec, "sample": seed, "kl": kl, "top1": top1,
                        "bytes_per_token": cache.nbytes / cache.seen})
    return out


@torch.inference_mode()
def measure_costs(model, ctx: needles.Context) -> dict[str, float]:
    """Measured seconds, on this context: a plain prefill of the document (the full cache, SDPA),
    and of a question appended to it: what recompressing per question or reusing costs."""
    prefix = torch.tensor([ctx.prefix_ids], device=model.device)
    cache = make_cache(model, "growable")
    started = time.perf_counter()
    model(prefix, **cache_kwargs(model, cache), use_cache=True)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    model(torch.tensor([ctx.questions[0].ids], device=model.device), **cache_kwargs(model, cache), use_cache=True)
    return {"prefill_seconds": prefill, "question_seconds": time.perf_counter() - started}
