"""The server's counters, in the Prometheus text exposition format (``GET /metrics``).

Counters and histograms are updated by the request handlers (on the event loop); the pool's gauges
and the engine's counts are read from the engine when scraped.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

#: Histogram bounds, seconds.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float, times: int = 1) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += times
        self.total += value * times
        self.n += times

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens: dict[str, int] = defaultdict(int)
        self.rejected = 0
        self.disconnects = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def finished(self, prompt: int, generated: int, reused: dict[str, int]) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            for tier, n in reused.items():
                self.cached_tokens[tier] += n

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def between_tokens(self, seconds: float, tokens: int) -> None:
        """``tokens`` tokens arrived ``seconds`` after the previous ones (each counted at the mean gap)."""
        if tokens > 0:
            with self._lock:
                self.itl.observe(seconds / tokens, tokens)

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def text(self, engine: Any) -> str:
        pool, stats = engine.pool, engine.stats
        with self._lock:
            #: (name, type, help or None, value: a number, a Histogram, or [(labels, number)])
            families = [
                ("kvcache_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                 [(f'endpoint="{e}",status="{s}"', n) for (e, s), n in sorted(self.requests.items())]),
                ("kvcache_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                ("kvcache_generation_tokens_total", "counter", "Tokens generated for finished requests.",
                 self.generation_tokens),
                ("kvcache_cached_prompt_tokens_total", "counter", "Prompt tokens reused instead of computed, by tier.",
                 [(f'tier="{t}"', self.cached_tokens[t]) for t in ("pool", "store")]),
                ("kvcache_rejected_requests_total", "counter",
                 "Requests answered 503 (pool and queue full, or draining).", self.rejected),
                ("kvcache_client_disconnects_total", "counter", "Streams whose client went away before the end.",
                 self.disconnects),
                ("kvcache_time_to_first_token_seconds", "histogram", "From a request's arrival to its first token.",
                 self.ttft),
                ("kvcache_inter_token_latency_seconds", "histogram", "Between consecutive tokens of a request.",
                 self.itl),
                ("kvcache_pool_blocks", "gauge",
                 "Blocks of the engine's pool: free, cached (a registered prefix, reusable) or used.",
                 [('state="free"', pool.free_count), ('state="cached"', pool.cached_count),
                  ('state="used"', pool.owned_count)]),
                ("kvcache_pool_bytes", "gauge", "Bytes the engine's pool allocated.", pool.nbytes),
                ("kvcache_requests_running", "gauge", "Requests holding blocks; waiting: queued.",
                 engine.running_count),
                ("kvcache_requests_waiting", "gauge", None, engine.waiting_count),
                ("kvcache_preemptions_total", "counter", "Requests preempted (blocks given back, recomputed later).",
                 stats.preemptions),
                ("kvcache_engine_steps_total", "counter", "Engine steps (forward passes).", stats.steps),
                ("kvcache_engine_compiled_steps_total", "counter",
                 "Engine steps run as a compiled graph (serve --compile).", stats.compiled_steps),
                ("kvcache_forward_tokens_total", "counter",
                 "Tokens run through the model (prompt chunks, recomputation, decode rows).", stats.forward_tokens),
                ("kvcache_shared_prefix_rows_total", "counter",
                 "Decode rows that read a shared prefix once with other rows.", stats.shared_prefix_rows),
            ]
            lines = []
            for name, kind, about, value in families:
                lines += [f"# HELP {name} {about}"] if about else []
                lines.append(f"# TYPE {name} {kind}")
                if isinstance(value, Histogram):
                    lines += value.lines(name)
                elif isinstance(value, list):
                    lines += [f"{name}{{{labels}}} {n}" for labels, n in value]
                else:
                    lines.append(f"{name} {value}")
        return "\n".join(lines) + "\n"
