"""Suite ``train``: training through a cache (``kvcache.train.chunked_loss``) against plain training,
time per token and memory against the sequence's length.

Model: SmolLM2-135M-Instruct in fp32 with a LoRA adapter of rank 8 on q/k/v/o (peft; the base
weights frozen, as ``kvcache finetune`` trains), 2 threads. Text: the standard library's source
files (``finetune.documents``). Contenders (``CONTENDERS``), each one step's loss and backward:
``plain`` on the model's own attention (SDPA), the time to beat, at the lengths where it fits
(``plain_lengths``), and ``chunked_loss`` through h2o at 25% (both ``grad`` modes) and through
the full cache (plain training's loss and gradients, chunk by chunk).

Per (length, contender): the median seconds of ``repeats`` timed steps (contenders alternating)
after one warm-up step, tokens per second, the ratio to plain's time at that length; from the
warm-up step, the peak bytes autograd held for backward (``SavedBytes``), the archive's and the
cache states' bytes, and the process's peak resident memory over its baseline (``rss.PeakRSS``).
The goals: chunked replay at most ``GOAL_RATIO`` x plain's time per token, and its bytes held for
backward flat in the length.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..run_options import RunOptions
from .common import clock, figure, finish_axes, human_bytes, markdown_table, median
from .harness import alternate, report
from .rss import PeakRSS, current_rss

#: name -> (spec, grad) for chunked_loss; None: plain training.
CONTENDERS: dict[str, tuple[str, str] | None] = {
    "plain": None,
    "replay h2o 25%": ("h2o:budget=0.25", "replay"),
    "detach h2o 25%": ("h2o:budget=0.25", "detach"),
    "replay full": ("growable", "replay"),
}
REFERENCE = "plain"
#: Time per token of chunked replay over plain's, at most.
GOAL_RATIO = 1.5


@dataclass(frozen=True)
class Sizes:
    model: str
    lengths: tuple[int, ...]
    plain_lengths: tuple[int, ...]  # where plain training runs (fits in memory)
    chunk: int
    repeats: int


FULL = Sizes("smollm2", (1024, 2048, 4096, 8192), (1024, 2048, 4096), 256, 2)


def sizes(options: RunOptions) -> Sizes:
    """The sizes of this run (``tiny``: the shipped model)."""
    return options.pick(
        tiny=Sizes("tiny", (128, 256), (128, 256), 32, 1),
        quick=replace(FULL, lengths=(512, 1024), plain_lengths=(512, 1024)),
        full=FULL,
    )


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd holds for backward (saved-tensor hooks, while entered), now and at the peak:
    each storage counted once however many operations saved it, the model's parameters not at all
    (they are held whether or not anything trains)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.now = self.peak = 0
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.users: dict[int, int] = {}  # storage address -> saved tensors on it
        super().__init__(lambda tensor: _Held(tensor, self), lambda held: held.tensor)

    def add(self, key: int, nbytes: int) -> None:
        self.users[key] = self.users.get(key, 0) + 1
        if self.users[key] == 1:
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def remove(self, key: int, nbytes: int) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            del self.users[key]
            self.now -= nbytes


class _Held:
    """A tensor autograd saved, counted in ``counter`` until autograd lets it go."""

    def __init__(self, tensor: torch.Tensor, counter: SavedBytes) -> None:
        self.tensor, self.counter = tensor, counter
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        self.nbytes = 0 if self.key in counter.skip else storage.nbytes()
        counter.add(self.key, self.nbytes)

    def __del__(self) -> None:
        self.counter.remove(self.key, self.nbytes)


def step_of(model: Any, name: str, ids: torch.Tensor, chunk: int) -> Callable[[], dict[str, int]]:
    """One training step of contender ``name`` on ``ids``: loss and backward, gradients cleared
    after; returns the archive's and states' bytes (0 for plain)."""
    from ...train import chunked_loss

    how = CONTENDERS[name]

    def run() -> dict[str, int]:
        if how is None:
            model(input_ids=ids, labels=ids).loss.backward()
            out = {"archive_bytes": 0, "state_bytes": 0}
        else:
            result = chunked_loss(model, ids, how[0], chunk=chunk, grad=how[1])
            out = {"archive_bytes": result.archive_bytes, "state_bytes": result.state_bytes}
        model.zero_grad(set_to_none=True)
        return out

    return run


def measure(model: Any, step: Callable[[], dict[str, int]], peak: PeakRSS) -> dict[str, Any]:
    """The warm-up step: saved bytes, archive and states, peak RSS over the baseline."""
    gc.collect()
    base = current_rss()
    peak.start()
    saved = SavedBytes(model)
    with saved:
        held = step()
    return {**held, "saved_peak_bytes": saved.peak, "rss_peak_over_base": max(0, peak.window_peak() - base)}


def run(options: RunOptions = RunOptions()) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from ..cli_load import load_model
    from ..finetune import adapt, documents

    s = sizes(options)
    model, tokenizer = load_model(s.model, dtype="float32")
    model = adapt(model, 8).train()
    doc = documents(tokenizer, max(s.lengths), "train", 1, 0)[0]
    peak = PeakRSS()
    rows: list[dict[str, Any]] = []
    names = list(CONTENDERS)
    total = sum(len(names) if n in s.plain_lengths else len(names) - 1 for n in s.lengths) * (1 + s.repeats)
    with tqdm(total=total, desc="bench train", disable=not options.progress) as bar:
        for length in s.lengths:
            ids = doc[:, :length]
            here = [n for n in names if n != REFERENCE or length in s.plain_lengths]
            steps = {n: step_of(model, n, ids, s.chunk) for n in here}
            found = {n: measure(model, steps[n], peak) for n in here}
            bar.update(len(here))
            times = alternate(here, s.repeats, lambda n: clock(steps[n]), bar)
            plain = median(times[REFERENCE]) if REFERENCE in times else None
            for n in here:
                rows.append({"length": length, "contender": n, "seconds": median(times[n]), "samples_s": times[n],
                             "tokens_per_s": length / median(times[n]), **found[n],
                             "time_over_plain": None if plain is None else median(times[n]) / plain})  # fmt: skip
    config = {"model": s.model, "lengths": list(s.lengths), "plain_lengths": list(s.plain_lengths), "chunk": s.chunk,
              "repeats": s.repeats, "adapter": "LoRA rank 8 (alpha 16) on q/k/v/o, base weights frozen",
              "contenders": {n: ("model(ids, labels=ids).loss.backward()" if h is None else f"chunked_loss(spec={h[0]!r}, grad={h[1]!r})")
                             for n, h in CONTENDERS.items()}, "threads": torch.get_num_threads(), "rss": peak.method}  # fmt: skip
    return report("train", options, config, rows, table, plot, summary=summarize(rows))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst time ratio of replay h2o at the plain lengths, and its saved bytes' spread."""
    replay = [r for r in rows if r["contender"] == "replay h2o 25%"]
    ratios = [r["time_over_plain"] for r in replay if r["time_over_plain"] is not None]
    saved = [r["saved_peak_bytes"] for r in replay]
    worst = max(ratios) if ratios else None
    return {"replay_time_over_plain_worst": worst, "time_goal_met": None if worst is None else worst <= GOAL_RATIO,
            "replay_saved_bytes_max_over_min": max(saved) / min(saved) if saved else None}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    c, summary = result["config"], result["summary"]
    body = [[r["length"], r["contender"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}",
             "—" if r["time_over_plain"] is None else f"{r['time_over_plain']:.2f}x", human_bytes(r["saved_peak_bytes"]),
             human_bytes(r["archive_bytes"]), human_bytes(r["state_bytes"]), human_bytes(r["rss_peak_over_base"])]
            for r in result["rows"]]  # fmt: skip
    worst = summary["replay_time_over_plain_worst"]
    spread = summary["replay_saved_bytes_max_over_min"]
    return "\n".join([
        "# bench train\n",
        f"Model {c['model']} (fp32, {c['adapter']}), {c['threads']} threads; one step = loss and backward over one document of "
        f"the standard library's source; chunks of {c['chunk']}; median of {c['repeats']} timed steps after a warm-up step "
        "(contenders alternating). Memory from the warm-up step: the peak bytes autograd held for backward (saved-tensor "
        f"hooks; each storage once, parameters not counted), the archive and cache states chunked training kept besides, and the process's peak RSS over its baseline ({c['rss']}).\n",
        f"- replay h2o 25%: time per token at most {GOAL_RATIO}x plain's: worst {'—' if worst is None else f'{worst:.2f}x'} "
        f"({'met' if summary['time_goal_met'] else 'not met' if summary['time_goal_met'] is not None else 'not judged'})",
        f"- replay h2o 25%: bytes held for backward, largest over smallest across lengths: {'—' if spread is None else f'{spread:.2f}x'}\n",
        markdown_table(["tokens", "contender", "s / step", "tokens/s", "x plain", "held for backward", "archive", "states",
                        "peak RSS over base"], body),  # fmt: skip
        "",
        *[f"- `{n}`: {how}" for n, how in c["contenders"].items()],
        "",
    ])


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, panels=2) as (speed, memory):
        for name in dict.fromkeys(r["contender"] for r in result["rows"]):
            mine = [r for r in result["rows"] if r["contender"] == name]
            xs = [r["length"] for r in mine]
            speed.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=name)
            memory.plot(xs, [r["saved_peak_bytes"] / 2**20 for r in mine], marker="o", label=name)
        finish_axes(speed, "tokens", "training tokens/s", "time")
        finish_axes(memory, "tokens", "MiB held for backward", "memory (saved tensors)", log_y=True)
