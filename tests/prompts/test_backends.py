"""The prompt store's byte backends, each kind against the same contract (memory, folder and a
real Redis), then what only the folder backend has to survive."""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict

import pytest
from backend_worker import checked_value, verifies
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcache.errors import KVCacheError, StoreUnavailable
from kvcache.prompts.backends import FolderBackend, MemoryBackend, RedisBackend, open_backend

BAD_KEYS = ["", "a/b", "..", ".hidden", "a" * 129, "ключ", "a b", "a\x00b", "a:b", "../x", None, 7, b"ab"]


def test_round_trip(backend_factory):
    store = backend_factory()
    every_byte = bytes(range(256)) * 3
    assert store.put("k-1", every_byte)
    assert store.put("k.2", bytearray(b"second"))
    assert store.put("K_3", memoryview(b"third"))
    assert store.put("empty", b"")
    got = store.get("k-1")
    assert type(got) is bytes and got == every_byte
    assert store.get_many(["K_3", "nope", "k.2", "empty"]) == [b"third", None, b"second", b""]
    assert store.get_many([]) == []
    assert store.contains_many(["k-1", "nope", "empty"]) == [True, False, True]
    assert len(store) == 4 and store.nbytes() == len(every_byte) + len(b"second") + len(b"third")
    assert store.put("k-1", b"rewritten")
    assert store.get("k-1") == b"rewritten"
    assert store.nbytes() == len(b"rewritten") + len(b"second") + len(b"third")
    store.delete("k-1")
    store.delete("never-there")
    assert store.get("k-1") is None and store.contains_many(["k-1"]) == [False]
    assert len(store) == 3


def test_iter_values_hands_out_each_value_in_turn(backend_factory):
    """Views of a reused buffer where the backend has one: each right when handed out, the buffer
    growing for a larger value and reused for smaller ones; a miss is None."""
    store = backend_factory()
    values = {"small": b"s" * 10, "large": bytes(range(256)) * 20, "smaller": b"t" * 3, "empty": b""}
    for key, value in values.items():
        assert store.put(key, value)
    order = ["small", "nope", "large", "smaller", "empty", "small"]
    seen = [(key, None if value is None else bytes(value)) for key, value in store.iter_values(order)]
    assert seen == [(key, values.get(key)) for key in order]
    assert list(store.iter_values([])) == []


def test_iter_values_is_a_use(backend_factory):
    store = backend_factory(max_bytes=300)
    assert store.put("a", b"a" * 100) and store.put("b", b"b" * 100)
    assert [bytes(v) for _, v in store.iter_values(["a"])] == [b"a" * 100]
    assert store.put("c", b"c" * 150)  # over the budget: the least recently used goes, b
    assert store.contains_many(["a", "b", "c"]) == [True, False, True]


def test_iter_values_left_half_way_leaves_the_backend_usable(backend_factory):
    store = backend_factory()
    for key in ("x", "y", "z"):
        assert store.put(key, key.encode() * 5000)
    values = store.iter_values(["x", "y", "z"])
    assert next(values)[0] == "x"
    values.close()  # Redis: the replies not read stay on that connection, which is dropped
    assert store.get_many(["z", "y"]) == [b"z" * 5000, b"y" * 5000]


def test_a_multi_byte_memoryview_is_stored_as_its_bytes(backend_factory):
    store = backend_factory()
    import array

    numbers = array.array("i", [1, 2, 3, -1])
    assert store.put("ints", memoryview(numbers))
    assert store.get("ints") == numbers.tobytes()


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_refused_naming_the_key(backend_factory, key):
    store = backend_factory()
    for call in (lambda: store.get(key), lambda: store.put(key, b"v"), lambda: store.delete(key),
                 lambda: store.get_many(["ok", key]), lambda: store.contains_many([key])):
        with pytest.raises(ValueError, match="store key") as error:
            call()
        assert repr(key) in str(error.value)
    assert len(store) == 0


def test_values_must_be_bytes(backend_factory):
    store = backend_factory()
    for value in ("text", 3, None, [1, 2]):
        with pytest.raises(TypeError, match="bytes"):
            store.put("k", value)
    assert len(store) == 0


def test_a_value_over_the_budget_is_refused_and_changes_nothing(backend_factory):
    store = backend_factory(max_bytes=100)
    assert store.put("a", b"a" * 60) and store.put("b", b"b" * 40)
    assert store.put("a", b"x" * 101) is False
    assert store.put("c", b"c" * 101) is False
    assert store.get_many(["a", "b", "c"]) == [b"a" * 60, b"b" * 40, None]
    assert store.nbytes() == 100 and len(store) == 2


def test_eviction_drops_the_least_recently_used(backend_factory):
    store = backend_factory(max_bytes=100)
    for key in "abc":
        assert store.put(key, key.encode() * 30)
    assert store.get("a") == b"a" * 30  # a is now the most recently used: b goes first
    assert store.put("d", b"d" * 30)
    assert store.contains_many(list("abcd")) == [True, False, True, True]
    assert store.put("e", b"e" * 50)  # 120 + 50: c then a go
    assert store.contains_many(list("abcde")) == [False, False, False, True, True]
    assert store.nbytes() == 80


class ReferenceLRU:
    """The model: an ordered dict, oldest use first."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.entries = max_bytes, OrderedDict()

    def put(self, key, value) -> bool:
        if len(value) > self.max_bytes:
            return False
        self.entries.pop(key, None)
        self.entries[key] = value
        while sum(map(len, self.entries.values())) > self.max_bytes:
            self.entries.popitem(last=False)
        return True

    def get(self, key):
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)


KEYS = ["k0", "k1", "k2", "k3", "k4"]
# Sizes of a third to two thirds of the budget make most puts evict; one is over it.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(KEYS), st.sampled_from([0, 20, 35, 50, 65, 101])),
        st.tuples(st.just("get"), st.sampled_from(KEYS), st.just(0)),
        st.tuples(st.just("delete"), st.sampled_from(KEYS), st.just(0)),
    ),
    min_size=4,
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=operations)
@example(ops=[("put", "k0", 50), ("put", "k1", 35), ("get", "k0", 0), ("put", "k2", 20), ("put", "k0", 101)])
def test_lru_matches_a_reference_model(backend_factory, ops):
    store, model = backend_factory(max_bytes=100), ReferenceLRU(100)
    for step, (op, key, size) in enumerate(ops):
        if op == "put":
            value = bytes([step % 256]) * size
            assert store.put(key, value) == model.put(key, value)
        elif op == "get":
            assert store.get(key) == model.get(key)
        else:
            store.delete(key)
            model.entries.pop(key, None)
        assert store.nbytes() <= 100
    assert store.contains_many(KEYS) == [key in model.entries for key in KEYS]
    assert store.nbytes() == sum(map(len, model.entries.values()))
    assert len(store) == len(model.entries)


def test_entries_expire_after_their_ttl(backend_factory):
    store = backend_factory(ttl=0.2)
    assert store.put("old", b"old value") and store.put("other", b"x")
    assert store.get("old") == b"old value"
    time.sleep(0.3)
    assert store.put("new", b"new value")
    assert store.get("old") is None
    assert store.get_many(["old", "new", "other"]) == [None, b"new value", None]
    assert store.contains_many(["old", "new"]) == [False, True]
    assert len(store) == 1 and store.nbytes() == len(b"new value")


def test_clear_clears_only_its_own_store(backend_factory):
    mine, theirs = backend_factory(), backend_factory()
    assert mine.put("a", b"mine") and mine.put("b", b"mine too")
    assert theirs.put("a", b"theirs")
    mine.clear()
    assert len(mine) == 0 and mine.nbytes() == 0 and mine.get("a") is None
    assert theirs.get("a") == b"theirs" and len(theirs) == 1
    assert mine.put("a", b"again") and mine.get("a") == b"again"


def test_threads_writing_and_reading_the_same_keys_never_see_a_torn_value(backend_factory):
    store = backend_factory()
    keys = [f"shared{i}" for i in range(4)]
    bad: list[str] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            key = rng.choice(keys)
            if rng.random() < 0.5:
                store.put(key, checked_value(rng))
            else:
                value = store.get(key)
                if value is not None and not verifies(value):
                    bad.append(key)

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bad == []
    final = store.get_many(keys)
    assert all(value is not None and verifies(value) for value in final)
    assert len(store) == len(keys) and store.nbytes() == sum(map(len, final))


def test_threads_under_a_budget_keep_it(backend_factory):
    store = backend_factory(max_bytes=50_000)

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            store.put(f"k{rng.randrange(12)}", checked_value(rng, 12_000))

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0 < store.nbytes() <= 50_000
    values = store.get_many([f"k{i}" for i in range(12)])
    assert all(verifies(value) for value in values if value is not None)


def test_budgets_are_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            MemoryBackend(max_bytes=bad)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="ttl"):
            MemoryBackend(ttl=bad)


def test_store_unavailable_is_a_kvcache_error_and_an_os_error():
    assert issubclass(StoreUnavailable, KVCacheError) and issubclass(StoreUnavailable, OSError)


def test_open_backend_picks_the_kind_from_the_location(tmp_path, redis_url):
    memory = open_backend("memory", max_bytes=10, ttl=5)
    assert type(memory) is MemoryBackend and (memory.max_bytes, memory.ttl) == (10, 5)
    assert type(open_backend("memory://")) is MemoryBackend
    assert open_backend(memory) is memory
    folder = open_backend(str(tmp_path / "a"), max_bytes=7)
    assert type(folder) is FolderBackend and folder.path == tmp_path / "a" and folder.max_bytes == 7
    assert open_backend(tmp_path / "b").path == tmp_path / "b"
    assert open_backend(f"file://{tmp_path}/c").path == tmp_path / "c"
    remote = open_backend(redis_url, ttl=3)
    assert type(remote) is RedisBackend and remote.ttl == 3 and remote.location == redis_url
    remote.close()
    with pytest.raises(ValueError, match="location"):
        open_backend("")
    with pytest.raises(ValueError, match="location"):
        open_backend(None)
