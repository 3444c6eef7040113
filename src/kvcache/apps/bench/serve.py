"""Suite ``serve``: ``kvcache serve`` under concurrent streaming chat clients, against ``transformers
serve --continuous-batching``, and a second replica warmed only through Redis; SmolLM2-135M-Instruct
(fp32), each server a subprocess on a loopback port (``serve_workload``), the workload's sizes in
``sizes``. For each client count each server is started, warmed up, loaded (``clients`` clients
sending chat requests one after another for ``window_s`` seconds) and stopped in turn, the order
rotated by one per client count (``measure_load``); then replicas on one ``redis-server``
(``measure_replicas``). The targets, judged at 16 clients on the full sizes only (``serve_report``):
``kvcache`` at least 1.5x ``transformers``' output tokens/s and at most half its TTFT p99. The whole
workload and how each server is configured: docs/benchmarks.md ("Serving over HTTP").
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import KVCacheError
from ..run_options import RunOptions
from ..serve.server import API_KEY_ENV
from . import serve_ray
from .engine import chosen
from .harness import report
from .prompt_request import redis_server
from .serve_report import OURS, PEER, load_row, replica_rows, summarize
from .serve_report import plot as _plot
from .serve_report import table as _table
from .serve_workload import (
    ChatTexts, Load, ServerError, chat_body, chat_texts, kv_bytes_per_token, model_folder, run_load, scratch_folder,
    send_together, server_env, serving,
)  # fmt: skip

CONTENDERS = (OURS, "kvcache+int8", PEER)
#: The ``--cache`` of each kvcache contender.
SPECS = {OURS: "growable", "kvcache+int8": "quantized:bits=8"}
__all__ = ["CONTENDERS", "plot", "run", "sizes", "table"]


@dataclass(frozen=True)
class Sizes:
    """Tokens, counts and seconds of one run (``sizes``)."""

    clients: tuple[int, ...]
    shared: int  # tokens of the system message
    user: int  # tokens of each user message
    new_tokens: int  # max_tokens
    window_s: float  # seconds each load sends requests
    replica_repeats: int
    max_seqs: int  # sessions each pool is sized for; kvcache's --max-seqs
    block_size: int  # kvcache's --block-size
    page_size: int  # transformers' --cb-block-size (its page size)
    max_batch_tokens: int  # both servers' tokens per forward pass
    store_chunk: int  # kvcache's --store-chunk (replicas)
    threads: int  # each server's OMP_NUM_THREADS
    users: int  # distinct user messages


#: The issue's workload: about 4 x 3 loads of 45 s plus their tails, starts and the replicas
#: (about 25 minutes on 2 cores).
FULL = Sizes(clients=(1, 4, 16, 32), shared=1024, user=64, new_tokens=64, window_s=45.0, replica_repeats=3, max_seqs=32,
             block_size=32, page_size=256, max_batch_tokens=512, store_chunk=256, threads=2, users=1024)  # fmt: skip


def sizes(options: RunOptions) -> Sizes:
    """``full``: the issue's workload; ``quick``: clients 1 and 4, a 256-token system message, 16
    new tokens, 10-second loads, one replica repeat (about 4 minutes); ``tiny``: 2 clients, 1-second
    loads, the shipped tiny model (under a minute: each server start takes seconds)."""
    return options.pick(
        tiny=replace(FULL, clients=(2,), shared=64, user=16, new_tokens=6, window_s=1.0, replica_repeats=1, block_size=32,
                     page_size=16, max_batch_tokens=64, store_chunk=32, threads=1, users=32),
        quick=replace(FULL, clients=(1, 4), shared=256, new_tokens=16, window_s=10.0, replica_repeats=1, users=256),
        full=FULL,
    )  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What every server and request of a run shares: the model ``folder`` (also the model's name in
    requests: both servers accept it), the messages, the sizes, the model's fp32 K/V bytes per token,
    the folder for server logs."""

    folder: Path
    texts: ChatTexts
    s: Sizes
    kv_bytes_per_token: int
    logs: Path

    @property
    def model(self) -> str:
        return str(self.folder)

    @property
    def session_tokens(self) -> int:
        """One session at most: the largest prompt and every new token."""
        return self.texts.prompt + self.s.new_tokens

    @property
    def max_bytes(self) -> int:
        """kvcache's ``--max-bytes``: ``max_seqs`` sessions of whole blocks of fp32 K/V."""
        s = self.s
        return s.max_seqs * math.ceil(self.session_tokens / s.block_size) * s.block_size * self.kv_bytes_per_token

    @property
    def hf_blocks(self) -> int:
        """transformers' ``--cb-num-blocks``: ``max_seqs`` sessions of whole pages."""
        return self.s.max_seqs * math.ceil(self.session_tokens / self.s.page_size)

    def body(self, i: int, system: str | None = None) -> dict[str, Any]:
        """Request ``i``'s body (``system``: another system message)."""
        return chat_body(self.model, self.texts.messages(i, system), self.s.new_tokens)


# ---- the servers --------------------------------------------------------------------------------


def command(setup: Setup, name: str, store: str | None = None) -> Callable[[int], list[str]]:
    """Contender ``name``'s server on a port: ``transformers serve --continuous-batching`` (the model
    forced to the folder), or ``kvcache serve`` with its ``SPECS`` blocks, the pool of
    ``Setup.max_bytes`` and ``store`` a prompt store URL or None."""
    s = setup.s
    if name == PEER:
        args = [sys.executable, "-m", "transformers.cli.transformers", "serve", setup.model, "--continuous-batching",
                "--device", "cpu", "--dtype", "float32", "--cb-block-size", str(s.page_size), "--cb-num-blocks",
                str(setup.hf_blocks), "--cb-max-batch-tokens", str(s.max_batch_tokens), "--host", "127.0.0.1",
                "--log-level", "warning"]  # fmt: skip
    else:
        args = [sys.executable, "-m", "kvcache", "serve", "--model", setup.model, "--host", "127.0.0.1", "--cache",
                SPECS[name], "--max-seqs", str(s.max_seqs), "--max-bytes", str(setup.max_bytes), "--block-size",
                str(s.block_size), "--max-batch-tokens", str(s.max_batch_tokens), "--log-level", "warning"]  # fmt: skip
    if store is not None:
        args += ["--prompt-store", store, "--store-chunk", str(s.store_chunk)]
    return lambda port: [*args, "--port", str(port)]


#: Contender -> the extra its server needs and the modules it brings.
EXTRAS = {PEER: ("transformers[serving]", ("fastapi", "uvicorn", "pydantic", "openai")),
          OURS: ("kvcache[serve]", ("starlette", "uvicorn"))}  # fmt: skip


def unavailable(name: str) -> str:
    """Why contender ``name`` cannot run here (its server's packages are missing), or ``""``."""
    extra, modules = EXTRAS[PEER if name == PEER else OURS]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not available: pip install '{extra}' (missing: {', '.join(missing)})" if missing else ""


def configured(setup: Setup) -> dict[str, str]:
    """How each server runs, in words, with this run's numbers."""
    s, t = setup.s, setup.texts
    blocks = math.ceil(setup.session_tokens / s.block_size)
    pages = math.ceil(setup.session_tokens / s.page_size)
    session = f"{t.prompt} + {s.new_tokens} tokens"
    common = (f"`kvcache serve --model <folder> --max-seqs {s.max_seqs} --max-bytes {setup.max_bytes} --block-size "
              f"{s.block_size} --max-batch-tokens {s.max_batch_tokens}")  # fmt: skip
    pool = (f"({setup.max_bytes / 2**20:.1f} MiB = {s.max_seqs} sessions x {blocks} blocks of {s.block_size} tokens x "
            f"{setup.kv_bytes_per_token} B of fp32 K/V per token: {s.max_seqs} sessions of {session}, nothing shared)")  # fmt: skip
    return {
        OURS: f"{common} --cache growable` {pool}; prefix sharing on (the engine's default), its C++ decode",
        "kvcache+int8": f"{common} --cache quantized:bits=8`: the same bytes in int8 blocks (keys per channel, "
        "values per token; more sessions fit), prefix sharing on",
        PEER: f"`transformers serve <folder> --continuous-batching --device cpu --dtype float32 --cb-block-size "
        f"{s.page_size} --cb-num-blocks {setup.hf_blocks} --cb-max-batch-tokens {s.max_batch_tokens}` ({setup.hf_blocks} = "
        f"{s.max_seqs} sessions x {pages} pages of {s.page_size} tokens: {s.max_seqs} sessions of {session}, nothing "
        "shared; --cb-block-size sets its page size, 256 its default), block sharing on (its default), sdpa attention "
        "(no flash attention on a CPU); the model preloaded (the folder given as the model, which requests name)",
    }


def measure_load(setup: Setup, name: str, clients: int) -> Load:
    """Start server ``name``, warm it up, run one load of ``clients`` clients, stop it. A server that
    cannot run here, fails to start or fails its warm-up is a ``Load`` with that reason."""
    reason = unavailable(name)
    if reason:
        return Load(clients, reason=reason)
    log = setup.logs / f"{name}-{clients}.log"
    try:
        with serving(command(setup, name), server_env(setup.s.threads, [API_KEY_ENV]), log) as url:
            endpoint = url + "/v1/chat/completions"
            warm = send_together(endpoint, [setup.body(-1 - k, setup.texts.other_system) for k in range(min(2, clients))])
            failed = next((w.error for w in warm if w.error), "")
            if failed:
                return Load(clients, warm_up=warm, reason=f"warm-up failed: {failed}")
            load = run_load(endpoint, setup.body, clients, setup.s.window_s)
            load.warm_up = warm
            return load
    except ServerError as e:
        return Load(clients, reason=f"failed: {e}")


# ---- replicas on one Redis -------------------------------------------------------------------------


REPLICAS = ("A", "B", "C")


def _ask(setup: Setup, store: str | None, request: int, log: Path) -> Any:
    """A fresh kvcache replica (``store``: its prompt store, or none): one warm-up request of the
    other system message, then request ``request`` alone; returns that request's ``Sample``."""
    with serving(command(setup, OURS, store), server_env(setup.s.threads, [API_KEY_ENV]), log) as url:
        endpoint = url + "/v1/chat/completions"
        warm = send_together(endpoint, [setup.body(-1, setup.texts.other_system)])[0]
        if warm.error:
            raise ServerError(f"warm-up failed: {warm.error}")
        return send_together(endpoint, [setup.body(request)])[0]


def measure_replicas(setup: Setup, bar: Any) -> dict[str, Any]:
    """Per repeat ``r``: Redis database ``r``; replica A stores request 0's prompt, then B (on that
    database) and C (no store) answer request 1, their order rotated by ``r``. Returns
    ``{"reason", "samples": {replica: [Sample summary per repeat]}}``."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in REPLICAS}
    reason = unavailable(OURS)
    if reason:
        return {"reason": reason, "samples": samples}
    with redis_server() as (url, why):
        if url is None:
            return {"reason": f"not available: {why}", "samples": samples}
        try:
            for r in range(setup.s.replica_repeats):
                store = url.rsplit("/", 1)[0] + f"/{r}"
                plan = {"A": (store, 0), "B": (store, 1), "C": (None, 1)}
                for name in ("A", *(("B", "C") if r % 2 == 0 else ("C", "B"))):
                    bar.set_postfix_str(f"replica {name}, repeat {r + 1}")
                    sample = _ask(setup, *plan[name], setup.logs / f"replica-{name}-{r}.log")
                    samples[name].append(sample.summary())
                    bar.update()
        except ServerError as e:
            return {"reason": f"failed: {e}", "samples": samples}
    return {"reason": "", "samples": samples}


# ---- the run -------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    """The result's table: the loads and replicas, or (``serve-ray``) the routers."""
    return (serve_ray.table if result.get("suite") == "serve-ray" else _table)(result)


def plot(result: dict[str, Any], path) -> None:
    return (serve_ray.plot if result.get("suite") == "serve-ray" else _plot)(result, path)


def run(options: RunOptions = RunOptions(), *, contenders: Sequence[str] | None = None,
        clients: Sequence[int] | None = None, ray: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run the suite (``contenders``: some of ``CONTENDERS``, default all; ``clients``: client counts,
    default ``sizes(options).clients``); write ``serve.json``/``.md``/``.png`` into ``options.out``.
    ``ray``: the replicas on Ray Serve instead, prefix affinity against the default router
    (``serve_ray.py``; ``serve-ray.*``)."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    if ray:
        if contenders is not None:
            raise KVCacheError("bench serve --ray compares its two routers; --contenders does not apply")
        return serve_ray.run(options, clients=list(clients) if clients else None)

    names = chosen(contenders, CONTENDERS, "contender")
    s = sizes(options)
    if clients is not None:
        s = replace(s, clients=tuple(dict.fromkeys(clients)))
    if not s.clients or min(s.clients) < 1:
        raise KVCacheError(f"client counts must be positive integers, got {list(s.clients)}")
    with scratch_folder() as scratch:
        folder, model_name = model_folder(options, scratch)
        texts = chat_texts(AutoTokenizer.from_pretrained(folder), s.shared, s.user, s.users)
        logs = scratch / "logs"
        logs.mkdir()
        setup = Setup(folder, texts, s, kv_bytes_per_token(folder), logs)
        total = len(s.clients) * len(names) + s.replica_repeats * len(REPLICAS)
        with tqdm(total=total, desc="bench serve", disable=not options.progress) as bar:
            loads = _loads(setup, names, bar)
            replicas = measure_replicas(setup, bar)
    return _report(options, setup, names, model_name, loads, replicas)


def _loads(setup: Setup, names: Sequence[str], bar: Any) -> dict[tuple[str, int], Load]:
    """Every (server, client count): per client count ``r``-th in ``clients``, the servers in their
    order rotated by ``r``."""
    out: dict[tuple[str, int], Load] = {}
    for r, clients in enumerate(setup.s.clients):
        shift = r % len(names)
        for name in [*names[shift:], *names[:shift]]:
            bar.set_postfix_str(f"{name}, {clients} clients")
            out[(name, clients)] = measure_load(setup, name, clients)
            bar.update()
    return {(n, c): out[(n, c)] for c in setup.s.clients for n in names}


def _report(options: RunOptions, setup: Setup, names: Sequence[str], model_name: str, loads: dict[tuple[str, int], Load],
            replicas: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    import torch

    s, t = setup.s, setup.texts
    table_rows = [load_row(name, load) for (name, _), load in loads.items()]
    judged = (s.shared, s.user, s.new_tokens) == (FULL.shared, FULL.user, FULL.new_tokens) and 16 in s.clients
    config = asdict(s) | {
        "model": model_name,
        "model_folder": setup.model,
        "text": "the kvcache package's source text",
        "system_turn_tokens": t.system_turn,
        "user_turn_tokens": t.user_turn,
        "prompt_tokens_max": t.prompt,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "contenders": list(names),
        "configured": {k: v for k, v in configured(setup).items() if k in names},
        "client_threads": f"this process, one event loop (bench threads: {torch.get_num_threads()})",
        "judged": judged,
        "quick": options.quick,
        "tiny": options.tiny,
    }
    replica = replica_rows(replicas, t, s.store_chunk)
    return report("serve", options, config, table_rows, _table, _plot, summary=summarize(table_rows, judged), replicas=replica)
