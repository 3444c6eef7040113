"""The ``kvcache`` command line: ``kvcache demo``, ``kvcache generate``, ``kvcache bench``, ``kvcache eval``.

Each subcommand is one ``add_<name>(subparsers)`` function that builds its parser and sets
``handler`` to a ``cmd_<name>(args) -> int`` function; :data:`SUBCOMMANDS` lists them in ``--help``
order. Heavy imports happen inside the handlers, so ``--help`` and argument errors stay quick.

Exit codes: 0 success, 2 bad arguments or a ``kvcache`` error (printed as one line,
``kvcache: error: ...``, without a traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__, tasks
from .bench import SUITES
from .demo import DEPTH, RANDOM_PROMPT_TOKENS, TRAINED_PROMPT_TOKENS
from .errors import KVCacheError, SpecError
from .spec import CacheSpec, parse_spec, valid_specs
from .tiny import FAMILIES

PROG = "kvcache"


# ---- argument types ------------------------------------------------------------------------


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def _output_file(text: str) -> str:
    """A path whose directory exists, checked before a long run rather than after it."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder!r} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    return text


def _write_json(path: str, payload: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise KVCacheError(f"cannot write {path}: {e.strerror or e}") from e


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _cache_spec(text: str) -> CacheSpec:
    try:
        return parse_spec(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise KVCacheError(f"--device cuda: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu")


def _output_dir(path: str) -> Path:
    """``--out`` as a Path; refused if it exists and is not a directory."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise KVCacheError(f"--out: {out} exists and is not a directory")
    return out


# ---- kvcache demo --------------------------------------------------------------------------


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="compare the caches on greedy generation with the shipped tiny model",
        description=(
            "Greedy generation with Hugging Face's DynamicCache and kvcache's caches on the small "
            "model trained for kvcache and shipped with it (nothing is downloaded). The prompt is a "
            "pass-key retrieval task on held-out text; the unbounded caches must reproduce "
            "DynamicCache's tokens, and the bounded ones (window, H2O, TOVA, int4) show whether the "
            "key survives what they drop. Contenders alternate round-robin; the table shows decode "
            "tokens/s (median), the bytes each cache holds, how often its storage moved, whether the "
            "tokens match DynamicCache's, and the answer. With --family, a random-weight model of "
            "that family with a wide KV cache and a random prompt instead (unbounded caches only)."
        ),
    )
    count = {"type": _int_at_least(1), "metavar": "N"}
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
        type=_int_at_least(2),
        metavar="N",
        default=64,
        help="tokens to generate, at least 2 (default: %(default)s)",
    )
    p.add_argument(
        "--depth",
        type=_probability,
        default=DEPTH,
        metavar="D",
        help="where the pass key sits, 0 = start, 1 = just before the question (default: %(default)s)",
    )
    p.add_argument("--repeats", **count, default=3, help="runs per cache (default: %(default)s)")
    p.add_argument("--threads", **count, default=None, help="torch threads (default: torch's own setting)")
    p.add_argument("--json", type=_output_file, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

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
        _write_json(args.json, {"header": header, "settings": settings, "results": results})
    return 0


# ---- kvcache generate ----------------------------------------------------------------------

TINY = "tiny"

def load_model(name_or_dir: str, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``--model``: ``"tiny"`` or a local Hugging Face checkpoint folder.

    ``"tiny"`` is the small model trained for kvcache and shipped with it (:mod:`kvcache.trained`),
    with its byte-level tokenizer. A folder is loaded with ``AutoTokenizer`` /
    ``AutoModelForCausalLM``, never from the hub.
    """
    if name_or_dir == TINY:
        from .trained import MODEL_DIR

        name_or_dir = str(MODEL_DIR)
    if not os.path.isdir(name_or_dir):
        raise KVCacheError(f"--model: {name_or_dir!r} is neither {TINY!r} nor a model directory")
    from .trained import load_pretrained

    try:
        return load_pretrained(name_or_dir, device)
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())
        raise KVCacheError(f"cannot load a model and tokenizer from {name_or_dir}: {reason}") from e


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
    from .cachefile import load_cache

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
    p = subparsers.add_parser(
        "generate",
        help="generate text with a kvcache cache, streaming tokens as they come",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Generate a continuation of --prompt, printing text as each token arrives, then a summary\n"
            "line on stderr. --save-cache keeps the cache and the token ids in one file, so a\n"
            "later --load-cache can continue the conversation: the new prompt is appended to it.\n\n"
            f"Cache specs (--cache):\n{valid_specs()}"
        ),
    )
    p.add_argument(
        "--model",
        default=TINY,
        metavar="DIR|tiny",
        help="a local Hugging Face checkpoint folder, or 'tiny': the small model trained for kvcache "
        "and shipped with it, byte-level tokenizer (default: %(default)s)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--cache", type=_cache_spec, default=None, metavar="SPEC", help="cache spec, e.g. growable, "
        "static:capacity=4096, concat (default: growable)"
    )
    source.add_argument(
        "--load-cache", default=None, metavar="FILE", help="continue from a cache saved with --save-cache "
        "(its spec is the one it was saved with)"
    )
    p.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (appended to a loaded cache)")
    p.add_argument(
        "--max-new-tokens", type=_int_at_least(1), default=64, metavar="N", help="tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--save-cache", type=_output_file, default=None, metavar="FILE", help="save the cache and the token ids afterwards"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="sample", action="store_false", help="greedy decoding (the default)")
    mode.add_argument("--sample", dest="sample", action="store_true", help="sample from the model's distribution")
    p.add_argument(
        "--temperature", type=_positive_float, default=None, metavar="T", help="sampling temperature (with --sample; default 1.0)"
    )
    p.add_argument(
        "--top-p", type=_probability, default=None, metavar="P", help="nucleus sampling mass (with --sample; default 1.0)"
    )
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed torch's random generator (for --sample)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    p.set_defaults(handler=cmd_generate, sample=False)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .bench.common import human_bytes
    from .build import make_cache
    from .hf import use_kvcache_attention
    from .tokenizer import TokenStreamer

    if not args.sample and (args.temperature is not None or args.top_p is not None):
        raise KVCacheError("--temperature and --top-p apply only with --sample")
    _check_device(args.device)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, args.device)
    use_kvcache_attention(model)  # our model: fast decode attention, and what bounded caches need
    if args.load_cache:
        cache, ids = load_conversation(args.load_cache, model)
    else:
        cache, ids = make_cache(model, args.cache or parse_spec("growable")), []
    ids = ids + list(tokenizer.encode(args.prompt, add_special_tokens=not ids))
    cached = cache.seen
    if len(ids) <= cached:
        raise KVCacheError("the prompt is empty and there is nothing left to feed the model")

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
    start = time.perf_counter()
    try:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
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
    rate = len(new) / seconds if seconds > 0 else float("inf")
    decode = ""
    if streamer.first_token_at is not None and len(new) > 1 and streamer.last_token_at > streamer.first_token_at:
        decode_rate = (len(new) - 1) / (streamer.last_token_at - streamer.first_token_at)
        decode = f", decode {decode_rate:.1f} tokens/s after a {streamer.first_token_at - start:.3f} s prefill"
    print(
        f"{PROG}: {len(new)} tokens in {seconds:.2f} s ({rate:.1f} tokens/s{decode}); "
        f"prefill {len(ids) - cached} tokens ({cached} already cached); "
        f"cache {cache.spec}, {human_bytes(cache.nbytes)} ({cache.nbytes} bytes){saved}",
        file=sys.stderr,
    )
    return 0


# ---- kvcache bench -------------------------------------------------------------------------


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark suite and write its JSON, table and plot",
        description=(
            "Run one benchmark suite, print its table and write SUITE.json, SUITE.md and SUITE.png into "
            "--out. Suites: " + ", ".join(SUITES) + "."
        ),
    )
    p.add_argument("suite", choices=SUITES, metavar="SUITE", help="one of: %(choices)s")
    p.add_argument("--quick", action="store_true", help="a smaller run (about two minutes on 2 cores)")
    p.add_argument(
        "--out", default=os.path.join("benchmarks", "results"), metavar="DIR", help="output folder (default: %(default)s)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # seconds-long run for tests
    p.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import get_suite

    out = _output_dir(args.out)
    _check_device(args.device)
    try:
        suite = get_suite(args.suite)
    except ModuleNotFoundError as e:
        if e.name != f"kvcache.bench.{args.suite}":
            raise
        raise KVCacheError(f"benchmark suite {args.suite!r} is not available in this version of kvcache") from e
    plots = _say_if_no_plots()
    result = suite.run(quick=args.quick, out=out, device=args.device, progress=args.progress, tiny=args.tiny)
    text = suite.table(result)
    print(text, end="" if text.endswith("\n") else "\n", flush=True)
    _list_written(out, result.get("suite", args.suite), plots)
    return 0


def _say_if_no_plots() -> bool:
    """Whether PNGs will be written; if not, one line says so before the run starts."""
    from .bench.common import NO_PLOTS, can_plot

    if can_plot():
        return True
    print(f"{PROG}: {NO_PLOTS}", file=sys.stderr, flush=True)
    return False


def _list_written(out, name: str, plots: bool) -> None:
    for ext in ("json", "md") + (("png",) if plots else ()):
        path = out / f"{name}.{ext}"
        if path.is_file():
            print(f"wrote {path}")


# ---- kvcache eval --------------------------------------------------------------------------


def add_eval(subparsers: argparse._SubParsersAction) -> None:
    from .eval import DEFAULT_BUDGETS, DEFAULT_KINDS, KINDS, QUICK_BUDGETS

    p = subparsers.add_parser(
        "eval",
        help="measure what each bounded cache costs in accuracy, against the full cache",
        description=(
            "Run the quality harness on the trained model: passkey, associative recall and variable "
            "tracking accuracy (needle early and late), KL divergence and top-1 agreement with the full "
            "cache on held-out text, and bytes per token, for each cache kind and budget. Writes "
            "eval.json, eval.md and eval.png into --out."
        ),
    )
    p.add_argument("--quick", action="store_true", help="a smaller run (under three minutes on 2 cores)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), metavar="DIR", help="output folder (default: %(default)s)")
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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # seconds-long run for tests
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
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
    out = _output_dir(args.out)
    _check_device(args.device)
    plots = _say_if_no_plots()
    try:
        result = run(
            quick=args.quick, out=out, kinds=kinds, budgets=budgets, model_dir=args.model,
            device=args.device, progress=args.progress, tiny=args.tiny,
        )
    except FileNotFoundError as e:
        raise KVCacheError(str(e)) from e
    print(table(result))
    _list_written(out, "eval", plots)
    return 0


# ---- the parser and the entry point --------------------------------------------------------

#: One ``add_<name>`` per subcommand, in ``--help`` order.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_demo, add_generate, add_bench, add_eval]


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
