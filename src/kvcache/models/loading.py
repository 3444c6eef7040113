"""``load``: a registry model (or a local folder) as ``(model, tokenizer)``, ready for ``generate``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelUnavailableError
from .catalog import ModelEntry
from .convert import quiet_transformers
from .install import model_path


def load(
    name_or_dir: str | os.PathLike[str] | ModelEntry,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    home: str | os.PathLike[str] | None = None,
    index_args: Sequence[str] = (),
    progress: bool = True,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a registry name or a local ``from_pretrained`` folder: the model
    in eval mode with weights in ``dtype`` on ``device``, never from the hub. Downloads and converts
    a registry model the first time (see :func:`model_path`)."""
    path = model_path(name_or_dir, home=home, index_args=index_args, progress=progress)
    return load_folder(path, dtype=dtype, device=device)


def load_folder(path: Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())
        raise ModelUnavailableError(f"cannot load a model and tokenizer from {path}: {reason}") from e
    return model.to(device).eval(), tokenizer
