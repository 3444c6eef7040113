"""The parts of suite ``engine``: the workload (prompts, arrival times) and one run of each kind of
contender over it.

A run serves the workload's requests as they arrive (``arrivals``: seconds after the first, one per
request, ascending) and returns a ``Run``: per request (``Served``) its arrival, first-token and
finish times (seconds after the first arrival, ``time.perf_counter``) and its generated tokens; the
bytes its K/V storage allocated; and the tokens its forward passes ran, counted by a forward
pre-hook on the model (the ``input_ids`` of every call: prompt chunks, recomputation, decode rows).

Every request is greedy and generates exactly ``new_tokens`` tokens: each contender is told an
end-of-sequence id that no model can produce (the vocabulary size), so no request stops early and
the logits are never edited (``min_new_tokens`` would mask the model's real end-of-sequence token).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcache import cache_kwargs

from ...errors import KVCacheError
from .prompt_request import FirstToken, Prompts


@dataclass(frozen=True)
class Workload:
    """The requests: ``prompts`` (token ids, each the shared system prompt then its own user turn),
    ``shared`` (tokens of the system prompt), ``new_tokens`` per request, ``never`` (the
    end-of-sequence id given to every contender: outside the vocabulary) and ``pad``."""

    prompts: tuple[tuple[int, ...], ...]
    shared: int
    new_tokens: int
    never: int
    pad: int

    @property
    def user(self) -> int:
        """Tokens of each user turn."""
        return len(self.prompts[0]) - self.shared

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return Workload(self.prompts[:n], self.shared, self.new_tokens, self.never, self.pad)


def make_workload(prompts: Prompts, sessions: int, shared: int, user: int, new_tokens: int, vocab: int, pad: int) -> Workload:
    """``sessions`` requests: one ``shared``-token system turn, then a distinct ``user``-token user
    turn each (ChatML opening and closing included; ``Prompts``)."""
    system = prompts.system(shared)[0].tolist()
    frame = prompts.user(0, 0, False).shape[1]  # the user turn's ChatML tokens around its text
    if user <= frame:
        raise KVCacheError(f"a user turn of {user} tokens leaves no text after its {frame} ChatML tokens")
    turns = [prompts.user(i, user - frame, False)[0].tolist() for i in range(sessions)]
    return Workload(tuple(tuple(system + t) for t in turns), shared, new_tokens, vocab, pad)


def arrival_times(pattern: str, n: int, mean_gap: float, seed: int) -> list[float]:
    """Seconds after the first arrival of ``n`` requests: ``burst`` all at 0; ``poisson`` exponential
    gaps of mean ``mean_gap`` s, drawn from ``random.Random(seed)`` (the same every call)."""
    if pattern == "burst":
        return [0.0] * n
    if pattern != "poisson":
        raise KVCacheError(f"unknown arrival pattern {pattern!r}")
    draw = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + draw.expovariate(1.0 / mean_gap))
    return times


# ---- what a run records --------------------------------------------------------------------


@dataclass
class Served:
    """One request: seconds after the first arrival, and its generated tokens. ``gaps`` (the
    sequential contender only): at each generated position, the top-1 minus the top-2 logit."""

    arrival: float
    first: float
    finish: float
    tokens: list[int]
    gaps: list[float] | None = None


@dataclass
class Run:
    """One contender's run over the workload (``reason``: why it could not run; then nothing else)."""

    requests: list[Served] = field(default_factory=list)
    cache_bytes: int = 0
    forward_tokens: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


class Clock:
    """Seconds since ``start()`` (the first arrival), and sleeping until a given second."""

    def __init__(self) -> None:
        self.zero = time.perf_counter()

    def start(self) -> None:
        self.zero = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.zero

    def since(self, at: float) -> float:
        """``perf_counter`` time ``at`` as seconds since the start."""
        return at - self.zero

    def wait(self, second: float) -> None:
        left = second - self.now()
        if left > 0:
            time.sleep(left)


class ForwardCounter:
    """Tokens run through ``model``'s forward passes while in use (a forward pre-hook reading each
    call's ``input_ids`` ``[B, T]``: ``B x T`` tokens)."""

    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            embeds = kwargs["inputs_embeds"]
            self.tokens += embeds.shape[0] * embeds.shape[1]
        else:
            self.tokens += ids.numel()

    @contextlib.contextmanager
    def on(self, model: Any) -> Iterator[ForwardCounter]:
        handle = model.register_forward_pre_hook(self, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


# ---- sequential: one request after another ----------------------------------------------------


def serve_sequential(model: Any, w: Workload, arrivals: Sequence[float], store: Any = None) -> Run:
    """Requests one at a time in arrival order, each a greedy ``model.generate`` with a new
    ``DynamicCache``, or through ``store`` (a ``PromptStore``: ``cache_for``, ``generate``, ``put``).
    A request waits for its arrival and for the one before it to finish (and be stored)."""
    clock, counter, served, largest = Clock(), ForwardCounter(), [], 0
    with counter.on(model):
        clock.start()
        for ids, arrival in zip(w.prompts, arrivals):
            clock.wait(arrival)
            one, nbytes = _one_sequential(model, w, ids, store, clock)
            one.arrival = arrival
            served.append(one)
            largest = max(largest, nbytes)
    held = store.backend.nbytes() if store is not None else 0
    facts = {"largest_cache_bytes": largest, "store_bytes": held}
    if store is not None:
        facts["reused_store"] = store.stats.reused_tokens
    return Run(served, largest + held, counter.tokens, facts)


def _one_sequential(model: Any, w: Workload, ids: Sequence[int], store: Any, clock: Clock) -> tuple[Served, int]:
    """One request (times from ``clock``) and the bytes its cache held."""
    from transformers import DynamicCache

    x = torch.tensor([ids])
    if store is None:
        cache = DynamicCache(config=model.config)
    else:
        cache, _ = store.cache_for(model, x, "growable")
    first = FirstToken()
    out = model.generate(
        x, attention_mask=torch.ones_like(x), **cache_kwargs(model, cache), max_new_tokens=w.new_tokens, do_sample=False,
        eos_token_id=w.never, pad_token_id=w.pad, streamer=first, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    finish = time.perf_counter()
    if store is not None:
        store.put(cache, out.sequences)
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values  # [new_tokens, 2]
    tokens = out.sequences[0, len(ids) :].tolist()
    one = Served(0.0, clock.since(first.at or finish), clock.since(finish), tokens, (top2[:, 0] - top2[:, 1]).tolist())
    return one, _cache_bytes(cache)


def _cache_bytes(cache: Any) -> int:
    """Bytes of a kvcache ``KVCache`` or of a Hugging Face ``DynamicCache``'s keys and values."""
    if hasattr(cache, "kv_layers"):
        return int(cache.nbytes)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None) is not None)


# ---- Hugging Face's continuous batching -------------------------------------------------------


@dataclass(frozen=True)
class HFSettings:
    """``ContinuousBatchingConfig`` sizes: ``page_size`` tokens per block, ``num_blocks`` blocks (a
    block: ``page_size`` tokens of every layer), ``max_batch_tokens`` per forward pass."""

    page_size: int
    num_blocks: int
    max_batch_tokens: int


def hf_settings(w: Workload, page_size: int, max_batch_tokens: int) -> HFSettings:
    """Enough blocks for every request at once, none shared: ``N x ceil((prompt + new) / page)``."""
    per_request = math.ceil((len(w.prompts[0]) + w.new_tokens) / page_size)
    return HFSettings(page_size, len(w.prompts) * per_request, max_batch_tokens)


def serve_hf(model: Any, w: Workload, arrivals: Sequence[float], settings: HFSettings) -> Run:
    """``transformers``' continuous batching through its manager, the one ``generate_batch`` runs:
    made, warmed up (its cache allocated) and started before the first arrival; requests added as
    they arrive (``add_requests``, as ``generate_batch`` adds them, for those due together), results
    collected with ``get_result``; first-token and finish times from its per-token timestamps."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(max_new_tokens=w.new_tokens, do_sample=False, eos_token_id=w.never, pad_token_id=w.pad)
    batching = ContinuousBatchingConfig(
        page_size=settings.page_size, num_blocks=settings.num_blocks, max_batch_tokens=settings.max_batch_tokens,
        max_requests_per_batch=len(w.prompts),
    )  # fmt: skip
    model.set_attn_implementation("sdpa")
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    try:
        manager.warmup()
        cache = manager.batch_processor.cache
        facts = {"num_blocks": cache.num_blocks, "max_batch_tokens": cache.max_batch_tokens, "prefix_sharing": cache.use_prefix_sharing}
        nbytes = cache.cache_tensor.nbytes
        manager.start()
        clock, counter = Clock(), ForwardCounter()
        with counter.on(model):
            clock.start()
            results = _feed(manager, w, arrivals, clock)
    finally:
        manager.stop(block=True)
        manager.destroy()
    failed = [r.error for r in results.values() if r.error is not None]
    if failed:
        return Run(reason=f"transformers' continuous batching failed a request: {failed[0]}")
    served = [_served_hf(results[i], arrival, clock) for i, arrival in enumerate(arrivals)]
    return Run(served, nbytes, counter.tokens, facts)


def _feed(manager: Any, w: Workload, arrivals: Sequence[float], clock: Clock) -> dict[int, Any]:
    """Add each request at its arrival and wait for every result: request index -> its output."""
    ids: dict[str, int] = {}
    results: dict[int, Any] = {}
    due = 0
    while len(results) < len(arrivals):
        now = clock.now()
        batch = [i for i in range(due, len(arrivals)) if arrivals[i] <= now]
        if batch:
            names = manager.add_requests([list(w.prompts[i]) for i in batch], max_new_tokens=w.new_tokens, record_timestamps=True)
            ids.update(zip(names, batch))
            due = batch[-1] + 1
        wait = arrivals[due] - clock.now() if due < len(arrivals) else 0.5
        result = manager.get_result(timeout=min(max(wait, 1e-3), 0.5))
        if result is not None and result.is_finished():
            results[ids[result.request_id]] = result
        elif result is None and not manager.is_running():
            raise KVCacheError("transformers' continuous batching stopped before every request finished (see its log)")
    return results


def _served_hf(result: Any, arrival: float, clock: Clock) -> Served:
    stamps = result.timestamps or [result.lifespan[1]]
    return Served(arrival, clock.since(stamps[0]), clock.since(stamps[-1]), list(result.generated_tokens))


# ---- kvcache's engine -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSettings:
    """``Engine`` keywords besides the spec and sharing: ``block_size`` tokens per block,
    ``blocks`` in the pool, ``max_batch_tokens`` per step, ``max_seqs`` running at once."""

    block_size: int
    blocks: int
    max_batch_tokens: int
    max_seqs: int


def engine_settings(w: Workload, block_size: int, max_batch_tokens: int) -> EngineSettings:
    """A pool holding every request at once, none shared: ``N x ceil((prompt + new - 1) / block)``
    (the last token's keys and values are never computed)."""
    per_request = math.ceil((len(w.prompts[0]) + w.new_tokens - 1) / block_size)
    return EngineSettings(block_size, len(w.prompts) * per_request, max_batch_tokens, len(w.prompts))


def make_engine(model: Any, spec: str, share: bool, settings: EngineSettings, compile: bool) -> Any:
    """``kvcache.Engine`` for ``spec`` blocks with ``settings``; with ``compile``, its steps compiled
    now (``warm_up`` of ``max_seqs`` rows: the graphs a server builds when it starts), or eager where
    the compiled step refuses the pool (coded blocks, a GPU: ``engine.graph`` is then None). An
    engine that cannot hold ``spec`` blocks (``UnsupportedOperation``) is returned as the reason, a str."""
    from ... import Engine
    from ...errors import UnsupportedOperation

    def made(compiled: bool) -> Any:
        return Engine(
            model, spec, block_size=settings.block_size, blocks=settings.blocks, max_batch_tokens=settings.max_batch_tokens,
            max_seqs=settings.max_seqs, share_prefixes=share, compile=compiled,
        )  # fmt: skip

    try:
        engine = made(compile)
    except UnsupportedOperation as refused:
        if not compile:
            return f"not available: {refused}"
        try:
            engine = made(False)  # the compiled step refuses these blocks or this device: eager steps
        except UnsupportedOperation as e:
            return f"not available: {e}"
    engine.warm_up(settings.max_seqs)
    return engine


def serve_engine(model: Any, engine: Any, w: Workload, arrivals: Sequence[float]) -> Run:
    """``engine`` (``make_engine``'s, kept from run to run: its prefix cache forgotten and its
    counts reset first) stepping on its background thread, each request submitted at its arrival;
    times from each request's ``RequestStats``. A reason (``make_engine``'s str) is a run with it."""
    if isinstance(engine, str):
        return Run(reason=engine)
    engine.reset_prefix_cache()
    engine.reset_stats()
    clock, counter = Clock(), ForwardCounter()
    with counter.on(model), engine.running():
        clock.start()
        handles = []
        for ids, arrival in zip(w.prompts, arrivals):
            clock.wait(arrival)
            handles.append(engine.submit(list(ids), max_new_tokens=w.new_tokens, eos_token_id=w.never))
        tokens = [h.result() for h in handles]
    served = [Served(a, clock.since(h.stats.first_token), clock.since(h.stats.finished), t) for a, h, t in zip(arrivals, handles, tokens)]
    s = engine.stats
    facts = {
        "engine_forward_tokens": s.forward_tokens, "steps": s.steps, "peak_rows": s.peak_rows, "peak_owned_blocks": s.peak_owned_blocks,
        "preemptions": s.preemptions, "reused_pool": sum(h.stats.reused_pool for h in handles),
        "reused_store": sum(h.stats.reused_store for h in handles), "blocks": engine.pool.total,
        "compiled": engine.graph is not None,
    }  # fmt: skip
    # compiled steps run the model's modules without its forward (no hook sees them): their count is the engine's
    tokens = counter.tokens if engine.graph is None else s.forward_tokens
    return Run(served, int(engine.pool.nbytes), tokens, facts)
