"""Every documented kind, used plainly: ``kvcache eval --model NAME --plain``.

Each kind of the kinds table is used the way the README shows it, nothing more: the model on the
``"kvcache"`` attention, ``make_cache(model, spec)``, ``model.generate`` with the question in the
prompt, greedy. The prompts are pass keys in held-out prose (``needles.make_context`` over the
``"heldout"`` files, which no rule was tuned on), one needle per context, at depth 0.1, 0.5 or 0.9 in
turn, the answer primed as the needle harness primes it. Budgets are shares of the tokens seen
(``h2o:budget=0.5``), as a user writes them; ``auto`` gets the same share of the fp32 cache's bytes.

At a generous budget (:data:`CHECKED`: 50% and more; the unbudgeted kinds always) a kind
**fails** (:func:`verdicts`) when, on the needles it is judged on,

- it finds more than :data:`MARGIN` fewer of them than the full cache does on the same prompts; or
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

Output (``plain.json``, ``plain.md``): one row per answer (kind, budget, spec, context, depth,
answer, found, degenerate, bytes), and per kind and budget the accuracy, the full cache's on the
same needles, the verdict and its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcache import cache_kwargs

from . import needles
from .bench.common import write_files
from .report import markdown, mean, pct
from .run_options import RunOptions

#: Kind -> spec template: ``{share}`` the budget as a share of the tokens seen (of the fp32 bytes,
#: for ``auto``), ``{window}`` that share of the prompt less the sinks, ``{capacity}`` every token.
PLAIN: dict[str, str] = {
    "growable": "growable",
    "static": "static:capacity={capacity}",
    "concat": "concat",
    "window": "window:window={window},sinks=4",
    **{k: k + ":budget={share}"
       for k in ("h2o", "tova", "tova-layer", "lastrec", "snapkv", "pyramidkv", "adakv", "kvzip")},
    **{f"quantized-int{bits}": f"quantized:bits={bits}" for bits in (8, 4, 2)},
    **{k: k + ":bytes={share}" for k in ("auto", "auto-heads")},
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
#: An answer whose last RUN tokens are one token has degenerated.
RUN = 8
#: Tokens generated per answer: a five-digit key, its full stop, and room to see a repetition.
NEW_TOKENS = 16


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
) -> dict[str, Any]:
    """Answer every context's question with every kind of ``kinds`` at every budget (module docstring)."""
    import torch
    from tqdm.auto import tqdm

    from .. import make_cache, use_kvcache_attention
    from ..models import load

    budgets = options.pick(tiny=(0.5,), quick=BUDGETS, full=BUDGETS) if budgets is None else tuple(budgets)
    length = options.pick(tiny=384, quick=2048, full=2048) if length is None else length
    contexts = options.pick(tiny=1, quick=6, full=15) if contexts is None else contexts
    runs = plan(kinds, budgets)
    model, tokenizer = load(model_name, device=options.device, progress=options.progress)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=contexts * len(runs), desc="eval --plain", disable=not options.progress)
    with torch.inference_mode(), use_kvcache_attention(model):
        for seed in range(contexts):
            ctx = needles.make_context(tokenizer, length, seed, split="heldout")
            q = ctx.questions[0]
            ids = torch.tensor([ctx.prefix_ids + q.ids], device=model.device)
            for kind, share in runs:
                spec = spec_of(kind, share, ids.shape[1])
                cache = make_cache(model, spec)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
                tokens = out[0, ids.shape[1]:].tolist()
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                rows.append({
                    "cache": kind, "budget": share, "spec": spec, "context": seed, "depth": q.depth, "key": q.key,
                    "prompt_tokens": ids.shape[1], "answer": text, "found": needles.answer_of(text) == q.key,
                    "degenerate": degenerate(tokens), "bytes": cache.nbytes,
                })
                bar.update()
    bar.close()
    result = {
        "suite": "eval-plain",
        "config": {"model": model_name, "length": length, "contexts": contexts, "budgets": list(budgets),
                   "margin": MARGIN, "checked": CHECKED, "run": RUN, "new_tokens": NEW_TOKENS, "prose": "held-out Python standard library docstrings (PSF License)"},
        "runs": rows,
    }
    result["verdicts"] = verdicts(result)
    if options.out is not None:
        write(result, Path(options.out))
    return result


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (kind, budget): accuracy on the needles it is judged on, the full cache's on the same
    contexts, answers degenerated, and ``ok`` with the ``reason`` it is not."""
    rows = result["runs"]
    reference = {r["context"]: r["found"] for r in rows if r["cache"] == REFERENCE}
    margin = result["config"]["margin"]
    out = []
    for key in dict.fromkeys((r["cache"], r["budget"]) for r in rows):
        mine = [r for r in rows if (r["cache"], r["budget"]) == key]
        counted = [r for r in mine if judged(key[0], key[1], r["depth"])]
        accuracy = mean(r["found"] for r in counted)
        full = mean(reference[r["context"]] for r in counted if r["context"] in reference)
        bad = sum(r["degenerate"] for r in mine)
        degenerate = mean(r["degenerate"] for r in counted)
        checked = key[1] is None or key[1] >= result["config"].get("checked", CHECKED)
        reasons = []
        if checked and counted and degenerate > margin:
            reasons.append(f"{degenerate:.0%} of its answers degenerate (more than {margin:.0%})")
        if checked and counted and full - accuracy > margin:
            reasons.append(f"{accuracy:.0%} found against the full cache's {full:.0%} (more than {margin:.0%} below)")
        out.append({
            "cache": key[0], "budget": key[1], "spec": mine[0]["spec"], "answers": len(mine), "judged": len(counted),
            "accuracy": accuracy, "all": mean(r["found"] for r in mine), "full": full, "degenerate": bad,
            "bytes": sum(r["bytes"] for r in mine) / len(mine), "checked": checked, "ok": not reasons,
            "reason": "; ".join(reasons),
        })
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: one line per kind and budget."""
    head = ["cache", "budget", "found (judged)", "full cache (same needles)", "found (all)", "degenerate", "MiB", "verdict"]
    return markdown(head, ([v["cache"], "-" if v["budget"] is None else f"{v['budget']:.0%}",
                            pct(v["accuracy"]) + ("" if v["judged"] == v["answers"] else f" of {v['judged']}"),
                            pct(v["full"]), pct(v["all"]), f"{v['degenerate']} of {v['answers']}", f"{v['bytes'] / 2**20:.1f}",
                            ("ok" if v["ok"] else "FAIL: " + v["reason"]) if v["checked"] else "reported"]
                           for v in result["verdicts"]))


def failures(result: dict[str, Any]) -> list[str]:
    """One line per kind and budget that failed."""
    return [f"{v['spec']}: {v['reason']}" for v in result["verdicts"] if not v["ok"]]


def write(result: dict[str, Any], out: Path) -> None:
    c = result["config"]
    head = (
        f"Every kind used plainly on {c['model']}: `make_cache(model, spec)` in `generate`, greedy, the question in the "
        f"prompt; {c['contexts']} pass keys in held-out prose at {c['length']} tokens (depths 0.1/0.5/0.9 in turn). "
        f"At budgets of {c['checked']:.0%} and more a kind fails when it finds more than {c['margin']:.0%} fewer needles than "
        f"the full cache on the needles it is judged on (window and lastrec: those inside the share they keep), or more "
        f"than {c['margin']:.0%} of its answers end in {c['run']} copies of one token; smaller budgets are reported.\n\n"
    )
    write_files(out, "plain", result, head + table(result) + "\n")
