"""The real-model workload of suite ``real``: the model, its prompts and one shared prefill.

Prompts are real text: the kvcache package's own source files (code and English docstrings),
concatenated in path order and tokenized once by the model's tokenizer; prompt ``b`` of ``B``
starts ``b / B`` of the way through those tokens (wrapping around if the text is short), so the
rows of a batch are different text.

The prefill runs once per run, at the largest context, one prompt at a time in chunks (bounded
memory), with Hugging Face's ``DynamicCache``. The keys and values of the first ``C`` tokens of a
causal model are exactly what a ``C``-token prefill gives, so every contender's state at context
``C`` is built from the first ``C`` positions of that one prefill.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvcache import cache_kwargs

from ...errors import KVCacheError

#: Keys and values per layer, ``[B, Hkv, T, D]`` each.
Past = list[tuple[torch.Tensor, torch.Tensor]]


def resolve_model(name_or_dir: str) -> Path:
    """A local ``from_pretrained`` folder for ``--model``: a directory as given, ``"tiny"`` the
    small model shipped with kvcache, or a registered name through ``kvcache.models.model_path``
    (downloaded and converted once)."""
    if name_or_dir == "tiny":
        from ..trained import MODEL_DIR

        return MODEL_DIR
    if os.path.isdir(name_or_dir):
        return Path(name_or_dir)
    from ... import models

    return Path(models.model_path(name_or_dir))


def load_model(name_or_dir: str, device: str = "cpu") -> tuple[Any, Any, Path]:
    """``(model, tokenizer, folder)`` for ``--model``, in eval mode, sdpa attention."""
    from ..trained import load_pretrained

    folder = resolve_model(name_or_dir)
    try:
        model, tokenizer = load_pretrained(folder, device)
    except (OSError, ValueError, KeyError) as e:
        raise KVCacheError(f"cannot load a model and tokenizer from {folder}: {' '.join(str(e).split())}") from e
    model.set_attn_implementation("sdpa")
    return model, tokenizer, folder


def corpus() -> str:
    """The prompt text: every ``.py`` file of the installed kvcache package, in path order."""
    root = Path(__file__).resolve().parents[2]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))


def make_prompts(tokenizer: Any, batch: int, length: int, vocab: int) -> torch.Tensor:
    """``[batch, length]`` token ids of real text (see the module docstring), each id below ``vocab``."""
    ids = list(tokenizer.encode(corpus(), add_special_tokens=False))
    if not ids:
        raise KVCacheError("the tokenizer made no tokens of the prompt text")
    tokens = torch.tensor(ids, dtype=torch.long)
    if int(tokens.max()) >= vocab:
        raise KVCacheError(f"the tokenizer gives ids up to {int(tokens.max())}, the model's vocabulary has {vocab}")
    repeats = -(-(length + len(ids)) // len(ids))  # enough to start anywhere and still have `length`
    tokens = tokens.repeat(repeats)
    starts = [b * len(ids) // batch for b in range(batch)]
    return torch.stack([tokens[s : s + length] for s in starts])


def prompts_pinned(tokenizer: Any, batch: int, length: int, vocab: int, folder: Path | None) -> torch.Tensor:
    """:func:`make_prompts`, kept in ``folder`` (when given) as ``prompts-BxL.pt`` and read back from
    there on a later run, so the prompts (and the prefill kept beside them) survive edits to the
    package's source text. A kept file of the wrong shape, dtype or range is refused."""
    if folder is None:
        return make_prompts(tokenizer, batch, length, vocab)
    path = Path(folder) / f"prompts-{batch}x{length}.pt"
    if path.is_file():
        try:
            kept = torch.load(path, weights_only=True)
        except Exception as e:  # an untrusted file: any failure to read it is the file's fault
            raise KVCacheError(f"{path} is not a prompts file kvcache wrote ({type(e).__name__}: {e}); delete it") from e
        ok = isinstance(kept, torch.Tensor) and kept.dtype == torch.long and tuple(kept.shape) == (batch, length)
        if not ok or (kept.numel() and not (0 <= int(kept.min()) and int(kept.max()) < vocab)):
            raise KVCacheError(f"{path} does not hold [{batch}, {length}] token ids below {vocab}; delete it")
        return kept
    prompts = make_prompts(tokenizer, batch, length, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(prompts, tmp)
    os.replace(tmp, path)
    return prompts


def prefill(model: Any, prompts: torch.Tensor, chunk: int = 512, bar: Any = None) -> Past:
    """The keys and values of ``prompts`` ``[B, T]``: per layer ``([B, Hkv, T, D], [B, Hkv, T, D])``.

    One row at a time, ``chunk`` tokens per forward pass (logits of the last position only);
    ``bar`` (tqdm) advances by the tokens done."""
    rows, length = prompts.shape
    past: Past = []
    for row in range(rows):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            for start in range(0, length, chunk):
                model(prompts[row : row + 1, start : start + chunk], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                if bar is not None:
                    bar.update(min(chunk, length - start))
        for i, layer in enumerate(cache.layers):
            if row == 0:
                past.append((layer.keys.new_empty((rows, *layer.keys.shape[1:])), layer.values.new_empty((rows, *layer.values.shape[1:]))))
            past[i][0][row].copy_(layer.keys[0])
            past[i][1][row].copy_(layer.values[0])
        del cache
    return past


def prefill_stored(model: Any, prompts: torch.Tensor, folder: Path | None, chunk: int = 512, bar: Any = None) -> Past:
    """:func:`prefill`, kept in ``folder`` (when given) under a name hashing the model's weights
    and the prompts, and loaded from there on a later run (memory-mapped)."""
    if folder is None:
        return prefill(model, prompts, chunk, bar)
    digest = hashlib.sha256(prompts.numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().float().flatten()[:4096].numpy().tobytes())
    path = Path(folder) / f"prefill-{digest.hexdigest()[:16]}.pt"
    if path.is_file():
        saved = torch.load(path, mmap=True, weights_only=True)
        return [(k, v) for k, v in zip(saved["keys"], saved["values"])]
    past = prefill(model, prompts, chunk, bar)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"keys": [k for k, _ in past], "values": [v for _, v in past]}, tmp)
    os.replace(tmp, path)
    return past
