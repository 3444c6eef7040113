"""Suite ``prompt``: time to first token (TTFT) and end-to-end time of requests whose prompts share
a beginning, recomputed against reused through ``kvcache.PromptStore``, on SmolLM2-135M (fp32, CPU).

Workloads (``workload`` in each row), every request greedy with ``new_tokens`` new tokens:

- ``chat``: ``turns`` turns; each appends a user message (60-100 tokens of real text, ChatML) to the
  token ids of the conversation so far (the previous prompt and the generated reply, as ids: the
  prefixes match exactly); through the store: ``cache_for`` -> ``generate`` -> ``put``.
- ``shared``: ``requests`` requests, one system prompt of ``shared_prefix`` tokens and a different
  question each; through the store the first computes and stores, the others reuse.
- ``backends``: the shared-prefix request at ``backend_prefix`` tokens through each backend
  (memory, a temporary folder, a ``redis-server`` started on localhost and stopped after), the
  prefix stored once beforehand; ``repeats`` rounds, a new question each round.

``run(options, workloads=...)`` runs some of them (``kvcache bench prompt --workloads backends``).

Contenders (``CONTENDERS``) alternate within each turn, request or round (``harness``): ``recompute``
(a new growable cache, plain ``generate``) and the store on each backend (``chat`` and ``shared``
use ``memory``). Every row says whether its tokens equal recompute's for the same prompt. Timing:
see ``prompt_request``. Storage: entry bytes per token against the model's fp32 K/V bytes per token.
Each reuse's floor: the entry bytes read / the read bandwidth of its medium, measured in the same
run (memory: summing a tensor; folder: reading the entry files; Redis: ``GET``-ting the entries
on a plain socket), the least time any store could load them from there.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ... import make_cache, prefill
from ...errors import KVCacheError
from ...prompts import PromptStore
from ..run_options import RunOptions
from .common import read_bandwidth
from .floor import model_shape
from .harness import alternate, report
from .prompt_report import REFERENCE, plot, summarize, table
from .prompt_request import Prompts, StoreTimer, folder_read_bandwidth, redis_read_bandwidth, redis_server, timed_request

CONTENDERS = (REFERENCE, "memory", "folder", "redis")
WORKLOADS = ("chat", "shared", "backends")
__all__ = ["CONTENDERS", "REFERENCE", "WORKLOADS", "plot", "run", "sizes", "table"]


@dataclass(frozen=True)
class Sizes:
    """Tokens and counts of one run (``sizes``)."""

    turns: int
    chat_rounds: int
    message_tokens: tuple[int, int]
    chat_chunk: int
    shared_prefix: int
    requests: int
    question_tokens: int
    backend_prefix: int
    repeats: int
    chunk: int
    new_tokens: int


def sizes(options: RunOptions) -> Sizes:
    """The sizes of this run: ``full`` as issue 14 asks (5 backend rounds, so that two disturbed
    rounds cannot move the median), ``quick`` 1K prefixes and 4 turns once, ``tiny`` seconds."""
    full = Sizes(turns=8, chat_rounds=3, message_tokens=(60, 100), chat_chunk=64, shared_prefix=2048, requests=8,
                 question_tokens=40, backend_prefix=4096, repeats=5, chunk=256, new_tokens=32)
    return options.pick(
        tiny=replace(full, turns=3, chat_rounds=2, message_tokens=(6, 12), chat_chunk=8, shared_prefix=48, requests=3,
                     question_tokens=6, backend_prefix=64, repeats=1, chunk=16, new_tokens=4),
        quick=replace(full, turns=4, chat_rounds=1, shared_prefix=1024, backend_prefix=1024, repeats=1),
        full=full,
    )


def load(options: RunOptions) -> tuple[Any, Prompts, str]:
    """(model, its prompts, its name): SmolLM2-135M, or for ``tiny`` the tiny Llama with random ids."""
    if options.tiny:
        from ..tiny import tiny_model

        model = tiny_model("llama")
        return model, Prompts(None, model.config.vocab_size), "tiny llama (random weights, random ids)"
    from ... import models

    model, tokenizer = models.load("smollm2", device=options.device, progress=options.progress)
    model.set_attn_implementation("sdpa")
    return model, Prompts(tokenizer, model.config.vocab_size), "smollm2 (SmolLM2-135M-Instruct, fp32)"


def run(options: RunOptions = RunOptions(), *, workloads: Sequence[str] = WORKLOADS) -> dict[str, Any]:
    """Run the suite's ``workloads`` (default all); write ``prompt.json``/``.md``/``.png`` into
    ``options.out`` if given."""
    from tqdm.auto import tqdm

    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        raise KVCacheError(f"workloads are some of {', '.join(WORKLOADS)}, got {', '.join(unknown) or 'none'}")
    s = sizes(options)
    model, prompts, model_name = load(options)
    warm_up(model, prompts, s)
    counts = {"chat": 2 * s.turns * s.chat_rounds, "shared": 2 * s.requests, "backends": s.repeats * len(CONTENDERS)}
    rows: list[dict[str, Any]] = []
    storage: dict[str, dict[str, Any]] = {}
    bandwidths: dict[str, float] = {}
    with tqdm(total=sum(counts[w] for w in workloads), desc="bench prompt", disable=not options.progress) as bar:
        if "chat" in workloads:
            rows += chat(model, prompts, s, bar)
        if "shared" in workloads:
            rows += shared(model, prompts, s, bar)
        if "backends" in workloads:
            backend_rows, storage, bandwidths = backends(model, prompts, s, bar)
            rows += backend_rows
    bandwidths["memory"] = read_bandwidth(options.device, mib=options.pick(16, 256, 512))
    for row in rows:
        if "read_bytes" in row:
            row["floor_s"] = row["read_bytes"] / bandwidths[row["backend"]]
    kv_per_token = model_shape(model).kv_bytes_per_token
    for facts in storage.values():
        facts["over_kv"] = facts["bytes_per_token"] / kv_per_token if facts.get("bytes_per_token") else None
    config = asdict(s) | {
        "model": model_name,
        "workloads": list(workloads),
        "threads": torch.get_num_threads(),
        "kv_bytes_per_token": kv_per_token,
        "read_bytes_per_s": bandwidths,
        "quick": options.quick,
        "tiny": options.tiny,
        "ttft": "from before cache_for (or make_cache) to generate's first new token (a streamer)",
        "reuse": "cache_for: from before it to the cache ready to run (fetch + open + assemble)",
    }
    summary = summarize(rows, s.backend_prefix)
    return report("prompt", options, config, rows, table, plot, storage=storage, summary=summary)


def warm_up(model: Any, prompts: Prompts, s: Sizes) -> None:
    """Requests each way, so first-call costs (thread pools, kernels, allocations) land in no measurement."""
    ids = torch.cat([prompts.system(2 * s.chunk), prompts.user(999, s.question_tokens, False)], 1)
    store = PromptStore("memory", chunk=s.chunk)
    for _ in range(2):
        timed_request(model, ids, s.new_tokens, store)
        timed_request(model, ids, s.new_tokens)


def compared(workload: str, round_: int, step: int, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one step (a turn, a request or a backends round): each contender's times, and
    whether its tokens are recompute's (``out`` leaves the rows)."""
    reference = results[REFERENCE]["out"]
    rows = []
    for name, result in results.items():
        identical = bool(torch.equal(result.pop("out"), reference))
        backend = "none" if name == REFERENCE else name
        head = {"workload": workload, "round": round_, "step": step, "contender": name, "backend": backend}
        rows.append(head | result | {"identical": identical, "reason": ""})
    return rows


def both_ways(model: Any, ids: torch.Tensor, s: Sizes, store: PromptStore, step: int, bar: Any, label: str) -> dict[str, dict[str, Any]]:
    """Recompute and through ``store`` (``memory``), the order rotated by ``step``."""
    names = (REFERENCE, "memory")
    results = {}
    for name in names[step % 2 :] + names[: step % 2]:
        bar.set_postfix_str(f"{label} {name}")
        results[name] = timed_request(model, ids, s.new_tokens, store if name == "memory" else None)
        bar.update()
    return {name: results[name] for name in names}


def chat(model: Any, prompts: Prompts, s: Sizes, bar: Any) -> list[dict[str, Any]]:
    """The multi-turn chat, ``chat_rounds`` times with a new store each; a turn continues recompute's tokens."""
    low, high = s.message_tokens
    messages = [prompts.user(turn, low + (turn * 37) % (high - low + 1), after_reply=turn > 0) for turn in range(s.turns)]
    rows = []
    for round_ in range(s.chat_rounds):
        store = PromptStore("memory", chunk=s.chat_chunk, timer=StoreTimer())
        history = prompts.system(48)
        for turn, message in enumerate(messages):
            ids = torch.cat([history, message], 1)
            results = both_ways(model, ids, s, store, round_ + turn, bar, f"chat round {round_ + 1} turn {turn + 1}")
            history = results[REFERENCE]["out"]
            rows += compared("chat", round_ + 1, turn + 1, results)
    return rows


def shared(model: Any, prompts: Prompts, s: Sizes, bar: Any) -> list[dict[str, Any]]:
    """Requests sharing one system prompt (module docstring)."""
    store = PromptStore("memory", chunk=s.chunk, timer=StoreTimer())
    system = prompts.system(s.shared_prefix)
    rows = []
    for request in range(s.requests):
        ids = torch.cat([system, prompts.user(100 + request, s.question_tokens, False)], 1)
        results = both_ways(model, ids, s, store, request, bar, f"shared request {request + 1}")
        rows += compared("shared", 1, request + 1, results)
    return rows


def backends(model: Any, prompts: Prompts, s: Sizes, bar: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, float]]:
    """The shared prefix through each backend: rows, per backend what its entries take (``storage``),
    and the read bandwidths of the folder and the Redis server, measured on those entries after."""
    prefix = prompts.system(s.backend_prefix)
    questions = [prompts.user(200 + r, s.question_tokens, False) for r in range(s.repeats)]
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-store-") as folder, redis_server() as (url, why):
        stores, skipped = open_stores({"memory": "memory", "folder": folder, "redis": url or why}, s.chunk)
        storage = fill(model, prefix, stores)
        names = tuple(n for n in CONTENDERS if n == REFERENCE or n in stores)
        rounds = {name: 0 for name in names}

        def measure(name: str) -> dict[str, Any]:
            ids = torch.cat([prefix, questions[rounds[name]]], 1)
            rounds[name] += 1
            return timed_request(model, ids, s.new_tokens, stores.get(name))

        bar.update(len(skipped) * s.repeats)
        samples = alternate(names, s.repeats, measure, bar)
        bandwidths = {"folder": folder_read_bandwidth(folder)} if "folder" in stores else {}
        if "redis" in stores:
            bandwidths["redis"] = redis_read_bandwidth(url)
        for store in stores.values():
            getattr(store.backend, "close", lambda: None)()
    rows = []
    for r in range(s.repeats):
        rows += compared("backends", r + 1, 1, {n: samples[n][r] for n in names})
    rows += [{"workload": "backends", "round": 1, "step": 1, "contender": n, "backend": n, "identical": None, "reason": why} for n, why in skipped.items()]
    return rows, storage, bandwidths


def open_stores(locations: dict[str, str], chunk: int) -> tuple[dict[str, PromptStore], dict[str, str]]:
    """Stores by contender name, each with a ``StoreTimer`` of its own, and why each other could not
    be opened (for ``redis``, a location not a URL is why there is no server)."""
    stores, skipped = {}, {}
    for name, location in locations.items():
        if name == "redis" and not location.startswith("redis://"):
            skipped[name] = location
            continue
        try:
            stores[name] = PromptStore(location, chunk=chunk, timer=StoreTimer())
        except (KVCacheError, OSError, ImportError) as e:
            skipped[name] = f"{type(e).__name__}: {e}"
    return stores, skipped


def fill(model: Any, prefix: torch.Tensor, stores: dict[str, PromptStore]) -> dict[str, dict[str, Any]]:
    """Prefill ``prefix`` once and ``put`` it into every store; per store its entries' facts."""
    cache = make_cache(model, "growable")
    prefill(model, prefix, cache, chunk=512)
    storage = {}
    for name, store in stores.items():
        start = time.perf_counter()
        stored = store.put(cache, prefix)
        seconds = time.perf_counter() - start
        held = store.backend.nbytes()
        storage[name] = {"tokens": stored, "entries": len(store.backend), "bytes": held, "put_s": seconds,
                         "bytes_per_token": held / stored if stored else None}
    return storage
