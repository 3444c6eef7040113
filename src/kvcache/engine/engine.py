"""``Engine``: many requests over one model and one paged KV pool, with continuous batching and
prefix sharing.

Every step (``Engine.step``) the scheduler (``scheduler.py``) picks rows: one token for each
decoding request and prompt chunks for the others, up to ``max_batch_tokens``. The rows run as one
forward pass of one packed sequence (``step.py``): the model's linear layers see every row's
tokens at once, and its attention writes each row's keys and values into the row's blocks and
reads the row's own blocks. The last token of each row whose tokens are all computed gives that
request its next token (greedy, or sampled per request: ``sampling.py``). Requests join and leave at every step; a request that finds its
prompt's leading blocks registered in the pool takes them instead of computing them.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import UnsupportedOperation
from ..hf.linears import PackedLinears
from ..hf.spec import CacheSpec, parse_spec
from ..persist.fingerprint import config_summary, fingerprint_of, text_config
from ..prompts import PromptStore
from ..prompts.keys import salt as key_salt
from .compression import Compression, compression_for
from .forward import Forward
from .graph_chunk import GraphChunk
from .graph_step import GraphDecode
from .inputs import eos_ids, positive, prompt_ids
from .logprobs import check_top
from .pool import PoolError
from .pool_setup import engine_spec, make_pool, pool_shape
from .probe import check_packing
from .request import Request, RequestHandle, State, tell
from .sampling import Sampling
from .stats import EngineStats
from .scheduler import Scheduler, blocks_for
from .step import stepping
from .tier import StoreTier, open_store


class Engine:
    """Serve many requests of ``model`` (a ``transformers`` causal LM in eval mode) from one pool
    of KV blocks.

    - ``block_size``: tokens per block (prefixes are shared a whole block at a time).
    - ``blocks`` or ``max_bytes``: the pool's size, allocated once; by default enough for
      ``max_seqs`` requests of 1,024 tokens.
    - ``max_batch_tokens``: tokens per forward pass (decode rows plus prefill chunks); 2,048 by
      default, as vLLM's CPU server: larger products run nearer the CPU's peak than 512's did.
    - ``max_seqs``: requests running at once.
    - ``share_prefixes``: reuse registered blocks of a prompt's leading tokens.
    - ``store``: a ``PromptStore`` (or a backend for one: ``"memory"``, a folder, ``"redis://..."``)
      as the tier past the pool (``tier.py``): prompts load what it holds beyond the pool's hits,
      and computed prompts (and preempted requests) are written back. Float pools only.
    - ``pack_linears``: run the model's linear layers on prepacked copies of their weights during
      steps (``linears.py``: panels up to 64 rows, oneDNN past that; 2-3x ``F.linear`` at decode
      sizes on the CPU; each layout costs those weights' bytes again, ``engine.linears.bytes``).
      The model itself is left as it was.
    - ``compile``: run steps as compiled graphs (inductor, weights frozen; float pools on the CPU,
      refused otherwise): decode-only steps one graph per row bucket (``graph_step.py``), other
      steps of pool rows one graph of a dynamic token count (``graph_chunk.py``); bounded rows run
      eagerly. A graph compiles at its first step (or at ``warm_up``); the graphs' padding rows
      hold one block of the pool.
    - ``spec``: the blocks' format (``formats.py``): ``"growable"`` (full precision, the model's
      dtype) or ``"quantized:bits=8"`` / ``4`` / ``2`` (coded blocks, each request's unfilled last
      block exact).

    ``submit`` queues a request and returns its ``RequestHandle``; ``step`` runs one scheduler
    step; ``with engine.running():`` steps on a background thread; ``generate_batch`` runs a list
    of prompts to the end. Decoding is greedy unless a request asks for a temperature. The model is switched to the ``"kvcache"`` attention
    only inside each step (``use_kvcache_attention`` as a context manager).
    """

    def __init__(
        self,
        model: Any,
        spec: str | CacheSpec = "growable",
        *,
        block_size: int = 32,
        blocks: int | None = None,
        max_bytes: int | None = None,
        max_batch_tokens: int = 2048,
        max_seqs: int = 32,
        share_prefixes: bool = True,
        store: PromptStore | str | None = None,
        pack_linears: bool = True,
        compile: bool = False,
    ):
        self.spec = engine_spec(spec)
        self.model = model
        geometry = pool_shape(model)
        self.window = geometry.window
        max_batch_tokens = positive("max_batch_tokens", max_batch_tokens)
        max_seqs = positive("max_seqs", max_seqs)
        block_size = positive("block_size", block_size)
        self.geometry = geometry
        self.pool = make_pool(self.spec, geometry, block_size, blocks, max_bytes, max_seqs)
        fingerprint = fingerprint_of(config_summary(text_config(model)))
        salt = key_salt(fingerprint, geometry.dtype, f"engine:{self.spec}", block_size)
        self.store = open_store(store, self.pool)
        tier = StoreTier(self.store, model, self.pool) if self.store is not None else None
        self._max_batch_tokens = max_batch_tokens
        self.linears = PackedLinears(model, rows_hint=min(max_seqs, 16)) if pack_linears else None
        #: The compiled decode steps (``compile=True``), which hold one block of the pool for padding rows.
        self.graph = GraphDecode(model, self.pool, max_seqs, self.linears) if compile else None
        self._compressions: dict[str, Compression | None] = {}
        self._compression = self._compression_for(self.spec)
        self.scheduler = Scheduler(self.pool, salt, max_batch_tokens, max_seqs, share_prefixes, tier)
        self.stats = EngineStats()
        keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        #: The compiled prompt steps (``compile=True`` and a model that takes ``logits_to_keep``).
        self.chunks = GraphChunk(model, self.pool, max_seqs, self.linears) if compile and keeps_logits else None
        #: One step's forward pass (``forward.py``).
        self.forward = Forward(model, self.pool, self.graph, self.chunks, self.linears, keeps_logits)
        self._eos = eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        self._vocab = getattr(text_config(model), "vocab_size", None)
        if self._vocab is None or self._vocab > 8:  # (a vocabulary of a few ids: a unit test's toy, nothing to probe)
            check_packing(model, geometry, block_size, keeps_logits, self.linears)
        # The engine lock is held through a step; submits and cancels from other threads queue up
        # without it (a step drains the queues first), and handles wait on ``_changed``, a
        # condition of its own, so nobody waits for a whole step to hand over a request.
        self._lock = threading.RLock()
        self._changed = threading.Condition()
        self._incoming: collections.deque[Request] = collections.deque()
        self._cancels: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __repr__(self) -> str:
        p = self.pool
        return (
            f"Engine({p.total} blocks of {p.block_size} tokens, {p.nbytes / 2**20:.0f} MiB; "
            f"model in {str(self.geometry.dtype).removeprefix('torch.')}; "
            f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting)"
        )

    # ---- requests ----------------------------------------------------------------------------------

    def submit(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 32,
        eos_token_id: int | Sequence[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_update: Callable[[], None] | None = None,
        cache: str | CacheSpec | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> RequestHandle:
        """Queue a request for ``input_ids`` (token ids: a list, a 1-D tensor or a ``[1, S]``
        tensor) to generate up to ``max_new_tokens`` tokens, stopping after an ``eos_token_id``
        (default: the model's generation config's). Greedy at ``temperature`` 0, else sampled
        (``sampling.py``: ``top_p``, ``seed``). ``on_update`` is called, on the thread that steps
        the engine, after each step that gave the request tokens and when it finishes; it must be
        quick and must not call the engine. ``cache``: this request's own spec where the pool allows
        one (a float pool: ``"growable"``, or a bounded kind, ``"h2o:budget=256"``, whose own cache
        holds its context once its prompt is computed: ``compression.py``); default the engine's.
        ``logprobs`` / ``prompt_logprobs``: report each generated / prompt token's log-probability
        with that many alternatives (0-20; ``handle.logprobs``, ``handle.prompt_logprobs``); a prompt
        scored so is computed whole, not reused."""
        logprobs, prompt_logprobs = check_top("logprobs", logprobs), check_top("prompt_logprobs", prompt_logprobs)
        prompt = prompt_ids(input_ids, self._vocab)
        compression = self._compression if cache is None else self._request_compression(cache)
        max_new_tokens = positive("max_new_tokens", max_new_tokens)
        eos = self._eos if eos_token_id is None else eos_ids(eos_token_id)
        sampling = Sampling(temperature, top_p, seed)
        longest = len(prompt) + max_new_tokens - 1  # the last token is never computed
        bs = self.pool.block_size
        # A bounded request holds its prompt in blocks (a window's not even that), then its cache's bytes.
        need = blocks_for(longest if compression is None else 0 if compression.prefills else len(prompt), bs)
        if need > self._usable_blocks:
            raise PoolError(
                f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens needs {need} blocks of {bs}; "
                f"the pool has {self._usable_blocks}" + (" for requests" if self.graph is not None else "")
            )
        if self.window is not None and longest > self.window:
            raise UnsupportedOperation(
                f"this model attends a sliding window of {self.window} tokens, which the engine does not apply yet: "
                f"it serves requests of at most {self.window} tokens (this one reaches {longest})"
            )
        request = Request(next(self._ids), prompt, max_new_tokens, eos, sampling=sampling, on_update=on_update,
                          compression=compression, logprobs=logprobs, prompt_logprobs=prompt_logprobs)  # fmt: skip
        request.generator = sampling.generator()
        request.stats.submitted = time.perf_counter()
        self._incoming.append(request)  # the next step takes it (deque appends are thread-safe)
        self._notify()
        return RequestHandle(request, self.step, self._cancel, self._in_background, self._changed)

    def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 32,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> list[list[int]]:
        """The generated token ids of each prompt in ``inputs``, in order (all submitted at once,
        then run to the end: on the background thread if one runs, else here)."""
        handles = [self.submit(ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id) for ids in inputs]
        with contextlib.nullcontext() if self._in_background() else self._stepping():
            return [h.result() for h in handles]

    def _cancel(self, request: Request, wait: bool = True) -> None:
        """Finish ``request`` as cancelled: at once when no background thread runs; else at the start
        of the background thread's next step (its blocks are in use until the current one ends),
        waiting for that if ``wait``."""
        if self._in_background():
            self._cancels.append(request)
            self._notify()
            if not wait:
                return
            with self._changed:
                self._changed.wait_for(lambda: request.state is State.FINISHED or not self._in_background())
            if request.state is State.FINISHED:
                return
        with self._lock:
            self._take_queued()
            self.scheduler.finish(request, "cancelled")
        tell([request])
        self._notify()

    def _take_queued(self) -> None:
        """Hand the queued submits to the scheduler and carry out the queued cancels (engine lock held)."""
        while self._incoming:
            self.scheduler.add(self._incoming.popleft())
        while self._cancels:
            request = self._cancels.popleft()
            self.scheduler.finish(request, "cancelled")
            tell([request])

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---- stepping ----------------------------------------------------------------------------------

    @property
    def waiting_count(self) -> int:
        """Requests queued or waiting for room (not yet holding blocks)."""
        return len(self._incoming) + len(self.scheduler.waiting)

    @property
    def prefix_salt(self) -> bytes:
        """The salt of this engine's block keys: ``chain_keys(tokens, pool.block_size, prefix_salt)``
        names a prompt's full blocks as ``pool.keys()`` lists the blocks held."""
        return self.scheduler.salt

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and generated) one request can hold in this pool."""
        return self._usable_blocks * self.pool.block_size

    @property
    def _usable_blocks(self) -> int:
        """The pool's blocks that requests may hold (all but the compiled step's scratch block)."""
        return self.pool.total - (self.graph is not None)

    @property
    def running_count(self) -> int:
        """Requests holding blocks (computing their prompt or decoding)."""
        return len(self.scheduler.running)

    @property
    def idle(self) -> bool:
        """No request running, waiting or queued."""
        return not self._incoming and not self._cancels and self.scheduler.idle

    def step(self) -> bool:
        """Run one scheduler step: one forward pass over the chosen rows. Returns False when there
        was nothing to run. If the forward pass raises, the requests stay as they were (their
        blocks are kept; a later step computes the same tokens again) and the error propagates."""
        with self._lock:
            if self._incoming or self._cancels:
                self._take_queued()
                self._notify()
            rows = self.scheduler.plan()
            if not rows:
                return False
            chosen, kept, shared, compiled = self.forward(rows)
            self.stats.shared_prefix_rows += shared
            self.stats.compiled_steps += compiled
            got = self.scheduler.commit(rows, chosen, kept)
            tell(got)
            stats = self.stats
            stats.steps += 1
            stats.forward_tokens += sum(n for _, n in rows)
            stats.peak_rows = max(stats.peak_rows, len(rows))
            stats.peak_owned_blocks = max(stats.peak_owned_blocks, self.pool.owned_count)
            decoding = sum(1 for r in self.scheduler.running if r.stats.generated > 0)
            stats.peak_decoding = max(stats.peak_decoding, decoding)
            stats.preemptions = self.scheduler.preemptions
            stats.store_tokens = self.scheduler.store_tokens
        if got:
            self._notify()
        return True

    def warm_up(self, rows: int | None = None) -> None:
        """With ``compile=True``, compile the decode steps of up to ``rows`` requests (default
        ``max_seqs``) and the prompt steps now rather than at the first step of each; without,
        nothing to do."""
        if self.graph is not None:
            with self._lock:
                self.graph.warm(rows)
                if self.chunks is not None:
                    self.chunks.warm(self.graph.scratch, self._max_batch_tokens)

    def reset_stats(self) -> None:
        """Count from zero again: ``stats`` (steps, tokens, peaks, preemptions, store tokens), as a
        benchmark's rounds on one engine need. Requests and cached blocks are not touched."""
        with self._lock:
            self.stats = EngineStats()
            self.scheduler.preemptions = self.scheduler.store_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every block cached for reuse (requests that finished), so later prompts compute
        their prefixes again; blocks of running requests stay. Returns the blocks freed."""
        with self._lock:
            return self.pool.forget_cached()

    def run(self) -> None:
        """Step until no request is running or waiting."""
        with self._stepping():
            while self.step():
                pass

    def _compression_for(self, spec: CacheSpec) -> Compression | None:
        key = str(spec)
        if key not in self._compressions:
            self._compressions[key] = compression_for(self.model, spec, self._max_batch_tokens)
        return self._compressions[key]

    def _request_compression(self, cache: str | CacheSpec) -> Compression | None:
        """A request's own spec: the engine's, or over a float pool ``growable`` (no compression)
        or a bounded kind; anything else is refused, naming what this engine takes."""
        spec = parse_spec(cache)
        if str(spec) == str(self.spec):
            return self._compression
        if not self.pool.exact or spec.kind == "quantized":
            raise UnsupportedOperation(
                f"this engine's pool holds {self.spec} blocks; a request may ask for {self.spec}"
                + ("" if not self.pool.exact else ", growable or a bounded kind (h2o:budget=..., auto:bytes=...)")
                + f", not {spec}"
            )
        return self._compression_for(engine_spec(spec))

    # ---- the background thread ---------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[Engine]:
        """Step on a background thread while the block runs (handles then wait instead of
        stepping). On leaving, the thread stops after its current step; requests not finished stay
        queued. An error in a step fails the requests of that step and the thread goes on.
        Where the model was loaded on the calling thread and speed matters, ``run_here`` on that
        thread is faster (OpenMP, see there)."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running on a background thread")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="kvcache-engine", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._notify()
            self._thread.join()
            self._thread = None
            self._notify()

    def run_here(self, stop: threading.Event) -> None:
        """Step on the calling thread until ``stop`` is set (then ``wake()``), waiting while there is
        nothing to run; meanwhile other threads' handles wait instead of stepping, as with
        ``running()``. An error in a step fails the requests of that step and the loop goes on.

        Run it on the thread that loaded the model when another thread serves requests: with
        OpenMP (torch's CPU builds) a second thread that has run parallel work keeps a second team
        of workers, and libgomp then stops its workers spinning between parallel regions, which
        cost a 16-row decode step of SmolLM2 about a third more on the background thread of
        ``running()`` (docs/benchmarks.md, "The engine's step")."""
        if self._thread is not None:
            raise RuntimeError("the engine is already stepping on another thread")
        self._thread = threading.current_thread()
        try:
            self._loop(stop)
        finally:
            self._thread = None
            self._notify()

    def wake(self) -> None:
        """Wake the thread stepping the engine (after setting the event that stops ``run_here``)."""
        self._notify()

    def _in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._stepping():
                while not stop.is_set() and self._step_or_fail():
                    pass
            with self._changed:
                self._changed.wait_for(lambda: stop.is_set() or not self.idle, timeout=1.0)

    def _stepping(self) -> contextlib.AbstractContextManager:
        """``step.stepping`` for this engine's model and packed layers."""
        return stepping(self.model, self.linears)

    def _step_or_fail(self) -> bool:
        """``step()``; an error in it fails that step's requests and the engine goes on (True)."""
        try:
            return self.step()
        except Exception as error:
            self._fail_running(error)
            return True

    def _fail_running(self, error: Exception) -> None:
        with self._lock:
            failed = list(self.scheduler.running)
            for request in failed:
                self.scheduler.finish(request, "error", error)
        tell(failed)
        self._notify()
