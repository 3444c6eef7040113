"""What every benchmark suite shares: machine facts, timing, and writing results.

Rules the suites follow: every contender runs in the same process, contenders alternate within
each repeat (so drift and noise hit them alike), and reports give medians and ratios.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import transformers

    import kvcache

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvcache": kvcache.__version__,
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def sync(device: str | torch.device = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def clock(fn: Callable[[], Any], device: str | torch.device = "cpu") -> float:
    """Seconds one call of ``fn`` takes (synchronising a GPU before and after)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def read_bandwidth(device: str = "cpu", mib: int = 512, repeats: int = 5) -> float:
    """Measured read bandwidth in bytes/s: summing a ``mib`` MiB fp32 tensor, median of repeats."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    x.sum()  # touch the pages once
    seconds = median([clock(x.sum, device) for _ in range(repeats)])
    return x.nbytes / seconds


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
