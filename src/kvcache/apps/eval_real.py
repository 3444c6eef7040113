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
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import needles
from .run_options import RunOptions
from .. import scoring
from ..build import make_cache
from ..hf import use_kvcache_attention

SINKS = 4
#: Cache kind -> spec template ({slots}: kept tokens; the window keeps SINKS more apart).
KINDS: dict[str, str] = {
    "full": "static:capacity={capacity}",  # sized to the run: its bytes are the tokens' own
    "window": "window:window={window},sinks=" + str(SINKS),
    "lastrec": "lastrec:budget={slots}",
    "h2o": "h2o:budget={slots}",
    "tova": "tova:budget={slots}",
    "tova-layer": "tova-layer:budget={slots}",
    "snapkv": "snapkv:budget={slots}",
    "pyramidkv": "pyramidkv:budget={slots}",
    "adakv": "adakv:budget={slots}",
    "adakv-int4": "adakv:budget={slots},storage=int4",
    "kvzip": "kvzip:budget={slots}",
    "snapkv-int4": "snapkv:budget={slots},storage=int4",
    "quantized-int8": "quantized:bits=8",
    "quantized-int4": "quantized:bits=4",
    "quantized-int2": "quantized:bits=2",
}
#: Kinds without a budget (one run each, no budget column).
UNBUDGETED = ("full", "quantized-int8", "quantized-int4", "quantized-int2")
#: Kinds that only run with the document compressed once (query-agnostic by design).
CONTEXT_ONLY = ("kvzip",)
DEFAULT_KINDS = tuple(KINDS)
#: Kinds also run the reuse way (``context``), besides kvzip.
DEFAULT_CONTEXT_KINDS = ("h2o", "snapkv", "kvzip")
DEFAULT_BUDGETS = (0.5, 0.25, 0.125)
ANSWER_TOKENS = 6  # the space and a five-digit key (one digit a token)


@dataclass(frozen=True)
class Setting:
    lengths: tuple[int, ...]
    contexts: int  # per length, three questions each
    text_tokens: int  # per held-out sample: the first half prefilled
    text_steps: int  # tokens scored after it, one at a time
    text_samples: int
    budgets: tuple[float, ...]


def setting(options: RunOptions) -> Setting:
    return options.pick(
        tiny=Setting((384,), 1, 128, 8, 1, (0.5,)),
        quick=Setting((1024, 2048), 3, 1024, 32, 1, (0.5, 0.25)),
        full=Setting((1024, 2048, 4096, 8192), 6, 1024, 64, 1, DEFAULT_BUDGETS),
    )


def spec_of(kind: str, slots: int, capacity: int | None = None) -> str:
    """The spec of ``kind`` keeping ``slots`` tokens (the full cache: ``capacity``, every token)."""
    return KINDS[kind].format(slots=slots, window=max(1, slots - SINKS), capacity=capacity or slots)


def runs_for(kinds, context_kinds, budgets) -> list[tuple[str, str, float | None]]:
    """``(kind, mode, budget)`` of every run, the full reference first."""
    out = [("full", "question", None)]
    for kind in kinds:
        if kind == "full":
            continue
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r} for the real-model eval; valid: {', '.join(KINDS)}")
        modes = ("context",) if kind in CONTEXT_ONLY else ("question", "context") if kind in context_kinds else ("question",)
        for mode in modes:
            out += [(kind, mode, None)] if kind in UNBUDGETED else [(kind, mode, b) for b in budgets]
    return out


# ---- weights: the document's, then a question's ---------------------------------------------------


def modes_for(model, specs: list[str], question_lengths: list[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modes the document pass records, modes a question pass records) so that every spec's
    weights can be put together: a ``window:N`` longer than a question reaches into the document."""
    wanted: set[str] = set()
    for spec in specs:
        try:
            cache = make_cache(model, spec)
        except Exception:
            continue
        for store in cache.stores:
            mode = store.weights_for(2) if hasattr(store, "weights_for") else None
            if isinstance(mode, str):  # what a prompt pass (many queries) asks for
                wanted.add(mode)
    wanted.discard(scoring.KVZIP_MODE)  # kvzip's scores come from its own repetition pass
    document = set(wanted) | {"sum", "last"}
    for mode in wanted:
        if mode.startswith("window:"):
            n = int(mode[7:])
            document |= {f"window:{n - q}" for q in question_lengths if q < n}
    return tuple(sorted(document)), tuple(sorted(wanted | {"sum", "last"}))


def _pad(w: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, length - w.shape[-1]))


def prompt_weights(doc: dict[str, list], question: dict[str, list], q_len: int) -> dict[str, list]:
    """Weights of the whole prompt (document + question) per mode and layer, from the two passes."""
    out: dict[str, list] = {}
    for mode, per_layer in question.items():
        layers = []
        for i, w in enumerate(per_layer):
            if w is None:
                layers.append(None)
                continue
            total = w.shape[-1]
            if mode == "sum":
                w = w + _pad(doc["sum"][i], total)
            elif mode.startswith("window:") and int(mode[7:]) > q_len:
                w = w + _pad(doc[f"window:{int(mode[7:]) - q_len}"][i], total)
            layers.append(w)
        out[mode] = layers
    return out


# ---- one context ------------------------------------------------------------------------------


def _decode(model, cache, first: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``first`` ``[1, 1]`` (inclusive of it), one pass each."""
    out, token = [int(first)], first
    for _ in range(steps - 1):
        logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
    return out


def _answer_after(model, cache, ids: list[int], steps: int) -> list[int]:
    """Feed ``ids`` through ``cache`` (a real pass), then decode greedily."""
    logits = model(torch.tensor([ids], device=model.device), past_key_values=cache, use_cache=True).logits[:, -1]
    return _decode(model, cache, logits.argmax(-1, keepdim=True), steps)


def _weights(cache, modes) -> dict[str, list]:
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
    for store in cache.stores:
        kind = getattr(store, "kind", None)
        if kind == "evicting":
            per_head = list(store.positions()[0])  # Hkv x [N]
        elif kind == "adakv":  # a flat store: each slot names its head
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


@torch.inference_mode()
def run_context(model, tokenizer, ctx: needles.Context, plan, specs, doc_modes, q_modes, bar=None) -> tuple[list[dict], dict]:
    """Every run's answers for one context; and the measured costs and attention profiles."""
    device = model.device
    rows: list[dict[str, Any]] = []
    prefix = torch.tensor([ctx.prefix_ids], device=device)
    T = len(ctx.prefix_ids)
    info: dict[str, Any] = {"profiles": []}
    with use_kvcache_attention(model):
        wants_kvzip = any(k == "kvzip" for k, _, _ in plan)
        rec = scoring.recording_cache(model, doc_modes + ((scoring.KVZIP_MODE,) if wants_kvzip else ()))
        model(prefix, past_key_values=rec, use_cache=True)
        doc_weights = _weights(rec, doc_modes)
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
                "correct": needles.answer_of(text) == q.key, "answer": text.strip(),
                "bytes_per_token": cache.nbytes / cache.seen, "needle_kept": kept,
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
                tokens = _answer_after(model, cache, q.ids, ANSWER_TOKENS)
                emit(kind, mode, budget, spec, q, tokens, cache, needle_kept(shared, spans[q.key]))

        # The question in the prompt: one recorded question pass, then every kind compressed from it.
        windows = {}
        for q in ctx.questions:
            fork = rec.fork()
            started = time.perf_counter()
            logits = model(torch.tensor([q.ids], device=device), past_key_values=fork, use_cache=True).logits[:, -1]
            info.setdefault("question_seconds", []).append(time.perf_counter() - started)
            first = logits.argmax(-1, keepdim=True)
            weights = prompt_weights(doc_weights, _weights(fork, q_modes), len(q.ids))
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
                    tokens, kept = _answer_after(model, cache, q.ids, ANSWER_TOKENS), None
                else:
                    cache = scoring.compress(model, spec, kv, weights)
                    kept = needle_kept(cache, span)
                    tokens = _decode(model, cache, first, ANSWER_TOKENS)
                emit(kind, mode, budget, spec, q, tokens, cache, kept)
            del fork, kv
    return rows, info


def _document_cache(model, kind: str, spec: str, prefix: torch.Tensor, kv=None, weights=None, kvzip=None):
    """A cache of ``spec`` holding the document ``prefix`` ``[1, T]``: a window prefilled for real
    (its prompt pass is masked), every other kind compressed from the recording's keys and values
    ``kv`` with the document's ``weights`` (kvzip: with its repetition scores ``kvzip``)."""
    if kind == "window":
        cache = make_cache(model, spec)
        model(prefix, past_key_values=cache, use_cache=True)
        return cache
    return scoring.compress(model, spec, kv, {scoring.KVZIP_MODE: kvzip} if kind == "kvzip" else weights)


# ---- held-out text: KL and top-1 ---------------------------------------------------------------


@torch.inference_mode()
def text_runs(model, tokenizer, plan, s: Setting, seed: int) -> list[dict]:
    """KL(full || ours) and top-1 agreement over ``s.text_steps`` teacher-forced tokens after a
    prefix of held-out prose, for every run (``context`` and ``question`` alike: no question here)."""
    ids = needles.heldout_text(tokenizer, s.text_tokens // 2 + s.text_steps + 1, seed)
    half = s.text_tokens // 2
    prefix = torch.tensor([ids[:half]], device=model.device)
    rest = ids[half:]
    doc_modes, _ = modes_for(model, [spec_of(k, 8) for k, _, _ in plan if k in KINDS], [])
    out, reference = [], None
    done: set[tuple] = set()
    with use_kvcache_attention(model):
        rec = scoring.recording_cache(model, doc_modes + (scoring.KVZIP_MODE,))
        first = model(prefix, past_key_values=rec, use_cache=True).logits[:, -1].float().log_softmax(-1)
        weights = _weights(rec, doc_modes)
        repeat = tokenizer("\n\nRepeat the text above exactly:\n", add_special_tokens=False)["input_ids"] + ids[:half]
        kvzip = scoring.repeat_scores(model, rec, torch.tensor([repeat], device=model.device))
        kv = scoring.keys_values(rec)
        for kind, _, budget in plan:
            if (kind, budget) in done:
                continue
            done.add((kind, budget))
            slots = half if budget is None else max(SINKS + 1, round(budget * half))
            spec = spec_of(kind, slots, capacity=len(ids))
            cache = _document_cache(model, kind, spec, prefix, kv, weights, kvzip)
            logps = [first]
            for t in rest[:-1]:
                logits = model(torch.tensor([[t]], device=model.device), past_key_values=cache, use_cache=True).logits[:, -1]
                logps.append(logits.float().log_softmax(-1))
            logps = torch.cat(logps)
            if reference is None:
                reference = logps
            kl = (reference.exp() * (reference - logps)).sum(-1).mean().item()
            top1 = (reference.argmax(-1) == logps.argmax(-1)).float().mean().item()
            out.append({"cache": kind, "budget": budget, "spec": spec, "sample": seed, "kl": max(kl, 0.0), "top1": top1,
                        "bytes_per_token": cache.nbytes / cache.seen})
    return out


# ---- the run ------------------------------------------------------------------------------------


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
                costs[str(length)] = {"document_tokens": T, **_costs(model, ctx), "repeat_seconds": info["repeat_seconds"]}
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


@torch.inference_mode()
def _costs(model, ctx: needles.Context) -> dict[str, float]:
    """Measured seconds, on this context: a plain prefill of the document (the full cache, SDPA),
    and of a question appended to it: what recompressing per question or reusing costs."""
    prefix = torch.tensor([ctx.prefix_ids], device=model.device)
    cache = make_cache(model, "growable")
    started = time.perf_counter()
    model(prefix, past_key_values=cache, use_cache=True)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    model(torch.tensor([ctx.questions[0].ids], device=model.device), past_key_values=cache, use_cache=True)
    return {"prefill_seconds": prefill, "question_seconds": time.perf_counter() - started}


# ---- report -------------------------------------------------------------------------------------


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (cache, mode, budget): accuracy per length and per depth, KL, top-1, bytes/token."""
    lines: dict[tuple, dict[str, Any]] = {}
    for r in result["runs"]:
        key = (r["cache"], r["mode"], r["budget"])
        line = lines.setdefault(key, {"cache": r["cache"], "mode": r["mode"], "budget": r["budget"], "hits": {}, "bytes": []})
        line["hits"].setdefault((r["length"], r["depth"]), []).append(bool(r["correct"]))
        if r.get("needle_kept") is not None:
            line.setdefault("kept", []).append(r["needle_kept"])
        line["bytes"].append(r["bytes_per_token"])
    for t in result.get("text", []):
        for line in lines.values():
            if line["cache"] == t["cache"] and line["budget"] == t["budget"]:
                line.setdefault("kl", []).append(t["kl"])
                line.setdefault("top1", []).append(t["top1"])
    out = []
    for line in lines.values():
        hits = line.pop("hits")
        lengths = sorted({L for L, _ in hits})
        depths = sorted({d for _, d in hits})
        line["by_length"] = {L: _mean(_mean(hits[(L, d)]) for d in depths if (L, d) in hits) for L in lengths}
        line["by_depth"] = {d: _mean(x for (L, dd), v in hits.items() if dd == d for x in v) for d in depths}
        line["accuracy"] = _mean(x for v in hits.values() for x in v)
        line["bytes_per_token"] = _mean(line.pop("bytes"))
        line["needle_kept"] = _mean(line.pop("kept", []))
        line["kl"] = _mean(line.get("kl", []))
        line["top1"] = _mean(line.get("top1", []))
        out.append(line)
    return sorted(out, key=lambda l: l["mode"] != "question")  # stable: kinds in run order


def _share(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _budget(b) -> str:
    return "-" if b is None else f"{b:.1%}".replace(".0%", "%")


def table(result: dict[str, Any]) -> str:
    lines = summary(result)
    lengths = result["config"]["lengths"]
    depths = result["config"]["depths"]
    header = ["cache", "kept", "compressed", *[f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths],
              *[f"depth {d}" for d in depths], "all", "key kept", "KL (nats)", "top-1", "bytes/token"]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for line in lines:
        cells = [line["cache"], _budget(line["budget"]), "with question" if line["mode"] == "question" else "once, reused"]
        cells += [_share(line["by_length"].get(L, math.nan)) for L in lengths]
        cells += [_share(line["by_depth"].get(d, math.nan)) for d in depths]
        kept = "-" if math.isnan(line["needle_kept"]) else f"{line['needle_kept']:.0%}"
        text = ("-", "-") if math.isnan(line["kl"]) else (f"{line['kl']:.3f}", f"{line['top1']:.1%}")
        cells += [f"{line['accuracy']:.0%}", kept, *text, f"{line['bytes_per_token']:,.0f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def costs_table(result: dict[str, Any]) -> str:
    out = ["| document tokens | prefill (s) | KVzip repetition (s) | question pass (s) | 3 questions, recompressed each time | 3 questions, KVzip once |",
           "|---|---|---|---|---|---|"]
    for c in result["costs"].values():
        recompress = 3 * c["prefill_seconds"]
        once = c["prefill_seconds"] + c["repeat_seconds"] + 3 * c["question_seconds"]
        out.append(f"| {c['document_tokens']} | {c['prefill_seconds']:.1f} | {c['repeat_seconds']:.1f} | {c['question_seconds']:.2f} | {recompress:.1f} | {once:.1f} |")
    return "\n".join(out)


def profile_table(result: dict[str, Any]) -> str:
    """Where the question's attention goes: the needle's lift (mass share / slot share) per layer,
    averaged over KV heads and questions, for the last query (TOVA) and the window (SnapKV)."""
    profiles = result.get("profiles", [])
    if not profiles:
        return ""
    modes = [m for m in profiles[0] if m not in ("length", "depth")]
    layers = len(profiles[0][modes[0]]["lift"])
    header = ["layer", *[f"{m} lift" for m in modes], *[f"{m} heads ranking the needle in the top 12.5%" for m in modes]]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i in range(layers):
        cells = [str(i)]
        cells += [f"{_mean(h for p in profiles for h in p[m]['lift'][i]):.1f}" for m in modes]
        cells += [f"{_mean(float(r < 0.125) for p in profiles for r in p[m]['rank'][i]):.0%}" for m in modes]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    from .bench.common import figure

    lines = summary(result)
    with figure(path, panels=1, size=(7.5, 5)) as axes:
        ax = axes[0] if isinstance(axes, (list, tuple)) else axes
        for kind in sorted({(l["cache"], l["mode"]) for l in lines}):
            pts = sorted((l["bytes_per_token"], l["accuracy"]) for l in lines if (l["cache"], l["mode"]) == kind)
            label = kind[0] + (" (once, reused)" if kind[1] == "context" else "")
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if kind[1] == "context" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per token (allocated)")
        ax.set_ylabel("needles found")
        ax.set_title(f"{result['config']['model']}: needles found against memory")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)


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


def write(result: dict[str, Any], out: Path) -> None:
    from .bench.common import can_plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    c = result["config"]
    contexts = c["contexts"] if not isinstance(c["contexts"], dict) else ", ".join(f"{n} at {L}" for L, n in c["contexts"].items())
    head = (
        f"Needles in prose on {c['model']}: {contexts} contexts per length, {c['questions_per_context']} pass key(s) "
        f"each (depths {', '.join(map(str, c['depths']))}; one needle: the depth turns with the context), one question "
        f"per key; kept = share of the document's tokens; "
        f"KL / top-1 against the full cache over {c['text']['text_steps']} held-out tokens x {c['text']['text_samples']}.\n\n"
    )
    (out / "eval.md").write_text(head + table(result) + "\n\nMeasured costs (first context of each length):\n\n"
                                 + costs_table(result) + "\n\n" + profile_table(result) + "\n")
    if can_plot():
        plot(result, out / "eval.png")
