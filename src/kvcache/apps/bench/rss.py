"""This process's resident memory (RSS), read from ``/proc``: now, and its peak over a window.

:func:`current_rss` is the resident set now (``/proc/self/statm``, in bytes). :class:`PeakRSS` is the
peak between two calls: the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``), read and
reset (``/proc/self/clear_refs`` = 5) at each call, so that it sees transient peaks inside a step;
where the mark cannot be reset, ``ru_maxrss`` of the process (its peak since it started). The
``memory`` and ``prefill`` suites measure with them. Linux only.
"""

from __future__ import annotations

import os
import resource

#: Bytes per memory page (``/proc/self/statm`` counts pages).
PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss() -> int:
    """Bytes of this process resident in memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak RSS per window: the kernel's high-water mark, read and reset at each sample."""

    def __init__(self) -> None:
        self.method = "VmHWM reset per sample window (/proc/self/clear_refs)"
        try:
            self._reset()
            self._hwm()
        except OSError:
            self.method = "ru_maxrss of a fresh process (high-water mark not resettable)"

    @property
    def resettable(self) -> bool:
        return self.method.startswith("VmHWM")

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM in /proc/self/status")

    def window_peak(self) -> int:
        """Peak RSS since the previous call (or since ``start``), and start a new window."""
        if not self.resettable:
            return max(current_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        peak = self._hwm()
        self._reset()
        return peak

    start = window_peak
