"""Every documented kind, used plainly: ``kvcache eval --model NAME --plain``.

Each kind of the kinds table is used the way the README shows it, nothing more: the model on the
``"kvcache"`` attention, ``make_cache(model, spec)``, ``model.generate`` with the question in the
prompt, greedy. The prompts are pass keys in prose no rule was tuned on, one needle per context, at
depth 0.1, 0.5 or 0.9 in turn, from each needle set of :data:`SETS` (``needles.SETS``: ``doors``, a
door's key in held-out docstrings; ``secret``, "the secret pass key" in the Python Language
Reference), each asked both ways (:data:`ASKS`): with the answer primed as the needle harness
primes it, and as a chat question, the assistant's turn opened with nothing in it. A key counts
only when the answer's first number is the whole key (``found``); the share of its digits in
place (``digits``) is shown beside, never instead. Budgets are shares of the tokens seen
(``h2o:budget=0.5``), as a user writes them; ``auto`` gets the same share of the fp32 cache's bytes.

At a generous budget (:data:`CHECKED`: 50% and more; the unbudgeted kinds always) a kind
**fails** (:func:`verdicts`) when, on the needles it is judged on,

- it finds more than :data:`MARGIN` fewer of them than the full cache does on the same prompts
  (over every set and way of asking together, or in any one of them); or
- more than :data:`MARGIN` of its answers degenerate: they end in :data:`RUN` copies of one token
  (``kvzip`` once answered "TheTheThe..." and "39999999999" to every question this way).

A kind that keeps by position alone (:data:`BY_POSITION`: ``window``, ``lastrec``) is judged on the
needles inside the recent share it keeps, since losing the others is what it is for; every other
kind on all of them. Lower budgets are measured and reported, not judged.

Why 25 points: the check is for defects (a kind that turns the model's answers into noise: kvzip
found 0 of 15 where the full cache found 14), not for ranking kinds. A bounded cache at a generous
budget may lose a few needles honestly, and with a dozen or so answers per kind the noise in a
difference of two accuracies is about 10-15 points (one standard error), so a smaller margin
would flag honest kinds by chance; 25 points is beyond that and far below the drops it is for.
The same share bounds degenerate answers: a cache that loses a needle's later digits can make the
model repeat the last digit it has ("399999...", once in six answers of ``tova-layer`` at 50%),
a wrong answer already counted as one; a kind whose answers degenerate as a rule is broken.

Output (``plain.json``, ``plain.md``): one row per answer (kind, budget, spec, set, ask, context,
depth, answer, found, digits, degenerate, bytes), and per kind and budget the accuracy (in all and
per set and way of asking), the full cache's on the same needles, the verdict and its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcache import cache_kwargs

from . import needles
from .bench.common import write_files
from .report import markdown, mean, pct
from .run_options import RunOptions

#: KVzip as its paper has it, used as docs/kinds.md shows: ``kvzip.compress_context`` on the
#: context, then the question on a fork (not a spec kind: no pass of ``generate`` can do it).
CONTEXT_KVZIP = "kvzip-context"
#: Kind -> spec template: ``{share}`` the budget as a share of the tokens seen (of the fp32 bytes,
#: for ``auto``), ``{window}`` that share of the prompt less the sinks, ``{capacity}`` every token.
PLAIN: dict[str, str] = {
    "growable": "growable",
    "static": "static:capacity={capacity}",
    "concat": "concat",
    "window": "window:window={window},sinks=4",
    **{k: k + ":budget={share}" for k in ("h2o", "tova", "tova-layer", "lastrec", "snapkv", "pyramidkv", "adakv")},
    "kvzip": "kvzip:budget={share},queries=prompt",
    **{f"quantized-int{bits}": f"quantized:bits={bits}" for bits in (8, 4, 2)},
    **{k: k + ":bytes={share}" for k in ("auto", "auto-heads")},
    CONTEXT_KVZIP: "kvzip.compress_context(ratio={share})",
}
#: The reference every kind is held against.
REFERENCE = "growable"
#: Kinds that keep every token (one run each, no budget).
UNBUDGETED = ("growable", "static", "concat", "quantized-int8", "quantized-int4", "quantized-int2")
#: Kinds that keep tokens by position alone: judged on the needles inside the share they keep.
BY_POSITION = ("window", "lastrec")
SINKS = 4
BUDGETS = (0.5, 0.25)
#: Budgets at least this generous are judged; smaller ones only reported.
CHECKED = 0.5
#: Accuracy a kind may lose against the full cache, in points (see the module docstring).
MARGIN = 0.25
#: Judged answers a needle set and way of asking needs to be judged alone (fewer: one miss is
#: more than the margin).
PART_LEAST = 10
#: An answer whose last RUN tokens are one token has degenerated.
RUN = 8
#: Tokens generated per answer: a five-digit key, its full stop, and room to see a repetition (an
#: unprimed answer opens with a few words first).
NEW_TOKENS = 24
#: The needle sets and the ways of asking every run covers.
SETS = tuple(needles.SETS)
ASKS = needles.ASKS


def spec_of(kind: str, share: float | None, prompt: int) -> str:
    """The spec of ``kind`` at budget ``share`` (None for unbudgeted kinds) for a ``prompt``-token prompt."""
    window = max(1, round((share or 1) * prompt) - SINKS)
    return PLAIN[kind].format(share=share, window=window, capacity=prompt + NEW_TOKENS)


def plan(kinds: tuple[str, ...], budgets: tuple[float, ...]) -> list[tuple[str, float | None]]:
    """``(kind, budget)`` of every run, the reference first."""
    unknown = [k for k in kinds if k not in PLAIN]
    if unknown:
        raise ValueError(f"unknown kind(s) {', '.join(unknown)} for --plain; valid: {', '.join(PLAIN)}")
    out: list[tuple[str, float | None]] = [(REFERENCE, None)]
    for kind in kinds:
        if kind == REFERENCE:
            continue
        out += [(kind, None)] if kind in UNBUDGETED else [(kind, b) for b in budgets]
    return out


def degenerate(tokens: list[int], run: int = RUN) -> bool:
    """Whether ``tokens`` end in ``run`` copies of one token."""
    return len(tokens) >= run and len(set(tokens[-run:])) == 1


def judged(kind: str, share: float | None, depth: float) -> bool:
    """Whether a needle at ``depth`` counts against ``kind`` at ``share``: always, except for a kind
    that keeps by position, whose kept share must lie wholly after the needle."""
    return kind not in BY_POSITION or share is None or depth > 1 - share


def run(
    options: RunOptions = RunOptions(),
    *,
    model_name: str = "smollm2",
    kinds: tuple[str, ...] = tuple(PLAIN),
    budgets: tuple[float, ...] | None = None,
    length: int | None = None,
    contexts: int | None = None,
    sets: tuple[str, ...] = SETS,
    asks: tuple[str, ...] = ASKS,
) -> dict[str, Any]:
    """Answer every context's question with every kind of ``kinds`` at every budget (module docstring)."""
    import torch
    from tqdm.auto import tqdm

    from .. import make_cache, use_kvcache_attention
    from ..hf import kvzip
    from ..models import load
    from .eval_real import answer_after

    budgets = options.pick(tiny=(0.5,), quick=BUDGETS, full=BUDGETS) if budgets is None else tuple(budgets)
    length = options.pick(tiny=384, quick=2048, full=2048) if length is None else length
    contexts = options.pick(tiny=1, quick=6, full=15) if contexts is None else contexts
    runs = plan(kinds, budgets)
    for name, valid, given in (("needle set", SETS, sets), ("way of asking", ASKS, asks)):
        if not given or any(g not in valid for g in given):
            raise ValueError(f"unknown or no {name} in {', '.join(given) or 'none'}; valid: {', '.join(valid)}")
    model, tokenizer = load(model_name, device=options.device, progress=options.progress)
    rows: list[dict[str, Any]] = []
    prompts = [(seed, kind, ask) for seed in range(contexts) for kind in sets for ask in asks]
    bar = tqdm(total=len(prompts) * len(runs), desc="eval --plain", disable=not options.progress)
    scored: dict[tuple[int, str], Any] = {}  # KVzip's scores of a context, for every way of asking
    with torch.inference_mode(), use_kvcache_attention(model):
        for seed, needle_set, ask in prompts:
            ctx = needles.make_context(tokenizer, length, seed, split="heldout", needle_set=needle_set)
            q = ctx.questions[0]
            ids = torch.tensor([ctx.prefix_ids + q.asked(ask)], device=model.device)
            for kind, share in runs:
                spec = spec_of(kind, share, ids.shape[1])
                if kind == CONTEXT_KVZIP:
                    if (seed, needle_set) not in scored:
                        scored.clear()
                        scored[(seed, needle_set)] = kvzip.score_context(model, tokenizer, ctx.prefix_ids)
                    cache = scored[(seed, needle_set)].compressed(model, share, room=len(q.asked(ask)) + NEW_TOKENS)
                    tokens = answer_after(model, cache, q.asked(ask), NEW_TOKENS)
                else:
                    cache = make_cache(model, spec)
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), do_sample=False,
                                         max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
                    tokens = out[0, ids.shape[1]:].tolist()
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                rows.append({
                    "cache": kind, "budget": share, "spec": spec, "set": needle_set, "ask": ask, "context": seed,
                    "depth": q.depth, "key": q.key, "prompt_tokens": ids.shape[1], "answer": text,
                    "found": needles.answer_of(text) == q.key, "digits": needles.digits_right(q.key, text),
                    "degenerate": degenerate(tokens), "bytes": cache.nbytes,
                })
                bar.update()
    bar.close()
    result = {
        "suite": "eval-plain",
        "config": {"model": model_name, "length": length, "contexts": contexts, "budgets": list(budgets),
                   "sets": list(sets), "asks": list(asks), "margin": MARGIN, "checked": CHECKED, "run": RUN,
                   "new_tokens": NEW_TOKENS,
                   "prose": "doors: held-out Python standard library docstrings; secret: the Python Language Reference "
                            "(pydoc_data.topics); PSF License"},
        "runs": rows,
    }
    result["verdicts"] = verdicts(result)
    if options.out is not None:
        write(result, Path(options.out))
    return result


def _prompt(row: dict[str, Any]) -> tuple:
    """Which prompt a row answered: its context, needle set and way of asking (rows of before
    needle sets: the ``doors`` set, primed)."""
    return row["context"], row.get("set", "doors"), row.get("ask", "primed")


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (kind, budget): accuracy on the needles it is judged on (in all, and per needle set and
    way of asking: ``by_prompt``), the full cache's on the same prompts, answers degenerated, and
    ``ok`` with the ``reason`` it is not."""
    rows = result["runs"]
    reference = {_prompt(r): r["found"] for r in rows if r["cache"] == REFERENCE}
    margin = result["config"]["margin"]
    out = []
    for key in dict.fromkeys((r["cache"], r["budget"]) for r in rows):
        mine = [r for r in rows if (r["cache"], r["budget"]) == key]
        counted = [r for r in mine if judged(key[0], key[1], r["depth"])]
        accuracy = mean(r["found"] for r in counted)
        full = mean(reference[_prompt(r)] for r in counted if _prompt(r) in reference)
        bad = sum(r["degenerate"] for r in mine)
        degenerate = mean(r["degenerate"] for r in counted)
        checked = key[1] is None or key[1] >= result["config"].get("checked", CHECKED)
        by_prompt = {}
        for part in dict.fromkeys(_prompt(r)[1:] for r in counted):
            those = [r for r in counted if _prompt(r)[1:] == part]
            by_prompt["/".join(part)] = {
                "accuracy": mean(r["found"] for r in those), "answers": len(those),
                "full": mean(reference[_prompt(r)] for r in those if _prompt(r) in reference),
            }
        reasons = []
        if checked and counted and degenerate > margin:
            reasons.append(f"{degenerate:.0%} of its answers degenerate (more than {margin:.0%})")
        if checked and counted and full - accuracy > margin:
            reasons.append(f"{accuracy:.0%} found against the full cache's {full:.0%} (more than {margin:.0%} below)")
        for part, got in by_prompt.items():
            if checked and len(by_prompt) > 1 and got["answers"] >= PART_LEAST and got["full"] - got["accuracy"] > margin:
                reasons.append(f"{part}: {got['accuracy']:.0%} found against the full cache's {got['full']:.0%}")
        out.append({
            "cache": key[0], "budget": key[1], "spec": mine[0]["spec"], "answers": len(mine), "judged": len(counted),
            "accuracy": accuracy, "all": mean(r["found"] for r in mine), "full": full, "degenerate": bad,
            "digits": mean(r["digits"] for r in counted) if all("digits" in r for r in counted) else None,
            "by_prompt": by_prompt, "bytes": sum(r["bytes"] for r in mine) / len(mine), "checked": checked,
            "ok": not reasons, "reason": "; ".join(reasons),
        })
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: one line per kind and budget; exact keys found, in all and per needle set and way of
    asking (when the run has several), the digits in place beside."""
    parts = list(dict.fromkeys(p for v in result["verdicts"] for p in v.get("by_prompt", {})))
    parts = parts if len(parts) > 1 else []
    head = ["cache", "budget", "found (judged)", "full cache (same needles)", *parts, "digits in place", "found (all)",
            "degenerate", "MiB", "verdict"]
    return markdown(head, ([v["cache"], "-" if v["budget"] is None else f"{v['budget']:.0%}",
                            pct(v["accuracy"]) + ("" if v["judged"] == v["answers"] else f" of {v['judged']}"),
                            pct(v["full"]), *(pct(v["by_prompt"][p]["accuracy"]) if p in v["by_prompt"] else "-" for p in parts),
                            "-" if v.get("digits") is None else pct(v["digits"]), pct(v["all"]),
                            f"{v['degenerate']} of {v['answers']}", f"{v['bytes'] / 2**20:.1f}",
                            ("ok" if v["ok"] else "FAIL: " + v["reason"]) if v["checked"] else "reported"]
                           for v in result["verdicts"]))


def failures(result: dict[str, Any]) -> list[str]:
    """One line per kind and budget that failed."""
    return [f"{v['spec']}: {v['reason']}" for v in result["verdicts"] if not v["ok"]]


def write(result: dict[str, Any], out: Path) -> None:
    c = result["config"]
    head = (
        f"Every kind used plainly on {c['model']}: `make_cache(model, spec)` in `generate`, greedy, the question in the "
        f"prompt (`{CONTEXT_KVZIP}`: `kvcache.hf.kvzip.compress_context` on the context, then the question on it); {c['contexts']} pass keys a needle set at {c['length']} tokens (depths 0.1/0.5/0.9 in turn), needle sets "
        f"{', '.join(c.get('sets', ['doors']))} (doors: a door's key in held-out docstrings; secret: the secret pass key in the "
        f"Python Language Reference), asked {' and '.join(c.get('asks', ['primed']))} (primed: the answer's start in the "
        f"assistant's turn; chat: the turn opened with nothing in it). A key counts only when answered whole; the digits in "
        f"place are shown beside. Columns set/ask: exact keys found on those prompts. "
        f"At budgets of {c['checked']:.0%} and more a kind fails when it finds more than {c['margin']:.0%} fewer needles than "
        f"the full cache on the needles it is judged on (window and lastrec: those inside the share they keep), or more "
        f"than {c['margin']:.0%} of its answers end in {c['run']} copies of one token; smaller budgets are reported.\n\n"
    )
    write_files(out, "plain", result, head + table(result) + "\n")
