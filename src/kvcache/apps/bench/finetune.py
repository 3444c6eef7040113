"""Suite ``finetune``: does training with the bounded cache in place help a model served with it?

For each seed, two LoRA fine-tunes of the same model on the same documents for the same number of
steps (``apps.finetune.finetune``): one through the serving cache (``chunked_loss`` with
``grad="replay"``), one with full attention (``growable``, plain training's gradients chunk by
chunk). Both are scored on the same held-out documents under the serving cache and under the full
cache (``kvcache.train.cache_loss``), as is the untrained model. Reported per arm: the held-out
loss under the cache before and after (mean and spread over seeds), the same under the full cache,
and training tokens per second. Training through the cache helps if its loss under the cache
ends below the full-attention arm's, by more than the spread over seeds.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..run_options import RunOptions
from .common import figure, markdown_table
from .harness import report

#: arm -> the cache it trains through (None: the serving cache itself).
CONTENDERS: dict[str, str | None] = {"through the cache": None, "full attention": "growable"}
#: A row's held-out losses: under the serving cache and under the full cache, before and after training.
LOSSES = ("before_under_cache", "after_under_cache", "before_full", "after_full")


@dataclass(frozen=True)
class Sizes:
    model: str
    cache: str
    length: int
    steps: int
    chunk: int
    seeds: tuple[int, ...]
    eval_docs: int
    lr: float


FULL = Sizes("smollm2", "h2o:budget=0.25", 4096, 10, 256, (0, 1, 2), 2, 1e-3)


def sizes(options: RunOptions) -> Sizes:
    """The sizes of this run (``tiny``: the shipped model)."""
    return options.pick(
        tiny=Sizes("tiny", "h2o:budget=24", 96, 2, 32, (0, 1), 1, 1e-3),
        quick=replace(FULL, length=1024, steps=4, seeds=(0,), eval_docs=1),
        full=FULL,
    )


def run(options: RunOptions = RunOptions()) -> dict[str, Any]:
    from ..finetune import Finetune, finetune

    s = sizes(options)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-finetune-") as scratch:
        for seed in s.seeds:
            for arm, train_cache in CONTENDERS.items():
                job = Finetune(model=s.model, cache=s.cache, train_cache=train_cache, chunk=s.chunk, length=s.length,
                               steps=s.steps, lr=s.lr, seed=seed, eval_docs=s.eval_docs)  # fmt: skip
                record = finetune(job, Path(scratch) / f"{arm}-{seed}", progress=options.progress)
                rows.append({"contender": arm, "seed": seed, "trained_through": record["trained_through"],
                             "before_under_cache": record["before"]["loss_under_cache"],
                             "after_under_cache": record["after"]["loss_under_cache"],
                             "before_full": record["before"]["loss_full"], "after_full": record["after"]["loss_full"],
                             "train_losses": record["train_losses"], "tokens_per_s": record["tokens_per_s"]})  # fmt: skip
    config = {"model": s.model, "cache": s.cache, "length": s.length, "steps": s.steps, "chunk": s.chunk, "seeds": list(s.seeds),
              "eval_docs": s.eval_docs, "lr": s.lr, "adapter": "LoRA rank 8 (alpha 16) on q/k/v/o, AdamW",
              "documents": "standard-library source files, train and held-out split by file"}  # fmt: skip
    return report("finetune", options, config, rows, table, plot, summary=summarize(rows))


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "spread": (max(xs) - min(xs)) if len(xs) > 1 else 0.0}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm the mean and spread (max - min over seeds) of each loss; the gap under the cache
    (full-attention arm minus cache arm: positive when training through the cache helps)."""
    arms = {arm: {k: _stats([r[k] for r in rows if r["contender"] == arm]) for k in LOSSES} for arm in CONTENDERS}
    by_seed = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["contender"]] = r["after_under_cache"]
    gaps = [v["full attention"] - v["through the cache"] for v in by_seed.values() if len(v) == 2]
    gap = _stats(gaps) if gaps else None
    return {"arms": arms, "gap_under_cache": gap, "gaps_by_seed": gaps, "verdict": verdict(gaps)}


def verdict(gaps: list[float]) -> str:
    """``helps`` when every seed's gap is positive and their mean exceeds their spread, ``hurts``
    the same way below zero, else ``no difference beyond the spread over seeds`` (one seed:
    ``one seed: no verdict``)."""
    if len(gaps) < 2:
        return "one seed: no verdict"
    stats = _stats(gaps)
    if all(g > 0 for g in gaps) and stats["mean"] > stats["spread"]:
        return "helps"
    if all(g < 0 for g in gaps) and -stats["mean"] > stats["spread"]:
        return "hurts"
    return "no difference beyond the spread over seeds"


def table(result: dict[str, Any]) -> str:
    c, summary = result["config"], result["summary"]
    body = [[r["contender"], r["seed"], r["trained_through"], *(f"{r[k]:.4f}" for k in LOSSES),
             f"{r['tokens_per_s']:.0f}"] for r in result["rows"]]  # fmt: skip
    gap = summary["gap_under_cache"]
    lines = [
        "# bench finetune\n",
        f"Model {c['model']} (fp32, {c['adapter']}, lr {c['lr']}), {c['steps']} steps of one {c['length']}-token document each "
        f"({c['documents']}), chunks of {c['chunk']}; each arm scored on {c['eval_docs']} held-out documents under `{c['cache']}` "
        "(fed a chunk at a time, as served) and under the full cache. Seeds: " + ", ".join(map(str, c["seeds"])) + ".\n",
        f"- loss under `{c['cache']}` after training, full-attention arm minus through-the-cache arm, per seed: "
        + ", ".join(f"{g:+.4f}" for g in summary["gaps_by_seed"])
        + ("" if gap is None else f" (mean {gap['mean']:+.4f}, spread {gap['spread']:.4f})"),
        f"- training through the cache, judged under `{c['cache']}`: {summary['verdict']} (helps: every seed's gap positive "
        "and their mean above their spread)\n",
        markdown_table(["arm", "seed", "trained through", "loss under cache, before", "after", "loss full cache, before", "after",
                        "train tokens/s"], body),  # fmt: skip
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path) as (ax,):
        for arm in CONTENDERS:
            mine = [r for r in result["rows"] if r["contender"] == arm]
            for i, r in enumerate(mine):
                ax.plot(range(1, len(r["train_losses"]) + 1), r["train_losses"], color="C0" if arm == "through the cache" else "C1",
                        alpha=0.7, label=arm if i == 0 else None)  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (through the arm's own cache)")
        ax.set_title(f"finetune, scored under {result['config']['cache']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
