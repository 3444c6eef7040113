"""What every long run (a benchmark suite, the quality harness) is told by its caller: how big a
run, where its results go, on which device, and whether to show progress."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RunOptions:
    """``quick``: a smaller run (minutes on 2 cores); ``tiny``: seconds, for tests (its numbers mean
    nothing); ``out``: the folder for ``<name>.json``/``.md``/``.png``, nothing written if None;
    ``device``: where tensors live; ``progress``: a progress bar on stderr."""

    quick: bool = False
    out: Path | None = None
    device: str = "cpu"
    progress: bool = True
    tiny: bool = False

    def pick(self, tiny: T, quick: T, full: T) -> T:
        """The value for this run's size (``tiny`` wins over ``quick``)."""
        return tiny if self.tiny else quick if self.quick else full
