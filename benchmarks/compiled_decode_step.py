"""Issue 58: what compiling an engine decode step as one graph gives on the CPU, before the engine
does it.

The model (SmolLM2-135M-Instruct, fp32) runs one decode step of ``--rows`` rows, each after
``--context`` tokens already in a paged pool (random keys and values, blocks of 32). The attention
is a function registered with transformers that writes the step's keys and values into the pool
with an index assignment and reads the pool through ``torch.ops.kvcache.paged_decode``
(``attention/graph_ops.py``). The step's tensors (slots, block tables, lengths) come in as the
forward's keyword arguments. So ``torch.compile(fullgraph=True)`` takes the whole forward as one
graph: inductor with weights frozen (it packs the linear layers for oneDNN itself).

The same function runs eagerly with the engine's packed linear layers (``PackedLinears``),
alternated with the compiled one in one process. It prints the medians and whether the two pick
the same next tokens. Every row reads the whole prefix here (there is no shared-prefix pass), so
the step is longer than the engine's.

    .venv/bin/python benchmarks/compiled_decode_step.py [--rows 16] [--context 1088] [--rounds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch._inductor.config
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.workload import load_model
from kvcache.attention import graph_ops
from kvcache.hf.linears import PackedLinears

BLOCK = 32


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=1088)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    print(machine_line(machine_info()))
    torch.manual_seed(0)
    ops = graph_ops.register()
    model, _, _ = load_model("smollm2")
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    dim = c.hidden_size // heads
    rows, position = args.rows, args.context
    per_row = position // BLOCK + 1
    pools = [(torch.randn(rows * per_row, kv_heads, BLOCK, dim), torch.randn(rows * per_row, kv_heads, BLOCK, dim))
             for _ in range(c.num_hidden_layers)]  # fmt: skip
    tables = torch.arange(rows * per_row, dtype=torch.int32).reshape(rows, per_row)
    step = {
        "blocks": tables[:, position // BLOCK].long(),
        "offsets": torch.full((rows,), position % BLOCK, dtype=torch.long),
        "tables": tables,
        "lengths": torch.full((rows,), position + 1, dtype=torch.int64),
    }

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        s = kwargs["paged_step"]
        key_pool, value_pool = pools[module.layer_idx]
        key_pool[s["blocks"], :, s["offsets"]] = key[0].transpose(0, 1)
        value_pool[s["blocks"], :, s["offsets"]] = value[0].transpose(0, 1)
        q = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
        out = ops.paged_decode(q, key_pool, value_pool, s["tables"], s["lengths"], scaling)
        return out.reshape(1, rows, heads, dim).to(query.dtype), None

    AttentionInterface.register("paged-graph", attention)
    AttentionMaskInterface.register("paged-graph", lambda *a, **k: None)
    model.set_attn_implementation("paged-graph")
    ids = torch.randint(0, c.vocab_size, (1, rows))
    positions = torch.full((1, rows), position)

    def forward(ids, positions, step):
        return model(input_ids=ids, position_ids=positions, use_cache=False, paged_step=step).logits

    torch._inductor.config.freezing = True
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)
    packed = PackedLinears(model)
    #: name -> (the function, the context it runs in)
    contenders = {
        "compiled (one graph, inductor, frozen)": (compiled, contextlib.nullcontext),
        "eager (packed linears)": (forward, packed.active),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        started = time.perf_counter()
        first = compiled(ids, positions, step)
        print(f"compilation and first call: {time.perf_counter() - started:.1f} s")
        with packed.active():
            same = torch.equal(first.argmax(-1), forward(ids, positions, step).argmax(-1))
        for _ in range(args.rounds):
            for name, (run, context) in contenders.items():
                with context():
                    t = time.perf_counter()
                    run(ids, positions, step)
                    times[name].append(time.perf_counter() - t)
    for name, run in times.items():
        print(f"{name}: {1000 * statistics.median(run):.1f} ms a step (median of {len(run)}, alternated)")
    print(f"same next tokens: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
