"""The small model trained here for the quality harness, shipped with the package.

``src/kvcache/apps/weights/tiny`` is a normal Hugging Face model folder written by
``tools/train_tiny.py``: a 2.4M-parameter ``LlamaForCausalLM`` and its byte-level tokenizer (ids
0..255 are the bytes, then ``<pad>``, ``<bos>``, ``<eos>``). It was trained on the CPU to retrieve
pass keys and key/value pairs from long prompts, so that what a bounded cache drops shows up as
lost accuracy (see its ``README.md`` for the data and the commands).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MODEL_DIR", "load_pretrained", "load_trained"]

#: Folder of the shipped model.
MODEL_DIR = Path(__file__).parent / "weights" / "tiny"


def load_pretrained(path: str | Path, device: str = "cpu", dtype: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local model folder, in eval mode, weights in ``dtype`` (a torch
    dtype's name, or ``"auto"``: as stored), without the hub and without ``transformers``'
    weight-loading progress bar (a tiny model loads in milliseconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), tokenizer


def load_trained(model_dir: str | Path | None = None, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``model_dir`` (default: the shipped model), in eval mode."""
    path = Path(model_dir) if model_dir is not None else MODEL_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no trained model at {path} (config.json missing)")
    return load_pretrained(path, device)
