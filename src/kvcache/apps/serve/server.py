"""``kvcache serve``: load a model, make its engine, and serve the app (``app.py``) with uvicorn.

The engine steps on the main thread (the one that loaded the model; see ``Engine.run_here``) for
the server's whole life, uvicorn's event loop on a thread beside it. SIGTERM (or SIGINT) drains:
the server stops listening, requests that arrive on open connections get 503, running requests
finish (uvicorn waits for their responses), then the engine stops stepping and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import KVCacheError

log = logging.getLogger("kvcache.serve")

#: Where the API key comes from when ``--api-key`` is not given.
API_KEY_ENV = "KVCACHE_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    model: str = "smollm2"
    #: The weights' and cache's dtype (``cli_options.DTYPES``; ``auto``: as the checkpoint stores them).
    dtype: str = "auto"
    cache: str = "growable"
    prompt_store: str | None = None
    store_chunk: int = 256
    host: str = "127.0.0.1"
    port: int = 8000
    max_seqs: int = 32
    max_bytes: int | None = None
    block_size: int = 32
    max_batch_tokens: int = 2048
    max_queue: int = 64
    api_key: str | None = None
    device: str = "cpu"
    log_level: str = "info"
    #: Decode steps as compiled graphs (``Engine(compile=True)``), compiled before serving.
    compile: bool = False


def build(options: ServeOptions) -> Any:
    """The app's ``Served`` (model loaded, engine made and, with ``compile``, its steps compiled;
    not yet stepping)."""
    from ... import Engine, PromptStore
    from ..cli_load import load_model
    from .app import Served

    model, tokenizer = load_model(options.model, options.device, options.dtype)
    name, aliases = model_names(options.model)
    store = None if options.prompt_store is None else PromptStore(options.prompt_store, chunk=options.store_chunk)
    engine = Engine(
        model, options.cache, block_size=options.block_size, max_bytes=options.max_bytes, max_seqs=options.max_seqs,
        max_batch_tokens=options.max_batch_tokens, store=store, compile=options.compile,
    )  # fmt: skip
    if options.compile:
        engine.warm_up()
    key = options.api_key if options.api_key is not None else os.environ.get(API_KEY_ENV) or None
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return Served(engine, tokenizer, name, tuple(aliases), key, options.max_queue, context)


def model_names(given: str) -> tuple[str, tuple[str, ...]]:
    """The name the server answers to (a registry model's name, a folder's own name) and aliases
    (the registry's, and what ``--model`` said)."""
    from ...models import find_entry

    entry = find_entry(given)
    if entry is not None:
        return entry.name, tuple(n for n in entry.names if n != entry.name)
    name = os.path.basename(os.path.normpath(given)) or given
    return name, (given,) if given != name else ()


def serve(options: ServeOptions) -> int:
    """Run the server until SIGTERM or SIGINT; 0 after a clean drain."""
    try:
        import uvicorn
    except ImportError:
        raise KVCacheError("kvcache serve needs its extra: pip install 'kvcache[serve]' (starlette, uvicorn)") from None
    from .app import make_app

    if options.compile:
        print(f"kvcache serve: compiling decode steps of up to {options.max_seqs} requests", flush=True)
    served = build(options)
    config = uvicorn.Config(make_app(served), host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=None, access_log=False)  # fmt: skip
    server = _draining_server(config, served)
    engine = served.engine
    print(f"kvcache serve: {served.model_name} on http://{options.host}:{options.port} ({engine!r})", flush=True)
    # The engine steps on this (the main) thread, which loaded the model, and the HTTP server runs
    # beside it: stepping on a second thread would give OpenMP a second team of workers and slow
    # every step by about a third (Engine.run_here). Signals reach the main thread, so their
    # handlers are installed here and hand the exit to the server.
    stopped = threading.Event()

    def http() -> None:
        try:
            server.run()
        finally:
            stopped.set()
            engine.wake()

    thread = threading.Thread(target=http, name="kvcache-http", daemon=True)
    original = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread.start()
        engine.run_here(stopped)
        thread.join()
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)
    return 0


def _draining_server(config: Any, served: Any) -> Any:
    """uvicorn's server, which on the first exit signal also marks the app as draining (new requests
    on open connections get 503 while running ones finish). It runs off the main thread, where
    uvicorn installs no signal handlers (so re-raises none after the drain): ``serve`` installs
    them on the main thread and hands them to ``handle_exit``."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not served.draining:
                served.draining = True
                log.info("draining: finishing %d running requests", served.engine.running_count)
            super().handle_exit(sig, frame)

    return Server(config)
