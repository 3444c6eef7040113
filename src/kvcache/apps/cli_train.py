"""``kvcache finetune``: a LoRA adapter trained through the cache it will be served with
(:mod:`kvcache.apps.finetune`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_options import add_command


def add_finetune(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "finetune", cmd_finetune)
    p.add_argument("--model", default="smollm2", metavar="NAME|DIR", help="a model name (kvcache models list), tiny, or a local Hugging Face model folder (default: %(default)s)")
    p.add_argument("--cache", default="h2o:budget=0.25", metavar="SPEC", help="the cache the model is served and scored with (default: %(default)s)")
    p.add_argument("--train-cache", default=None, metavar="SPEC", help="the cache it is trained through (default: --cache; growable trains with full attention)")
    p.add_argument("--grad", default="replay", type=grad_mode, metavar="replay|detach|K", help="gradients through the cache: exact, none, or within groups of K chunks (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=256, metavar="N", help="tokens per forward pass (default: %(default)s)")
    p.add_argument("--length", type=int, default=4096, metavar="N", help="tokens per training and held-out document (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, metavar="N", help="optimizer steps, one document each (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--rank", type=int, default=8, metavar="R", help="LoRA rank on q/k/v/o (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="orders the training documents and seeds torch (default: %(default)s)")
    p.add_argument("--eval-docs", type=int, default=4, metavar="N", help="held-out documents scored before and after (default: %(default)s)")
    p.add_argument("--needles", type=int, default=0, metavar="N", help="also score N pass-key needles under --cache (needs a chat template; default: %(default)s)")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="save the adapter every N steps (default: only at the end)")
    p.add_argument("--out", type=Path, default=Path("finetune"), metavar="DIR", help="adapter and finetune.json go here (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def grad_mode(text: str) -> str | int:
    if text in ("replay", "detach"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected replay, detach or a positive number of chunks, got {text!r}")


def cmd_finetune(args: argparse.Namespace) -> int:
    """fine-tune a LoRA adapter through a bounded cache, scored under it before and after

    Trains a LoRA adapter (peft; pip install 'kvcache[train]') over long documents (the standard
    library's source files, --length tokens each) with the loss computed chunk by chunk through
    the cache of --train-cache (default --cache), with exact gradients through it (--grad replay),
    none (detach) or within groups of K chunks. Before and after, it scores held-out documents
    under --cache and under the full cache (and, with --needles, pass-key accuracy under --cache),
    then writes the adapter and finetune.json to --out.
    """
    from .finetune import Finetune, finetune

    run = Finetune(
        model=args.model, cache=args.cache, train_cache=args.train_cache, chunk=args.chunk, grad=args.grad,
        length=args.length, steps=args.steps, lr=args.lr, rank=args.rank, seed=args.seed, eval_docs=args.eval_docs,
        needles=args.needles, save_every=args.save_every,
    )  # fmt: skip
    record = finetune(run, args.out, progress=not args.no_progress)
    b, a = record["before"], record["after"]
    print(f"held-out loss under {run.cache}: {b['loss_under_cache']:.4f} -> {a['loss_under_cache']:.4f}")
    print(f"held-out loss, full cache: {b['loss_full']:.4f} -> {a['loss_full']:.4f}")
    if run.needles:
        print(f"needles under {run.cache}: {b['needles_under_cache']:.0%} -> {a['needles_under_cache']:.0%}")
    print(f"trained through {record['trained_through']}: {record['tokens_per_s']:.0f} tokens/s; adapter in {args.out / 'adapter'}")
    return 0
