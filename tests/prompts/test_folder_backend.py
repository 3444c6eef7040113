"""What only the folder backend has to survive: other processes on the same folder, files
replaced, truncated or planted under it, a folder it cannot write, temporary files of killed
writers."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest
from backend_worker import checked_value, run_workers, verifies

from kvcache.errors import StoreUnavailable
from kvcache.persist.atomic import _HOST
from kvcache.prompts.folder_backend import FolderBackend, fan_of

def test_entries_are_files_in_fan_out_folders_and_no_temporary_is_left(tmp_path):
    store = FolderBackend(tmp_path / "a" / "b")
    assert store.put("abc-123", b"value")
    assert (tmp_path / "a" / "b" / fan_of("abc-123") / "abc-123.kvp").read_bytes() == b"value"
    assert [p.name for p in (tmp_path / "a" / "b").rglob("*") if p.is_file()] == ["abc-123.kvp"]
    assert store.location == str(tmp_path / "a" / "b")


def test_processes_writing_and_reading_one_folder_never_see_a_torn_value(tmp_path):
    run_workers(str(tmp_path / "shared"), "-", count=3)
    store = FolderBackend(tmp_path / "shared")
    values = store.get_many([f"k{i}" for i in range(4)])
    assert all(verifies(value) for value in values if value is not None)
    assert sum(value is not None for value in values) == len(store) >= 1


def test_processes_evicting_in_one_folder_keep_the_budget(tmp_path):
    run_workers(str(tmp_path / "shared"), "-", count=3, ops=120, keys=12, max_bytes=60_000)
    store = FolderBackend(tmp_path / "shared")
    assert 0 < store.nbytes() <= 60_000
    assert not list(store.path.rglob(".*.tmp"))


def test_two_stores_on_one_folder_share_the_lru(tmp_path):
    first, second = FolderBackend(tmp_path, max_bytes=100), FolderBackend(tmp_path, max_bytes=100)
    assert first.put("x", b"x" * 40) and first.put("y", b"y" * 40)
    assert second.get("x") == b"x" * 40  # a use seen by every process: the file's time
    assert second.put("z", b"z" * 40)
    assert first.contains_many(["x", "y", "z"]) == [True, False, True]


def test_a_file_replaced_or_truncated_while_read_is_a_value_or_a_miss(tmp_path):
    store = FolderBackend(tmp_path)
    path = store.file_of("key")
    store.put("key", checked_value(random.Random(0)))
    stop = threading.Event()

    def meddle():
        rng = random.Random(1)
        while not stop.is_set():
            store.put("key", checked_value(rng))
            try:
                os.truncate(path, rng.randrange(100))  # in place, as no writer of ours would
            except FileNotFoundError:
                pass

    meddler = threading.Thread(target=meddle)
    meddler.start()
    try:
        results = [store.get("key") for _ in range(300)]
    finally:
        stop.set()
        meddler.join()
    assert all(result is None or type(result) is bytes for result in results)


def test_files_vanishing_while_listed_or_read_are_misses(tmp_path):
    store = FolderBackend(tmp_path)
    stop = threading.Event()

    def churn():
        rng = random.Random(2)
        while not stop.is_set():
            key = f"k{rng.randrange(20)}"
            store.put(key, b"v" * rng.randrange(50)) if rng.random() < 0.5 else store.delete(key)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for i in range(100):
            assert len(store) >= 0 and store.nbytes() >= 0
            store.get_many([f"k{j}" for j in range(20)])
    finally:
        stop.set()
        churner.join()


def test_a_folder_that_cannot_be_written_raises_store_unavailable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(StoreUnavailable, match="cannot create the folder"):
        FolderBackend(blocker / "store")
    store = FolderBackend(tmp_path / "store")
    assert store.put("kept", b"old")
    fan = store.path / fan_of("blocked")
    if os.geteuid() == 0:  # chmod does not stop root: block the sub-folder with a file instead
        fan.write_bytes(b"")
    else:
        fan.mkdir(exist_ok=True)
        fan.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailable, match=str(store.path)):
            store.put("blocked", b"value")
    finally:
        if fan.is_dir():
            fan.chmod(0o700)
    assert store.get("blocked") is None and store.get("kept") == b"old"


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_temporary_folders_of_killed_writers_are_swept(tmp_path):
    store = FolderBackend(tmp_path)
    gone = dead_pid()
    leftovers = []
    for key in ("rewritten", "other"):
        fan = store.path / fan_of(key)
        fan.mkdir(exist_ok=True)
        leftover = fan / f".{key}.kvp.{_HOST}~{gone}~abc123.tmp"
        leftover.mkdir()
        (leftover / "data").write_bytes(b"half a value")
        leftovers.append(leftover)
    live = store.path / fan_of("other") / f".other.kvp.{_HOST}~{os.getpid()}~live.tmp"
    live.mkdir()
    assert store.put("rewritten", b"value")  # a write sweeps its own key's leftovers
    assert not leftovers[0].exists() and leftovers[1].exists()
    assert len(store) == 1  # a scan sweeps every key's, but not a live writer's
    assert not leftovers[1].exists() and live.exists()


def test_planted_files_are_misses_and_are_not_entries(tmp_path):
    store = FolderBackend(tmp_path / "store", max_entry_bytes=1000)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the store")
    for key in ("link", "fifo", "folder", "huge"):
        store.path.joinpath(fan_of(key)).mkdir(parents=True, exist_ok=True)
    store.file_of("link").symlink_to(secret)
    os.mkfifo(store.file_of("fifo"))
    store.file_of("folder").mkdir()
    store.file_of("huge").write_bytes(b"x" * 1001)
    (store.path / "README").write_text("someone else's file")
    assert store.get_many(["link", "fifo", "folder", "huge"]) == [None] * 4  # and the FIFO did not block
    assert store.contains_many(["link", "fifo", "folder"]) == [False] * 3
    assert len(store) == 1 and store.nbytes() == 1001  # the over-long file is a miss, yet counts
    store.clear()
    assert (store.path / "README").exists() and secret.exists() and len(store) == 0


def test_an_expired_file_is_removed_when_met(tmp_path):
    store = FolderBackend(tmp_path, ttl=0.2)
    assert store.put("old", b"value")
    path = store.file_of("old")
    time.sleep(0.3)
    assert store.get("old") is None and not path.exists()


def test_eviction_sees_what_other_processes_did_since_it_last_listed(tmp_path):
    """The evicting store keeps listings between puts (``FolderIndex``); another store on the
    folder (as another process would) writes an entry and uses an old one after those listings
    settled. Eviction must count the new entry and spare the entry just used."""
    evicting, other = FolderBackend(tmp_path, max_bytes=100), FolderBackend(tmp_path)
    for key in "abc":
        assert evicting.put(key, key.encode() * 30)
    time.sleep(0.6)  # past the index's racy margin: listings from now on are trusted
    assert evicting.put("w", b"w")  # 91 bytes: lists every folder, evicts nothing
    time.sleep(0.6)
    assert other.get("a") == b"a" * 30  # a use: only the file's atime changes, not its folder
    # 121 bytes, written behind the index's back into a folder it has listed already
    e = next(key for key in (f"e{i}" for i in range(10_000)) if fan_of(key) == fan_of("c"))
    assert other.put(e, b"e" * 30)
    assert evicting.put("f", b"f")  # 122: the least recently used is b, not a
    assert evicting.contains_many(["a", "b", "c", "w", e, "f"]) == [True, False, True, True, True, True]
    assert evicting.nbytes() == 92


def test_a_change_within_the_clock_tick_of_a_listing_is_not_missed(tmp_path):
    """Folder mtimes come from a coarse clock: a write right after a listing can leave the mtime
    as the listing saw it (simulated here by setting it back). The index must list again."""
    evicting, other = FolderBackend(tmp_path, max_bytes=100), FolderBackend(tmp_path)
    assert evicting.put("a", b"a" * 30) and evicting.put("b", b"b" * 30)
    assert evicting.put("c", b"c" * 30)  # lists c's folder just after changing it
    fan = evicting.path / fan_of("c")
    seen = fan.stat()
    e = next(key for key in (f"e{i}" for i in range(10_000)) if fan_of(key) == fan_of("c"))
    assert other.put(e, b"e" * 30)
    os.utime(fan, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    assert evicting.put("f", b"f" * 11)  # 131 bytes: a and b go
    assert evicting.contains_many(["a", "b", "c", e, "f"]) == [False, False, True, True, True]
