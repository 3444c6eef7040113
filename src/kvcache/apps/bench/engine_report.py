"""What suite ``engine`` reports: one row per (contender, arrival pattern) from its rounds
(``rows``), the tokens compared with the sequential contender's (``compare_tokens``), the ratios and
the issue's targets (``summarize``), the markdown (``table``) and the plot (``plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import figure, human_bytes, markdown_table, median
from .engine_workload import Run, Workload

REFERENCE = "sequential"
#: The engine judged against the others, and what it is judged against.
OURS, HF = "engine+sharing", "hf_generate_batch"
#: A first differing token is a near-tie when the reference's top-1 and top-2 logits there differ by less.
NEAR_TIE = 1e-4
#: The issue's targets, each a ratio of ``OURS``'s measure to another contender's: its key, the other
#: contender, the measure, its words, the bound and whether the ratio is to be at least (else at most) it.
TARGETS = (
    ("over_hf", HF, "tokens_per_s", f"{OURS} / {HF} tokens/s", 1.5, True),
    ("over_sequential", REFERENCE, "tokens_per_s", f"{OURS} / {REFERENCE} tokens/s", 4.0, True),
    ("ttft_p95_of_hf", HF, "ttft_p95_s", f"{OURS} TTFT p95 / {HF}'s", 0.5, False),
)
#: What a row keeps of each round's numbers.
TIMES = ("tokens_per_s", "wall_s", "ttft_p50_s", "ttft_p95_s", "tpot_s")


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    at = (len(s) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(s) - 1)
    return s[low] + (s[high] - s[low]) * (at - low)


def run_facts(run: Run, w: Workload) -> dict[str, Any]:
    """One run's numbers: tokens/s (generated tokens over first arrival to last finish), TTFT
    (arrival to first token, s) p50/p95, TPOT (median over requests of (finish - first token) /
    (tokens - 1), s), and the prompt tokens computed (forward tokens less the decode rows)."""
    reqs = run.requests
    wall = max(r.finish for r in reqs)
    ttft = [r.first - r.arrival for r in reqs]
    tpot = [(r.finish - r.first) / (len(r.tokens) - 1) for r in reqs if len(r.tokens) > 1]
    decode_rows = sum(max(len(r.tokens) - 1, 0) for r in reqs)
    return {
        "tokens_per_s": sum(len(r.tokens) for r in reqs) / wall,
        "wall_s": wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "tpot_s": median(tpot),
        "prompt_tokens_computed": run.forward_tokens - decode_rows,
        "ttft_s": ttft,
    }


def compare_tokens(run: Run, reference: Run) -> list[dict[str, Any]]:
    """Per request whose tokens differ from the reference's for the same prompt: its index, the
    first differing position, the reference's top-2 logit gap there and whether that is a near-tie."""
    out = []
    for i, (mine, ref) in enumerate(zip(run.requests, reference.requests)):
        if mine.tokens == ref.tokens:
            continue
        at = next((j for j, (a, b) in enumerate(zip(mine.tokens, ref.tokens)) if a != b), min(len(mine.tokens), len(ref.tokens)))
        gap = ref.gaps[at] if ref.gaps is not None and at < len(ref.gaps) else None
        out.append({"request": i, "position": at, "gap": gap, "near_tie": gap is not None and gap < NEAR_TIE})
    return out


def rows(samples: dict[tuple[str, str], list[Run]], w: Workload) -> list[dict[str, Any]]:
    """One row per (contender, pattern): medians over the rounds, tokens compared with the
    reference's run of the same round and pattern (``samples``: its runs in round order)."""
    out = []
    for (name, pattern), runs in samples.items():
        head = {"contender": name, "arrivals": pattern}
        if any(r.reason for r in runs):
            out.append(head | {"tokens_per_s": None, "reason": next(r.reason for r in runs if r.reason)})
            continue
        facts = [run_facts(r, w) for r in runs]
        diverged = []
        for round_, (run, ref) in enumerate(zip(runs, samples[(REFERENCE, pattern)])):
            diverged += [d | {"round": round_ + 1} for d in compare_tokens(run, ref)]
        compared = len(runs) * len(w.prompts)
        out.append(head | {key: median([f[key] for f in facts]) for key in TIMES} | {
            "cache_bytes": runs[-1].cache_bytes,
            "forward_tokens": runs[-1].forward_tokens,
            "prompt_tokens_computed": facts[-1]["prompt_tokens_computed"],
            "identical": compared - len(diverged),
            "compared": compared,
            "near_ties": sum(d["near_tie"] for d in diverged),
            "divergences": diverged,
            "facts": runs[-1].facts,
            "samples": [{k: f[k] for k in (*TIMES, "ttft_s")} for f in facts],
            "reason": "",
        })  # fmt: skip
    return out


def summarize(table_rows: list[dict[str, Any]], w: Workload, judged: bool) -> dict[str, Any]:
    """Per pattern the ``TARGETS``' ratios, each against its bound (a verdict only when ``judged``:
    the issue's workload), and whether the shared prompt was computed once (prompt tokens computed
    = shared + N x user turn)."""
    by = {(r["contender"], r["arrivals"]): r for r in table_rows if not r["reason"]}
    out: dict[str, Any] = {}
    for pattern in dict.fromkeys(r["arrivals"] for r in table_rows):
        ours = by.get((OURS, pattern))
        ratios = {key: ours[measure] / by[(other, pattern)][measure] if ours and (other, pattern) in by else None
                  for key, other, measure, *_ in TARGETS}  # fmt: skip
        met = {key: verdict(ratios[key], bound, least) if judged else None for key, *_, bound, least in TARGETS}
        once = len(w.prompts[0]) - w.shared  # each user turn
        least = w.shared + len(w.prompts) * once
        computed = ours["prompt_tokens_computed"] if ours else None
        out[pattern] = {"ratios": ratios, "met": met, "prompt_tokens_least": least, "prompt_tokens_computed": computed,
                        "shared_once": None if computed is None else computed == least}
    return out


def verdict(ratio: float | None, bound: float, at_least: bool) -> bool | None:
    """Whether ``ratio`` is at least (``at_least``) or at most ``bound``; None without a ratio."""
    if ratio is None:
        return None
    return ratio >= bound if at_least else ratio <= bound


# ---- markdown ---------------------------------------------------------------------------------


def _s(x: Any) -> str:
    return "—" if x is None else f"{x:.3g}"


def times(x: Any) -> str:
    """A ratio as ``1.23x`` (``—`` for none)."""
    return "—" if x is None else f"{x:.2f}x"


MET = {True: "met", False: "**not met**", None: "not judged"}


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        "# bench engine\n",
        f"Model {c['model']}, {c['threads']} torch threads. {c['sessions']} sessions: a {c['shared']}-token shared system prompt "
        f"and a distinct {c['user']}-token user turn each (ChatML, {c['text']}), {c['new_tokens']} greedy new tokens each "
        f"(end of sequence ignored: every request generates {c['new_tokens']}). Arrivals: {c['arrivals_text']}. "
        f"Contenders alternate; medians of {c['repeats']} round(s).\n",
        *_targets(result),
        "## Results\n",
        markdown_table(
            ["contender", "arrivals", "tokens/s", "x hf_generate_batch", "x sequential", "TTFT p50 s", "TTFT p95 s", "TPOT ms",
             "K/V bytes", "prompt tokens computed", "identical to sequential", "note"],
            [_row(r, result["rows"]) for r in result["rows"]],
        ),
        "## How each contender runs\n",
        *[f"- `{name}`: {text}" for name, text in c["configured"].items()],
        "",
        f"tokens/s: all generated tokens / (first arrival to last finish). TTFT: arrival to first token. TPOT: median over "
        f"requests of (finish - first token) / (tokens - 1). K/V bytes: what the contender allocated for keys and values "
        f"(sequential: the largest one request's cache; +store: that plus the store's entries; engines and "
        f"hf_generate_batch: the pool). prompt tokens computed: tokens through the model's forward passes (a hook counts "
        f"every call's input_ids) less the decode rows; the shared prompt computed once is {c['shared']} + "
        f"{c['sessions']} x {c['user']} = {c['shared'] + c['sessions'] * c['user']}. identical: "
        f"requests whose tokens equal sequential's for the same prompt, over all rounds; a difference is a near-tie when "
        f"sequential's top-1 and top-2 logits at the first differing token are within {NEAR_TIE:g}.\n",
    ]
    return "\n".join(lines)


def _targets(result: dict[str, Any]) -> list[str]:
    c, summary = result["config"], result["summary"]
    judged = "" if c["judged"] else " (not judged: this run is smaller than the issue's 16 x (1,024 + 64) tokens + 64 new)"
    lines = [f"## Targets{judged}\n"]
    for pattern, s in summary.items():
        for key, _, _, words, bound, least in TARGETS:
            lines.append(f"- {pattern}: {words} = {times(s['ratios'][key])} ({'>=' if least else '<='} {bound:g}x: "
                         f"{MET[s['met'][key]]})")
        lines.append(f"- {pattern}: prompt tokens {OURS} computed: {_s(s['prompt_tokens_computed'])}, the shared "
                     f"prompt once is {s['prompt_tokens_least']} ({MET[s['shared_once']]})")
    lines.append("")
    return lines


def _row(r: dict[str, Any], all_rows: list[dict[str, Any]]) -> list[Any]:
    if r["reason"]:
        return [r["contender"], r["arrivals"]] + ["—"] * 9 + [r["reason"]]
    speed = {(x["contender"], x["arrivals"]): x.get("tokens_per_s") for x in all_rows}
    hf, seq = speed.get((HF, r["arrivals"])), speed.get((REFERENCE, r["arrivals"]))
    ties = f" ({r['near_ties']} near-ties)" if r["identical"] < r["compared"] else ""
    note = ", ".join(f"{k} {v}" for k, v in r["facts"].items() if k in ("reused_pool", "reused_store", "preemptions"))
    return [r["contender"], r["arrivals"], _s(r["tokens_per_s"]), times(r["tokens_per_s"] / hf if hf else None),
            times(r["tokens_per_s"] / seq if seq else None), _s(r["ttft_p50_s"]), _s(r["ttft_p95_s"]), _s(r["tpot_s"] * 1e3),
            human_bytes(r["cache_bytes"]), r["prompt_tokens_computed"], f"{r['identical']}/{r['compared']}{ties}", note]


# ---- plot -------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    """Tokens/s and TTFT p95 per contender, one bar per arrival pattern."""
    measured = [r for r in result["rows"] if not r["reason"]]
    names = list(dict.fromkeys(r["contender"] for r in measured))
    patterns = list(dict.fromkeys(r["arrivals"] for r in measured))
    by = {(r["contender"], r["arrivals"]): r for r in measured}
    width = 0.8 / max(len(patterns), 1)
    with figure(path, panels=2) as (speed, ttft):
        for k, pattern in enumerate(patterns):
            xs = [i + (k - (len(patterns) - 1) / 2) * width for i in range(len(names))]
            for ax, key in ((speed, "tokens_per_s"), (ttft, "ttft_p95_s")):
                ax.bar(xs, [by[(n, pattern)][key] if (n, pattern) in by else 0 for n in names], width, label=pattern)
        for ax, label in ((speed, "output tokens/s (median)"), (ttft, "time to first token p95, s (median)")):
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
            ax.set_ylabel(label)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize="small", title="arrivals")
        speed.set_title(f"{result['config']['sessions']} sessions, shared {result['config']['shared']}-token prompt")
        ttft.set_yscale("log")
        ttft.set_title("time to first token, from arrival")
