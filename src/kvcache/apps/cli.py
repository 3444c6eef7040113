"""The ``kvcache`` command line: ``kvcache demo``, ``kvcache generate``, ``kvcache bench``, ``kvcache eval``,
``kvcache models``.

Each subcommand is one ``add_<name>(subparsers)`` function that builds its parser with
:func:`.cli_options.add_command`, run by a ``cmd_<name>(args) -> int`` handler whose docstring is the
command's help; :data:`SUBCOMMANDS` lists them in ``--help`` order. ``generate`` lives here, ``demo`` in :mod:`.cli_demo`, ``bench`` and ``eval`` in
:mod:`.cli_runs`, ``models`` in :mod:`.cli_models`, what they share in :mod:`.cli_options`, and what ``--model``
loads in :mod:`.cli_load`. Heavy imports happen inside the handlers,
so ``--help`` and argument errors stay quick.

Exit codes: 0 success, 2 bad arguments or a ``kvcache`` error (printed as one line,
``kvcache: error: ...``, without a traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcache import cache_kwargs

from .. import __version__, parse_spec
from ..errors import KVCacheError
from ..hf import valid_specs
from .cli_demo import add_demo
from .cli_load import TINY, load_model
from .cli_models import add_models
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
)
from .cli_runs import add_bench, add_eval
from .cli_serve import add_serve
from .cli_train import add_finetune

# ---- kvcache generate ----------------------------------------------------------------------


def save_conversation(cache: Any, path: str, ids: list[int]) -> None:
    """Save ``cache`` to ``path`` with the conversation's token ids, in one file, atomically.

    ``ids`` is every token so far; the cache holds the first ``cache.seen`` of them (``generate``
    never feeds its last token back).
    """
    try:
        cache.save(path, token_ids=ids)
    except KVCacheError:
        raise  # CacheSaveError: already names the file and the reason
    except OSError as e:
        raise KVCacheError(f"cannot save the cache to {path}: {e.strerror or e}") from e


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


def open_prompt_store(location: str) -> Any:
    """The ``--prompt-store``: a folder, a Redis URL or ``memory``, signed with ``$KVCACHE_STORE_SECRET`` if set."""
    from ..prompts import PromptStore

    try:
        return PromptStore(location, secret=os.environ.get("KVCACHE_STORE_SECRET") or None)
    except (OSError, ValueError) as e:
        raise KVCacheError(f"--prompt-store {location}: {e}") from e


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
        "--cache", type=cache_spec, default=None, metavar="SPEC", help="cache spec, e.g. growable, "
        "static:capacity=4096, concat (default: growable)"
    )
    source.add_argument(
        "--load-cache", default=None, metavar="FILE", help="continue from a cache saved with --save-cache "
        "(its spec is the one it was saved with)"
    )
    p.add_argument(
        "--prompt-store", default=None, metavar="DIR|redis://...|memory",
        help="reuse the longest stored prefix of the prompt from this prompt store (a folder, or "
        "redis://[:password@]host:port/db) and store what this run computes; reports reused and computed "
        "tokens. Entries are signed with $KVCACHE_STORE_SECRET when it is set. Not with --load-cache",
    )
    p.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (appended to a loaded cache)")
    p.add_argument(
        "--max-new-tokens", type=int_at_least(1), default=64, metavar="N", help="tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--save-cache", type=output_file, default=None, metavar="FILE", help="save the cache and the token ids afterwards"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="sample", action="store_false", help="greedy decoding (the default)")
    mode.add_argument("--sample", dest="sample", action="store_true", help="sample from the model's distribution")
    p.add_argument(
        "--temperature", type=positive_float, default=None, metavar="T", help="sampling temperature (with --sample; default 1.0)"
    )
    p.add_argument(
        "--top-p", type=probability, default=None, metavar="P", help="nucleus sampling mass (with --sample; default 1.0)"
    )
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed torch's random generator (for --sample)")
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
        store = open_prompt_store(args.prompt_store)
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
        save_conversation(cache, args.save_cache, ids + new)
        saved = f"; saved {args.save_cache}"
    reused_from = "already cached"
    if store is not None:
        store.put(cache, out)
        kept = store.stats.stored_tokens
        saved += f"; prompt store {store.backend.location}: {kept} tokens stored"
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


# ---- the parser and the entry point --------------------------------------------------------

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
