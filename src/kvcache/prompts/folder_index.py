"""The folder backend's view of its folder: listing entry files, and evicting the least recently
used ones without stating every file on every put.

A full listing stats each entry file (about 50 ms at 10k entries on a busy machine). The
``FolderIndex`` keeps, per fan-out folder, what its last listing found, and lists a folder again
only when its mtime moved (every write is a rename into it, every eviction an unlink from it) or
when that listing began too soon after the mtime to be sure: the kernel stamps folders with a
coarse clock, so a change within the same tick would leave the mtime as it was. Use times change
without touching the folder (a ``get`` sets the file's atime), but they only grow, so a listed
use time is a lower bound: eviction pops the entry with the oldest listed use, stats that one
file, and deletes it only if its use time is still the listed one, else queues it again with the
real one. It deletes the same files as a full scan would.
"""

from __future__ import annotations

import heapq
import os
import re
import stat
import threading
import time
from typing import NamedTuple

from ..persist.atomic import sweep_temps

SUFFIX = ".kvp"
RACY_NS = 500_000_000  # a listing begun this soon after its folder's mtime is not trusted later
_FAN = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.([A-Za-z0-9_-][A-Za-z0-9_.-]*\.kvp)\.[A-Za-z0-9-]*~\d+~[A-Za-z0-9_]+\.tmp")


class Listed(NamedTuple):
    """One entry file as listed; tuples order by last use (then path), the eviction order."""

    used_ns: int  # atime: the last get or put
    path: str
    size: int
    written_ns: int  # mtime: the last put
    inode: int


def fan_folders(root: str) -> list[str]:
    """The fan-out sub-folders of ``root`` (raises ``OSError`` if ``root`` cannot be listed)."""
    with os.scandir(root) as items:
        return [item.path for item in items if _FAN.fullmatch(item.name) and item.is_dir(follow_symlinks=False)]


def remove_if_same(path: str, listed_inode: int, listed_written_ns: int) -> None:
    """Remove an entry file unless a writer replaced it since it was listed (best effort)."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if (now.st_ino, now.st_mtime_ns) == (listed_inode, listed_written_ns):
            os.unlink(path)
    except OSError:
        pass


def list_fan(fan: str, written_before_ns: int = 0) -> list[Listed]:
    """The live entry files of one fan-out folder. On the way it removes the expired ones (last
    written before ``written_before_ns``) and sweeps temporary folders that killed writers left.
    Files that vanish meanwhile are skipped."""
    found = []
    try:
        with os.scandir(fan) as items:
            items = list(items)
    except OSError:
        return found  # removed meanwhile, or not ours to read
    for item in items:
        if item.name.endswith(SUFFIX):
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            if info.st_mtime_ns < written_before_ns:
                remove_if_same(item.path, info.st_ino, info.st_mtime_ns)
                continue
            found.append(Listed(info.st_atime_ns, item.path, info.st_size, info.st_mtime_ns, info.st_ino))
        elif (match := _TEMP.fullmatch(item.name)) is not None:
            sweep_temps(os.path.join(fan, match[1]))
    return found


class FolderIndex:
    """Listings of one store folder's fan-out folders, kept between evictions (one per backend
    object; other processes' changes show in the folders' mtimes)."""

    def __init__(self, root: str):
        self.root = root
        self._fans: dict[str, tuple[int, int, list[Listed], int]] = {}  # fan -> (mtime_ns, listed_at_ns, entries, bytes)
        self._lock = threading.Lock()

    def _listings(self, written_before_ns: int) -> list[tuple[int, int, list[Listed], int]]:
        fans = fan_folders(self.root)
        listings = []
        for fan in fans:
            try:
                mtime = os.stat(fan, follow_symlinks=False).st_mtime_ns
            except OSError:
                self._fans.pop(fan, None)
                continue
            known = self._fans.get(fan)
            if known is None or known[0] != mtime or known[1] - mtime < RACY_NS:
                listed_at = time.time_ns()
                entries = list_fan(fan, written_before_ns)
                known = (mtime, listed_at, entries, sum(entry.size for entry in entries))
                self._fans[fan] = known
            listings.append(known)
        for gone in set(self._fans) - set(fans):
            del self._fans[gone]
        return listings

    def evict(self, budget: int, written_before_ns: int = 0) -> None:
        """Delete the least recently used entry files until their sizes total at most ``budget``,
        and those last written before ``written_before_ns`` (expired) first. Raises ``OSError``
        if the folder cannot be listed or a file cannot be deleted."""
        with self._lock:
            listings = self._listings(written_before_ns)
            total = sum(listing[3] for listing in listings)
            if total <= budget:
                return
            queue = [entry for listing in listings for entry in listing[2]]
            if written_before_ns > 0:  # expired since listed: they go first, whatever their use
                for entry in [entry for entry in queue if entry.written_ns < written_before_ns]:
                    remove_if_same(entry.path, entry.inode, entry.written_ns)
                    total -= entry.size
                queue = [entry for entry in queue if entry.written_ns >= written_before_ns]
            heapq.heapify(queue)
            while total > budget and queue:
                entry = heapq.heappop(queue)
                used, path = entry.used_ns, entry.path
                try:
                    info = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    total -= entry.size  # another process evicted it first
                    continue
                if not stat.S_ISREG(info.st_mode):  # something else planted under the name: not ours
                    total -= entry.size
                    continue
                if info.st_ino != entry.inode or info.st_atime_ns > used:  # rewritten or used since listed
                    total += info.st_size - entry.size
                    heapq.heappush(queue, Listed(info.st_atime_ns, path, info.st_size, info.st_mtime_ns, info.st_ino))
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                total -= entry.size
                self._fans.pop(os.path.dirname(path), None)
