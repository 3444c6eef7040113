"""Atomic writes: a file is complete or absent, never half-written.

A save writes a temporary file beside the target and renames it into place, so readers see the
complete old or the complete new file, never a mix. The temporary file sits in a temporary
folder of its own, ``.{target}.{host}~{pid}~{random}.tmp/``, because the writer may make
temporary files of its own next to the path it is given (safetensors does: ``.tmpXXXXXX``), and
a kill would leave those behind under names nobody could tell apart. A failed save removes its
folder; one left by a killed process (SIGKILL, power loss) is swept by the next save to the same
target once its process is gone (same host) or it is an hour old (another host's, on a shared
folder). Loads never look at them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import CacheSaveError

STALE_TEMP_S = 3600
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _temp_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(re.escape(f".{target.name}.") + r"([A-Za-z0-9-]*)~(\d+)~[A-Za-z0-9_]+\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def sweep_temps(target: str | os.PathLike) -> list[str]:
    """Remove temporary files that killed saves to ``target`` left behind; returns their names."""
    target = Path(target)
    pattern = _temp_pattern(target)
    swept = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return swept
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        path = target.parent / name
        try:
            stale = time.time() - path.lstat().st_mtime > STALE_TEMP_S
            if stale or (match[1] == _HOST and not _alive(int(match[2]))):
                _remove(path)
                swept.append(name)
        except OSError:
            pass  # another save swept it first, or it is not ours to remove
    return swept


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write a file with ``write(temporary_path)``, flush it to disk and rename it to ``path``.

    Raises ``CacheSaveError`` (an ``OSError``) naming ``path`` if anything fails; the old file at
    ``path`` (if any) is then intact and no temporary file is left.
    """
    target = Path(path)
    sweep_temps(target)
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix=f".{target.name}.{_HOST}~{os.getpid()}~", suffix=".tmp", dir=target.parent)
        tmp = os.path.join(folder, "data")
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        os.rmdir(folder)
    except BaseException as e:
        if folder is not None:
            _remove(Path(folder))
        if isinstance(e, OSError) and not isinstance(e, CacheSaveError):
            error = CacheSaveError(f"cannot save {target}: {e.strerror or e}")
            error.errno = e.errno
            raise error from e
        raise
    _fsync_dir(target.parent)


def _remove(path: Path) -> None:
    """Remove a temporary folder and what is in it (or a temporary file of an older version)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every system can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


