"""What every benchmark suite shares: machine facts, timing, and writing results.

Rules the suites follow: every contender runs in the same process, contenders alternate within
each repeat (so drift and noise hit them alike), and reports give medians and ratios.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


#: Prefixes of the CPU flags that say which vector instructions the kernels may use.
VECTOR_FLAGS = ("avx", "fma", "amx", "sse4", "asimd", "sve", "neon")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(info: dict[str, Any]) -> str:
    """One line naming the CPU, its vector flags and the ISA the kernels were built for."""
    return (f"CPU: {info.get('cpu_model', '?')}, {info.get('cpu_count', '?')} cores, {info.get('torch_threads', '?')} threads; "
            f"vector flags: {info.get('vector_flags', '?')}; kernels built for: {info.get('kernel_isa', '?')}")  # fmt: skip


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import transformers

    import kvcache

    from ...attention import cpu_flags, isa

    flags = cpu_flags().split()
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "vector_flags": " ".join(f for f in flags if f.startswith(VECTOR_FLAGS)),
        "kernel_isa": isa(),
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


@functools.cache
def _evict_buffer(mib: int) -> torch.Tensor:
    return torch.ones(mib * 2**20 // 4)


def evict_caches(device: str | torch.device = "cpu", mib: int = 96) -> None:
    """Push the CPU's caches out by reading ``mib`` MiB (more than a server L3), as a model's
    weights do between one layer's attention and the next: a call timed after this reads its
    keys and values from memory, as in a decode step, not from a cache warmed by the call before.
    Nothing to do on a GPU (its L2 is small next to these reads)."""
    if not str(device).startswith("cuda"):
        _evict_buffer(mib).sum()


def clock_cold(fn: Callable[[], Any], device: str | torch.device = "cpu") -> float:
    """``clock(fn)`` after ``evict_caches``: seconds of a call whose inputs come from memory."""
    evict_caches(device)
    return clock(fn, device)


def cache_config(layers: int, kv_heads: int, head_dim: int, max_tokens: int):
    """A Llama config whose cache is ``layers`` x ``kv_heads`` x ``head_dim`` (no model is built)."""
    from ..tiny import tiny_config

    return tiny_config(
        "llama",
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max(4096, max_tokens),
    )


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


def column_table(rows: list[dict[str, Any]], columns: dict[str, str | Callable[[dict[str, Any]], Any]]) -> str:
    """``markdown_table`` of ``rows`` with one column per item of ``columns``: its header, and the
    row's key to show or a function of the row giving the cell."""
    body = [[r[cell] if isinstance(cell, str) else cell(r) for cell in columns.values()] for r in rows]
    return markdown_table(list(columns), body)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


#: The one line said when a run writes no PNG.
NO_PLOTS = "no plot: matplotlib is not installed; JSON and markdown only (pip install 'kvcache[bench]' for the PNG)"


def can_plot() -> bool:
    """Whether matplotlib can be imported (the optional ``kvcache[bench]`` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


@contextmanager
def figure(path: Path, panels: int = 1, size: tuple[float, float] = (7, 4.5)):
    """Axes for ``panels`` side-by-side plots, saved to ``path`` (PNG) and closed on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), squeeze=False)
    try:
        yield list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def finish_axes(ax, xlabel: str, ylabel: str, title: str, log_y: bool = False) -> None:
    """The house style: log2 x axis (sizes), grid, legend."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def write_files(out: Path, name: str, result: dict[str, Any], text: str,
                plot: Callable[[dict[str, Any], Path], None] | None = None) -> None:  # fmt: skip
    """``name.json`` (``result``), ``name.md`` (``text``) and, when ``plot`` is given and matplotlib
    is installed, ``name.png`` (``plot(result, path)``) in folder ``out`` (made if missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", result)
    (out / f"{name}.md").write_text(text)
    if plot is not None and can_plot():
        plot(result, out / f"{name}.png")
