"""``chunked_loss``: the language-model loss of a sequence of any length, chunk by chunk through a
bounded cache, with its gradients accumulated into the parameters.

Per group of chunks (the whole sequence for ``grad="replay"``, one chunk for ``"detach"``, ``k``
chunks for an integer ``k``):

1. **Forward, deciding.** The group's chunks go through the inference cache of ``spec`` exactly as
   ``kvcache.prefill`` feeds them, without autograd. After each chunk every layer's kept positions
   are recorded (the eviction decisions) and its keys and values go to the archive
   (``states.Archive``).
2. **Backward, replaying.** The chunks are run again with autograd, last first. Chunk ``c`` attends
   its recorded state before it as leaves (``replay.ChunkStep``), builds the state it kept after it
   by the recorded positions, and back-propagates its own loss together with the gradient that the
   later chunks sent into that state (the adjoint). Its leaves' gradients are the adjoint for chunk
   ``c - 1``. The parameters' ``.grad`` gather every chunk's share.

What is held for backward at any time: one chunk's activations, two cache states (the leaves and
the adjoint) and the archive. The state entering a group is a constant: no gradient crosses a
group boundary (truncated back-propagation through the cache), so ``"detach"`` gives each chunk's
loss no gradient into anything cached, and ``"replay"`` is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UnsupportedOperation
from ..hf.bridge import FORWARD_STEP, use_kvcache_attention
from ..hf.build import make_cache
from ..hf.prefill import prefill
from .replay import ChunkStep, ReplayState
from .states import Archive, check_replayable, read_states, rule_of

GRAD_MODES = ("replay", "detach")
IGNORE = -100


@dataclass(frozen=True)
class ChunkedLoss:
    """What ``chunked_loss`` computed: ``loss`` the mean next-token loss over ``tokens`` labelled
    positions (as ``model(ids, labels=ids).loss``), ``chunks`` and ``groups`` (the gradient crosses
    no group boundary), ``archive_bytes`` (keys and values kept by position for the backward
    sweep) and ``state_bytes`` (the largest pair of cache states held at once: leaves and adjoint)."""

    loss: float
    tokens: int
    chunks: int
    groups: int
    archive_bytes: int
    state_bytes: int


def chunked_loss(
    model,
    input_ids: torch.Tensor,
    spec: str = "growable",
    *,
    chunk: int = 512,
    labels: torch.Tensor | None = None,
    grad: str | int = "replay",
    progress: bool = False,
    after_chunk: Callable[[int], None] | None = None,
) -> ChunkedLoss:
    """The next-token loss of ``input_ids`` ``[B, L]`` through a cache of ``spec``, ``chunk`` tokens
    per forward pass; its gradient is added to the ``.grad`` of every parameter that requires one.

    ``labels`` ``[B, L]``: the targets (default ``input_ids``; ``-100`` is ignored), shifted as
    ``transformers`` shifts them. ``grad``: ``"replay"`` (exact gradients through the cache, its
    eviction decisions fixed as the forward pass made them), ``"detach"`` (no gradient into the
    cache: each chunk learns from its own tokens, the cached past a constant, as Transformer-XL) or
    an integer ``k`` (exact within groups of ``k`` chunks, the state entering a group a constant).
    ``after_chunk(done)`` runs after each chunk of the backward sweep with the chunks done.

    The model must be deterministic (no dropout active) and the rows equally long (no padding).
    Raises ``ValueError`` for bad arguments and ``UnsupportedOperation`` for a cache or model whose
    decisions cannot be replayed, before any parameter's ``.grad`` changes.
    """
    mode = check_arguments(model, input_ids, chunk, labels, grad)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("no parameter of the model requires a gradient; for the loss alone use kvcache.train.cache_loss")
    length = input_ids.shape[1]
    targets, count = labelled_targets(input_ids, labels)
    cache = make_cache(model, spec)
    check_replayable(cache.kv_layers)
    rules = [rule_of(layer) for layer in cache.kv_layers]
    bounds = [(s, min(length, s + chunk)) for s in range(0, length, chunk)]
    per_group = len(bounds) if mode == "replay" else 1 if mode == "detach" else int(grad)
    groups = [bounds[i : i + per_group] for i in range(0, len(bounds), per_group)]
    archive = Archive(length) if per_group > 1 else None
    totals = _Totals()
    from tqdm.auto import tqdm

    with tqdm(total=2 * len(bounds), unit="chunk", desc="chunked loss", disable=not progress) as bar:
        for group in groups:
            entering, kept = _decide(model, input_ids, cache, group, archive, bar)
            _replay(model, input_ids, targets, count, group, entering, kept, archive, rules, totals, bar, after_chunk)
    archive_bytes = 0 if archive is None else archive.nbytes
    return ChunkedLoss(totals.loss, count, len(bounds), len(groups), archive_bytes, totals.state_bytes)


class _Totals:
    """What the backward sweeps add up: the loss, chunks done, the largest pair of states held."""

    def __init__(self) -> None:
        self.loss, self.done, self.state_bytes = 0.0, 0, 0


def _decide(model, ids, cache, group, archive, bar) -> tuple[list[ReplayState | None], list[list[torch.Tensor | None]]]:
    """Feed the group's chunks to the inference cache as ``kvcache.prefill`` does; return the state
    before the group and each layer's kept positions after each chunk (written to ``archive``)."""
    entering = read_states(cache.kv_layers)
    kept = []
    for start, stop in group:
        prefill(model, ids[:, start:stop], cache, chunk=stop - start)
        states = read_states(cache.kv_layers, copy=False)  # read before the next chunk changes the cache
        kept.append([None if s is None else s.positions for s in states])
        if archive is not None:
            for i, s in enumerate(states):
                archive.write(i, s)
        bar.update()
    return entering, kept


def _replay(model, ids, targets, count, group, entering, kept, archive, rules, totals, bar, after_chunk) -> None:
    """The group's chunks with autograd, last first: each attends its recorded state as leaves and
    back-propagates its loss with the adjoint of the state it kept; the leaves' gradients are the
    adjoint for the chunk before. The state entering the group is a constant."""
    adjoint: list[ReplayState | None] | None = None
    for j in reversed(range(len(group))):
        start, stop = group[j]
        before = entering if j == 0 else [archive.read(i, p) for i, p in enumerate(kept[j - 1])]
        leaves = [None if s is None else (s.detached() if j == 0 else s.leaf()) for s in before]
        wanted = kept[j] if adjoint is not None else [None] * len(leaves)
        step = ChunkStep(start, stop - start, leaves, wanted, rules)
        loss = _chunk_loss(model, ids[:, start:stop], targets[:, start:stop], step, start, count)
        roots, grads = [loss], [torch.ones_like(loss)]
        for after, adj in zip(step.after, adjoint or []):
            if after is None or adj is None:
                continue
            for tensor, gradient in ((after.keys, adj.keys), (after.values, adj.values)):
                if tensor.requires_grad:  # not when nothing before it needs a gradient (a frozen k_proj)
                    roots.append(tensor)
                    grads.append(gradient)
        torch.autograd.backward(roots, grads)
        totals.loss += float(loss.detach())
        held = sum(s.nbytes for s in leaves if s is not None) + sum(a.nbytes for a in adjoint or [] if a is not None)
        totals.state_bytes = max(totals.state_bytes, held)
        adjoint = None if j == 0 else [_gradient(s) for s in leaves]
        totals.done += 1
        bar.update()
        if after_chunk is not None:
            after_chunk(totals.done)


def _gradient(leaf: ReplayState | None) -> ReplayState | None:
    """A leaf state's gradient as a state (zeros where nothing reached it)."""
    if leaf is None:
        return None
    keys = leaf.keys.grad if leaf.keys.grad is not None else torch.zeros_like(leaf.keys)
    values = leaf.values.grad if leaf.values.grad is not None else torch.zeros_like(leaf.values)
    return ReplayState(keys, values, leaf.positions)


def _chunk_loss(model, ids: torch.Tensor, targets: torch.Tensor, step: ChunkStep, start: int, count: int) -> torch.Tensor:
    """The chunk's share of the mean loss: its summed cross-entropy over ``count``."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    with torch.enable_grad(), use_kvcache_attention(model):
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **{FORWARD_STEP: step})
    layers = len(step.states)
    if step.layers_run != layers:
        raise UnsupportedOperation(
            f"the chunk's forward pass ran {step.layers_run} attention calls through chunked training, expected {layers}: "
            "this model's attention does not go through the transformers attention interface"
        )
    return summed_loss(out.logits, targets) / count


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` ``[B, S, V]`` against ``targets`` ``[B, S]`` (-100 ignored),
    summed, computed in float32 at least (float64 logits stay float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def labelled_targets(ids: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Each position's target (label t + 1 of ``labels``, default ``ids``; the last position has
    none) and how many positions have one; ``ValueError`` when none does."""
    labels = ids if labels is None else labels
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    count = int((targets != IGNORE).sum())
    if count == 0:
        raise ValueError("no position has a label: every target is -100 (the last position has none of its own)")
    return targets, count


def check_arguments(model, ids, chunk, labels, grad="replay") -> str:
    """Refuse bad arguments and an active dropout; the gradient mode's kind ("replay", "detach", "k")."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor of token ids, got {_describe(ids)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != ids.shape):
        raise ValueError(f"labels must have input_ids' shape {list(ids.shape)}, got {_describe(labels)}")
    if isinstance(grad, bool) or not (grad in GRAD_MODES or (isinstance(grad, int) and grad >= 1)):
        raise ValueError(f"grad must be 'replay', 'detach' or a positive number of chunks, got {grad!r}")
    dropout = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training]
    attention_dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout or (model.training and attention_dropout > 0):
        where = dropout[0] if dropout else "the attention"
        raise UnsupportedOperation(
            f"chunked training replays the forward pass, which must be deterministic, but dropout is on ({where}); "
            "set its probability to 0 (peft: lora_dropout=0) or call model.eval()"
        )
    return grad if isinstance(grad, str) else "k"


def _describe(x) -> str:
    return f"{type(x).__name__} of shape {list(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else repr(x)
