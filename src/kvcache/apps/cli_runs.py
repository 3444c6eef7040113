"""``kvcache bench`` and ``kvcache eval``: run a benchmark suite or the quality harness, print its
table and write its JSON, markdown and plot."""

from __future__ import annotations

import argparse

from ..errors import KVCacheError
from .bench import SUITES
from .cli_options import add_command, add_run_options, list_written, run_options, say_if_no_plots


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "bench", cmd_bench, suites=", ".join(SUITES))
    p.add_argument("suite", choices=SUITES, metavar="SUITE", help="one of: %(choices)s")
    add_run_options(p, "a smaller run (about two minutes on 2 cores)")
    real = p.add_argument_group("suite real (a real pretrained model)")
    real.add_argument("--model", default=None, metavar="NAME|DIR", help="a model name, tiny (the shipped model), or a local Hugging Face model folder (default: smollm2)")
    real.add_argument("--contexts", type=int_list, default=None, metavar="N,...", help="context lengths (default: 1024,4096,8192; --quick 1024)")
    real.add_argument("--batches", type=int_list, default=None, metavar="N,...", help="batch sizes (default: 1,8)")
    real.add_argument("--prefill-cache", default=None, metavar="DIR", help="keep the prefill's keys and values here for later runs")


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1024,4096, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1024,4096, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    """run a benchmark suite and write its JSON, table and plot

    Run one benchmark suite, print its table and write SUITE.json, SUITE.md and SUITE.png into --out.
    Suites: {suites}.
    """
    from .bench import get_suite

    options = run_options(args)
    try:
        suite = get_suite(args.suite)
    except ModuleNotFoundError as e:
        if e.name != f"kvcache.apps.bench.{args.suite}":
            raise
        raise KVCacheError(f"benchmark suite {args.suite!r} is not available in this version of kvcache") from e
    given = {"model": args.model, "contexts": args.contexts, "batches": args.batches, "prefill_dir": args.prefill_cache}
    given = {k: v for k, v in given.items() if v is not None}
    if given and args.suite != "real":
        raise KVCacheError(f"--model, --contexts, --batches and --prefill-cache apply to suite 'real' only, not {args.suite!r}")
    plots = say_if_no_plots()
    result = suite.run(options, **given)
    text = suite.table(result)
    print(text, end="" if text.endswith("\n") else "\n", flush=True)
    list_written(options.out, result.get("suite", args.suite), plots)
    return 0


# ---- kvcache eval --------------------------------------------------------------------------


def add_eval(subparsers: argparse._SubParsersAction) -> None:
    from .eval import DEFAULT_BUDGETS, DEFAULT_KINDS, KINDS, QUICK_BUDGETS

    p = add_command(subparsers, "eval", cmd_eval)
    add_run_options(p, "a smaller run (under three minutes on 2 cores)")
    p.add_argument(
        "--caches",
        default=",".join(DEFAULT_KINDS),
        metavar="KIND,...",
        help=f"cache kinds, from: {', '.join(k for k in KINDS if k != 'full')} (default: %(default)s)",
    )
    p.add_argument(
        "--budgets",
        default=None,
        metavar="F,...",
        help=(
            "budgets as fractions of the context, for window and eviction (default: "
            f"{','.join(map(str, DEFAULT_BUDGETS))}; with --quick {','.join(map(str, QUICK_BUDGETS))})"
        ),
    )
    p.add_argument("--model", default=None, metavar="DIR", help="a trained model folder (default: the shipped one)")


def cmd_eval(args: argparse.Namespace) -> int:
    """measure what each bounded cache costs in accuracy, against the full cache

    Run the quality harness on the trained model: passkey, associative recall and variable tracking
    accuracy (needle early and late), KL divergence and top-1 agreement with the full cache on
    held-out text, and bytes per token, for each cache kind and budget. Writes eval.json, eval.md
    and eval.png into --out.
    """
    from .eval import KINDS, run, table

    kinds = tuple(k.strip() for k in args.caches.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise KVCacheError(f"--caches: unknown kind(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(KINDS)}")
    budgets = None
    if args.budgets is not None:
        try:
            budgets = tuple(float(b) for b in args.budgets.split(",") if b.strip())
        except ValueError:
            raise KVCacheError(f"--budgets: expected fractions like 0.5,0.25, got {args.budgets!r}") from None
        if not budgets or not all(0 < b < 1 for b in budgets):
            raise KVCacheError(f"--budgets: every budget must be a fraction in (0, 1), got {args.budgets!r}")
    options = run_options(args)
    plots = say_if_no_plots()
    try:
        result = run(options, kinds=kinds, budgets=budgets, model_dir=args.model)
    except FileNotFoundError as e:
        raise KVCacheError(str(e)) from e
    print(table(result))
    list_written(options.out, "eval", plots)
    return 0
