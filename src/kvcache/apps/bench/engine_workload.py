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

import itertools
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
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

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return replace(self, prompts=self.prompts[:n])


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
    return list(itertools.accumulate((draw.expovariate(1.0 / mean_gap) for _ in range(n - 1)), initial=0.0))


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


class Meter:
    """While in use (``with``): seconds since it began (the first arrival), and the tokens run through
    ``model``'s forward passes (a forward pre-hook reading each call's ``input_ids`` ``[B, T]``, else
    its ``inputs_embeds`` ``[B, T, H]``: ``B x T`` tokens)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens = 0

    def __enter__(self) -> Meter:
        self.hook = self.model.register_forward_pre_hook(self.count, with_kwargs=True)
        self.zero = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hook.remove()

    def count(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += ids.numel() if ids is not None else math.prod(kwargs["inputs_embeds"].shape[:2])

    def since(self, at: float) -> float:
        """``perf_counter`` time ``at`` as seconds since the start."""
        return at - self.zero

    def now(self) -> float:
        return self.since(time.perf_counter())

    def wait(self, second: float) -> None:
        left = second - self.now()
        if left > 0:
            time.sleep(left)


# ---- sequential: one request after another ----------------------------------------------------


def serve_sequential(model: Any, w: Workload, arrivals: Sequence[float], store: Any = None) -> Run:
    """Requests one at a time in arrival order, each ``model.generate`` with a new ``DynamicCache`` or
    through ``store`` (a ``PromptStore``), waiting for its arrival and for the one before it."""
    from transformers import DynamicCache

    served, largest = [], 0
    with Meter(model) as meter:
        for ids, arrival in zip(w.prompts, arrivals):
            meter.wait(arrival)
            x = torch.tensor([ids])
            cache = DynamicCache(config=model.config) if store is None else store.cache_for(model, x, "growable")[0]
            first = FirstToken()
            out = model.generate(
                x, attention_mask=torch.ones_like(x), **cache_kwargs(model, cache), max_new_tokens=w.new_tokens,
                do_sample=False, eos_token_id=w.never, pad_token_id=w.pad, streamer=first, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            finish = time.perf_counter()
            if store is not None:
                store.put(cache, out.sequences)
            top2 = torch.cat(out.logits).float().topk(2, dim=-1).values  # [new_tokens, 2]
            tokens = out.sequences[0, len(ids) :].tolist()
            gaps = (top2[:, 0] - top2[:, 1]).tolist()
            served.append(Served(arrival, meter.since(first.at or finish), meter.since(finish), tokens, gaps))
            largest = max(largest, _cache_bytes(cache))
    held = store.backend.nbytes() if store is not None else 0
    facts = {"largest_cache_bytes": largest, "store_bytes": held}
    if store is not None:
        facts["reused_store"] = store.stats.reused_tokens
    return Run(served, largest + held, meter.tokens, facts)


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
    """``transformers``' continuous batching through the manager ``generate_batch`` runs, started
    before the first arrival (``engine.configured``); times from its per-token timestamps."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(max_new_tokens=w.new_tokens, do_sample=False, eos_token_id=w.never, pad_token_id=w.pad)
    batching = ContinuousBatchingConfig(**asdict(settings), max_requests_per_batch=len(w.prompts))
    model.set_attn_implementation("sdpa")
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    try:
        manager.warmup()
        cache = manager.batch_processor.cache
        facts = {"num_blocks": cache.num_blocks, "max_batch_tokens": cache.max_batch_tokens, "prefix_sharing": cache.use_prefix_sharing}
        nbytes = cache.cache_tensor.nbytes
        manager.start()
        with Meter(model) as meter:
            results = _feed(manager, w, arrivals, meter)
    finally:
        manager.stop(block=True)
        manager.destroy()
    failed = [r.error for r in results.values() if r.error is not None]
    if failed:
        return Run(reason=f"transformers' continuous batching failed a request: {failed[0]}")
    served = [_served_hf(results[i], arrival, meter) for i, arrival in enumerate(arrivals)]
    return Run(served, nbytes, meter.tokens, facts)


def _feed(manager: Any, w: Workload, arrivals: Sequence[float], meter: Meter) -> dict[int, Any]:
    """Add each request at its arrival and wait for every result: request index -> its output."""
    ids: dict[str, int] = {}
    results: dict[int, Any] = {}
    due = 0
    while len(results) < len(arrivals):
        now = meter.now()
        batch = [i for i in range(due, len(arrivals)) if arrivals[i] <= now]
        if batch:
            names = manager.add_requests([list(w.prompts[i]) for i in batch], max_new_tokens=w.new_tokens, record_timestamps=True)
            ids.update(zip(names, batch))
            due = batch[-1] + 1
        wait = arrivals[due] - meter.now() if due < len(arrivals) else 0.5
        result = manager.get_result(timeout=min(max(wait, 1e-3), 0.5))
        if result is not None and result.is_finished():
            results[ids[result.request_id]] = result
        elif result is None and not manager.is_running():
            raise KVCacheError("transformers' continuous batching stopped before every request finished (see its log)")
    return results


def _served_hf(result: Any, arrival: float, meter: Meter) -> Served:
    stamps = result.timestamps or [result.lifespan[1]]
    return Served(arrival, meter.since(stamps[0]), meter.since(stamps[-1]), list(result.generated_tokens))


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
    """``kvcache.Engine`` warmed up for ``max_seqs`` rows (with ``compile``, its steps compiled now, as
    a server does when it starts; eager where the compiled step refuses the pool: ``engine.graph`` is
    then None), or why it cannot hold ``spec`` blocks (``UnsupportedOperation``), a str."""
    from ... import Engine
    from ...errors import UnsupportedOperation

    for compiled in dict.fromkeys((compile, False)):  # where the compiled step refuses the blocks or the device: eager
        try:
            engine = Engine(model, spec, **asdict(settings), share_prefixes=share, compile=compiled)
        except UnsupportedOperation as e:
            reason = f"not available: {e}"
        else:
            engine.warm_up(settings.max_seqs)
            return engine
    return reason


def serve_engine(model: Any, engine: Any, w: Workload, arrivals: Sequence[float]) -> Run:
    """``engine`` (``make_engine``'s: its prefix cache and counts reset first; a str is the run's
    reason) stepping on its background thread; times from each request's ``RequestStats``."""
    if isinstance(engine, str):
        return Run(reason=engine)
    engine.reset_prefix_cache()
    engine.reset_stats()
    with engine.running(), Meter(model) as meter:
        handles = []
        for ids, arrival in zip(w.prompts, arrivals):
            meter.wait(arrival)
            handles.append(engine.submit(list(ids), max_new_tokens=w.new_tokens, eos_token_id=w.never))
        tokens = [h.result() for h in handles]
    served = [Served(a, meter.since(h.stats.first_token), meter.since(h.stats.finished), t)
              for a, h, t in zip(arrivals, handles, tokens)]  # fmt: skip
    s = engine.stats
    facts = {
        "engine_forward_tokens": s.forward_tokens, "steps": s.steps, "peak_rows": s.peak_rows, "peak_owned_blocks": s.peak_owned_blocks,
        "preemptions": s.preemptions, "reused_pool": sum(h.stats.reused_pool for h in handles),
        "reused_store": sum(h.stats.reused_store for h in handles), "blocks": engine.pool.total,
        "compiled": engine.graph is not None,
    }  # fmt: skip
    # compiled steps run the model's modules without its forward (no hook sees them): their count is the engine's
    tokens = meter.tokens if engine.graph is None else s.forward_tokens
    return Run(served, int(engine.pool.nbytes), tokens, facts)
