"""``kvcache serve --ray``: the OpenAI server as a Ray Serve application, N engine replicas behind
one address.

Two deployments:

- ``kvcache-engine`` (``Replica``, ``--replicas`` of them): each loads the model and runs its own
  ``Engine`` (its own paged pool) on a thread of its own, with the prompt store every replica shares
  (``--prompt-store redis://...``). A replica answers whole HTTP requests with the very app of
  ``kvcache serve`` (``app.make_app``), called in process (``asgi_call``), so shapes, errors,
  streaming and each replica's metrics are the single server's.
- ``kvcache-openai`` (``Ingress``, one, no CPU of its own): Ray Serve's HTTP entry. It forwards
  each request to a replica through a deployment handle and streams the answer back. A request
  whose replica dies before the first byte of its answer is sent again (``retries`` times) to
  another; one whose answer has begun is cut off.

Which replica takes a request is the request router's choice (``ROUTERS``), set on
``kvcache-engine``: ``blocks`` (``ray_router.py``) matches ``Call.tokens``, the prompt's token ids
the ingress computes with the model's tokenizer (``routing_tokens``), against the blocks each pool
holds (``Replica.record_routing_stats``); ``prefix`` (Ray Serve's ``PrefixCacheAffinityRouter``)
matches text, ``Call.prompt`` (``routing_text``); ``default`` is Ray Serve's power of two choices.
The first two balance load once the queues differ by more than ``imbalance``.

Ray restarts a replica that dies (its health check is ``Replica.check_health``). ``application``
builds the app; ``app_builder`` is the same for ``serve run kvcache.apps.serve.ray_app:app_builder
key=value ...`` and Serve config files (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from .server import ServeOptions
from .text import chat_ids, text_ids

#: The ingress logs through Ray Serve's logger, so its lines land in its replica's log file (the
#: cluster's logs folder, ``serve/replica_kvcache_kvcache-openai_*.log``).
log = logging.getLogger("ray.serve")

#: ``--router`` names -> Ray Serve request router classes (None: Serve's default). Ray's prefix router
#: is named by its defining module: Ray's public path (``ray.serve.llm.request_router``) imports
#: Ray Serve LLM, which refuses to load without vLLM or SGLang.
ROUTERS = {
    "blocks": "kvcache.apps.serve.ray_router.BlockAffinityRouter",
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
    "default": None,
}  # fmt: skip
ENGINE = "kvcache-engine"
#: Seconds before a request is sent again, times the attempt.
RETRY_WAIT_S = 0.5
#: Seconds Ray Serve gives a starting HTTP proxy before a readiness check fails (Ray's own: 5).
PROXY_READY_S = 60
INGRESS = "kvcache-openai"


@dataclass(frozen=True)
class Call:
    """One HTTP request as the ingress hands it to a replica, with what the routers match:
    ``prompt``, its text (``prefix``; empty under ``blocks``), and ``tokens``, its prompt's token
    ids (``blocks``; empty under the others)."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prompt: str
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class RayOptions:
    """How the replicas are deployed."""

    replicas: int = 2  # with max_replicas: the fewest
    router: str = "blocks"
    imbalance: float = 4.0  # queue length difference beyond which the blocks and prefix routers balance load
    cpus: float = 1.0  # CPUs a replica reserves (Ray sets its torch threads to this)
    retries: int = 2  # times a request is sent again when its replica dies before answering
    max_replicas: int | None = None  # Ray Serve scales between replicas and this many (None: a fixed number)


def request_prompt(path: str, body: bytes) -> list[dict[str, Any]] | str | list[int] | None:
    """What a request's prompt is made of: a chat's messages, a completion's first prompt (text or
    token ids), or None for anything else."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else None
    prompt = data.get("prompt") if path.endswith("/completions") else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return prompt if isinstance(prompt, str) else None


def routing_text(path: str, body: bytes) -> str:
    """The text a request's prefix is matched on by ``prefix``: a chat's messages (``role: content``
    lines in order), a completion's first prompt (token ids as text), or "" for anything else."""
    prompt = request_prompt(path, body)
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], dict)):
        return "".join(f"{m.get('role', '')}: {_content_text(m.get('content'))}\n" for m in prompt)
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt or ""


def routing_tokens(tokenizer: Any, path: str, body: bytes) -> tuple[int, ...]:
    """The token ids of a request's prompt as the replica will compute them (``chat_ids``,
    ``text_ids``), for ``blocks``; none when the request has no prompt or the tokenizer refuses it
    (the replica then answers with the error)."""
    prompt = request_prompt(path, body)
    try:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return tuple(chat_ids(tokenizer, prompt))
        if isinstance(prompt, str):
            return tuple(text_ids(tokenizer, prompt))
    except Exception:  # noqa: BLE001 - a template's refusal, an odd message: the replica says why
        return ()
    return tuple(prompt) if isinstance(prompt, list) else ()


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def asgi_call(app: Any, method: str, path: str, query: str, headers: tuple[tuple[bytes, bytes], ...],
                    body: bytes) -> AsyncIterator[Any]:  # fmt: skip
    """Run the ASGI ``app`` in process on one HTTP request; yields ``(status, headers)`` (headers
    as ``(bytes, bytes)`` pairs), then each non-empty body chunk as bytes. If the consumer stops
    early, the app is told the client went away (``http.disconnect``), as a server would."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower(), v) for k, v in headers], "client": None, "server": None,
    }  # fmt: skip
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(task, timeout=5)


class Replica:
    """One engine replica (see the module docstring). The model is loaded on the thread that then
    steps the engine (``Engine.run_here``'s advice)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from .app import make_app
        from .server import build

        self.options = ServeOptions(**options)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.served: Any = None
        ready = threading.Event()

        def run() -> None:
            try:
                self.served = build(self.options)
            except BaseException as e:  # noqa: BLE001 (raised again by __init__)
                self._error = e
                return
            finally:
                ready.set()
            self.served.engine.run_here(self._stop)

        self._thread = threading.Thread(target=run, name="kvcache-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:
            raise self._error
        self.app = make_app(self.served)

    async def handle(self, request: Call):
        """The app's answer to ``request``: ``(status, headers, first body chunk)`` (``b""`` for an
        empty body) as one message, then the rest of the body's chunks. One message, so a replica
        that dies between them never leaves the ingress holding a status with no body (a whole
        JSON answer is one chunk)."""
        parts = asgi_call(self.app, request.method, request.path, request.query, request.headers, request.body)
        status, headers = await anext(parts)
        first = await anext(parts, b"")
        yield status, headers, first
        async for part in parts:
            yield part

    def record_routing_stats(self) -> dict[str, Any]:
        """What this replica's pool holds, for ``blocks`` (Ray Serve calls it every
        ``request_routing_stats_period_s``): ``ray_router.report``."""
        from .ray_router import report

        engine = self.served.engine
        return report(engine.prefix_salt, engine.pool.block_size, engine.pool.keys())

    def check_health(self) -> None:
        """Ray Serve's health check: the engine's thread must be stepping."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine's thread has stopped")

    def __del__(self) -> None:  # Ray Serve calls it when the replica shuts down, after its requests drain
        if getattr(self, "served", None) is not None:
            self.served.draining = True
            self._stop.set()
            self.served.engine.wake()


class Ingress:
    """Ray Serve's HTTP entry (see the module docstring)."""

    def __init__(self, engine: Any, retries: int = 2, model: str | None = None) -> None:
        """``model``: ``--model``, whose tokenizer gives each request its ``Call.tokens`` (for
        ``blocks``); None for the routers that match text."""
        from ..cli_load import load_tokenizer

        self.engine = engine
        self.retries = retries
        self.tokenizer = None if model is None else load_tokenizer(model)

    async def __call__(self, request: Any) -> Any:
        from ray.exceptions import RayError
        from starlette.responses import JSONResponse, StreamingResponse

        body = await request.body()
        path = request.url.path
        if self.tokenizer is None:  # a router on text (``blocks`` alone reads tokens, the others the text)
            text, tokens = routing_text(path, body) or f"{request.method} {path}", ()  # (the prefix router cannot match "")
        else:
            text, tokens = "", routing_tokens(self.tokenizer, path, body)
        call = Call(request.method, path, request.url.query, tuple(request.headers.raw), body, text, tokens)
        for attempt in range(self.retries + 1):
            if attempt:  # (time for Ray to learn that the replica died, so the router picks another)
                await asyncio.sleep(RETRY_WAIT_S * attempt)
            answer = self.engine.options(stream=True).handle.remote(call)
            try:
                status, headers, first = await answer.__anext__()
                break
            except (RayError, StopAsyncIteration) as e:
                log.warning("a replica failed before answering (%s); %s", type(e).__name__, "sending again" if attempt < self.retries else "giving up")
                if attempt == self.retries:
                    body = {"error": {"message": f"the replica serving this request failed: {type(e).__name__}", "type": "server_error",
                                      "param": None, "code": "replica_failed"}}  # fmt: skip
                    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

        async def rest():
            if first:
                yield first
            try:
                async for chunk in answer:
                    yield chunk
            except RayError as e:  # the replica died mid-answer: the client sees the stream end
                log.warning("a replica failed mid-answer (%s)", type(e).__name__)

        response = StreamingResponse(rest(), status_code=status)
        response.raw_headers = [(k.lower(), v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
        return response


def application(options: ServeOptions, ray: RayOptions) -> Any:
    """The Ray Serve application: ``Ingress`` over ``ray.replicas`` ``Replica``'s."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if ray.router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {ray.router!r}")
    if ray.replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {ray.replicas}")
    if ray.max_replicas is not None and ray.max_replicas < ray.replicas:
        raise ValueError(f"max_replicas must be at least replicas ({ray.replicas}), got {ray.max_replicas}")
    # Autoscaling aims at max_seqs requests a replica: as many as its engine runs at once.
    count = {"num_replicas": ray.replicas} if ray.max_replicas is None else {"autoscaling_config": {
        "min_replicas": ray.replicas, "max_replicas": ray.max_replicas, "target_ongoing_requests": options.max_seqs}}  # fmt: skip
    if ray.router == "blocks":
        from .ray_router import STATS_PERIOD_S

        router = RequestRouterConfig(request_router_class=ROUTERS["blocks"], request_router_kwargs={"imbalance": ray.imbalance},
                                     request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=5 * STATS_PERIOD_S)  # fmt: skip
    elif ray.router == "prefix":
        router = RequestRouterConfig(request_router_class=ROUTERS["prefix"], request_router_kwargs={"imbalanced_threshold": ray.imbalance})
    else:
        router = RequestRouterConfig()
    replica = serve.deployment(
        Replica, name=ENGINE, **count, ray_actor_options={"num_cpus": ray.cpus},
        max_ongoing_requests=options.max_seqs + options.max_queue, request_router_config=router,
        health_check_period_s=2, graceful_shutdown_timeout_s=30,
    )  # fmt: skip
    ingress = serve.deployment(Ingress, name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(asdict(options)), ray.retries, options.model if ray.router == "blocks" else None)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run kvcache.apps.serve.ray_app:app_builder model=DIR replicas=2 router=prefix ...``:
    ``ServeOptions`` and ``RayOptions`` fields by name (values as text are converted); an unknown
    name is refused."""
    serve_names = {f.name: f for f in fields(ServeOptions)}
    ray_names = {f.name: f for f in fields(RayOptions)}
    unknown = sorted(set(args) - set(serve_names) - set(ray_names))
    if unknown:
        raise ValueError(f"unknown arguments {unknown}; expected some of {sorted(set(serve_names) | set(ray_names))}")

    def typed(f, value):
        kind = {"int": int, "float": float, "int | None": int, "str | None": str}.get(str(f.type), str)
        return None if value is None else kind(value)

    options = ServeOptions(**{k: typed(serve_names[k], v) for k, v in args.items() if k in serve_names})
    ray = RayOptions(**{k: typed(ray_names[k], v) for k, v in args.items() if k in ray_names})
    return application(options, ray)


def serve_ray(options: ServeOptions, ray_options: RayOptions, address: str | None = None) -> int:
    """Run the application on Ray (a local cluster, or the one at ``address``) until SIGTERM or
    SIGINT; then delete it (and stop the local cluster); 0 after a clean stop."""
    import signal

    from ...errors import KVCacheError

    try:
        import ray
        from ray import serve
    except ImportError:
        raise KVCacheError("kvcache serve --ray needs its extra: pip install 'kvcache[ray]' (ray[serve])") from None
    app = application(options, ray_options)
    # A proxy not ready in 5 s (Ray's default) three times is killed, and serve.start fails with
    # it: a starved machine (a cluster starting beside other work on 2 cores) takes longer.
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_S))}
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": env})  # fmt: skip
    stop = threading.Event()
    original = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(app, name="kvcache", route_prefix="/", blocking=False)
        count = ray_options.replicas if ray_options.max_replicas is None else f"{ray_options.replicas} to {ray_options.max_replicas}"
        print(f"kvcache serve: {options.model} on http://{options.host}:{options.port} "
              f"({count} replicas on Ray Serve, router {ray_options.router})", flush=True)  # fmt: skip
        stop.wait()
        print("kvcache serve: stopping the replicas", flush=True)
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)
        try:
            if address is None:
                serve.shutdown()
            else:
                serve.delete("kvcache")
        finally:
            ray.shutdown()
    return 0
