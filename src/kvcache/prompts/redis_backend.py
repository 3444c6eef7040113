"""The Redis backend: a store shared by every process and machine that can reach one server.

Keys in Redis, all under one hash tag so a cluster keeps them in one slot:

    {ns}:<key>     the value (a string; with PX when the store has a ttl)
    {ns}/sizes     hash   key -> value bytes       (so a rewrite never counts twice)
    {ns}/bytes     int    sum of sizes
    {ns}/lru       zset   key -> last use, a logical clock (exact order, no clock skew)
    {ns}/clock     int    that clock
    {ns}/expiry    zset   key -> expiry time in server milliseconds (store with a ttl only)

Bookkeeping names use ``/``, which a store key cannot contain, so no key shadows them. Every
change runs as one Lua script, so a ``put``, its accounting and its evictions are atomic against
other clients, and entries whose time ran out leave the bookkeeping when a script meets them. A
server is untrusted: a value over ``max_entry_bytes`` is never downloaded (the script checks its
length first, and the reader refuses a reply announcing more), and a key of another type is a miss.

Reads: the ``touch`` script finds the values and counts their use, then one round trip of ``GET``
brings them, read off the socket into one reused buffer (``redis_reader``: redis-py's parser
moved large values at a few hundred MB/s).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StoreUnavailable
from .backend_base import DEFAULT_MAX_ENTRY_BYTES, Backend, as_bytes_view, check_budget, check_key
from .redis_reader import BulkReader, TooLarge

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

# KEYS: 1 lru, 2 sizes, 3 bytes, 4 clock, 5 expiry. ARGV[1]: the value keys' prefix "{ns}:".
_COMMON = """
if redis.replicate_commands then redis.replicate_commands() end  -- Redis < 5: TIME before writes
local prefix = ARGV[1]
local function drop(m)
  local size = redis.call('HGET', KEYS[2], m)
  if size then
    redis.call('DECRBY', KEYS[3], size)
    redis.call('HDEL', KEYS[2], m)
  end
  redis.call('ZREM', KEYS[1], m)
  redis.call('ZREM', KEYS[5], m)
  redis.call('DEL', prefix .. m)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function purge_expired(now)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 1000)
  for _, m in ipairs(gone) do drop(m) end
end
"""

# ARGV: prefix, key, value, max_bytes (-1: none), ttl in ms (0: none). Returns 1, or 0 if refused.
_PUT = _COMMON + """
local m, v, max_bytes, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local size = string.len(v)
if max_bytes >= 0 and size > max_bytes then return 0 end
local now = now_ms()
purge_expired(now)
local old = redis.call('HGET', KEYS[2], m)
if old then redis.call('DECRBY', KEYS[3], old) end
if ttl > 0 then
  redis.call('SET', prefix .. m, v, 'PX', ttl)
  redis.call('ZADD', KEYS[5], now + ttl, m)
else
  redis.call('SET', prefix .. m, v)
  redis.call('ZREM', KEYS[5], m)
end
redis.call('HSET', KEYS[2], m, size)
redis.call('INCRBY', KEYS[3], size)
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), m)
if max_bytes >= 0 then
  while tonumber(redis.call('GET', KEYS[3]) or '0') > max_bytes do
    local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
    if not victim then break end
    drop(victim)
  end
end
return 1
"""

# ARGV: prefix, max_entry_bytes, key... Returns per key its value's length, or -1 if it is absent,
# not a string or longer than max_entry_bytes; a value found (length >= 0) is a use.
_TOUCH = _COMMON + """
local max_entry = tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV do
  local m = ARGV[i]
  local k = prefix .. m
  local size = -1
  local kind = redis.call('TYPE', k)['ok']
  if kind == 'string' then
    local n = redis.call('STRLEN', k)
    if n <= max_entry then
      size = n
      if redis.call('HEXISTS', KEYS[2], m) == 1 then
        redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), m)
      end
    end
  elseif kind == 'none' and redis.call('HEXISTS', KEYS[2], m) == 1 then
    drop(m)
  end
  out[#out + 1] = size
end
return out
"""

# ARGV: prefix, key.
_DELETE = _COMMON + """
drop(ARGV[2])
return 1
"""

# ARGV: prefix. Returns {bytes, entries} after dropping expired entries.
_STATS = _COMMON + """
purge_expired(now_ms())
return {tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('HLEN', KEYS[2])}
"""


def redact(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        if ":" in user:
            netloc = f"{user.split(':', 1)[0]}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*/")
    # Not urlunsplit: it writes unix:///path as unix:/path.
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + (
        f"#{parts.fragment}" if parts.fragment else ""
    )


class RedisBackend(Backend):
    """Entries in a Redis server at ``url`` (``redis://[[user]:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix:///path?db=0``), under ``namespace``. ``timeout``: seconds to
    connect and per socket operation. Connecting is lazy: a server that is down is met (and
    reported as ``StoreUnavailable``) by the first call, and every call after it tries again."""

    def __init__(
        self,
        url: str,
        max_bytes: int | None = None,
        ttl: float | None = None,
        namespace: str = "kvcache",
        timeout: float = 2.0,
        *,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ):
        check_budget(max_bytes, ttl)
        if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
            raise ValueError(f"a Redis namespace is 1-64 characters of [A-Za-z0-9_.:-], got {namespace!r}")
        self.location, self.max_bytes, self.ttl = redact(url), max_bytes, ttl
        self.namespace, self.max_entry_bytes = namespace, max_entry_bytes
        try:
            # No retries inside redis-py: a down server must answer within one timeout. A pooled
            # connection the server dropped (restart) is replaced when it is next taken.
            self._redis = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
            )
        except ValueError as e:
            raise ValueError(f"not a Redis URL: {self.location} ({e})") from None
        tag = "{" + namespace + "}"
        self._prefix = tag + ":"
        self._bookkeeping = [f"{tag}/{name}" for name in ("lru", "sizes", "bytes", "clock", "expiry")]
        self._scripts = {name: self._redis.register_script(code) for name, code in
                         (("put", _PUT), ("touch", _TOUCH), ("delete", _DELETE), ("stats", _STATS))}

    def _call(self, what: str, call: Callable):
        try:
            return call()
        except (redis.exceptions.RedisError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreUnavailable(f"prompt store {self.location}: {what} failed: {reason}") from e

    def _script(self, name: str, *args):
        return self._scripts[name](keys=self._bookkeeping, args=[self._prefix, *args])

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None if value is None else bytes(value) for _, value in self.iter_values(keys)]

    def iter_values(self, keys: Sequence[str]) -> Iterator[tuple[str, bytes | memoryview | None]]:
        """One script finds the values, checks their type and length and counts the use; then one
        round trip of ``GET`` brings them, each read into one buffer (``redis_reader``)."""
        keys = [check_key(key) for key in keys]
        if not keys:
            return
        sizes = [int(n) for n in self._call("get", lambda: self._script("touch", self.max_entry_bytes, *keys))]
        values = self._values([key for key, size in zip(keys, sizes) if size >= 0])
        try:
            for key, size in zip(keys, sizes):
                yield key, next(values) if size >= 0 else None
        finally:
            values.close()

    def _values(self, keys: list[str]) -> Iterator[memoryview | bytes | None]:
        """The values of ``keys`` (found a moment ago: one may have gone since, a None), on one
        connection that is dropped unless every reply was read. A value over ``max_entry_bytes``
        (rewritten since) is a None, and so is every one after it."""
        if not keys:
            return
        pool = self._redis.connection_pool
        connection = self._call("get", lambda: _connection(pool))
        complete = False
        try:
            self._call("get", lambda: connection.send_packed_command(connection.pack_commands([("GET", self._prefix + key) for key in keys])))
            sock = getattr(connection, "_sock", None)  # redis-py's own parser where it has no socket to lend
            reader, buffer = BulkReader(sock) if hasattr(sock, "recv_into") else None, bytearray()
            for done in range(len(keys)):
                try:
                    value = self._call("get", lambda: reader.read_bulk(buffer, self.max_entry_bytes) if reader else _response(connection))
                except TooLarge:
                    yield from [None] * (len(keys) - done)
                    return
                if isinstance(value, memoryview):
                    buffer = value.obj
                yield value if value is None or len(value) <= self.max_entry_bytes else None
            complete = True
        finally:
            if not complete:
                connection.disconnect()
            pool.release(connection)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        names = [self._prefix + check_key(key) for key in keys]

        def exists():
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        return [bool(found) for found in self._call("contains", exists)] if names else []

    def put(self, key: str, value) -> bool:
        check_key(key)
        view = as_bytes_view(value)
        if self.max_bytes is not None and view.nbytes > self.max_bytes:
            return False
        ttl_ms = 0 if self.ttl is None else max(1, round(self.ttl * 1000))
        limit = -1 if self.max_bytes is None else self.max_bytes
        return bool(self._call("put", lambda: self._script("put", key, view, limit, ttl_ms)))

    def delete(self, key: str) -> None:
        check_key(key)
        self._call("delete", lambda: self._script("delete", key))

    def _stats(self) -> tuple[int, int]:
        nbytes, entries = self._call("stats", lambda: self._script("stats"))
        return int(nbytes), int(entries)

    def nbytes(self) -> int:
        return self._stats()[0]

    def __len__(self) -> int:
        return self._stats()[1]

    def clear(self) -> None:
        def remove_namespace():
            batch = []
            for name in self._redis.scan_iter(match="{" + self.namespace + "}*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._redis.delete(*batch)
                    batch.clear()
            if batch:
                self._redis.delete(*batch)

        self._call("clear", remove_namespace)

    def close(self) -> None:
        self._redis.close()


def _connection(pool: redis.ConnectionPool) -> redis.Connection:
    """A connection of ``pool`` (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("GET")


def _response(connection) -> bytes | None:
    """A reply read by redis-py's parser: the value, or None for a null or an error (another type)."""
    try:
        return connection.read_response()
    except redis.exceptions.ResponseError:
        return None
