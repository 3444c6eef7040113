"""Reliability: cache files attacked as an adversary would (issue 10, section 5).

Every damaged, forged or hostile file must end in one of two ways: a ``CacheFileError`` (a
``ValueError``) whose message names the file, or a load whose greedy continuation is token for
token the continuation of the undamaged file. Anything else fails: another exception type, a
hang, a wrong continuation. Saving must be atomic against SIGKILL, a full disk and concurrent
writers. The CLI must turn every such file into one line on stderr and exit 2.

Quick by default (a sample of every mutation kind, a few kill trials); ``KVCACHE_RELIABILITY=full``
runs all of it (several thousand mutations, 20 kill trials). ``KVCACHE_RELIABILITY_SEED`` picks
the seed (default 0); ``KVCACHE_RELIABILITY_REPORT=FILE`` writes the counts as JSON.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache.tiny import _DEFAULT_ATTN, tiny_model
from mutations import SPECS, Mutation, crafted_forgeries, mutations

FULL = os.environ.get("KVCACHE_RELIABILITY", "quick") == "full"
SEED = int(os.environ.get("KVCACHE_RELIABILITY_SEED", "0"))
HERE = Path(__file__).parent
WORKER = HERE / "reliability_worker.py"
PROMPT, GENERATED, CONTINUE = 30, 6, 4
HANG_GUARD_S = 30.0  # one load; generous: only a hang or a runaway allocation takes this long

#: (category, outcome) -> count, for the report; outcome is an error class name or "continued".
COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if not COUNTS:
        return
    table: dict[str, dict[str, int]] = {}
    for (category, outcome), n in sorted(COUNTS.items()):
        table.setdefault(category, {})[outcome] = n
    print(f"\nreliability ({'full' if FULL else 'quick'}, seed {SEED}): {json.dumps(table, indent=1)}")
    if os.environ.get("KVCACHE_RELIABILITY_REPORT"):
        Path(os.environ["KVCACHE_RELIABILITY_REPORT"]).write_text(json.dumps(table, indent=1) + "\n")


# ---- the model, the saved files and their continuations -----------------------------------------


@functools.lru_cache(maxsize=None)
def model():
    """Our own tiny gemma2 (hybrid sliding/full): nobody else's model has its attention switched."""
    return tiny_model("gemma2", seed=11)


@contextlib.contextmanager
def attention_for(m, cache):
    """Run ``m`` with the attention ``cache`` needs, putting the model's setting back afterwards."""
    before = m.config._attn_implementation
    want = "kvcache" if cache.needs_kvcache_attention else _DEFAULT_ATTN.get(m.config.model_type, "sdpa")
    if want != before:
        m.set_attn_implementation(want)
    try:
        yield
    finally:
        if m.config._attn_implementation != before:
            m.set_attn_implementation(before)


def greedy(m, cache, first: torch.Tensor, n: int) -> list[int]:
    """Feed ``first`` ``[1, S]``, then ``n - 1`` greedy tokens; the ``n`` tokens chosen."""
    out, ids = [], first
    with attention_for(m, cache), torch.no_grad():
        for _ in range(n):
            ids = m(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


@functools.lru_cache(maxsize=None)
def saved(spec: str) -> tuple[bytes, int, tuple[int, ...]]:
    """(file bytes, the last generated token (not yet cached), the continuation of the loaded file)."""
    m = model()
    cache = kvcache.make_cache(m, spec)
    ids = torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    last = greedy(m, cache, ids, GENERATED)[-1]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.kv"
        cache.save(path)
        raw = path.read_bytes()
        loaded = kvcache.load_cache(path, m)
    assert loaded.seen == PROMPT + GENERATED - 1
    return raw, last, tuple(greedy(m, loaded, torch.tensor([[last]]), CONTINUE))


def outcome(spec: str, mutation: Mutation, path: Path) -> str:
    """Load the mutated file: the error class name, or "continued" (identical tokens); else raise."""
    _, last, ref = saved(spec)
    path.write_bytes(mutation.data)
    where = f"[seed {SEED}] {spec}: {mutation.category} '{mutation.name}'"
    start = time.perf_counter()
    try:
        cache = kvcache.load_cache(path, model())
    except kvcache.CacheFileError as e:
        message = str(e)
        assert str(path) in message, f"{where}: the message does not name the file: {message}"
        assert "\n" not in message, f"{where}: a message of several lines: {message!r}"
        return type(e).__name__
    except Exception as e:  # noqa: BLE001 - every other escape is the failure being looked for
        raise AssertionError(f"{where}: escaped as {type(e).__name__}: {str(e)[:300]}") from e
    finally:
        took = time.perf_counter() - start
        assert took < HANG_GUARD_S, f"{where}: load took {took:.1f} s"
    try:
        tokens = tuple(greedy(model(), cache, torch.tensor([[last]]), CONTINUE))
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{where}: loaded, then continuing raised {type(e).__name__}: {e}") from e
    assert tokens == ref, f"{where}: loaded and continued with {tokens}, the saved cache with {ref}"
    return "continued"


def _sample(items: list, key: str, keep: int, total: int) -> list:
    """Deterministic share ``keep/total`` of ``items`` (by name), rotated by ``key``: quick mode
    still runs every forgery on some kinds."""
    return [it for it in items if (zlib.crc32((key + it[0]).encode()) + SEED) % total < keep]


@pytest.mark.parametrize("spec", SPECS)
def test_mutated_files_are_refused_or_continue_identically(spec, tmp_path):
    raw, _, _ = saved(spec)
    rng = random.Random(f"{SEED}:{spec}")
    forgeries = crafted_forgeries()
    if not FULL:
        forgeries = _sample(forgeries, spec, 1, 12)
    muts = mutations(
        raw, rng,
        flips_n=40 if FULL else 4,
        cuts_n=12 if FULL else 3,
        appends_n=6 if FULL else 1,
        forgeries=forgeries,
        raw_too=FULL or spec == SPECS[(SEED % len(SPECS))],
    )
    failures = []
    for mutation in muts:
        try:
            COUNTS[mutation.category, outcome(spec, mutation, tmp_path / "m.kv")] += 1
        except AssertionError as e:
            COUNTS[mutation.category, "FAILED"] += 1
            failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} mutations escaped:\n" + "\n".join(failures[:60 if not FULL else None])
