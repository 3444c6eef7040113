"""Print the README's "Numbers" section from the committed suite results in benchmarks/results/.

    python benchmarks/summarize.py > /tmp/numbers.md
"""

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load(name):
    return json.loads((RESULTS / f"{name}.json").read_text())


def rows_by(result, *keys):
    return {tuple(r[k] for k in keys): r for r in result["rows"]}


def main() -> None:
    u, d, a, m, r, b = (load(n) for n in ("update", "decode", "attention", "memory", "resume", "bounded"))
    ur = rows_by(u, "contender", "tokens")
    dr = rows_by(d, "variant", "context", "contender")
    ar = rows_by(a, "variant", "tokens", "contender")
    mr = rows_by(m, "contender")
    rr = rows_by(r, "contender", "tokens")
    top = max(u["config"]["lengths"])
    flat = u["flatness_max_over_min"]["growable"]
    g16 = ur[("growable", top)]
    ours = "growable+attend"

    def dec(variant, ctx, name=ours):
        return dr[(variant, ctx, name)]

    def vs_static(variant, ctx):
        return dec(variant, ctx)["tokens_per_s"] / dec(variant, ctx, "hf_static")["tokens_per_s"] - 1

    identical = all(row["identical_to_dynamic"] for row in d["rows"])
    att = {v: ar[(v, 16384, "attend")]["bandwidth_fraction"] for v in ("mha", "gqa")}
    sdpa = {v: ar[(v, 16384, "sdpa")]["bandwidth_fraction"] for v in ("mha", "gqa")}
    print("| suite | target | measured | met |")
    print("|---|---|---|---|")
    print(
        f"| update | ours >= 50x concat per token at 16K, flat (max/min <= 2x) | "
        f"{g16['speedup_vs_concat']:,.0f}x; max/min {flat:.2f}x | yes |"
    )
    print(
        f"| decode | >= 1.5x DynamicCache at 4K | MHA {dec('mha', 4096)['speedup_vs_dynamic']:.2f}x, "
        f"GQA {dec('gqa', 4096)['speedup_vs_dynamic']:.2f}x | yes |"
    )
    print(
        f"| decode | >= 2x DynamicCache at 16K | MHA {dec('mha', 16384)['speedup_vs_dynamic']:.2f}x, "
        f"GQA {dec('gqa', 16384)['speedup_vs_dynamic']:.2f}x | yes |"
    )
    worst = min((vs_static(v, c), v, c) for v in ("mha", "gqa") for c in d["config"]["contexts"])
    margin = "ahead everywhere, smallest lead" if worst[0] >= 0 else "worst"
    print(
        f"| decode | never slower than HF StaticCache | {margin} {worst[0]:+.1%} ({worst[1]} at {worst[2]}) | "
        f"{'yes' if worst[0] >= 0 else 'no'} |"
    )
    print(f"| decode | identical tokens | {'all contexts and variants' if identical else 'NO'} | {'yes' if identical else 'no'} |")
    print(
        f"| attention | >= 50% of read bandwidth at 16K | attend MHA {att['mha']:.0%}, GQA {att['gqa']:.0%} "
        f"(SDPA {sdpa['mha']:.0%}, {sdpa['gqa']:.0%}) | no |"
    )
    bounded_targets(b)
    print()
    print(f"**Decode through `generate`** (`kvcache bench decode`; tokens/s, median of {d['config']['repeats']}; "
          "ours = growable cache + the `kvcache` attention):")
    print()
    print("| model | context | DynamicCache | HF StaticCache | ours | ours vs DynamicCache | growable + sdpa |")
    print("|---|---|---|---|---|---|---|")
    for v, heads in d["config"]["variants"].items():
        for c in d["config"]["contexts"]:
            print(
                f"| {v} ({heads}q/8kv) | {c} | {dec(v, c, 'dynamic')['tokens_per_s']:.1f} | "
                f"{dec(v, c, 'hf_static')['tokens_per_s']:.1f} | {dec(v, c)['tokens_per_s']:.1f} | "
                f"{dec(v, c)['speedup_vs_dynamic']:.2f}x | {dec(v, c, 'growable')['tokens_per_s']:.1f} |"
            )
    print()
    print(f"**Append cost per token** (`kvcache bench update`; B=1, 8 KV heads x 128; µs/token, median of {u['config']['repeats']}):")
    print()
    print("| T | concat | fixed +256 | HF StaticLayer | growable | static | growable reallocations |")
    print("|---|---|---|---|---|---|---|")
    for t in u["config"]["lengths"]:
        c = [ur[(n, t)]["us_per_token"] for n in ("concat", "step256", "hf_static", "growable", "static")]
        print(f"| {t} | {c[0]:,.0f} | {c[1]:.0f} | {c[2]:.0f} | {c[3]:.0f} | {c[4]:.0f} | {ur[('growable', t)]['reallocations']} |")
    print()
    bw = a["read_bandwidth_bytes_per_s"] / 1e9
    print(f"**Decode attention** (`kvcache bench attention`; one query token, 8 KV heads x 128, fp32; "
          f"fraction of the {bw:.0f} GB/s read bandwidth measured in the same run):")
    print()
    print("| T | MHA: SDPA | MHA: attend | GQA-4: SDPA | GQA-4: attend |")
    print("|---|---|---|---|---|")
    for t in a["config"]["lengths"]:
        f = [ar[(v, t, n)]["bandwidth_fraction"] for v in ("mha", "gqa") for n in ("sdpa", "attend")]
        print(f"| {t} | " + " | ".join(f"{x:.0%}" for x in f) + " |")
    print()
    tm = m["rows"][0]["tokens"]
    print(f"**Memory over {tm:,} tokens** (`kvcache bench memory`; 4 layers x 8 KV heads x 128, fp32; one token per step):")
    print()
    print("| cache | peak process memory / cache size | reallocations | spikes |")
    print("|---|---|---|---|")
    for n in ("concat", "step256", "growable", "static"):
        row = mr[(n,)]
        star = " *" if row.get("counts_extrapolated") else ""
        print(f"| {n}{star} | {row['peak_rss_over_needed']:.2f} | {row['reallocations']} | {row['spikes']} |")
    print()
    print("\\* counted by the rule every concat append reallocates, checked on 64 real steps (see benchmarks/results/memory.md).")
    print()
    print("**Save and load** (`kvcache bench resume`; 1 layer x 8 KV heads x 128, fp32; ms, median of 7; "
          "the floor is plain safetensors without checksums):")
    print()
    print("| tokens | file | save | load | save / floor | load / floor |")
    print("|---|---|---|---|---|---|")
    for t in sorted({k[1] for k in rr}):
        row = rr[("kvcache", t)]
        print(f"| {t} | {row['file_bytes'] / 2**20:.0f} MiB | {row['save_ms']:.1f} | {row['load_ms']:.1f} | "
              f"{row['save_x_floor']:.2f}x | {row['load_x_floor']:.2f}x |")
    bounded_tables(b)


BOUNDED = ("window", "lastrec", "h2o", "tova", "h2o-int8", "quantized-int8", "quantized-int4")


def bounded_targets(b) -> None:
    dec = rows_by({"rows": [x for x in b["rows"] if x["part"] == "decode"]}, "variant", "context", "contender")
    byt = rows_by({"rows": [x for x in b["rows"] if x["part"] == "bytes"]}, "contender", "tokens")
    bw = rows_by({"rows": [x for x in b["rows"] if x["part"] == "bandwidth"]}, "variant", "tokens", "contender")
    top = max(b["config"]["decode"]["contexts"])
    best = {v: max(dec[(v, top, n)]["speedup_vs_growable"] for n in BOUNDED) for v in ("mha", "gqa")}
    print(
        f"| bounded | >= 5x the full growable cache at 16K with a 1K budget | best GQA {best['gqa']:.2f}x, "
        f"MHA {best['mha']:.2f}x (window; h2o GQA {dec[('gqa', top, 'h2o')]['speedup_vs_growable']:.2f}x) | no |"
    )
    int4 = byt[("quantized-int4", 4096)]["ratio_to_fp16"]
    print(f"| bounded | int4 storage <= 0.30x fp16 at 4K | {int4:.3f}x | {'yes' if int4 <= 0.30 else 'no'} |")
    q = {bits: bw[("gqa", 16384, f"quantized-int{bits}")]["bandwidth_fraction"] for bits in (8, 4)}
    print(
        f"| bounded | decode attention on quantized storage, fraction of read bandwidth (bytes read) | "
        f"GQA at 16K: int8 {q[8]:.0%}, int4 {q[4]:.0%} (fp32 growable {bw[('gqa', 16384, 'growable')]['bandwidth_fraction']:.0%}) | reported |"
    )


def bounded_tables(b) -> None:
    rows = [x for x in b["rows"] if x["part"] == "decode"]
    dec = rows_by({"rows": rows}, "variant", "context", "contender")
    c = b["config"]["decode"]
    print()
    print(
        f"**Bounded caches in `generate`** (`kvcache bench bounded`; {c['new_tokens']} tokens after the prefill, "
        f"budget/window {c['budget']}; tokens/s, median of {c['repeats']}, and the ratio to the full growable cache):"
    )
    print()
    print("| model | context | growable | " + " | ".join(BOUNDED) + " |")
    print("|---|---|---|" + "---|" * len(BOUNDED))
    for v in ("gqa", "mha"):
        for ctx in c["contexts"]:
            cells = [f"{dec[(v, ctx, n)]['tokens_per_s']:.1f} ({dec[(v, ctx, n)]['speedup_vs_growable']:.2f}x)" for n in BOUNDED]
            print(f"| {v} | {ctx} | {dec[(v, ctx, 'growable')]['tokens_per_s']:.1f} | " + " | ".join(cells) + " |")
    byt = rows_by({"rows": [x for x in b["rows"] if x["part"] == "bytes"]}, "contender", "tokens")
    lengths = b["config"]["bytes"]["lengths"]
    print()
    print("**Bytes per token** (fp16, 4 layers x 8 KV heads x 128; everything allocated: codes, scales, "
          "residual, positions and scores; x = ratio to an fp16 cache holding exactly T tokens):")
    print()
    print("| kind | " + " | ".join(f"T={t}" for t in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for n in ("static", "growable", *BOUNDED):
        print(f"| {n} | " + " | ".join(f"{byt[(n, t)]['bytes_per_token']:,.0f} ({byt[(n, t)]['ratio_to_fp16']:.3f}x)" for t in lengths) + " |")
    bw = rows_by({"rows": [x for x in b["rows"] if x["part"] == "bandwidth"]}, "variant", "tokens", "contender")
    print()
    print("**Decode attention over quantized storage** (one token: update + attend, fp32; bytes actually read: "
          "codes, scales, minimums, residual; fraction of the read bandwidth measured in the same run):")
    print()
    print("| model | T | growable fp32 | int8 | int4 |")
    print("|---|---|---|---|---|")
    for v in ("gqa", "mha"):
        for t in b["config"]["bandwidth"]["lengths"]:
            cells = [
                f"{bw[(v, t, n)]['ms']:.1f} ms, {bw[(v, t, n)]['bandwidth_fraction']:.0%}"
                for n in ("growable", "quantized-int8", "quantized-int4")
            ]
            print(f"| {v} | {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
