"""``kvcache finetune``: a LoRA adapter trained over long documents through the cache the model will
be served with (``kvcache.train.chunked_loss``), scored before and after: held-out loss under that
cache (fed ``chunk`` tokens at a time, as serving would feed them) and under the full cache, and with
``--needles N`` the pass-key accuracy of ``N`` needle contexts answered through the cache.

The documents are the Python standard library's source files (present on every machine with Python;
train and held-out files split by ``tasks.filler_files``): source code reuses names defined thousands
of tokens earlier, which is what a bounded cache loses.
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvcache import cache_kwargs

from ..errors import KVCacheError

#: The projections LoRA adapts in every attention block.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Finetune:
    """One run. ``cache``: the spec it is served and scored with; ``train_cache``: the spec it is
    trained through (default ``cache``; ``growable`` is training with full attention)."""

    model: str = "smollm2"
    cache: str = "h2o:budget=0.25"
    train_cache: str | None = None
    chunk: int = 256
    grad: str | int = "replay"
    length: int = 4096
    steps: int = 20
    lr: float = 1e-3
    rank: int = 8
    seed: int = 0
    eval_docs: int = 4
    needles: int = 0
    save_every: int = 0

    @property
    def trained_through(self) -> str:
        return self.cache if self.train_cache is None else self.train_cache


def documents(tokenizer: Any, length: int, split: str, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` documents ``[1, length]`` of ``split``: standard-library files with at least
    ``length`` tokens, their first ``length``, in a seeded order."""
    import sysconfig

    from . import tasks

    root = Path(sysconfig.get_paths()["stdlib"])
    files = list(tasks.filler_files(split))
    random.Random(f"finetune-{split}-{seed}").shuffle(files)
    out = []
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # cut below, never run whole
        if len(ids) >= length:
            out.append(torch.tensor([ids[:length]]))
            if len(out) == count:
                return out
    raise KVCacheError(f"only {len(out)} standard-library files of the {split} split hold {length} tokens; asked for {count}")


def needle_accuracy(model: Any, tokenizer: Any, spec: str, length: int, count: int, chunk: int) -> float:
    """Share of ``count`` pass-key needles (one per context of ``length`` tokens) answered right
    through a cache of ``spec``: the prompt prefilled ``chunk`` tokens at a time, 8 greedy tokens."""
    from .. import make_cache, prefill, use_kvcache_attention
    from . import needles

    found = 0
    for seed in range(count):
        ctx = needles.make_context(tokenizer, length, seed)
        question = ctx.questions[0]
        ids = torch.tensor([ctx.prefix_ids + question.ids])
        cache = make_cache(model, spec)
        prefill(model, ids[:, :-1], cache, chunk=chunk)
        with torch.no_grad(), use_kvcache_attention(model):
            out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
        found += needles.answer_of(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)) == question.key
    return found / count


def evaluate(model: Any, tokenizer: Any, run: Finetune, held_out: list[torch.Tensor]) -> dict[str, Any]:
    """Held-out loss under ``run.cache`` and under the full cache; needle accuracy under ``run.cache``."""
    from ..train import cache_loss

    model.eval()
    out: dict[str, Any] = {
        "loss_under_cache": sum(cache_loss(model, d, run.cache, chunk=run.chunk) for d in held_out) / len(held_out),
        "loss_full": sum(cache_loss(model, d, "growable", chunk=run.chunk) for d in held_out) / len(held_out),
    }
    if run.needles:
        out["needles_under_cache"] = needle_accuracy(model, tokenizer, run.cache, run.length, run.needles, run.chunk)
    return out


def adapt(model: Any, rank: int) -> Any:
    """``model`` wrapped with a LoRA adapter of ``rank`` on ``TARGETS`` (no dropout: the chunks are
    replayed, so the forward pass must be deterministic)."""
    try:
        import peft
    except ImportError:
        raise KVCacheError("kvcache finetune needs peft: pip install 'kvcache[train]'") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGETS))
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for the user to do
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def finetune(run: Finetune, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Train, evaluate before and after, save the adapter to ``out/adapter`` (and every
    ``save_every`` steps to ``out/adapter-step-N``) and the record to ``out/finetune.json``."""
    from tqdm.auto import tqdm

    from ..train import chunked_loss
    from .cli_load import load_model

    _check(run)
    torch.manual_seed(run.seed)
    model, tokenizer = load_model(run.model, dtype="float32")
    model = adapt(model, run.rank)
    train_docs = documents(tokenizer, run.length, "train", min(run.steps, 64), run.seed)
    held_out = documents(tokenizer, run.length, "heldout", run.eval_docs, 0)
    before = evaluate(model, tokenizer, run, held_out)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=run.lr)
    model.train()
    losses, started = [], time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(range(run.steps), desc=f"finetune through {run.trained_through}", unit="step", disable=not progress) as bar:
        for step in bar:
            result = chunked_loss(model, train_docs[step % len(train_docs)], run.trained_through, chunk=run.chunk, grad=run.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(result.loss)
            bar.set_postfix(loss=f"{result.loss:.3f}")
            if run.save_every and (step + 1) % run.save_every == 0:
                model.save_pretrained(out / f"adapter-step-{step + 1}")
    train_s = time.perf_counter() - started
    after = evaluate(model, tokenizer, run, held_out)
    model.save_pretrained(out / "adapter")
    record = {"run": asdict(run), "trained_through": run.trained_through, "before": before, "after": after,
              "train_losses": losses, "train_s": train_s, "tokens_per_s": run.steps * run.length / train_s}  # fmt: skip
    (out / "finetune.json").write_text(json.dumps(record, indent=1))
    return record


def _check(run: Finetune) -> None:
    for name in ("chunk", "length", "steps", "rank", "eval_docs"):
        if getattr(run, name) < 1:
            raise KVCacheError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(run, name)}")
    if run.needles < 0 or run.save_every < 0:
        raise KVCacheError("--needles and --save-every must be at least 0")
    if not (math.isfinite(run.lr) and run.lr > 0):
        raise KVCacheError(f"--lr must be a positive number, got {run.lr}")
