"""The manifest of a converted model folder: where it came from and every file's size and sha256,
written at conversion time. Sizes are checked on every use (a stat per file); the hashes, which
take seconds for half a gigabyte, on request (``verify=True``, ``kvcache models verify``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelUnavailableError
from .catalog import ModelEntry
from .fetch import sha256_of

MANIFEST = "kvcache-model.json"
FORMAT = 1


def write_manifest(folder: Path, entry: ModelEntry) -> dict[str, Any]:
    """Hash every file in ``folder`` and write the manifest beside them; returns it."""
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": sha256_of(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {
        "format": FORMAT,
        "name": entry.name,
        "source": {"package": entry.package, "version": entry.version, "wheel": entry.wheel, "sha256": entry.sha256},
        "member": entry.member,
        "converter": entry.converter,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelUnavailableError(_unusable(folder, f"it has no {MANIFEST}")) from None
    except (OSError, ValueError) as e:
        raise ModelUnavailableError(_unusable(folder, f"its {MANIFEST} cannot be read ({e})")) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ModelUnavailableError(_unusable(folder, f"its {MANIFEST} is not a format-{FORMAT} kvcache manifest"))
    return manifest


def check_folder(folder: Path, entry: ModelEntry, full: bool = False) -> dict[str, Any]:
    """Refuse ``folder`` unless it is ``entry``'s conversion with every file at its recorded size
    (and, if ``full``, its recorded sha256); returns the manifest."""
    manifest = read_manifest(folder)
    source = manifest.get("source") or {}
    if manifest.get("name") != entry.name or source.get("sha256") != entry.sha256:
        raise ModelUnavailableError(
            _unusable(folder, f"it was converted from {source.get('wheel')!r} for {manifest.get('name')!r}, "
                      f"expected {entry.wheel} for {entry.name}")  # fmt: skip
        )
    for name, recorded in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ModelUnavailableError(_unusable(folder, f"{name} is missing"))
        size = path.stat().st_size
        if size != recorded.get("size"):
            raise ModelUnavailableError(_unusable(folder, f"{name} has {size} bytes, expected {recorded.get('size')}"))
        if full and (got := sha256_of(path)) != recorded.get("sha256"):
            raise ModelUnavailableError(
                _unusable(folder, f"{name} changed since conversion: sha256 {got}, expected {recorded.get('sha256')}")
            )
    return manifest


def folder_bytes(manifest: dict[str, Any]) -> int:
    return sum(int(f.get("size", 0)) for f in manifest["files"].values())


def _unusable(folder: Path, why: str) -> str:
    return (
        f"the converted model at {folder} is not usable: {why}; delete the folder or convert it again "
        f"(refresh=True, or kvcache models get {folder.name} --refresh)"
    )
