"""The quality harness (``kvcache eval``): what each bounded cache costs in accuracy, per byte.

For every cache kind and budget it runs, on a trained model (the shipped one by default):

- **tasks**: passkey retrieval, associative recall and variable tracking (``kvcache.apps.tasks``,
  held-out filler and seeds), with the needle early (``depth`` 0.1: the first thing a
  query-agnostic policy evicts) and late (``depth`` 1.0, right before the question); greedy
  generation through ``model.generate`` with the cache, exact-match accuracy;
- **text**: held-out text (standard library sources) prefilled up to its middle, then the rest fed
  one token at a time (teacher forcing) with the cache: per-token KL divergence from the full
  cache's next-token distribution, and how often both pick the same top-1 token;
- **bytes per token**: ``cache.nbytes / cache.seen`` at the end of each run (allocated bytes).

Budgets are fractions of the context (``--budgets``); the window keeps 4 sinks inside its budget.
The prompt is prefilled with full attention over itself (a long prefill attends a temporary
concatenation, see ``layers/own_attention.py``) and then the cache keeps what its policy keeps: the
bounded cache decides what the answer can still see.

Output: ``eval.json`` (``{"runs": [{"cache", "budget", "task", "depth", "accuracy", "kl", "top1",
"bytes_per_token", ...}]}``, ``"cache": "full"`` for the unbounded reference), ``eval.md`` and
``eval.png`` (quality against bytes per token, one line per kind).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcache import cache_kwargs

from .. import make_cache, use_kvcache_attention
from . import tasks
from .bench.common import write_files
from .contenders import SINKS, spec_for
from .report import markdown, mean
from .run_options import RunOptions
from .trained import MODEL_DIR, load_trained

#: Kinds the harness knows, in report order; "full" is the reference.
KINDS = ("full", "window", "lastrec", "h2o", "tova", "quantized", "h2o-int8")
DEFAULT_KINDS = ("window", "lastrec", "h2o", "tova", "quantized")
#: Fractions of the context; 0.2 and 0.125 are the budgets the H2O and TOVA papers report on.
DEFAULT_BUDGETS = (0.5, 0.25, 0.2, 0.125, 0.1)
QUICK_BUDGETS = (0.5, 0.125)
TASKS = ("passkey", "assoc", "vartrack")
DEPTHS = {"early": 0.1, "late": 1.0}


@dataclass(frozen=True)
class Setting:
    context: int  # prompt tokens of every task instance
    instances: int  # per task and depth
    text_context: int  # tokens of each held-out text; the second half is scored
    text_samples: int
    seed: int = 0


def setting(options: RunOptions) -> Setting:
    return options.pick(
        # tiny: text_context past what a quantized cache keeps exact (up to residual + group_size - 1 = 95 tokens)
        tiny=Setting(context=256, instances=2, text_context=128, text_samples=1),
        quick=Setting(context=512, instances=8, text_context=512, text_samples=2),
        full=Setting(context=1024, instances=24, text_context=1024, text_samples=4),
    )


def specs_for(kinds: tuple[str, ...], budgets: tuple[float, ...], context: int) -> list[tuple[str, str, str]]:
    """``(kind, budget label, cache spec)`` for every run, the full reference first."""
    out = [("full", "100%", spec_for("growable"))]
    for kind in kinds:
        if kind == "full":
            continue
        if kind == "quantized":
            out += [("quantized", f"int{bits}", spec_for(f"quantized-int{bits}")) for bits in (8, 4, 2)]
            continue
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r} for eval; valid: {', '.join(KINDS)}")
        for b in budgets:
            slots = max(SINKS + 1, round(b * context))
            out.append((kind, f"{b:.0%}", spec_for(kind, slots=slots - SINKS if kind == "window" else slots)))
    return out


# ---- runs ---------------------------------------------------------------------------------------


def task_accuracy(model, tokenizer, spec: str, task: str, depth: float, s: Setting) -> tuple[float, float]:
    """(accuracy, bytes per token) of greedy answers to ``s.instances`` held-out instances, batched."""
    # Imported here, as the plotting helpers are: ``kvcache eval --help`` reads this module's
    # constants, and building the parser imports nothing from the benchmark suites.
    from .bench.harness import greedy_generate

    insts = [tasks.make_instance(task, s.seed + i, length=s.context, depth=depth) for i in range(s.instances)]
    ids = torch.stack([_encode(tokenizer, inst.prompt) for inst in insts]).to(model.device)
    cache = make_cache(model, spec)
    new = max(len(inst.answer) for inst in insts) + 2
    with torch.inference_mode(), use_kvcache_attention(model):
        out = greedy_generate(model, ids, cache, new, attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.pad_token_id)
    texts = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]
    right = sum(tasks.score(inst.answer, text) for inst, text in zip(insts, texts))
    return right / len(insts), cache.nbytes / (cache.seen * ids.shape[0])


def text_logprobs(model, tokenizer, spec: str, s: Setting) -> tuple[torch.Tensor, float]:
    """Log-probabilities ``[samples, steps, vocab]`` of the second half of held-out texts, fed one
    token at a time after a prefill of the first half; and bytes per token."""
    rng = random.Random(f"eval-text-{s.seed}")
    samples = [tasks.filler(rng, s.text_context, "heldout") for _ in range(s.text_samples)]
    ids = torch.stack([_encode(tokenizer, text) for text in samples]).to(model.device)
    half = ids.shape[1] // 2
    cache = make_cache(model, spec)
    out = []
    with torch.inference_mode(), use_kvcache_attention(model):
        for part in (ids[:, :half], *ids[:, half:-1].split(1, dim=1)):  # the prefill, then one token at a time
            logits = model(part, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
            out.append(logits.float().log_softmax(-1))
    return torch.stack(out, dim=1), cache.nbytes / (cache.seen * ids.shape[0])


def kl_and_top1(reference: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """Mean per-token KL(reference || ours) in nats, and top-1 agreement, over log-probs ``[..., V]``."""
    kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
    return max(kl, 0.0), top1


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=True)["input_ids"], dtype=torch.long)


def run(
    options: RunOptions = RunOptions(),
    *,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
    budgets: tuple[float, ...] | None = None,
    model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the harness; write ``eval.json``/``eval.md``/``eval.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    s = setting(options)
    if budgets is None:
        budgets = QUICK_BUDGETS if options.quick or options.tiny else DEFAULT_BUDGETS
    model, tokenizer = load_trained(model_dir, options.device)
    # Budgets are fractions of each run's own context: the task prompts' and the texts'.
    runs_spec = specs_for(tuple(kinds), tuple(budgets), s.context)
    text_specs = [spec for _, _, spec in specs_for(tuple(kinds), tuple(budgets), s.text_context)]
    jobs = len(runs_spec) * (len(TASKS) * len(DEPTHS) + 1)
    bar = tqdm(total=jobs, desc="eval", disable=not options.progress)
    rows: list[dict[str, Any]] = []
    reference = None
    for (kind, label, spec), text_spec in zip(runs_spec, text_specs):
        logprobs, text_bytes = text_logprobs(model, tokenizer, text_spec, s)
        if reference is None:
            reference = logprobs
        kl, top1 = kl_and_top1(reference, logprobs)
        base = {"cache": kind, "budget": label}
        rows.append({**base, "task": "text", "spec": text_spec, "depth": None, "accuracy": None, "kl": kl,
                     "top1": top1, "bytes_per_token": text_bytes})
        bar.update()
        for task in TASKS:
            for where, depth in DEPTHS.items():
                acc, nbytes = task_accuracy(model, tokenizer, spec, task, depth, s)
                rows.append({**base, "task": f"{task}-{where}", "spec": spec, "depth": depth, "accuracy": acc,
                             "kl": None, "top1": None, "bytes_per_token": nbytes})
                bar.update()
    bar.close()
    result = {
        "suite": "eval",
        "config": {"model": str(model_dir or MODEL_DIR.name), **{k: v for k, v in vars(s).items() if k != "seed"},
                   "depths": DEPTHS, "sinks": SINKS, "quick": options.quick, "tiny": options.tiny},
        "runs": rows,
    }
    if options.out is not None:
        write(result, Path(options.out))
    return result


# ---- report -------------------------------------------------------------------------------------


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (cache, budget): task accuracies, their mean, KL, top-1 and bytes per token."""
    keyed: dict[tuple[str, str], dict[str, Any]] = {}
    for r in result["runs"]:
        line = keyed.setdefault((r["cache"], r["budget"]), {"cache": r["cache"], "budget": r["budget"], "tasks": {}})
        if r["task"] == "text":
            line.update(kl=r["kl"], top1=r["top1"], bytes_per_token=r["bytes_per_token"])
        else:
            line["tasks"][r["task"]] = r["accuracy"]
    for line in keyed.values():
        line["mean_accuracy"] = mean(line["tasks"].values())
    return list(keyed.values())


def table(result: dict[str, Any]) -> str:
    names = [f"{t}-{w}" for t in TASKS for w in DEPTHS]
    header = ["cache", "budget", *names, "mean acc", "KL (nats)", "top-1", "bytes/token"]
    return markdown(header, ([line["cache"], line["budget"], *[f"{line['tasks'].get(n, math.nan):.0%}" for n in names],
                              f"{line['mean_accuracy']:.0%}", f"{line['kl']:.3f}", f"{line['top1']:.1%}",
                              f"{line['bytes_per_token']:,.0f}"] for line in summary(result)))


def plot(result: dict[str, Any], path: Path) -> None:
    from .bench.common import figure, finish_axes

    lines = summary(result)
    with figure(path, panels=2, size=(6.5, 4.5)) as axes:
        for ax, (key, label) in zip(axes, (("mean_accuracy", "mean task accuracy"), ("top1", "top-1 agreement with full"))):
            for kind in KINDS:
                pts = sorted((line["bytes_per_token"], line[key]) for line in lines if line["cache"] == kind)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=kind)
            finish_axes(ax, "bytes per token (allocated)", label, f"{label} against memory")
            ax.set_xscale("log")


def write(result: dict[str, Any], out: Path) -> None:
    c = result["config"]
    head = (
        f"Quality against the full cache: trained model {c['model']}, context {c['context']} tokens, "
        f"{c['instances']} held-out instances per task and depth (early = depth {DEPTHS['early']}, "
        f"late = {DEPTHS['late']}), {c['text_samples']} held-out texts for KL / top-1.\n\n"
    )
    write_files(out, "eval", result, head + table(result) + "\n", plot)
