"""Which models a bounded layer cannot serve, and why: read before anything is written.

A bounded layer (a window's ring, an eviction policy's survivors, coded storage) hands the model
keys that are not the past in order, and attends its own read record with a causal mask by
absolute position (``layers/own_attention.py``). That serves a model whose attention takes the keys and
values the cache returned, causally, with the mask ``transformers`` builds over positions. Some
models do otherwise, and a bounded cache would give them wrong tokens:

- ``bounded_refusal(config)``: what the config says. Multi-head latent attention (any config with
  ``kv_lora_rank``: DeepSeek V2/V3, MiniCPM3, ...) caches compressed latents and expands them into
  keys and values after the cache; ``BOUNDED_REFUSED`` names the families whose attention changes
  what the cache returned in ways the config does not show.
- ``noncausal_attention(model)``: attention modules that are not causal (an encoder such as BERT
  run as a language model without ``is_decoder``), found by the switch on the model's modules.

``make_cache`` refuses a bounded spec for the first, and a ``KVCache`` with bounded layers refuses
its first update for the second (the switch records it on the config: ``switched_refusal``);
either way nothing changed.
The ``"kvcache"`` attention keeps its own checks as a last line (``hf.hf_attention_forward``).
"""

from __future__ import annotations

from typing import Any

#: Families whose attention builds on what the cache returned in a way a bounded layer cannot
#: serve, with the reason. (The families sweep, ``tests/hf/test_families.py``, finds new ones.)
BOUNDED_REFUSED: dict[str, str] = {
    "doge": "Doge builds its dynamic attention mask over the slots the cache returned, assuming them in position order",
    "diffllama": "DiffLlama attends halves of the values the cache returned, which a bounded layer's own read does not see",
    "jetmoe": "JetMoE repeats the keys and values the cache returned over its attention experts before attending",
}

#: Set by ``use_kvcache_attention`` on the configs of a model whose attention is not causal: why.
NONCAUSAL_FLAG = "_kvcache_noncausal"


def bounded_refusal(config: Any) -> str | None:
    """Why a bounded layer cannot serve the model of ``config`` (its text config), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type in BOUNDED_REFUSED:
        return BOUNDED_REFUSED[model_type]
    if _declared(config, "kv_lora_rank") is not None:
        return (
            "this model uses multi-head latent attention: it caches compressed latents and expands them into "
            "keys and values after the cache, which a bounded layer's attention never sees"
        )
    return None


def switched_refusal(config: Any) -> str | None:
    """What the switch found in the model's modules that a bounded layer cannot serve (cheap: read
    on every forward pass of a bounded cache), or None."""
    return getattr(config, NONCAUSAL_FLAG, None)


def noncausal_attention(model: Any) -> str | None:
    """Why ``model``'s self-attention is not causal (its attention modules say ``is_causal`` False),
    or None: a bounded layer masks causally, so it cannot serve such a model."""
    names = [
        name for name, module in model.named_modules()
        if getattr(module, "is_causal", True) is False and isinstance(getattr(module, "layer_idx", None), int)
    ]
    if not names:
        return None
    return (
        f"this model's attention is not causal ({names[0]}.is_causal is False: an encoder run without "
        f"is_decoder?), and a bounded layer masks causally"
    )


def _declared(config: Any, name: str) -> Any:
    """A config field as stored (per-layer configs refuse a plain read of fields that may vary)."""
    try:
        return config.to_dict().get(name)
    except Exception:  # noqa: BLE001 - a config that cannot list its fields declares nothing here
        return getattr(config, "__dict__", {}).get(name)
