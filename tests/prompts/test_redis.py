"""The Redis backend against a real ``redis-server`` (see conftest): a server that refuses, one
restarted mid-run, passwords, processes sharing one namespace, and a server that is not trusted
(huge or wrongly typed values planted beside ours)."""

from __future__ import annotations

import pytest
from backend_worker import run_workers, verifies

from kvcache.errors import StoreUnavailable
from kvcache.prompts.redis_backend import RedisBackend, redact


def every_call(store: RedisBackend):
    return {
        "get": lambda: store.get("k"),
        "get_many": lambda: store.get_many(["k", "j"]),
        "contains_many": lambda: store.contains_many(["k"]),
        "put": lambda: store.put("k", b"value"),
        "delete": lambda: store.delete("k"),
        "nbytes": store.nbytes,
        "len": lambda: len(store),
        "clear": store.clear,
    }


def test_a_refused_connection_raises_store_unavailable_from_every_call(refused_url):
    store = RedisBackend(refused_url, timeout=0.5)
    for name, call in every_call(store).items():
        with pytest.raises(StoreUnavailable, match=f"prompt store {refused_url}: .*failed") as error:
            call()
        assert isinstance(error.value, OSError), name
    store.close()


def test_a_restarted_server_is_used_again(redis_server):
    store = RedisBackend(redis_server.url(), timeout=0.5)
    assert store.put("k", b"before")
    redis_server.stop()
    with pytest.raises(StoreUnavailable):
        store.get("k")
    redis_server.start()
    assert store.get("k") is None  # nothing persisted: a miss, not an error
    assert store.put("k", b"after") and store.get("k") == b"after"
    redis_server.restart()  # pooled connections now dead, and no call saw the outage
    assert store.get("k") is None and store.put("k", b"again") and store.nbytes() == len(b"again")
    store.close()


def test_a_server_that_stops_answering_times_out_and_is_used_again_when_it_answers(redis_server):
    import signal

    store = RedisBackend(redis_server.url(), timeout=0.3)
    assert store.put("k", b"before")
    redis_server.process.send_signal(signal.SIGSTOP)  # connections stay open, answers never come
    try:
        with pytest.raises(StoreUnavailable, match="(?i)timeout|timed out"):
            store.get("k")
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    assert store.get("k") == b"before" and store.put("k", b"after") and store.get("k") == b"after"
    store.close()


def test_passwords(redis_password_server):
    right = RedisBackend(redis_password_server.url(), timeout=1)
    assert "s3cret-pw" not in right.location and ":***@" in right.location
    assert right.put("k", b"v") and right.get("k") == b"v"
    right.clear()
    for url in (redis_password_server.url(password="wrong-pw"), redis_password_server.url().replace(":s3cret-pw@", "")):
        store = RedisBackend(url, timeout=1)
        with pytest.raises(StoreUnavailable) as error:
            store.put("k", b"v")
        assert "pw" not in str(error.value).replace(store.location, "")
        store.close()
    right.close()


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:p%40ss@host/1", "redis://user:***@host/1"),
        ("rediss://host:6380/0", "rediss://host:6380/0"),
        ("unix:///run/redis.sock?db=2&password=pw", "unix:///run/redis.sock?db=2&password=***"),
        ("redis://user@host", "redis://user@host"),
    ],
)
def test_the_location_never_shows_a_password(url, shown):
    assert redact(url) == shown


def test_bad_urls_and_namespaces_are_refused():
    with pytest.raises(ValueError, match="Redis URL"):
        RedisBackend("http://host:6379")
    for namespace in ("", "a b", "{x}", "a*", "x" * 65):
        with pytest.raises(ValueError, match="namespace"):
            RedisBackend("redis://localhost:6379/0", namespace=namespace)


def test_layout_ttl_and_bookkeeping_of_expired_entries(redis_session_server, redis_url):
    import time

    client = redis_session_server.client(int(redis_url.rsplit("/", 1)[1]))
    store = RedisBackend(redis_url, namespace="ns", ttl=0.2)
    assert store.put("key", b"value") and store.put("other", b"v2")
    assert client.get("{ns}:key") == b"value" and 0 < client.pttl("{ns}:key") <= 200
    assert client.hgetall("{ns}/sizes") == {b"key": b"5", b"other": b"2"} and client.get("{ns}/bytes") == b"7"
    time.sleep(0.3)
    assert store.nbytes() == 0 and len(store) == 0
    assert [client.exists(f"{{ns}}/{name}") for name in ("sizes", "lru", "expiry")] == [0, 0, 0]
    store.close()


def test_a_huge_planted_value_is_a_miss_and_is_not_downloaded(redis_session_server, redis_url):
    client = redis_session_server.client(int(redis_url.rsplit("/", 1)[1]))
    store = RedisBackend(redis_url, namespace="ns", max_entry_bytes=1000)
    client.set("{ns}:huge", b"x" * 1_000_000)
    client.set("{ns}:small", b"y" * 1000)
    client.hset("{ns}:wrongtype", "field", "value")
    sent_before = client.info("stats")["total_net_output_bytes"]
    assert store.get("huge") is None
    assert store.get_many(["huge", "small", "wrongtype"]) == [None, b"y" * 1000, None]
    assert client.info("stats")["total_net_output_bytes"] - sent_before < 100_000
    assert store.contains_many(["huge", "small"]) == [True, True]
    store.close()


def test_processes_sharing_a_namespace_never_see_a_torn_value_and_keep_the_count(redis_url):
    run_workers(redis_url, "shared", count=3)
    store = RedisBackend(redis_url, namespace="shared")
    values = store.get_many([f"k{i}" for i in range(4)])
    assert all(value is not None and verifies(value) for value in values)
    assert store.nbytes() == sum(map(len, values)) and len(store) == 4
    store.close()


def test_processes_evicting_in_one_namespace_keep_the_byte_count_and_the_budget(redis_session_server, redis_url):
    run_workers(redis_url, "budget", count=3, ops=120, keys=12, max_bytes=60_000)
    store = RedisBackend(redis_url, namespace="budget")
    client = redis_session_server.client(int(redis_url.rsplit("/", 1)[1]))
    held = [name for name in client.scan_iter(match="{budget}:*")]
    assert 0 < store.nbytes() == sum(client.strlen(name) for name in held) <= 60_000
    assert len(store) == len(held) and client.zcard("{budget}/lru") == len(held)
    store.close()


def test_clear_leaves_other_namespaces_and_foreign_keys(redis_session_server, redis_url):
    client = redis_session_server.client(int(redis_url.rsplit("/", 1)[1]))
    for name in ("plain", "kvcache:a", "{kvcache2}:a", "{kvcachex}/lru"):
        client.set(name, b"foreign")
    store, neighbour = RedisBackend(redis_url), RedisBackend(redis_url, namespace="kvcache2")
    assert store.put("a", b"mine") and neighbour.put("b", b"theirs")
    store.clear()
    assert len(store) == 0 and store.get("a") is None
    assert neighbour.get("b") == b"theirs" and len(neighbour) == 1
    assert all(client.get(name) == b"foreign" for name in ("plain", "kvcache:a", "{kvcache2}:a", "{kvcachex}/lru"))
    store.close()
    neighbour.close()


def test_a_database_flushed_behind_its_back_is_an_empty_store(redis_session_server, redis_url):
    store = RedisBackend(redis_url, max_bytes=100)
    assert store.put("a", b"a" * 60)
    redis_session_server.client(int(redis_url.rsplit("/", 1)[1])).flushdb()
    assert store.get("a") is None and store.nbytes() == 0
    assert store.put("b", b"b" * 60) and store.put("c", b"c" * 30) and store.nbytes() == 90
    store.close()


# ---- the reader of GET replies ----------------------------------------------------------------


def reader_of(*chunks: bytes):
    """A ``BulkReader`` on one end of a socket pair whose other end has sent ``chunks`` and closed."""
    import socket

    from kvcache.prompts.redis_reader import BulkReader

    ours, theirs = socket.socketpair()
    theirs.sendall(b"".join(chunks))
    theirs.close()
    return BulkReader(ours)


def test_the_reader_takes_bulk_strings_nulls_and_errors_in_turn():
    value = bytes(range(256)) * 300
    reader = reader_of(b"$5\r\nhello\r\n", b"$-1\r\n", b"_\r\n", b"-WRONGTYPE Operation against a key\r\n", b"$%d\r\n" % len(value), value, b"\r\n", b"$0\r\n\r\n")
    buffer = bytearray(8)
    first = reader.read_bulk(buffer, 10**6)
    assert bytes(first) == b"hello" and first.obj is buffer  # small enough for the caller's buffer
    assert [reader.read_bulk(buffer, 10**6) for _ in range(3)] == [None, None, None]
    big = reader.read_bulk(buffer, 10**6)
    assert bytes(big) == value and big.obj is not buffer  # a larger buffer, for the caller to keep
    assert bytes(reader.read_bulk(big.obj, 10**6)) == b""


@pytest.mark.parametrize(
    "sent, error",
    [
        (b"$1000\r\n" + b"x" * 10, ConnectionError),  # the server went away mid-value
        (b"$3\r\nabcXY", "ProtocolError"),  # no CRLF after the value
        (b"+OK\r\n", "ProtocolError"),  # not an answer to GET
        (b"$12x\r\n", "ProtocolError"),
        (b"$" + b"9" * 70_000, "ProtocolError"),  # a line that never ends
        (b"$2000\r\n", "TooLarge"),  # announced over the limit: refused before it is read
    ],
)
def test_the_reader_refuses_what_is_not_a_whole_reply(sent, error):
    from kvcache.prompts import redis_reader

    expected = getattr(redis_reader, error) if isinstance(error, str) else error
    with pytest.raises(expected):
        reader_of(sent).read_bulk(bytearray(), 1500)
