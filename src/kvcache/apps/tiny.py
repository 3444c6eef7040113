"""Tiny, randomly initialised causal language models for tests and benchmarks.

Every family is built from its real ``transformers`` config class and the
matching ``*ForCausalLM`` class, so the real modeling code (attention masks,
rotary embeddings, sliding windows, cache updates) runs exactly as it would for
a pretrained checkpoint; only the sizes are shrunk and the weights are random.
Nothing is downloaded.

Common shape of every tiny model (unless overridden):

* 4 decoder layers, ``hidden_size=64``, ``intermediate_size=128``
* 4 query heads, 2 key/value heads (grouped-query attention, group size 2),
  ``head_dim=16`` -- so one cached layer holds key/value tensors of shape
  ``[batch, 2, seq_len, 16]``
* ``vocab_size=256`` with ``pad_token_id=0``, ``bos_token_id=1``,
  ``eos_token_id=2``
* ``max_position_embeddings=4096``

Sliding windows (see :func:`tiny_config`):

=========  ==========================================================
family     attention layout by default
=========  ==========================================================
llama      all full attention (no sliding support)
gemma      all full attention (no sliding support)
mistral    every layer sliding, window 16
gemma2     hybrid: sliding, full, sliding, full (window 16)
qwen2      all full; with ``sliding_window=w`` the upper half slides
qwen3      all full; with ``sliding_window=w`` the upper half slides
phi3       all full; with ``sliding_window=w`` every layer slides
smollm3    all full, layer 3 has no rotary embedding (NoPE); with
           ``sliding_window=w`` the NoPE layers slide
=========  ==========================================================
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

__all__ = [
    "BOS_TOKEN_ID",
    "DEFAULT_SLIDING_WINDOW",
    "EOS_TOKEN_ID",
    "FAMILIES",
    "PAD_TOKEN_ID",
    "VOCAB_SIZE",
    "tiny_config",
    "tiny_model",
]

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "smollm3")

VOCAB_SIZE = 256
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
DEFAULT_SLIDING_WINDOW = 16
"""Default window: short enough that a 24-token test prompt already exceeds it."""

NUM_LAYERS = 4
HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16

# With the usual std of 0.02 a 64-wide model is almost a bigram model: the
# attention scores are nearly uniform, the attention branch adds little to the
# residual stream, and the top-2 logits are often close.  A larger std makes
# attention (and therefore the KV cache) matter for the next token and keeps
# the greedy argmax well separated from the runner-up (measured on 64 random
# 24-token prompts: changing the context changes the argmax for most prompts,
# and the median top-1/top-2 logit gap is ~0.2-0.4 instead of ~0.02-0.05).
# Gemma2 scales embeddings by sqrt(hidden_size) and post-normalises each
# sublayer, so at 0.2 its embedding dominates and it degenerates towards a
# bigram model; 0.1 keeps it context-sensitive.
INITIALIZER_RANGE = 0.2
_FAMILY_INITIALIZER_RANGE: dict[str, float] = {"gemma2": 0.1}

_FAMILY_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
}

# Gemma2 in transformers 5.x declares ``_supports_sdpa = False`` (SDPA cannot
# apply ``attn_logit_softcapping``) and raises a ValueError when "sdpa" is
# requested, even with softcapping switched off.  We keep the real softcapping
# and default gemma2 to "eager"; an explicit ``attn_implementation`` override
# is passed through untouched.
_DEFAULT_ATTN: dict[str, str] = {"gemma2": "eager"}


def _check_family(family: str) -> None:
    if family not in _FAMILY_CLASSES:
        raise ValueError(f"unknown model family {family!r}; expected one of: {', '.join(FAMILIES)}")


def _family_kwargs(family: str, sliding_window: int | None) -> dict[str, Any]:
    """Family-specific config kwargs, including the sliding-window layout.

    ``sliding_window`` is ``None`` (family default), a positive window length,
    or ``0`` (disable sliding attention where the family has it).
    """
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 or None, got {sliding_window}")
    window = DEFAULT_SLIDING_WINDOW if sliding_window is None else sliding_window

    if family in ("llama", "gemma"):
        if sliding_window:
            raise ValueError(f"family {family!r} has no sliding-window attention")
        if family == "gemma":
            # Gemma's default head_dim is 256, not hidden_size // num_heads.
            return {"head_dim": HEAD_DIM, "hidden_act": "gelu_pytorch_tanh"}
        return {"head_dim": HEAD_DIM}

    if family == "mistral":
        # No ``layer_types``: one window for every layer (None = full attention).
        return {"head_dim": HEAD_DIM, "sliding_window": window or None}

    if family == "gemma2":
        layer_types = [
            "sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(NUM_LAYERS)
        ]
        return {
            "head_dim": HEAD_DIM,
            "hidden_activation": "gelu_pytorch_tanh",
            # Default is 256 (the real model's head_dim); use 1/sqrt(head_dim) scaling.
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": window or DEFAULT_SLIDING_WINDOW,
            "layer_types": layer_types,
        }

    if family in ("qwen2", "qwen3"):
        kwargs: dict[str, Any] = {"head_dim": HEAD_DIM} if family == "qwen3" else {}
        if sliding_window:
            # Layers with index >= max_window_layers use the window.
            kwargs |= {
                "use_sliding_window": True,
                "sliding_window": sliding_window,
                "max_window_layers": NUM_LAYERS // 2,
            }
        else:
            kwargs |= {"use_sliding_window": False}
        return kwargs

    if family == "phi3":
        # Phi3 has no head_dim field (derived as hidden_size // num_heads) and
        # fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``.
        return {
            "original_max_position_embeddings": 4096,
            "sliding_window": sliding_window or None,
        }

    # smollm3: a NoPE layer every ``no_rope_layer_interval`` layers (layer 3 of 4);
    # when sliding is enabled, the NoPE layers are the sliding ones.
    return {
        "no_rope_layer_interval": 4,
        "use_sliding_window": bool(sliding_window),
        "sliding_window": sliding_window or None,
    }


def tiny_config(family: str, *, sliding_window: int | None = None, **overrides: Any) -> PretrainedConfig:
    """Return a tiny config of the given family.

    Args:
        family: one of :data:`FAMILIES`.
        sliding_window: ``None`` keeps the family default (mistral: every layer
            with window 16; gemma2: alternating sliding/full with window 16;
            the others: no sliding). A positive value sets the window and
            enables sliding attention for qwen2/qwen3 (upper half of the
            layers), phi3 (all layers) and smollm3 (its NoPE layers). ``0``
            disables sliding attention (gemma2 becomes all-full). Llama and
            gemma reject a non-zero window.
        **overrides: any config field, applied last (e.g. ``num_hidden_layers``,
            ``attn_implementation``, ``initializer_range``). Note that derived
            fields such as gemma2's ``layer_types`` are computed for the default
            4 layers; pass ``layer_types`` too when changing the depth.

    Raises:
        ValueError: for an unknown family or an unsupported window.
    """
    _check_family(family)
    config_cls, _ = _FAMILY_CLASSES[family]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 2 * HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": 4096,
        "initializer_range": _FAMILY_INITIALIZER_RANGE.get(family, INITIALIZER_RANGE),
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "attn_implementation": _DEFAULT_ATTN.get(family, "sdpa"),
    }
    kwargs |= _family_kwargs(family, sliding_window)
    if "num_hidden_layers" in overrides and family == "gemma2" and "layer_types" not in overrides:
        # Re-derive the alternating pattern for the requested depth.
        n = overrides["num_hidden_layers"]
        sliding = any(t == "sliding_attention" for t in kwargs["layer_types"])
        kwargs["layer_types"] = [
            "sliding_attention" if sliding and i % 2 == 0 else "full_attention" for i in range(n)
        ]
    kwargs |= overrides
    return config_cls(**kwargs)


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    suppress_eos: bool = True,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a tiny random causal LM of the given family, in ``eval()`` mode.

    The model maps ``input_ids`` of shape ``[batch, seq_len]`` to logits of
    shape ``[batch, seq_len, 256]`` and works with ``model.generate``.

    Args:
        family: one of :data:`FAMILIES`.
        seed: weights are a pure function of ``(family, seed, config)``; the
            global torch RNG state is left unchanged.
        sliding_window: see :func:`tiny_config`.
        dtype: parameter dtype; weights are drawn in float32 then cast, so
            different dtypes share the same underlying values.
        suppress_eos: zero the output-embedding row of the EOS token so its
            logit is exactly 0 while the other 255 random logits have their
            maximum far above 0: greedy and beam search never pick EOS and
            never stop early. With tied embeddings (gemma, gemma2, smollm3)
            this also zeroes EOS's input embedding, which is harmless.
        **overrides: config fields, see :func:`tiny_config`.
    """
    config = tiny_config(family, sliding_window=sliding_window, **overrides)
    _, model_cls = _FAMILY_CLASSES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    if suppress_eos:
        eos = config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        with torch.no_grad():
            for token_id in eos_ids:
                if token_id is not None:
                    model.get_output_embeddings().weight[token_id].zero_()
    return model.to(dtype=dtype).eval()
