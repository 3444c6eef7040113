"""The real-model eval's model passes: one context's needle questions, held-out text, costs.

:func:`run_context` answers every question of one context with every run of the plan (see
:mod:`kvcache.apps.eval_real` for the two ways, ``question`` and ``context``): the document is
prefilled once into a recording cache, each question fed once on a fork, and each bounded cache
put together from the recorded keys, values and weights (``scoring.compress``), then decoded
greedily. :func:`text_runs` scores KL divergence and top-1 agreement with the full cache over
held-out prose; :func:`measure_costs` times a plain prefill and a question pass. Token ids are
``[1, T]`` tensors on the model's device; times are seconds of ``time.perf_counter``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcache import cache_kwargs

from .. import make_cache, use_kvcache_attention
from ..hf import scoring
from ..layers import mix_of
from . import needles
from .eval_real_plan import ANSWER_TOKENS, SINKS, Setting, spec_of
from .eval_real_weights import attention_profile, modes_for, needle_kept, needle_span, prompt_weights, recorded_weights


def chosen_storages(cache) -> dict[str, int] | None:
    """For an ``auto`` cache, how many layers chose each storage; None for other kinds."""
    mix = [m for m in mix_of(cache) if m is not None]
    if not mix:
        return None
    out: dict[str, int] = {}
    for m in mix:
        out[m["storage"]] = out.get(m["storage"], 0) + 1
    return out


def _decode(model, cache, first: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``first`` ``[1, 1]`` (inclusive of it), one pass each."""
    out, token = [int(first)], first
    for _ in range(steps - 1):
        logits = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
    return out


def _answer_after(model, cache, ids: list[int], steps: int) -> list[int]:
    """Feed ``ids`` through ``cache`` (a real pass), then decode greedily."""
    logits = model(torch.tensor([ids], device=model.device), **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    return _decode(model, cache, logits.argmax(-1, keepdim=True), steps)


@torch.inference_mode()
def run_context(
    model, tokenizer, ctx: needles.Context, plan, specs, doc_modes, q_modes, bar=None, judge=None, answer_tokens: int = ANSWER_TOKENS
) -> tuple[list[dict], dict]:
    """Every run's answers for one context; and the measured costs and attention profiles.
    ``judge(question, text)``: whether a generated text answers a question (default: its first
    whole number is the key); ``answer_tokens``: tokens decoded per answer."""
    if judge is None:
        judge = lambda q, text: needles.answer_of(text) == q.key  # noqa: E731
    device = model.device
    rows: list[dict[str, Any]] = []
    prefix = torch.tensor([ctx.prefix_ids], device=device)
    T = len(ctx.prefix_ids)
    info: dict[str, Any] = {"profiles": []}
    with use_kvcache_attention(model):
        wants_kvzip = any(k == "kvzip" for k, _, _ in plan)
        rec = scoring.recording_cache(model, doc_modes + ((scoring.KVZIP_MODE,) if wants_kvzip else ()))
        model(prefix, **cache_kwargs(model, rec), use_cache=True)
        doc_weights = recorded_weights(rec, doc_modes)
        started = time.perf_counter()
        kvzip = scoring.repeat_scores(model, rec, torch.tensor([ctx.repeat_ids], device=device)) if wants_kvzip else None
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
            shared = _document_cache(model, kind, spec, prefix, doc_kv, doc_weights, kvzip)
            for q in ctx.questions:
                cache = shared.fork()
                tokens = _answer_after(model, cache, q.ids, answer_tokens)
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
                    tokens, kept = _answer_after(model, cache, q.ids, answer_tokens), None
                else:
                    cache = scoring.compress(model, spec, kv, weights)
                    kept = needle_kept(cache, span)
                    tokens = _decode(model, cache, first, answer_tokens)
                emit(kind, mode, budget, spec, q, tokens, cache, kept)
            del fork, kv
    return rows, info


def _document_cache(model, kind: str, spec: str, prefix: torch.Tensor, kv=None, weights=None, kvzip=None):
    """A cache of ``spec`` holding the document ``prefix`` ``[1, T]``: a window prefilled for real
    (its prompt pass is masked), every other kind compressed from the recording's keys and values
    ``kv`` with the document's ``weights`` (kvzip: with its repetition scores ``kvzip``)."""
    if kind == "window":
        cache = make_cache(model, spec)
        model(prefix, **cache_kwargs(model, cache), use_cache=True)
        return cache
    return scoring.compress(model, spec, kv, {scoring.KVZIP_MODE: kvzip} if kind == "kvzip" else weights)


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
    done: set[tuple] = set()
    with use_kvcache_attention(model):
        rec = scoring.recording_cache(model, doc_modes + (scoring.KVZIP_MODE,))
        first = model(prefix, **cache_kwargs(model, rec), use_cache=True).logits[:, -1].float().log_softmax(-1)
        weights = recorded_weights(rec, doc_modes)
        repeat = tokenizer("\n\nRepeat the text above exactly:\n", add_special_tokens=False)["input_ids"] + ids[:half]
        kvzip = scoring.repeat_scores(model, rec, torch.tensor([repeat], device=model.device))
        kv = scoring.keys_values(rec)
        for kind, _, budget in plan:
            if (kind, budget) in done:
                continue
            done.add((kind, budget))
            spec = spec_for(kind, budget, half)
            cache = _document_cache(model, kind, spec, prefix, kv, weights, kvzip)
            logps = [first]
            for t in rest[:-1]:
                logits = model(torch.tensor([[t]], device=model.device), **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
                logps.append(logits.float().log_softmax(-1))
            logps = torch.cat(logps)
            if reference is None:
                reference = logps
            kl = (reference.exp() * (reference - logps)).sum(-1).mean().item()
            top1 = (reference.argmax(-1) == logps.argmax(-1)).float().mean().item()
            out.append({"cache": kind, "budget": budget, "spec": spec, "sample": seed, "kl": max(kl, 0.0), "top1": top1,
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
