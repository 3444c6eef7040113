"""What suite ``prompt`` reports from its rows: medians, sums and ratios (``summarize``), the
markdown (``table``) and the plot (``plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import figure, human_bytes, markdown_table, median

REFERENCE = "recompute"
#: The targets of issue 14, as ratios measured in one run.
TTFT_SPEEDUP_TARGET = 5.0
TTFT_SPEEDUP_PREFIX = 4096  # tokens of shared prefix the speedup and reuse targets are set at
REDIS_OVER_FOLDER_TARGET = 2.0
#: The targets of issue 23: the reuse time (cache ready) over its floor, memory and folder, and Redis's over the folder's.
REUSE_OVER_FLOOR_TARGET = {"memory": 3.0, "folder": 3.0}
REDIS_REUSE_OVER_FOLDER_TARGET = 1.5


def _measured(rows: list[dict[str, Any]], workload: str) -> dict[str, list[dict[str, Any]]]:
    """The measured rows of ``workload`` by contender, in step order (skipped contenders left out)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["workload"] == workload and not row["reason"]:
            out.setdefault(row["contender"], []).append(row)
    return out


def _chat_turns(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's chat: per turn the medians over rounds, and their sums over the turns."""
    turns = []
    for turn in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == turn]
        turns.append({"turn": turn, "prompt_tokens": mine[0]["prompt_tokens"], "reused_tokens": mine[0]["reused_tokens"]}
                     | {key: median([r[key] for r in mine]) for key in ("ttft_s", "e2e_s", "store_s")}
                     | {"identical": all(r["identical"] for r in mine), "samples_ttft_s": [r["ttft_s"] for r in mine]})
    sums = {key: sum(t[key] for t in turns) for key in ("prompt_tokens", "reused_tokens", "ttft_s", "e2e_s", "store_s")}
    return sums | {"identical": all(t["identical"] for t in turns), "turns": turns}


def summarize(rows: list[dict[str, Any]], backend_prefix: int) -> dict[str, Any]:
    """Per workload and contender: ``shared`` the first request and the medians of the others;
    ``chat`` per turn medians over rounds, and their sums; ``backends`` medians over rounds, each
    lookup part's median, the reuse time over its floor (median of the rounds' ratios), and the
    ratios the targets name (judged only at a prefix of ``TTFT_SPEEDUP_PREFIX`` tokens or more)."""
    chat = {name: _chat_turns(rs) for name, rs in _measured(rows, "chat").items()}
    shared = {
        name: {"first_ttft_s": rs[0]["ttft_s"], "first_e2e_s": rs[0]["e2e_s"], "first_reused_tokens": rs[0]["reused_tokens"],
               "ttft_s": median([r["ttft_s"] for r in rs[1:]]), "e2e_s": median([r["e2e_s"] for r in rs[1:]]),
               "reused_tokens": median([r["reused_tokens"] for r in rs[1:]]), "identical": all(r["identical"] for r in rs)}
        for name, rs in _measured(rows, "shared").items()
    }
    backends = {}
    for name, rs in _measured(rows, "backends").items():
        facts = {key: median([r[key] for r in rs]) for key in ("prompt_tokens", "reused_tokens", "ttft_s", "e2e_s", "store_s")}
        if "split_s" in rs[0]:
            facts["split_s"] = {part: median([r["split_s"][part] for r in rs]) for part in rs[0]["split_s"]}
            for key in ("read_bytes", "floor_s", "reuse_s"):
                facts[key] = median([r.get(key, float("nan")) for r in rs])
            facts["reuse_over_floor"] = median([r["reuse_s"] / r["floor_s"] for r in rs if r.get("floor_s")])
        backends[name] = facts | {"identical": all(r["identical"] for r in rs), "samples_ttft_s": [r["ttft_s"] for r in rs]}
    for group in (shared, backends):
        if REFERENCE in group:
            for facts in group.values():
                facts["ttft_speedup"] = group[REFERENCE]["ttft_s"] / facts["ttft_s"]
    stores = [n for n in backends if n != REFERENCE]
    targets = {
        "ttft_speedup_min": min((backends[n]["ttft_speedup"] for n in stores), default=None),
        "redis_over_folder": backends["redis"]["ttft_s"] / backends["folder"]["ttft_s"] if {"redis", "folder"} <= set(backends) else None,
    }
    judged = targets["ttft_speedup_min"] is not None and backend_prefix >= TTFT_SPEEDUP_PREFIX
    targets["ttft_speedup_met"] = targets["ttft_speedup_min"] >= TTFT_SPEEDUP_TARGET if judged else None
    ratio = targets["redis_over_folder"]
    targets["redis_over_folder_met"] = None if ratio is None else ratio <= REDIS_OVER_FOLDER_TARGET
    sized = backend_prefix >= TTFT_SPEEDUP_PREFIX
    for name, most in REUSE_OVER_FLOOR_TARGET.items():
        over = backends.get(name, {}).get("reuse_over_floor")
        targets[f"{name}_reuse_over_floor"] = over
        targets[f"{name}_reuse_over_floor_met"] = over <= most if over is not None and sized else None
    reuse = {n: backends.get(n, {}).get("reuse_s") for n in ("redis", "folder")}
    ratio = reuse["redis"] / reuse["folder"] if None not in reuse.values() else None
    targets["redis_reuse_over_folder"] = ratio
    targets["redis_reuse_over_folder_met"] = ratio <= REDIS_REUSE_OVER_FOLDER_TARGET if ratio is not None and sized else None
    return {"chat": chat, "shared": shared, "backends": backends, "targets": targets}


def _s(x: Any) -> str:
    return "—" if x is None else f"{x:.3g}"


def _same(x: Any) -> str:
    return "—" if x is None else "yes" if x else "**NO**"


def table(result: dict[str, Any]) -> str:
    c, summary, storage = result["config"], result["summary"], result["storage"]
    t = summary["targets"]
    bandwidth = c["read_bytes_per_s"]
    met = {True: "met", False: "**not met**", None: "not judged"}
    lines = [
        "# bench prompt\n",
        f"Model {c['model']}, {c['threads']} torch threads; store chunk {c['chunk']} tokens (chat {c['chat_chunk']}); "
        f"{c['new_tokens']} greedy new tokens per request. TTFT: {c['ttft']}. Reuse: {c['reuse']}. Contenders alternate "
        "within each step; identical: the same tokens as recompute.\n",
        "## Targets\n",
        f"At a {c['backend_prefix']}-token shared prefix (judged at {TTFT_SPEEDUP_PREFIX} tokens or more); floor: the entry bytes "
        "read / the read bandwidth of the medium, measured in this run "
        f"({', '.join(f'{name} {bw / 1e9:.1f} GB/s' for name, bw in bandwidth.items())}).\n",
        f"- reuse from memory / its floor: {_s(t['memory_reuse_over_floor'])}x (issue 23: <= {REUSE_OVER_FLOOR_TARGET['memory']:g}x: "
        f"{met[t['memory_reuse_over_floor_met']]})",
        f"- reuse from a folder / its floor (the folder's read bandwidth): {_s(t['folder_reuse_over_floor'])}x (issue 23: <= "
        f"{REUSE_OVER_FLOOR_TARGET['folder']:g}x: {met[t['folder_reuse_over_floor_met']]})",
        f"- reuse from Redis / from the folder: {_s(t['redis_reuse_over_folder'])} (issue 23: <= {REDIS_REUSE_OVER_FOLDER_TARGET:g}: "
        f"{met[t['redis_reuse_over_folder_met']]})",
        f"- TTFT, recompute / reuse (lowest over the backends): {_s(t['ttft_speedup_min'])}x (issue 14: >= {TTFT_SPEEDUP_TARGET:g}x: "
        f"{met[t['ttft_speedup_met']]})",
        f"- TTFT, Redis / folder: {_s(t['redis_over_folder'])} (issue 14: <= {REDIS_OVER_FOLDER_TARGET:g}: {met[t['redis_over_folder_met']]})",
        f"- model K/V: {human_bytes(c['kv_bytes_per_token'])} per token (fp32)\n",
    ]
    b = summary["backends"]
    if b:
        lines.append(f"## Backends: {c['backend_prefix']}-token prefix + a {c['question_tokens']}-token question, median of {c['repeats']}\n")
        head = ["contender", "reused", "TTFT s", "x recompute", "e2e s", "fetch ms", "open ms", "assemble ms", "reuse ms", "read",
                "floor ms", "x floor", "prefill+1st ms", "put s", "stored B/token", "x K/V", "identical", "note"]
        body = []
        for name in [r["contender"] for r in result["rows"] if r["workload"] == "backends" and r["round"] == 1]:
            facts, held = b.get(name), storage.get(name, {})
            note = next((r["reason"] for r in result["rows"] if r["workload"] == "backends" and r["contender"] == name and r["reason"]), "")
            if facts is None:
                body.append([name] + ["—"] * (len(head) - 2) + [note])
                continue
            split = {k: v * 1e3 for k, v in facts.get("split_s", {}).items()}
            body.append([name, facts["reused_tokens"], _s(facts["ttft_s"]), _s(facts.get("ttft_speedup")), _s(facts["e2e_s"]),
                         _s(split.get("fetch")), _s(split.get("open")), _s(split.get("assemble")), _ms(facts.get("reuse_s")),
                         human_bytes(facts["read_bytes"]) if "read_bytes" in facts else "—", _ms(facts.get("floor_s")),
                         _s(facts.get("reuse_over_floor")), _s(split.get("prefill_first_token")),
                         _s(held.get("put_s")), _s(held.get("bytes_per_token")), _s(held.get("over_kv")), _same(facts["identical"]), note])
        lines.append(markdown_table(head, body))
    sh = summary["shared"]
    if sh:
        lines.append(f"## Shared system prompt: {c['shared_prefix']} tokens + {c['requests']} different questions (store: memory)\n")
        head = ["contender", "request 1 TTFT s", "request 1 e2e s", f"TTFT s, median 2-{c['requests']}", "e2e s, median", "reused", "x recompute", "identical"]
        body = [[n, _s(f["first_ttft_s"]), _s(f["first_e2e_s"]), _s(f["ttft_s"]), _s(f["e2e_s"]), f["reused_tokens"], _s(f.get("ttft_speedup")), _same(f["identical"])]
                for n, f in sh.items()]
        lines.append(markdown_table(head, body))
    chat = summary["chat"]
    if {REFERENCE, "memory"} <= set(chat):
        lines.append(f"## Chat: {c['turns']} turns, each reusing the earlier ones (store: memory, chunk {c['chat_chunk']}), median of {c['chat_rounds']}\n")
        head = ["turn", "prompt", "reused", "TTFT recompute s", "TTFT store s", "x", "e2e recompute s", "e2e store s", "put s", "identical"]
        body = []
        for ref, mine in zip(chat[REFERENCE]["turns"] + [chat[REFERENCE]], chat["memory"]["turns"] + [chat["memory"]]):
            body.append([mine.get("turn", "sum"), mine["prompt_tokens"], mine["reused_tokens"], _s(ref["ttft_s"]), _s(mine["ttft_s"]),
                         _s(ref["ttft_s"] / mine["ttft_s"]), _s(ref["e2e_s"]), _s(mine["e2e_s"]), _s(mine["store_s"]), _same(mine["identical"])])
        lines.append(markdown_table(head, body))
    lines.append("fetch: backend reads; open: checking entry headers; assemble: the rest of `cache_for`, mostly copying the entries into "
                 "the cache's buffers with their digests checked on the way; reuse: all of `cache_for` (the cache ready); prefill+1st: "
                 "`generate` up to the first new token. floor: entry bytes read / the medium's read bandwidth; x floor: reuse / floor "
                 "(median of the rounds' ratios). stored B/token: backend bytes / tokens stored; x K/V: that over the model's fp32 K/V "
                 "bytes per token.\n")
    return "\n".join(lines)


def _ms(seconds: Any) -> str:
    return "—" if seconds is None else _s(seconds * 1e3)


def plot(result: dict[str, Any], path: Path) -> None:
    b, chat = result["summary"]["backends"], result["summary"]["chat"]
    with figure(path, panels=2) as (bars, turns):
        names = list(b)
        heights = [b[n]["ttft_s"] for n in names]
        if names:
            bars.bar(names, heights, color=["tab:gray" if n == REFERENCE else "tab:blue" for n in names])
            bars.set_yscale("log")
            bars.set_ylim(min(heights) / 4, max(heights) * 2)
        for x, name in enumerate(names):
            label = f"{b[name]['ttft_s']:.2g} s" + ("" if name == REFERENCE else f"\n{b[name]['ttft_speedup']:.1f}x faster")
            bars.annotate(label, (x, b[name]["ttft_s"]), textcoords="offset points", xytext=(0, 3), ha="center", fontsize="small")
        bars.set_ylabel("time to first token, s (median)")
        bars.set_title(f"{result['config']['backend_prefix']}-token shared prefix, by backend")
        bars.grid(True, axis="y", which="both", alpha=0.3)
        for name, label in ((REFERENCE, "recompute"), ("memory", "prompt store (memory)")):
            mine = chat.get(name, {}).get("turns", [])
            turns.plot([t["turn"] for t in mine], [t["ttft_s"] for t in mine], marker="o", label=label)
        turns.set_yscale("log")
        turns.set_xlabel("chat turn")
        turns.set_ylabel("time to first token, s (median)")
        turns.set_title("multi-turn chat")
        turns.grid(True, which="both", alpha=0.3)
        turns.legend(fontsize="small")
