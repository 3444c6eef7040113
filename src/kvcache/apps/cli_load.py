"""``--model NAME|DIR|tiny``: the model and tokenizer a command runs on, loaded, or a ``KVCacheError``
(one line on the command line) saying why not. Nothing of any one command, so every command can import it.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import KVCacheError
from .cli_options import HALF_DTYPES, check_half_precision, weights_dtype

#: The ``--model`` value naming the small model trained for kvcache and shipped with it.
TINY = "tiny"


def load_model(name_or_dir: str, device: str = "cpu", dtype: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``--model``: ``"tiny"``, a registry model or a local Hugging Face
    checkpoint folder, weights in ``dtype`` (``"auto"``: as the checkpoint stores them).

    ``"tiny"`` is the small model trained for kvcache and shipped with it (:mod:`kvcache.apps.trained`),
    with its byte-level tokenizer. A registry model (:mod:`kvcache.models`, e.g. ``smollm2``) is
    downloaded and converted the first time, progress on stderr. A folder is loaded with
    ``AutoTokenizer`` / ``AutoModelForCausalLM``, never from the hub. Half-precision weights on the
    CPU are checked first (:func:`.cli_options.check_half_precision`).
    """
    name_or_dir = model_dir(name_or_dir)
    loads_in = weights_dtype(name_or_dir, dtype)
    if device == "cpu" and loads_in in HALF_DTYPES:
        check_half_precision(f"--model {name_or_dir} in {loads_in}")
    from .trained import load_pretrained

    try:
        return load_pretrained(name_or_dir, device, dtype)
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())
        raise KVCacheError(f"cannot load a model and tokenizer from {name_or_dir}: {reason}") from e


def model_dir(name_or_dir: str) -> str:
    """The folder ``--model`` names (a registry model is downloaded and converted the first time)."""
    from ..models import find_entry, known_names, model_path

    if name_or_dir == TINY:
        from .trained import MODEL_DIR

        name_or_dir = str(MODEL_DIR)
    elif find_entry(name_or_dir) is not None:
        name_or_dir = str(model_path(name_or_dir))
    if not os.path.isdir(name_or_dir):
        raise KVCacheError(f"--model: {name_or_dir!r} is neither {TINY!r} nor a model directory nor a known model ({known_names()})")
    return name_or_dir


def load_tokenizer(name_or_dir: str) -> Any:
    """The tokenizer ``load_model`` pairs with ``--model``'s model, alone (no weights loaded)."""
    from transformers import AutoTokenizer

    folder = model_dir(name_or_dir)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise KVCacheError(f"cannot load a tokenizer from {folder}: {' '.join(str(e).split())}") from e
