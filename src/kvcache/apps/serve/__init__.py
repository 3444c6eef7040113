"""``kvcache serve``: an OpenAI-compatible HTTP server on ``kvcache.Engine``.

- ``server``: options, loading the model and the engine, uvicorn, draining on SIGTERM.
- ``app``: the Starlette app: the endpoints, a request's way through the engine, streaming.
- ``protocol``: the OpenAI API's request checks and response shapes.
- ``text``: generated tokens as text, cut at stop strings.
- ``metrics``: the Prometheus text of ``/metrics``.

Needs the ``serve`` extra (``pip install 'kvcache[serve]'``: starlette, uvicorn).
"""
