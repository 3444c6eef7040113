"""What the ``kvcache`` subcommands share: argument types (checked before a long run, not after
it), the device check, output folders and files, and the options of the commands that write results."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .. import CacheSpec, parse_spec
from ..errors import KVCacheError, SpecError
from .run_options import RunOptions

PROG = "kvcache"


def int_at_least(least: int) -> Callable[[str], int]:
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


def output_file(text: str) -> str:
    """A path whose directory exists, checked before a long run rather than after it."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder!r} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    return text


def write_json(path: str, payload: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise KVCacheError(f"cannot write {path}: {e.strerror or e}") from e


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def cache_spec(text: str) -> CacheSpec:
    try:
        return parse_spec(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise KVCacheError(f"--device cuda: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu")


#: ``--dtype`` choices: ``auto`` keeps the checkpoint's own.
DTYPES = ("auto", "float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")


def weights_dtype(folder: str, dtype: str) -> str:
    """The dtype a model in ``folder`` loads in under ``--dtype dtype``: ``auto`` reads the
    checkpoint's ``config.json`` (``dtype``, or the older ``torch_dtype``; float32 when absent)."""
    if dtype != "auto":
        return dtype
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "float32"  # loading reports the broken folder
    stored = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    return stored if isinstance(stored, str) else "float32"


def check_half_precision(what: str) -> None:
    """Before a model runs in half precision on the CPU: where this CPU's oneDNN AMX kernels kill the
    process (see :mod:`kvcache.attention.half_precision`), cap oneDNN for this run and say so, or refuse."""
    from ..attention import HalfPrecision, use_safe_isa

    found = use_safe_isa()
    if found.status is HalfPrecision.NEEDS_ISA_CAP:
        print(f"{PROG}: note: {found.describe()}; set for this run", file=sys.stderr, flush=True)
    elif found.status is HalfPrecision.BROKEN:
        raise KVCacheError(f"{what}: {found.describe()} (--dtype float32)")


def text_table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    """``rows`` (the head first) as lines of columns two spaces apart, each as wide as its widest cell,
    left-aligned but the ``right`` ones; a rule of dashes under the head."""
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    cells = [[c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))] for row in rows]
    lines = ["  ".join(row).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    raw: bool = False,
    **details: str,
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, run by ``handler(args)`` (it returns the exit code).

    The handler's docstring is the command's help, written once: its first paragraph is the line in
    ``kvcache --help``, the rest (``{name}`` fields filled from ``details``) heads ``kvcache NAME
    --help``, rewrapped unless ``raw``.
    """
    # python -OO drops docstrings: the name stands in for the help then.
    summary, _, description = inspect.cleandoc(handler.__doc__ or name).partition("\n\n")
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    p = subparsers.add_parser(name, help=summary, description=description.format(**details), formatter_class=formatter)
    p.set_defaults(handler=handler)
    return p


# ---- the commands that write results (bench, eval) -------------------------------------------


def add_run_options(p: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick``, ``--out``, ``--device``, ``--no-progress`` and the hidden ``--tiny``."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--out", default=os.path.join("benchmarks", "results"), metavar="DIR", help="output folder (default: %(default)s)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # seconds-long run for tests


def run_options(args: argparse.Namespace) -> RunOptions:
    """The parsed ``add_run_options`` as :class:`RunOptions`; refuses an ``--out`` that is a file
    and a ``--device cuda`` without CUDA before the run starts."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KVCacheError(f"--out: {out} exists and is not a directory")
    check_device(args.device)
    return RunOptions(quick=args.quick, out=out, device=args.device, progress=args.progress, tiny=args.tiny)


def say_if_no_plots() -> bool:
    """Whether PNGs will be written; if not, one line says so before the run starts."""
    from .bench.common import NO_PLOTS, can_plot

    if can_plot():
        return True
    print(f"{PROG}: {NO_PLOTS}", file=sys.stderr, flush=True)
    return False


def list_written(out, name: str, plots: bool) -> None:
    for ext in ("json", "csv", "md") + (("png",) if plots else ()):
        path = out / f"{name}.{ext}"
        if path.is_file():
            print(f"wrote {path}")
