"""``kvcache bench serve --ray``: two ``kvcache serve --ray`` replicas under each router: ``blocks``
(kvcache's, on the blocks each pool holds), ``prefix`` (Ray Serve's, on text) and ``default`` (Ray
Serve's power of two choices), on many users of a few system prompts (docs/serving.md, "The three
routers").

Request ``i`` takes one of ``systems`` system messages (each opened by its own words, so no two
share a block), drawn at random (seeded, the same draw for every router), and user message ``i``;
greedy, streamed, ``clients`` clients sending the ``requests`` in order, each after its previous
answer ended. Each replica's pool holds half the system messages and the own tokens of every
request it may run at once (``Workload.max_bytes``), so where a request lands decides what it finds
(the case prefix affinity is for: more prompts than one replica's memory). No prompt store (it
would carry prompts between replicas and hide the routing). Each router runs ``repeats`` times, the
order rotated, each time started afresh and warmed up with one request of another system message;
reported: the medians over the repeats of what ``summarize`` measures.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import KVCacheError
from ..run_options import RunOptions
from ..serve.ray_app import RayOptions
from ..serve.text import chat_ids
from .common import figure, finish_axes, markdown_table
from .harness import report
from .serve_workload import (
    Sample, ServerError, chat_body, chat_texts, http_client, kv_bytes_per_token, model_folder, scratch_folder, send_together,
    server_env, serving, stream_chat,
)  # fmt: skip

CONTENDERS = ("blocks", "prefix", "default")
SEED = 0  # of the system messages' draw


@dataclass(frozen=True)
class Sizes:
    systems: int
    shared: int  # tokens of each system message
    user: int
    new_tokens: int
    requests: int
    clients: int
    repeats: int
    block_size: int
    threads: int  # torch threads of each replica (Ray gives a replica this many CPUs)


FULL = Sizes(systems=8, shared=256, user=32, new_tokens=16, requests=96, clients=8, repeats=3, block_size=16, threads=1)


def sizes(options: RunOptions) -> Sizes:
    """``full``: 96 requests, three repeats (about 12 minutes on 2 cores); ``quick``: 48 requests, one
    repeat; ``tiny``: the shipped tiny model, 16 short requests (its numbers mean nothing)."""
    return options.pick(
        tiny=replace(FULL, systems=4, shared=48, user=8, new_tokens=4, requests=16, clients=4, repeats=1),
        quick=replace(FULL, requests=48, repeats=1),
        full=FULL,
    )  # fmt: skip


@dataclass(frozen=True)
class Workload:
    folder: Path
    systems: tuple[str, ...]
    users: tuple[str, ...]
    other: str  # the warm-up's system message
    picks: tuple[int, ...]  # the system message of each request
    system_blocks: int  # whole blocks of a request's prompt that its system message fills
    prompt: int  # the largest prompt, tokens
    s: Sizes

    def body(self, i: int) -> dict[str, Any]:
        messages = [{"role": "system", "content": self.systems[self.picks[i]]}, {"role": "user", "content": self.users[i % len(self.users)]}]
        return chat_body(str(self.folder), messages, self.s.new_tokens)

    def max_bytes(self, kv_bytes_per_token: int) -> int:
        """A replica's pool: half the system messages' whole blocks, and every client's own part
        (the rest of a prompt and its new tokens, in whole blocks, with a block to spare)."""
        s = self.s
        own = -(-(self.prompt - self.system_blocks * s.block_size + s.new_tokens) // s.block_size) + 1
        blocks = -(-s.systems // 2) * self.system_blocks + s.clients * own
        return blocks * s.block_size * kv_bytes_per_token


def workload(folder: Path, s: Sizes) -> Workload:
    """The messages (see the module docstring) and their token counts under the model's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = chat_texts(tokenizer, s.shared, s.user, s.requests)
    systems = tuple(f"Assistant {k} of {s.systems}. {texts.system}" for k in range(s.systems))

    def ids(system: str, user: str) -> list[int]:
        return chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}])

    shared = len(os.path.commonprefix([ids(systems[0], texts.users[0]), ids(systems[0], texts.users[1])]))
    rng = random.Random(SEED)
    picks = tuple(rng.randrange(s.systems) for _ in range(s.requests))
    prompt = max(len(ids(systems[picks[i]], texts.users[i])) for i in range(s.requests))
    return Workload(folder, systems, texts.users, texts.other_system, picks, shared // s.block_size, prompt, s)


def command(w: Workload, router: str, max_bytes: int):
    s = w.s
    args = [sys.executable, "-m", "kvcache", "serve", "--ray", "--replicas", "2", "--router", router, "--model", str(w.folder),
            "--host", "127.0.0.1", "--max-seqs", str(s.clients), "--max-bytes", str(max_bytes), "--block-size", str(s.block_size),
            "--log-level", "warning"]  # fmt: skip
    return lambda port: [*args, "--port", str(port)]


async def _send_all(url: str, w: Workload) -> tuple[list[Sample], float]:
    numbers = iter(range(w.s.requests))  # requests in order, each to the next free client
    samples: dict[int, Sample] = {}

    async def client(http: Any) -> None:
        for i in numbers:
            samples[i] = await stream_chat(http, url, w.body(i))

    start = time.perf_counter()
    async with http_client(w.s.clients, 600.0) as http:
        await asyncio.gather(*(client(http) for _ in range(w.s.clients)))
    return [samples[i] for i in range(w.s.requests)], time.perf_counter() - start


def measure(w: Workload, router: str, max_bytes: int, log: Path) -> dict[str, Any]:
    """One run of ``router``'s server: its numbers, or ``{"reason": ...}``."""
    try:
        with serving(command(w, router, max_bytes), server_env(w.s.threads), log, startup_s=300) as url:
            endpoint = url + "/v1/chat/completions"
            warm = send_together(endpoint, [chat_body(str(w.folder), [{"role": "system", "content": w.other}, {"role": "user", "content": w.users[0]}], 2)])
            if warm[0].error:
                return {"reason": f"warm-up failed: {warm[0].error}"}
            samples, wall = asyncio.run(_send_all(endpoint, w))
    except ServerError as e:
        return {"reason": f"failed: {e}"}
    errors = [s.error for s in samples if s.error]
    if errors:
        return {"reason": f"{len(errors)} requests failed: {errors[0]}"}
    return summarize(w, samples, wall)


def summarize(w: Workload, samples: list[Sample], wall: float) -> dict[str, Any]:
    """The numbers of one load: the share of a system message's whole blocks found cached on its
    second and later requests (``usage.prompt_tokens_details.cached_tokens``, at most the system part
    counted), TTFT p50 and p95 over those later requests (a system message's first request computes
    it under any router) and over all requests, output tokens per second over the load's wall time."""
    whole = w.system_blocks * w.s.block_size
    repeats = [s for i, s in enumerate(samples) if w.picks[i] in w.picks[:i]]
    cached = sum(min(s.cached_tokens or 0, whole) for s in repeats)
    later = sorted(s.ttft_s for s in repeats if s.ttft_s is not None)
    ttfts = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
    return {
        "cached_share": cached / (whole * len(repeats)) if repeats and whole else 0.0,
        "ttft_p50_s": _quantile(later, 0.5), "ttft_p95_s": _quantile(later, 0.95),
        "ttft_p50_all_s": _quantile(ttfts, 0.5), "ttft_p95_all_s": _quantile(ttfts, 0.95),
        "tokens_per_s": sum(s.tokens for s in samples) / wall, "wall_s": wall, "requests": len(samples),
        "samples": [s.summary() for s in samples],
    }  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run(options: RunOptions = RunOptions(), *, clients: list[int] | None = None) -> dict[str, Any]:
    """Run the comparison (``clients``: one client count instead of the sizes'); write
    ``serve-ray.json``/``.md``/``.png`` into ``options.out``."""
    from tqdm.auto import tqdm

    s = sizes(options)
    if clients:
        if len(clients) != 1:
            raise KVCacheError(f"bench serve --ray takes one client count, got {clients}")
        s = replace(s, clients=clients[0])
    with scratch_folder() as scratch:
        folder, model_name = model_folder(options, scratch)
        w = workload(folder, s)
        max_bytes = w.max_bytes(kv_bytes_per_token(folder))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
        with tqdm(total=s.repeats * len(CONTENDERS), desc="bench serve --ray", disable=not options.progress) as bar:
            for r in range(s.repeats):
                k = r % len(CONTENDERS)
                for name in CONTENDERS[k:] + CONTENDERS[:k]:
                    bar.set_postfix_str(f"{name}, repeat {r + 1}")
                    runs[name].append(measure(w, name, max_bytes, scratch / f"{name}-{r}.log"))
                    bar.update()
    rows = [_row(name, runs[name]) for name in CONTENDERS]
    config = asdict(s) | {
        "model": model_name, "replicas": 2, "max_bytes_per_replica": max_bytes, "system_blocks": w.system_blocks,
        "prompt_tokens_max": w.prompt, "cpu_count": os.cpu_count(), "imbalance": RayOptions().imbalance,
        "configured": {name: f"kvcache serve --ray --replicas 2 --router {name} --max-seqs {s.clients} --max-bytes {max_bytes} "
                       f"--block-size {s.block_size} (each replica one CPU, {s.threads} torch thread)" for name in CONTENDERS},
    }  # fmt: skip
    return report("serve-ray", options, config, rows, table, plot, runs=runs)


def _row(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if "reason" not in r]
    if not done:
        return {"contender": name, "reason": runs[0]["reason"] if runs else "not run"}
    keys = ("cached_share", "ttft_p50_s", "ttft_p95_s", "ttft_p50_all_s", "ttft_p95_all_s", "tokens_per_s")
    each = {f"{k}_each": [r[k] for r in done] for k in ("cached_share", "ttft_p95_s")}
    return {"contender": name, "repeats": len(done), **{k: statistics.median(r[k] for r in done) for k in keys}, **each}


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    head = (f"Two `kvcache serve --ray` replicas, {c['model']}: {c['requests']} requests of {c['systems']} system messages "
            f"({c['system_blocks']} blocks of {c['block_size']} tokens each) from {c['clients']} clients; medians of "
            f"{c['repeats']} repeat(s)")  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        if "reason" in r:
            return [r["contender"], r["reason"], "", "", ""]
        each = ", ".join(f"{x:.0%}" for x in r["cached_share_each"])
        return [r["contender"], f"{r['cached_share']:.0%} ({each})", f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f}",
                f"{r['ttft_p50_all_s']:.2f} / {r['ttft_p95_all_s']:.2f}", f"{r['tokens_per_s']:.1f}"]  # fmt: skip

    header = ["router", "system blocks cached, 2nd+ requests (each repeat)", "TTFT p50 / p95 s, 2nd+ requests", "TTFT p50 / p95 s, all", "tokens/s"]
    lines = [head, markdown_table(header, [cells(r) for r in result["rows"]])]
    rows = {r["contender"]: r for r in result["rows"]}
    base = rows.get("default", {}).get("ttft_p95_s")
    if base:
        ratios = [f"{n} {rows[n]['ttft_p95_s'] / base:.2f}x" for n in CONTENDERS if n != "default" and "ttft_p95_s" in rows.get(n, {})]
        lines.append("TTFT p95 of 2nd+ requests against the default router's: " + ", ".join(ratios))
    return "\n\n".join(lines) + "\n"


def plot(result: dict[str, Any], path) -> None:
    """Each request's TTFT in the order sent, per router (the first repeat)."""
    with figure(path, panels=1) as (ax,):
        for name, runs in result.get("runs", {}).items():
            done = [r for r in runs if "samples" in r]
            if done:
                ttft = [s["ttft_s"] for s in done[0]["samples"]]
                ax.plot(range(len(ttft)), ttft, marker=".", linestyle="", label=name)
        finish_axes(ax, "request (in the order sent)", "TTFT (s)", "two replicas: each router")
        ax.set_xscale("linear")
