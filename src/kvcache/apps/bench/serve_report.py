"""What suite ``serve`` reports: one row per (server, client count) from its load (``rows``), the
replicas' medians (``replica_rows``), the ratios and the issue's targets (``summarize``), the
markdown (``table``) and the plot (``plot``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .common import figure, markdown_table, median
from .engine_report import MET, percentile, times, verdict
from .serve_workload import ChatTexts, Load

OURS, PEER = "kvcache", "transformers"
#: The issue's targets at ``TARGET_CLIENTS`` clients: output tokens/s over transformers' at least
#: ``OVER_PEER``, TTFT p99 at most ``TTFT_P99_OF_PEER`` of transformers'.
TARGET_CLIENTS, OVER_PEER, TTFT_P99_OF_PEER = 16, 1.5, 0.5
#: What each replica of the Redis part does.
ROLES = {
    "A": "computes request 0 (the system message, user message 0) and stores its prompt in Redis",
    "B": "a fresh replica on the same Redis database: request 1 (the same system message, user message 1)",
    "C": "a fresh replica with no prompt store: request 1",
}
#: The measured fields of a load row (None where it could not run).
MEASURED = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "wall_s",
            "tokens_per_request")  # fmt: skip


def load_row(name: str, load: Load) -> dict[str, Any]:
    """One load's numbers: requests done (no error) and output tokens over the load's wall time (its
    start to the last request's end), TTFT and inter-token latency percentiles over its done requests,
    errors (any non-200, error event or broken stream)."""
    head = {"contender": name, "clients": load.clients}
    if load.reason:
        return head | dict.fromkeys(MEASURED) | {"errors": 0, "requests_done": 0, "error_samples": [], "samples": [],
                                                   "reason": load.reason}  # fmt: skip
    done = [x for x in load.samples if not x.error]
    wall = max(x.end for x in load.samples) - load.start
    tokens = sum(x.tokens for x in done)
    ttft = [x.ttft_s for x in done if x.ttft_s is not None]
    gaps = [g for x in done for g in x.gaps_s()]
    return head | {
        "requests_per_s": len(done) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99),
        "wall_s": wall,
        "tokens_per_request": tokens / len(done) if done else None,
        "errors": len(load.samples) - len(done),
        "requests_done": len(done),
        "window_s": load.window_s,
        "error_samples": [x.error for x in load.samples if x.error][:3],
        "warm_up": [x.summary() for x in load.warm_up],
        "samples": [x.summary() for x in load.samples],
        "reason": "",
    }


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(table_rows: list[dict[str, Any]], judged: bool) -> dict[str, Any]:
    """Per client count: kvcache's output tokens/s over transformers' and over kvcache+int8's, its
    TTFT p99 over transformers'; the targets at 16 clients (a verdict only when ``judged``)."""
    by = {(r["contender"], r["clients"]): r for r in table_rows if not r["reason"]}
    ratios = []
    for clients in dict.fromkeys(r["clients"] for r in table_rows):
        ours, peer, int8 = (by.get((n, clients), {}) for n in (OURS, PEER, "kvcache+int8"))
        ratios.append({
            "clients": clients,
            "tokens_over_peer": _ratio(ours.get("output_tokens_per_s"), peer.get("output_tokens_per_s")),
            "ttft_p99_of_peer": _ratio(ours.get("ttft_p99_s"), peer.get("ttft_p99_s")),
            "int8_tokens_over_ours": _ratio(int8.get("output_tokens_per_s"), ours.get("output_tokens_per_s")),
        })  # fmt: skip
    at = next((r for r in ratios if r["clients"] == TARGET_CLIENTS), None)
    met = {"tokens_over_peer": None, "ttft_p99_of_peer": None}
    if judged and at is not None:
        met = {"tokens_over_peer": verdict(at["tokens_over_peer"], OVER_PEER, at_least=True),
               "ttft_p99_of_peer": verdict(at["ttft_p99_of_peer"], TTFT_P99_OF_PEER, at_least=False)}  # fmt: skip
    return {"ratios": ratios, "target_clients": TARGET_CLIENTS, "at_target": at, "met": met,
            "errors": sum(r["errors"] for r in table_rows)}  # fmt: skip


def replica_rows(replicas: dict[str, Any], texts: ChatTexts, chunk: int) -> dict[str, Any]:
    """Per replica the median TTFT over the repeats (seconds), the cached prompt tokens its usage
    reported in each, errors; C's TTFT over B's; the least B must reuse (the system turn's whole
    chunks)."""
    out = []
    for name, role in ROLES.items():
        samples = replicas["samples"][name]
        good = [x for x in samples if not x["error"] and x["ttft_s"] is not None]
        out.append({
            "replica": name, "role": role, "ttft_s": median([x["ttft_s"] for x in good]) if good else None,
            "ttft_samples_s": [x["ttft_s"] for x in good], "e2e_s": median([x["e2e_s"] for x in good]) if good else None,
            "cached_tokens": [x["cached_tokens"] for x in samples], "errors": len(samples) - len(good), "samples": samples,
        })  # fmt: skip
    b, c = out[1]["ttft_s"], out[2]["ttft_s"]
    return {"reason": replicas["reason"], "rows": out, "cold_over_redis_ttft": _ratio(c, b),
            "least_cached_tokens": texts.system_turn // chunk * chunk}  # fmt: skip


# ---- markdown ----------------------------------------------------------------------------------


def _s(x: Any, scale: float = 1.0) -> str:
    return "—" if x is None else f"{x * scale:.3g}"


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        "# bench serve\n",
        f"Model {c['model']}; each server a subprocess on a loopback port with {c['threads']} torch thread(s), started, "
        f"warmed up (min(2, clients) requests of another system message), loaded and stopped for each client count, the "
        f"order rotated per client count. Each client sends requests one after another for {c['window_s']:g} s; every "
        f"request sent by then runs to its end. A request: a shared system message of {c['shared']} tokens ("
        f"{c['system_turn_tokens']} as its templated turn) and a distinct user message of {c['user']} tokens ("
        f"{c['user_turn_tokens']} with the assistant's opening), {c['text']}; max_tokens {c['new_tokens']}, temperature 0, "
        "streamed. The clients run in the benchmark's process (httpx, one event loop) and time every server-sent event.\n",
        *_targets(result),
        "## Concurrent clients\n",
        markdown_table(
            ["server", "clients", "requests/s", "output tokens/s", "x transformers", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
             "ITL p99 ms", "errors", "requests done", "note"],
            [_row(r, result["rows"]) for r in result["rows"]],
        ),  # fmt: skip
        *_replicas(result),
        "## How each server runs\n",
        *[f"- `{name}`: {text}" for name, text in c["configured"].items()],
        "",
        "requests/s and output tokens/s: requests done (no error) and their generated tokens (`usage.completion_tokens`) "
        "over the load's wall time, from its start to the last request's end. TTFT: request sent to the first event "
        "carrying text. ITL (inter-token latency): gaps between consecutive text events, tokens that came in one event "
        "counted 0 s apart. errors: a status other than 200, an error event, or a stream that broke or ended without a "
        "finish_reason. Greedy answers may end before max_tokens at the end-of-sequence token (tokens per request in "
        "the JSON).\n",
    ]
    return "\n".join(lines)


def _targets(result: dict[str, Any]) -> list[str]:
    summary, judged = result["summary"], result["config"]["judged"]
    note = "" if judged else " (not judged: this run is not the issue's 1,024 + 64 tokens, 64 new, 16 clients)"
    at, met = summary["at_target"] or {}, summary["met"]
    return [
        f"## Targets at {TARGET_CLIENTS} clients{note}\n",
        f"- {OURS} / {PEER} output tokens/s = {times(at.get('tokens_over_peer'))} (>= {OVER_PEER:g}x: "
        f"{MET[met['tokens_over_peer']]})",
        f"- {OURS} TTFT p99 / {PEER}' = {times(at.get('ttft_p99_of_peer'))} (<= {TTFT_P99_OF_PEER:g}x: "
        f"{MET[met['ttft_p99_of_peer']]})",
        f"- errors over every load: {summary['errors']}",
        "",
    ]


def _row(r: dict[str, Any], all_rows: list[dict[str, Any]]) -> list[Any]:
    if r["reason"]:
        return [r["contender"], r["clients"]] + ["—"] * 9 + [r["reason"]]
    peer = next((x["output_tokens_per_s"] for x in all_rows if (x["contender"], x["clients"]) == (PEER, r["clients"])), None)
    note = f"{r['tokens_per_request']:.1f} tokens/request" if r["tokens_per_request"] is not None else ""
    if r["error_samples"]:
        note += f"; first error: {r['error_samples'][0][:120]}"
    return [r["contender"], r["clients"], _s(r["requests_per_s"]), _s(r["output_tokens_per_s"]),
            times(_ratio(r["output_tokens_per_s"], peer)), _s(r["ttft_p50_s"]), _s(r["ttft_p99_s"]), _s(r["itl_p50_s"], 1e3),
            _s(r["itl_p99_s"], 1e3), r["errors"], r["requests_done"], note]  # fmt: skip


def _replicas(result: dict[str, Any]) -> list[str]:
    rep, c = result["replicas"], result["config"]
    lines = [
        "## A second replica warmed only through Redis\n",
        f"`kvcache serve --prompt-store redis://.../r --store-chunk {c['store_chunk']}` on a throwaway `redis-server`, "
        f"database r for repeat r ({c['replica_repeats']} repeat(s), medians); each replica fresh, one warm-up request of "
        "another system message before its measured one, stopped before the next starts, so Redis is all they share. "
        f"B should take at least {rep['least_cached_tokens']} prompt tokens (the system turn's whole chunks) from Redis. "
        f"C's TTFT / B's: {times(rep['cold_over_redis_ttft'])}.\n",
    ]
    if rep["reason"]:
        return [*lines, f"Not run: {rep['reason']}\n"]
    body = [[r["replica"], r["role"], _s(r["ttft_s"]), ", ".join(_s(x) for x in r["ttft_samples_s"]),
             ", ".join(str(x) for x in r["cached_tokens"]), r["errors"]] for r in rep["rows"]]  # fmt: skip
    return [*lines, markdown_table(["replica", "what it does", "TTFT s", "TTFT each repeat s", "cached tokens", "errors"], body)]


# ---- plot --------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    """Output tokens/s and TTFT p99 against clients per server; the replicas' TTFT."""
    measured = [r for r in result["rows"] if not r["reason"]]
    with figure(path, panels=3, size=(5.5, 4.5)) as (speed, ttft, replicas):
        for name in dict.fromkeys(r["contender"] for r in measured):
            mine = [r for r in measured if r["contender"] == name]
            xs = [r["clients"] for r in mine]
            speed.plot(xs, [r["output_tokens_per_s"] for r in mine], marker="o", label=name)
            ttft.plot(xs, [r["ttft_p99_s"] or math.nan for r in mine], marker="o", label=name)
        counts = sorted({r["clients"] for r in result["rows"]})
        for ax, label in ((speed, "output tokens/s"), (ttft, "TTFT p99, s")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(n) for n in counts])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            if measured:
                ax.legend(fontsize="small")
        ttft.set_yscale("log")
        speed.set_title("throughput")
        ttft.set_title("time to first token")
        rep = result["replicas"]["rows"]
        replicas.bar([r["replica"] for r in rep], [r["ttft_s"] or 0 for r in rep])
        replicas.set_ylabel("TTFT, s (median)")
        replicas.set_title("replica B warmed through Redis, C cold")
        replicas.grid(True, axis="y", alpha=0.3)
