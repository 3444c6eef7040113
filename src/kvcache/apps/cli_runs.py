"""``kvcache bench`` and ``kvcache eval``: run a benchmark suite or the quality harness, print its
table and write its JSON, markdown and plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import KVCacheError
from .bench import SUITES
from .cli_options import PROG, add_command, add_run_options, list_written, run_options, say_if_no_plots


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "bench", cmd_bench, suites=", ".join(SUITES))
    p.add_argument("suite", choices=SUITES, metavar="SUITE", help="one of: %(choices)s")
    add_run_options(p, "a smaller run (about two minutes on 2 cores)")
    real = p.add_argument_group("suite real (a real pretrained model; --model also for suite mixes)")
    real.add_argument("--model", default=None, metavar="NAME|DIR", help="a model name, tiny (the shipped model), or a local Hugging Face model folder (default: smollm2)")
    real.add_argument("--contexts", type=int_list, default=None, metavar="N,...", help="context lengths (default: 1024,4096,8192; --quick 1024)")
    real.add_argument("--batches", type=int_list, default=None, metavar="N,...", help="batch sizes (default: 1,4,8,16; --quick 1,8)")
    real.add_argument("--prefill-cache", default=None, metavar="DIR", help="keep the prompts and the prefill's keys and values here for later runs")
    real.add_argument(
        "--contenders", type=name_list, default=None, metavar="NAME,...",
        help="only these contenders, the reference always runs (real: DynamicCache, see kvcache.apps.bench.real_decode.CONTENDERS; "
        "engine: sequential, see kvcache.apps.bench.engine.CONTENDERS; serve: some of kvcache, kvcache+int8, transformers)",
    )  # fmt: skip
    attention = p.add_argument_group("suite attention")
    attention.add_argument(
        "--shapes", type=shape_list, default=None, metavar="Hq/HkvxD@BxT,...",
        help="only these decode calls, e.g. 32/8x128@1x16384,9/3x64@8x4096 (query heads / KV heads x head dim @ batch x tokens)",
    )  # fmt: skip
    prompt = p.add_argument_group("suite prompt (the prompt store)")
    prompt.add_argument("--workloads", type=name_list, default=None, metavar="NAME,...", help="some of chat, shared, backends (default: all)")
    engine = p.add_argument_group("suite engine (the paged engine; also --contenders)")
    engine.add_argument("--arrivals", type=name_list, default=None, metavar="NAME,...", help="some of burst, poisson (default: both)")
    engine.add_argument("--eager", action="store_true", default=None, help="the engines' steps eagerly (default: compile=True, compiled before each engine's first run)")
    capacity = p.add_argument_group("suite capacity (sessions one pool holds)")
    capacity.add_argument(
        "--formats", type=spec_list, default=None, metavar="SPEC;...",
        help="engine specs to run, ';' between them (default: kvcache.apps.bench.capacity.FORMATS); growable is fp32's reference",
    )  # fmt: skip
    serve = p.add_argument_group("suite serve (kvcache serve against transformers serve; also --contenders)")
    serve.add_argument("--clients", type=int_list, default=None, metavar="N,...", help="concurrent client counts (default: 1,4,16,32; --quick 1,4; --ray: one count, 8)")
    serve.add_argument("--ray", action="store_true", default=None, help="two kvcache serve --ray replicas under each router: blocks, prefix (Ray Serve's, on text) and default (needs kvcache[ray])")

#: Which suites take each suite-specific option.
SUITE_OPTIONS = {
    "model": ("real", "mixes"), "contexts": ("real",), "batches": ("real",), "prefill_dir": ("real",), "contenders": ("real", "engine", "serve"),
    "shapes": ("attention",), "workloads": ("prompt",), "arrivals": ("engine",), "eager": ("engine",), "clients": ("serve",),
    "ray": ("serve",), "formats": ("capacity",),
}  # fmt: skip


def _suites(names: tuple[str, ...]) -> str:
    """``suite 'real'``, or ``suites 'real', 'engine'``."""
    return ("suite " if len(names) == 1 else "suites ") + ", ".join(map(repr, names))


def _items(text: str, sep: str = ",") -> tuple[str, ...]:
    """The non-empty items of a ``sep``-separated list, stripped."""
    return tuple(x.strip() for x in text.split(sep) if x.strip())


def name_list(text: str) -> list[str]:
    names = list(_items(text))
    if not names:
        raise argparse.ArgumentTypeError(f"expected names like growable,hf_static, got {text!r}")
    return names


def spec_list(text: str) -> list[str]:
    specs = list(_items(text, ";"))
    if not specs:
        raise argparse.ArgumentTypeError(f"expected cache specs separated by ';', got {text!r}")
    return specs


def shape_list(text: str) -> list:
    from .bench.attention import parse_shapes

    try:
        return parse_shapes(text)
    except KVCacheError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in _items(text)]
    except ValueError:
        values = []
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
    given = {k: getattr(args, "prefill_cache" if k == "prefill_dir" else k) for k in SUITE_OPTIONS}
    given = {k: v for k, v in given.items() if v is not None}
    misplaced = [k for k in given if args.suite not in SUITE_OPTIONS[k]]
    if misplaced:
        flags = ", ".join("--" + ("prefill-cache" if k == "prefill_dir" else k) + f" ({_suites(SUITE_OPTIONS[k])})" for k in misplaced)
        raise KVCacheError(f"not options of suite {args.suite!r}: {flags}")
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
        metavar="KIND,...",
        help=f"cache kinds, from: {', '.join(k for k in KINDS if k != 'full')} (default: {','.join(DEFAULT_KINDS)}); "
        "for a real model see `kvcache.apps.eval_real_plan.KINDS` (default: all of them)",
    )
    p.add_argument(
        "--budgets",
        metavar="F,...",
        help=(
            "budgets as fractions of the context, for window and eviction (default: "
            f"{','.join(map(str, DEFAULT_BUDGETS))}; with --quick {','.join(map(str, QUICK_BUDGETS))})"
        ),
    )
    p.add_argument(
        "--model",
        metavar="NAME|DIR",
        help="a real model by name (smollm2: needles in prose through its chat template, see --lengths), "
        "or a trained model folder (default: the shipped tiny one)",
    )
    p.add_argument("--lengths", default=None, metavar="N,...", help="real model: context lengths in tokens (default: 1024,2048,4096,8192; --quick 1024,2048)")
    p.add_argument("--contexts", type=int, default=None, metavar="N", help="real model: contexts per length (default 6; --quick 3)")
    p.add_argument(
        "--needles",
        type=int,
        default=1,
        choices=(1, 3),
        help="real model: needles per context, one question each (3: one context serves three questions; default %(default)s)",
    )
    p.add_argument(
        "--frontier",
        action="store_true",
        default=None,
        help="real model: quality per byte instead: at each byte budget (--budgets, shares of the fp32 cache; default "
        "0.5,0.25,0.125,0.0625) every eviction kind (--caches, from snapkv,pyramidkv,adakv,h2o,tova,tova-layer,lastrec) "
        "with each slot storage, and auto:bytes=; writes frontier.json, frontier.md and frontier.png",
    )
    p.add_argument(
        "--autos",
        metavar="POINT;...",
        help="with --frontier: the points that choose their own mix, auto or auto-heads with options after a comma "
        "(e.g. 'auto;auto-heads,tolerance=0.3,margin=0.01'; default auto;auto-heads; none: no such point)",
    )
    p.add_argument(
        "--storages",
        metavar="STORAGE,...",
        help="with --frontier: the slot storages of the fixed mixes (default full,int8,int4,int2); fine@share+coarse is "
        "mixed precision inside a layer, e.g. int8@0.25+int4: the quarter of the kept slots ranked highest in int8, the rest in int4",
    )
    p.add_argument(
        "--tasks",
        metavar="FAMILY,...",
        help="with --frontier: task families instead of the needles (needle-digits, needle-words, needle-mixed, multi-key, "
        "kv-lookup, turn; or all), one item per family and context seed; the caches default to snapkv,adakv",
    )
    p.add_argument(
        "--split",
        choices=("tuned", "held-out"),
        help="with --tasks: which split's items (other prose, phrasings and seeds; default held-out)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        default=None,
        help="real model: every documented kind used plainly (make_cache in generate, the question in the prompt; "
        "kvzip-context: kvzip.compress_context on the context, then the question) at --budgets (default 0.5,0.25) on pass keys in held-out prose (--lengths: one length, default 2048; --contexts, "
        "default 15); exits 1 when a kind finds far fewer needles than the full cache or an answer degenerates; "
        "writes plain.json and plain.md",
    )
    p.add_argument(
        "--first-context",
        type=int,
        default=0,
        metavar="N",
        help="with --frontier: the contexts are those of seeds N, N+1, ... (to add contexts to an earlier run, then --merge; default 0)",
    )
    p.add_argument(
        "--merge",
        metavar="DIR,...",
        help="with --frontier: run nothing; merge the frontier.json of these folders (other lengths or contexts of the same "
        "frontier) into one report in --out",
    )
    p.add_argument(
        "--reuse",
        metavar="KIND,...",
        help="real model: kinds also run with the document compressed once and reused for every question (kvzip always is)",
    )


def _budgets(args: argparse.Namespace) -> tuple[float, ...] | None:
    if args.budgets is None:
        return None
    try:
        budgets = tuple(map(float, _items(args.budgets)))
    except ValueError:
        raise KVCacheError(f"--budgets: expected fractions like 0.5,0.25, got {args.budgets!r}") from None
    if not budgets or not all(0 < b < 1 for b in budgets):
        raise KVCacheError(f"--budgets: every budget must be a fraction in (0, 1), got {args.budgets!r}")
    return budgets


def _names(value: str, valid, what: str, noun: str = "kind(s)") -> tuple[str, ...]:
    names = _items(value)
    unknown = [k for k in names if k not in valid]
    if unknown or not names:
        raise KVCacheError(f"{what}: unknown {noun} {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return names


def _refuse(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """Refuse the first of the options ``names`` that was given (is not None): ``--NAME why``."""
    for name in names:
        if getattr(args, name) is not None:
            raise KVCacheError(f"--{name.replace('_', '-')} {why}")


def _refuse_frontier_options(args: argparse.Namespace) -> None:
    """Options that only ``--frontier`` takes, refused elsewhere."""
    names = ("merge", "tasks", "split", "autos", "storages") + (("first_context",) if args.first_context else ())
    _refuse(args, names, "applies to --frontier")


def _eval_real(args: argparse.Namespace) -> int:
    from . import eval_real, eval_real_report
    from .eval_real_plan import DEFAULT_CONTEXT_KINDS, DEFAULT_KINDS, KINDS

    lengths = None
    if args.lengths is not None:
        try:
            lengths = tuple(map(int, _items(args.lengths)))
        except ValueError:
            raise KVCacheError(f"--lengths: expected token counts like 1024,2048, got {args.lengths!r}") from None
        if not lengths or min(lengths) < 256:
            raise KVCacheError(f"--lengths: every length must be at least 256 tokens, got {args.lengths!r}")
    if args.contexts is not None and args.contexts < 1:
        raise KVCacheError(f"--contexts must be at least 1, got {args.contexts}")
    if args.frontier and args.plain:
        raise KVCacheError("--frontier and --plain are two different runs: give one")
    if args.plain:
        _refuse_frontier_options(args)
        return _eval_plain(args, lengths)
    frontier_kinds = ("snapkv", "pyramidkv", "adakv", "h2o", "tova", "tova-layer", "lastrec")
    kinds = DEFAULT_KINDS if args.caches is None else _names(args.caches, frontier_kinds if args.frontier else KINDS, "--caches")
    reuse = DEFAULT_CONTEXT_KINDS if args.reuse is None else _names(args.reuse, KINDS, "--reuse")
    if args.frontier:
        return _eval_frontier(args, lengths)
    _refuse_frontier_options(args)
    options = run_options(args)
    plots = say_if_no_plots()
    try:
        result = eval_real.run(options, model_name=args.model, kinds=kinds, context_kinds=reuse,
                               budgets=_budgets(args), lengths=lengths, contexts=args.contexts,
                               needles_per_context=args.needles)
    except ValueError as e:
        raise KVCacheError(str(e)) from e
    print(eval_real_report.table(result))
    list_written(options.out, "eval", plots)
    return 0


def _eval_frontier(args: argparse.Namespace, lengths: tuple[int, ...] | None) -> int:
    from . import eval_frontier, frontier_points

    if args.reuse is not None:
        raise KVCacheError("--reuse does not apply to --frontier (every point compresses with the question in the prompt)")
    if args.first_context < 0:
        raise KVCacheError(f"--first-context must be 0 or more, got {args.first_context}")
    kinds = None if args.caches is None else _items(args.caches)
    tasks = None
    if args.tasks is not None:
        from .families import FAMILIES

        tasks = FAMILIES if args.tasks.strip() == "all" else _names(args.tasks, FAMILIES, "--tasks", "task family(ies)")
    elif args.split is not None:
        raise KVCacheError("--split applies to --tasks")
    autos = frontier_points.AUTO
    if args.autos is not None:
        if args.merge is not None:
            raise KVCacheError("--autos runs points; --merge runs nothing: give one")
        try:
            autos = () if args.autos.strip() == "none" else frontier_points.check_autos(_items(args.autos, ";"))
        except ValueError as e:
            raise KVCacheError(f"--autos: {e}") from None
    storages = frontier_points.STORAGES
    if args.storages is not None:
        if args.merge is not None:
            raise KVCacheError("--storages runs points; --merge runs nothing: give one")
        storages = _items(args.storages)
        try:
            for storage in storages or ("",):
                frontier_points.storage_options(storage)
        except ValueError as e:
            raise KVCacheError(f"--storages: {e}") from None
    options = run_options(args)
    plots = say_if_no_plots()
    try:
        if args.merge is not None:
            result = eval_frontier.merge([_frontier_of(Path(d)) for d in _items(args.merge)])
            if options.out is not None:
                eval_frontier.write(result, Path(options.out))
        else:
            result = eval_frontier.run(options, model_name=args.model, kinds=kinds, lengths=lengths, contexts=args.contexts,
                                       needles_per_context=args.needles, budgets=_budgets(args), first_context=args.first_context,
                                       tasks=tasks, split=args.split or "held-out", autos=autos, storages=storages)  # fmt: skip
    except ValueError as e:
        raise KVCacheError(str(e)) from e
    print(eval_frontier.budget_table(eval_frontier.points_of(result), result["config"]["budgets"]))
    list_written(options.out, "frontier", plots)
    return 0


def _eval_plain(args: argparse.Namespace, lengths: tuple[int, ...] | None) -> int:
    from . import eval_plain

    _refuse(args, ("reuse",) + (("needles",) if args.needles != 1 else ()),
            "does not apply to --plain (one needle per context, the question in the prompt)")
    if lengths is not None and len(lengths) != 1:
        raise KVCacheError(f"--plain runs one length, got --lengths {args.lengths}")
    kinds = tuple(eval_plain.PLAIN) if args.caches is None else _names(args.caches, tuple(eval_plain.PLAIN), "--caches")
    options = run_options(args)
    try:
        result = eval_plain.run(options, model_name=args.model, kinds=kinds, budgets=_budgets(args),
                                length=None if lengths is None else lengths[0], contexts=args.contexts)
    except ValueError as e:
        raise KVCacheError(str(e)) from e
    print(eval_plain.table(result))
    list_written(options.out, "plain", False)
    failed = eval_plain.failures(result)
    for line in failed:
        print(f"{PROG} eval --plain: FAIL {line}", file=sys.stderr)
    return 1 if failed else 0


def _frontier_of(folder: Path) -> dict:
    """A frontier result read back from ``folder/frontier.json`` (an untrusted file: checked)."""
    path = folder / "frontier.json" if folder.is_dir() else folder
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KVCacheError(f"--merge: cannot read a frontier result from {path}: {e}") from None
    if not isinstance(result, dict) or not isinstance(result.get("config"), dict) or not isinstance(result.get("runs"), list):
        raise KVCacheError(f"--merge: {path} is not a frontier result (expected an object with config and runs)")
    return result


def cmd_eval(args: argparse.Namespace) -> int:
    """measure what each bounded cache costs in accuracy, against the full cache

    Run the quality harness on the trained model: passkey, associative recall and variable tracking
    accuracy (needle early and late), KL divergence and top-1 agreement with the full cache on
    held-out text, and bytes per token, for each cache kind and budget. Writes eval.json, eval.md
    and eval.png into --out.
    """
    from ..models import find_entry
    from .eval import DEFAULT_KINDS, KINDS, run, table

    if args.model is not None and find_entry(args.model) is not None:
        return _eval_real(args)
    real_only = "applies to a real model (--model smollm2), not to the trained tiny one"
    _refuse(args, ("frontier", "plain"), real_only)
    _refuse_frontier_options(args)
    names = ("lengths", "contexts", "reuse") + (("needles",) if args.needles != 1 else ())
    _refuse(args, names, real_only)
    kinds = DEFAULT_KINDS if args.caches is None else _names(args.caches, KINDS, "--caches")
    budgets = _budgets(args)
    options = run_options(args)
    plots = say_if_no_plots()
    try:
        result = run(options, kinds=kinds, budgets=budgets, model_dir=args.model)
    except FileNotFoundError as e:
        raise KVCacheError(str(e)) from e
    print(table(result))
    list_written(options.out, "eval", plots)
    return 0
