"""Benchmark suites, run by ``kvcache bench SUITE``.

Each suite is a module with ``run(options: RunOptions = RunOptions(), *, <its own settings>)``
returning a JSON-able dict (``suite``, ``machine``, ``config``, ``rows``, ...) and, given
``options.out``, writing ``<suite>.json``, ``<suite>.md`` and ``<suite>.png`` there.
``options.quick`` finishes in under two minutes on 2 cores; ``options.tiny`` in seconds, for tests
(its numbers mean nothing). See :class:`kvcache.apps.run_options.RunOptions`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

SUITES: tuple[str, ...] = ("update", "decode", "attention", "memory", "resume", "bounded", "budget", "real", "prefill", "prompt", "engine", "capacity", "serve", "train", "finetune", "mixes", "gpu")


def get_suite(name: str) -> ModuleType:
    """The module of suite ``name``; ``ValueError`` listing the suites if unknown."""
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name!r}; valid suites: {', '.join(SUITES)}")
    return importlib.import_module(f"{__name__}.{name}")
