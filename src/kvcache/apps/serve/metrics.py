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
            lines = [
                "# HELP kvcache_requests_total HTTP requests answered, by endpoint and status.",
                "# TYPE kvcache_requests_total counter",
                *(f'kvcache_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())),
                "# HELP kvcache_prompt_tokens_total Prompt tokens of finished requests.",
                "# TYPE kvcache_prompt_tokens_total counter",
                f"kvcache_prompt_tokens_total {self.prompt_tokens}",
                "# HELP kvcache_generation_tokens_total Tokens generated for finished requests.",
                "# TYPE kvcache_generation_tokens_total counter",
                f"kvcache_generation_tokens_total {self.generation_tokens}",
                "# HELP kvcache_cached_prompt_tokens_total Prompt tokens reused instead of computed, by tier.",
                "# TYPE kvcache_cached_prompt_tokens_total counter",
                *(f'kvcache_cached_prompt_tokens_total{{tier="{t}"}} {self.cached_tokens[t]}' for t in ("pool", "store")),
                "# HELP kvcache_rejected_requests_total Requests answered 503 (pool and queue full, or draining).",
                "# TYPE kvcache_rejected_requests_total counter",
                f"kvcache_rejected_requests_total {self.rejected}",
                "# HELP kvcache_client_disconnects_total Streams whose client went away before the end.",
                "# TYPE kvcache_client_disconnects_total counter",
                f"kvcache_client_disconnects_total {self.disconnects}",
                "# HELP kvcache_time_to_first_token_seconds From a request's arrival to its first token.",
                "# TYPE kvcache_time_to_first_token_seconds histogram",
                *self.ttft.lines("kvcache_time_to_first_token_seconds"),
                "# HELP kvcache_inter_token_latency_seconds Between consecutive tokens of a request.",
                "# TYPE kvcache_inter_token_latency_seconds histogram",
                *self.itl.lines("kvcache_inter_token_latency_seconds"),
            ]
        lines += [
            "# HELP kvcache_pool_blocks Blocks of the engine's pool: free, cached (a registered prefix, reusable) or used.",
            "# TYPE kvcache_pool_blocks gauge",
            f'kvcache_pool_blocks{{state="free"}} {pool.free_count}',
            f'kvcache_pool_blocks{{state="cached"}} {pool.cached_count}',
            f'kvcache_pool_blocks{{state="used"}} {pool.owned_count}',
            "# HELP kvcache_pool_bytes Bytes the engine's pool allocated.",
            "# TYPE kvcache_pool_bytes gauge",
            f"kvcache_pool_bytes {pool.nbytes}",
            "# HELP kvcache_requests_running Requests holding blocks; waiting: queued.",
            "# TYPE kvcache_requests_running gauge",
            f"kvcache_requests_running {engine.running_count}",
            "# TYPE kvcache_requests_waiting gauge",
            f"kvcache_requests_waiting {engine.waiting_count}",
            "# HELP kvcache_preemptions_total Requests preempted (blocks given back, recomputed later).",
            "# TYPE kvcache_preemptions_total counter",
            f"kvcache_preemptions_total {stats.preemptions}",
            "# HELP kvcache_engine_steps_total Engine steps (forward passes).",
            "# TYPE kvcache_engine_steps_total counter",
            f"kvcache_engine_steps_total {stats.steps}",
            "# HELP kvcache_engine_compiled_steps_total Engine steps run as a compiled graph (serve --compile).",
            "# TYPE kvcache_engine_compiled_steps_total counter",
            f"kvcache_engine_compiled_steps_total {stats.compiled_steps}",
            "# HELP kvcache_forward_tokens_total Tokens run through the model (prompt chunks, recomputation, decode rows).",
            "# TYPE kvcache_forward_tokens_total counter",
            f"kvcache_forward_tokens_total {stats.forward_tokens}",
            "# HELP kvcache_shared_prefix_rows_total Decode rows that read a shared prefix once with other rows.",
            "# TYPE kvcache_shared_prefix_rows_total counter",
            f"kvcache_shared_prefix_rows_total {stats.shared_prefix_rows}",
        ]
        return "\n".join(lines) + "\n"
