"""The ``kvcache`` command line: ``kvcache demo`` (more subcommands to come).

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
from collections.abc import Callable, Sequence

from . import __version__
from .errors import KVCacheError
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


# ---- kvcache demo --------------------------------------------------------------------------


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="compare the caches on greedy generation with a tiny local model",
        description=(
            "Greedy generation with Hugging Face's DynamicCache and kvcache's concat, growable and "
            "static caches on a tiny random model built locally (nothing is downloaded). Contenders "
            "alternate round-robin; the table shows decode tokens/s (median), the bytes each cache "
            "holds, how often its storage moved, and whether the tokens match DynamicCache's."
        ),
    )
    count = {"type": _int_at_least(1), "metavar": "N"}
    p.add_argument("--family", choices=FAMILIES, default="llama", help="model family (default: %(default)s)")
    p.add_argument("--prompt-tokens", **count, default=2048, help="prompt length (default: %(default)s)")
    p.add_argument(
        "--new-tokens",
        type=_int_at_least(2),
        metavar="N",
        default=64,
        help="tokens to generate, at least 2 (default: %(default)s)",
    )
    p.add_argument("--repeats", **count, default=3, help="runs per cache (default: %(default)s)")
    p.add_argument("--threads", **count, default=None, help="torch threads (default: torch's own setting)")
    p.add_argument("--json", type=_output_file, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    model = demo.build_model(args.family)
    header = demo.header_line(model, args.family, args.prompt_tokens, args.new_tokens, args.repeats, args.threads)
    print(header, flush=True)
    results = demo.run_demo(
        args.family, args.prompt_tokens, args.new_tokens, args.repeats, model=model, threads=args.threads
    )
    print(demo.format_table(results), flush=True)
    if args.json:
        settings = {k: getattr(args, k) for k in ("family", "prompt_tokens", "new_tokens", "repeats", "threads")}
        _write_json(args.json, {"header": header, "settings": settings, "results": results})
    return 0


# ---- the parser and the entry point --------------------------------------------------------

#: One ``add_<name>`` per subcommand, in ``--help`` order.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_demo]


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
