"""Converters: a downloaded weights file -> a normal ``from_pretrained`` folder.

Each converter is ``convert(source, out)``: read the file ``source``, write the model, its
generation config and its tokenizer into the existing empty folder ``out``. ``requires`` names the
optional packages it needs, checked before anything is downloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelUnavailableError

INSTALL_HINT = "pip install 'kvcache[models]' (or pip install gguf accelerate)"


@dataclass(frozen=True)
class Converter:
    convert: Callable[[Path, Path], None]
    requires: tuple[str, ...] = ()

    def check_requirements(self, model: str) -> None:
        missing = [name for name in self.requires if importlib.util.find_spec(name) is None]
        if missing:
            raise ModelUnavailableError(
                f"converting {model} needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}: {INSTALL_HINT}"
            )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or warnings from transformers while converting or loading: kvcache says
    what it does. (Its GGUF reader's bar is a bare tqdm, silenced only by ``TQDM_DISABLE``.)"""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    tqdm_disable = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if tqdm_disable is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_disable
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def convert_gguf(source: Path, out: Path) -> None:
    """A GGUF file (weights, config and tokenizer in one) -> fp32 safetensors, config, tokenizer.

    transformers dequantizes GGUF weights on load but leaves its GGUF quantizer attached and a
    ``quantization_config`` in the config; both go, so the folder loads as a plain fp32 model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


#: Converter name (``ModelEntry.converter``) -> converter.
CONVERTERS: dict[str, Converter] = {"gguf": Converter(convert_gguf, requires=("gguf", "accelerate"))}


def converter_for(name: str) -> Converter:
    try:
        return CONVERTERS[name]
    except KeyError:
        raise ModelUnavailableError(f"no converter {name!r}; known: {', '.join(CONVERTERS)}") from None
