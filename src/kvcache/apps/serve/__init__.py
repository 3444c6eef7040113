"""``kvcache serve``: an OpenAI-compatible HTTP server on ``kvcache.Engine`` (``server.py`` runs the
Starlette app of ``app.py``; ``ray_app.py``, its replicas on Ray Serve).

Needs the ``serve`` extra (``pip install 'kvcache[serve]'``: starlette, uvicorn).
"""
