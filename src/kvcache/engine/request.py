"""A request of the engine: what the scheduler keeps about it (``Request``), and what the caller
holds (``RequestHandle``: its tokens as they come, the result, cancel, the numbers)."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import KVCacheError
from .sampling import Sampling

log = logging.getLogger("kvcache.engine")


class State(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no blocks
    RUNNING = "running"  # holds blocks; computes a prefill chunk or a decode token each step it is scheduled
    FINISHED = "finished"


class RequestCancelled(KVCacheError):
    """The request was cancelled before it finished; the tokens generated until then are kept on
    the handle (``handle.tokens``)."""


@dataclass
class RequestStats:
    """What one request cost and where its prompt came from.

    Times are ``time.perf_counter()`` seconds; ``ttft`` and ``tpot`` are None until known."""

    prompt_tokens: int = 0
    #: Prompt tokens found in blocks of the pool (computed earlier by this or another request).
    reused_pool: int = 0
    #: Prompt tokens loaded from the prompt store (a tier past the pool).
    reused_store: int = 0
    #: Tokens whose keys and values this request computed (prefill chunks, recomputation after a
    #: preemption and decode steps).
    computed: int = 0
    preemptions: int = 0
    #: Most blocks its table held once its prompt was computed (its context's footprint in the pool
    #: while it decodes: for a compressed prompt, what it kept).
    held_blocks: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    generated: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from submit to the first generated token."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tpot(self) -> float | None:
        """Seconds per generated token after the first (None with fewer than two)."""
        if self.finished is None or self.first_token is None or self.generated < 2:
            return None
        return (self.finished - self.first_token) / (self.generated - 1)

    @property
    def reused(self) -> dict[str, int]:
        """Prompt tokens reused, by tier."""
        return {"pool": self.reused_pool, "store": self.reused_store}


@dataclass(eq=False)
class Request:
    """The scheduler's record of one request (see ``scheduler.py``).

    ``tokens`` is the prompt followed by the tokens generated so far; ``computed`` of them have
    keys and values in the pool, in blocks ``table``; the first ``registered`` blocks are
    registered under their keys (``keys``: the chain key of each full block of ``tokens``)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    computed: int = 0
    registered: int = 0
    #: Its open block while running over a pool that codes blocks whole (the unfilled last block); else -1.
    tail: int = -1
    #: Its own bounded cache once its prompt is computed (``compression.py``; a ``KVCache``): its
    #: context lives there, not in the pool's blocks. None for a request of the pool's blocks.
    cache: Any = None
    #: Blocks held for its own cache's bytes (never written: they stand for the cache in the pool).
    lease: list[int] = field(default_factory=list)
    #: Attention weights its prompt reported so far, to compress it: mode -> per layer ``[1, Hkv, T]``.
    observed: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    state: State = State.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    sampling: Sampling = field(default_factory=Sampling)
    generator: torch.Generator | None = None
    on_update: Callable[[], None] | None = None
    #: How its prompt is compressed into its own cache once computed (``compression.Compression``), or None.
    compression: Any = None
    #: Alternatives reported per generated token (``logprobs.py``), or None for no log-probabilities.
    logprobs: int | None = None
    #: Alternatives reported per prompt token, or None: then its prompt is computed whole (no reuse
    #: of positions not yet scored), each position's logits kept in the pass that computes it.
    prompt_logprobs: int | None = None
    #: The generated tokens' log-probabilities, in order (with ``logprobs``).
    token_logprobs: list[Any] = field(default_factory=list)
    #: Each prompt token's log-probability by position (the first None: nothing comes before it).
    prompt_scores: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.stats.prompt_tokens = len(self.prompt)
        self.prompt_scores = [None] * len(self.prompt) if self.prompt_logprobs is not None else []

    @property
    def scored_upto(self) -> int:
        """Leading prompt tokens whose log-probabilities are known or not asked for (all of them
        without ``prompt_logprobs``): positions before this may be reused instead of computed."""
        if self.prompt_logprobs is None:
            return len(self.prompt)
        n = 1
        while n < len(self.prompt) and self.prompt_scores[n] is not None:
            n += 1
        return n

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def own_context(self) -> bool:
        """Whether its own cache holds its context (from its first chunk for a ``window``), not the pool."""
        return self.cache is not None or (self.compression is not None and self.compression.prefills)

    @property
    def slots(self) -> int:
        """Slots of its blocks in use: its computed tokens, or none once its own cache holds them."""
        return 0 if self.own_context else self.computed

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be chosen."""
        return len(self.tokens) - self.computed


class RequestHandle:
    """What ``Engine.submit`` returns: iterate it for the generated tokens as they come,
    ``result()`` for all of them, ``cancel()`` to stop the request (its blocks return to the pool at
    once), ``stats`` for its numbers (``RequestStats``).

    Without a background thread (``Engine.running``), iterating or waiting steps the engine itself."""

    def __init__(self, request: Request, engine_step: Callable[[], bool], engine_cancel: Callable[[Request, bool], None],
                 background: Callable[[], bool], changed: threading.Condition):
        self._request = request
        self._step, self._cancel, self._background, self._changed = engine_step, engine_cancel, background, changed

    def __repr__(self) -> str:
        r = self._request
        return f"RequestHandle(id={r.rid}, {r.state.value}, {len(r.prompt)} prompt + {len(r.generated)} generated tokens)"

    @property
    def id(self) -> int:
        return self._request.rid

    @property
    def done(self) -> bool:
        return self._request.state is State.FINISHED

    @property
    def finish_reason(self) -> str | None:
        """``"eos"``, ``"length"``, ``"cancelled"`` or ``"error"`` once finished; None before."""
        return self._request.finish_reason

    @property
    def error(self) -> BaseException | None:
        """What failed the request (``finish_reason`` ``"error"``), else None."""
        return self._request.error

    @property
    def tokens(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return list(self._request.generated)

    @property
    def logprobs(self) -> list[Any]:
        """The generated tokens' log-probabilities so far (``TokenLogprob``; empty unless asked)."""
        return list(self._request.token_logprobs)

    @property
    def prompt_logprobs(self) -> list[Any]:
        """Each prompt token's log-probability (``TokenLogprob``; the first None), once the prompt
        is computed; empty unless asked."""
        return list(self._request.prompt_scores)

    @property
    def stats(self) -> RequestStats:
        return self._request.stats

    def cancel(self, wait: bool = True) -> None:
        """Stop the request; its blocks go back to the pool: at once, or, while a background thread
        steps the engine, at the start of its next step (``wait``: return only then; else at once,
        as an event loop must). A finished request is left as it is."""
        self._cancel(self._request, wait)

    def __iter__(self) -> Iterator[int]:
        """The generated tokens, each as soon as it is chosen; raises what the request raised."""
        sent = 0
        while True:
            self._wait(lambda: len(self._request.generated) > sent or self.done)
            generated = self._request.generated
            while sent < len(generated):
                yield generated[sent]
                sent += 1
            if self.done:
                self._raise_failure()
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated tokens once the request has finished (``RequestCancelled`` if it was
        cancelled, the engine's error if it failed; ``TimeoutError`` after ``timeout`` seconds of a
        background engine)."""
        self._wait(lambda: self.done, timeout)
        self._raise_failure()
        return self.tokens

    def _raise_failure(self) -> None:
        r = self._request
        if r.finish_reason == "cancelled":
            raise RequestCancelled(f"request {r.rid} was cancelled after {len(r.generated)} generated tokens")
        if r.error is not None:
            raise r.error

    def _wait(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if self._background():
                with self._changed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
                    self._changed.wait_for(lambda: ready() or not self._background(), timeout=left)
            elif not self._step() and not ready():
                raise KVCacheError(f"request {self.id} cannot progress: the engine has nothing to run")


def tell(requests: Iterable[Request]) -> None:
    """Call each request's ``on_update``; a callback that raises is logged, not the engine's failure."""
    for request in requests:
        if request.on_update is not None:
            try:
                request.on_update()
            except Exception:  # noqa: BLE001 - the caller's code: it must not stop the engine
                log.exception("request %d: on_update raised", request.rid)
