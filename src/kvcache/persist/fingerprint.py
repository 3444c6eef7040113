"""What a saved cache must agree with: the fields of a model's config, and their fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from transformers import PretrainedConfig
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

#: Config fields that decide whether a saved cache fits a model.
FINGERPRINT_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "rope_theta",
    "rope_parameters",
    "max_position_embeddings",
)


def text_config(model_or_config: Any) -> PretrainedConfig:
    """The decoder config of a model, or of a config."""
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config.get_text_config(decoder=True)


def config_summary(config: PretrainedConfig) -> dict[str, Any]:
    """The fields of ``config`` that a saved cache must agree with (JSON-safe).

    A field that varies per layer (heterogeneous configs such as Gemma 4's ``head_dim``, where
    reading the global value raises) is recorded as ``{"per_layer": [value of layer 0, ...]}``.
    """
    out = {}
    for name in FINGERPRINT_FIELDS:
        try:
            value = getattr(config, name, None)
        except AmbiguousGlobalPerLayerAttributeError:
            value = {"per_layer": [getattr(layer, name, None) for layer in config.per_layer_config]}
        out[name] = json.loads(json.dumps(value, default=str, sort_keys=True))
    return out


def fingerprint_of(summary: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]
