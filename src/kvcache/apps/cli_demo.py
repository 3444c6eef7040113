"""``kvcache demo``: the caches side by side on greedy generation (see :mod:`kvcache.apps.demo`)."""

from __future__ import annotations

import argparse

from . import tasks
from ..errors import KVCacheError
from .cli_options import add_command, int_at_least, output_file, probability, write_json
from .demo import DEPTH, RANDOM_PROMPT_TOKENS, TRAINED_PROMPT_TOKENS
from .tiny import FAMILIES


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "demo", cmd_demo)
    count = {"type": int_at_least(1), "metavar": "N"}
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default=None,
        help="use a random tiny model of this family instead of the trained one",
    )
    p.add_argument(
        "--prompt-tokens",
        **count,
        default=None,
        help=f"prompt length (default: {TRAINED_PROMPT_TOKENS}, or {RANDOM_PROMPT_TOKENS} with --family)",
    )
    p.add_argument(
        "--new-tokens",
        type=int_at_least(2),
        metavar="N",
        default=64,
        help="tokens to generate, at least 2 (default: %(default)s)",
    )
    p.add_argument(
        "--depth",
        type=probability,
        default=DEPTH,
        metavar="D",
        help="where the pass key sits, 0 = start, 1 = just before the question (default: %(default)s)",
    )
    p.add_argument("--repeats", **count, default=3, help="runs per cache (default: %(default)s)")
    p.add_argument("--threads", **count, default=None, help="torch threads (default: torch's own setting)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the results as JSON")


def cmd_demo(args: argparse.Namespace) -> int:
    """compare the caches on greedy generation with the shipped tiny model

    Greedy generation with Hugging Face's DynamicCache and kvcache's caches on the small model
    trained for kvcache and shipped with it (nothing is downloaded). The prompt is a pass-key
    retrieval task on held-out text; the unbounded caches must reproduce DynamicCache's tokens, and
    the bounded ones (window, H2O, TOVA, int4) show whether the key survives what they drop.
    Contenders alternate round-robin; the table shows decode tokens/s (median), the bytes each cache
    holds, how often its storage moved, whether the tokens match DynamicCache's, and the answer.
    With --family, a random-weight model of that family with a wide KV cache and a random prompt
    instead (unbounded caches only).
    """
    from . import demo
    from .cli import TINY, load_model  # the generate command's loader (cli imports this module)

    tokenizer = None
    if args.family is None:
        model, tokenizer = load_model(TINY)
        prompt_tokens = args.prompt_tokens or TRAINED_PROMPT_TOKENS
        try:
            tasks.passkey(0, length=prompt_tokens - 1, depth=args.depth)
        except ValueError as e:
            raise KVCacheError(f"--prompt-tokens {prompt_tokens}: {e}") from None
    else:
        model = demo.build_model(args.family)
        prompt_tokens = args.prompt_tokens or RANDOM_PROMPT_TOKENS
    header = demo.header_line(
        model, args.family, prompt_tokens, args.new_tokens, args.repeats, args.threads, depth=args.depth
    )
    print(header, flush=True)
    results = demo.run_demo(
        args.family,
        prompt_tokens,
        args.new_tokens,
        args.repeats,
        depth=args.depth,
        model=model,
        tokenizer=tokenizer,
        threads=args.threads,
    )
    print(demo.format_table(results), flush=True)
    if args.json:
        settings = {k: getattr(args, k) for k in ("family", "new_tokens", "depth", "repeats", "threads")}
        settings["prompt_tokens"] = prompt_tokens
        write_json(args.json, {"header": header, "settings": settings, "results": results})
    return 0
