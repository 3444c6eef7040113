"""SmolLM2's 211 linear layers (its 30 blocks and the LM head, distinct weights, so they stream
from memory as in a step) at decode and prompt row counts: the panel library (``hf.panels``)
against oneDNN on its packed weights (``torch.ops.mkldnn``, what ``PackedLinears`` used before)
and ``F.linear``, alternated call by call, medians of ``--calls`` passes over all layers.

    .venv/bin/python benchmarks/panel_linears.py [--rows 1,4,16,32,64,512] [--calls 9] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.workload import load_model
from kvcache.hf import panels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,512")
    p.add_argument("--calls", type=int, default=9)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model, _, _ = load_model("smollm2")
    model.to(dtype)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [panels.pack(m.weight) for m in layers]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), batch_size=16) for m in layers]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    print(f"{machine_line(machine_info())}; {len(layers)} layers, {weight_bytes / 2**20:.0f} MiB of {args.dtype} weights")
    print("| rows | panels | oneDNN packed | F.linear | panels / oneDNN | panels' weight stream |")
    print("|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = {k: torch.randn(rows, k).to(dtype) for k in {m.in_features for m in layers}}
        contenders = {
            "panels": lambda: [panels.run(x[m.in_features], w, m.out_features, None) for m, w in zip(layers, packed)],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x[m.in_features], w, None, "none", [], "")
                               for m, w in zip(layers, onednn)],  # fmt: skip
            "blas": lambda: [F.linear(x[m.in_features], m.weight) for m in layers],
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        with torch.inference_mode():
            for run in contenders.values():
                run()
            for _ in range(args.calls):
                for name, run in contenders.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {rows} | {ms['panels']:.1f} ms | {ms['onednn']:.1f} ms | {ms['blas']:.1f} ms | "
              f"{ms['onednn'] / ms['panels']:.2f}x | {weight_bytes / ms['panels'] / 1e6:.1f} GB/s |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
