"""``kvcache demo``: the caches side by side on greedy generation (see :mod:`kvcache.apps.demo`)."""

from __future__ import annotations

import argparse

from ..errors import KVCacheError
from . import demo, demo_sessions, demo_table, tasks
from .cli_load import TINY, load_model
from .cli_options import add_command, int_at_least, output_file, probability, write_json
from .tiny import FAMILIES


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "demo", cmd_demo)
    count = {"type": int_at_least(1), "metavar": "N"}
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--family",
        choices=FAMILIES,
        help="use a random tiny model of this family instead of the trained one",
    )
    which.add_argument(
        "--model",
        metavar="NAME|DIR",
        help="use a real model instead: a name from kvcache models list (downloaded and converted once) "
        "or a local Hugging Face model folder; it answers --prompt",
    )
    p.add_argument("--prompt", metavar="TEXT", help="with --model: the user message it answers")
    p.add_argument(
        "--prompt-tokens",
        **count,
        help=f"prompt length (default: {demo.TRAINED_PROMPT_TOKENS}, or {demo.RANDOM_PROMPT_TOKENS} with --family)",
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
        default=demo.DEPTH,
        metavar="D",
        help="where the pass key sits, 0 = start, 1 = just before the question (default: %(default)s)",
    )
    p.add_argument("--repeats", **count, default=3, help="runs per cache (default: %(default)s)")
    p.add_argument(
        "--sessions",
        type=int_at_least(0),
        metavar="N",
        default=demo_sessions.SESSIONS,
        help="then N sessions at once through the engine against generate one after another, on the "
        "shipped model (default: %(default)s; 0: skip)",
    )
    p.add_argument("--threads", **count, help="torch threads (default: torch's own setting)")
    p.add_argument("--json", type=output_file, metavar="FILE", help="also write the results as JSON")


def cmd_demo(args: argparse.Namespace) -> int:
    """compare the caches on greedy generation with the shipped tiny model

    Greedy generation with Hugging Face's DynamicCache and kvcache's caches on the small model
    trained for kvcache and shipped with it (nothing is downloaded). The prompt is a pass-key
    retrieval task on held-out text; the unbounded caches must reproduce DynamicCache's tokens, and
    the bounded ones show whether the key survives what they drop, and why: SnapKV, Ada-KV and
    auto keep it at an eighth of the bytes, a window and H2O lose it. Then many sessions at once
    through the engine, against generate one session after another (--sessions).
    Contenders alternate round-robin; the table shows decode tokens/s (median), the bytes each cache
    holds, how often its storage moved, whether the tokens match DynamicCache's, and the answer.
    With --family, a random-weight model of that family with a wide KV cache and a random prompt
    instead (unbounded caches only). With --model (e.g. smollm2), a real model answering a short
    chat prompt with the unbounded and the quantized caches.
    """
    if args.prompt is not None and args.model is None:
        raise KVCacheError("--prompt applies only with --model")
    if args.model is not None and args.model != TINY:
        return demo_real_model(args)
    tokenizer = None
    if args.family is None:
        model, tokenizer = load_model(TINY)
        prompt_tokens = args.prompt_tokens or demo.TRAINED_PROMPT_TOKENS
        try:
            tasks.passkey(0, length=prompt_tokens - 1, depth=args.depth)
        except ValueError as e:
            raise KVCacheError(f"--prompt-tokens {prompt_tokens}: {e}") from None
    else:
        model = demo.build_model(args.family)
        prompt_tokens = args.prompt_tokens or demo.RANDOM_PROMPT_TOKENS
    header = demo_table.header_line(
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
    print(demo_table.format_table(results), flush=True)
    sessions = None
    if args.family is None and args.sessions:
        print(flush=True)
        with demo.torch_threads(args.threads):
            sessions = demo_sessions.run_sessions(model, tokenizer, args.sessions, depth=args.depth)
        print(demo_sessions.sessions_lines(sessions), flush=True)
    if args.json:
        settings = {k: getattr(args, k) for k in ("family", "new_tokens", "depth", "repeats", "threads", "sessions")}
        settings["prompt_tokens"] = prompt_tokens
        write_json(args.json, {"header": header, "settings": settings, "results": results, "sessions": sessions})
    return 0


def demo_real_model(args: argparse.Namespace) -> int:
    """``kvcache demo --model NAME|DIR``: see :func:`kvcache.apps.demo.run_real_demo`."""
    if args.prompt_tokens is not None:
        raise KVCacheError("--prompt-tokens applies to the tiny models; with --model the prompt is --prompt")
    model, tokenizer = load_model(args.model)
    text = args.prompt or demo.DEFAULT_PROMPT
    with demo.torch_threads(args.threads):  # before the header, so it shows the count the run uses
        prompt = demo.chat_prompt(tokenizer, text)
        header = demo_table.real_header_line(model, args.model, prompt, text, args.new_tokens, args.repeats)
        print(header, flush=True)
        results, _ = demo.run_real_demo(model, tokenizer, text, args.new_tokens, args.repeats)
    print(demo_table.format_table(results), flush=True)
    print(f"{demo.REFERENCE}'s reply: {results[0]['reply'].strip()!r}", flush=True)
    if args.json:
        settings = {"model": args.model, "prompt": text, "new_tokens": args.new_tokens, "repeats": args.repeats}
        settings |= {"threads": args.threads, "prompt_tokens": int(prompt.shape[1])}
        write_json(args.json, {"header": header, "settings": settings, "results": results})
    return 0
