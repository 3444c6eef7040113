"""Tiny, randomly initialised causal language models for tests and benchmarks.

Every family is built from its real ``transformers`` config class and the
matching ``*ForCausalLM`` class, so the real modeling code (attention masks,
rotary embeddings, sliding windows, cache updates) runs exactly as it would for
a pretrained checkpoint; only the sizes are shrunk and the weights are random.
Nothing is downloaded.

Common shape of every tiny model (unless overridden): 4 decoder layers,
``hidden_size=64``, ``intermediate_size=128``, 4 query heads sharing 2 key/value
heads of ``head_dim=16`` (one cached layer holds ``[batch, 2, seq_len, 16]``),
``vocab_size=256`` with pad/BOS/EOS ids 0/1/2, ``max_position_embeddings=4096``.

Sliding windows (``sliding_window`` of :func:`tiny_config`: None keeps the default
below, a positive value sets the window and turns sliding on where the table
says, 0 turns it off; llama and gemma refuse a non-zero window):

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

#: Family -> config class, model class and the family's own config fields (its sliding-window
#: layout apart, see :func:`_sliding`).
_FAMILY_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"head_dim": HEAD_DIM}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": HEAD_DIM}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": HEAD_DIM}),
    # Phi3 has no head_dim field (derived as hidden_size // num_heads) and fuses q/k/v into
    # ``qkv_proj`` and gate/up into ``gate_up_proj``.
    "phi3": (Phi3Config, Phi3ForCausalLM, {"original_max_position_embeddings": 4096}),
    # Gemma's default head_dim is 256, not hidden_size // num_heads.
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": HEAD_DIM, "hidden_act": "gelu_pytorch_tanh"}),
    # query_pre_attn_scalar: the default is 256 (the real model's head_dim); use 1/sqrt(head_dim) scaling.
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {"head_dim": HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": HEAD_DIM},
    ),
    # A NoPE layer every ``no_rope_layer_interval`` layers (layer 3 of 4).
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layer_interval": 4}),
}

# Gemma2 in transformers 5.x declares ``_supports_sdpa = False`` (SDPA cannot
# apply ``attn_logit_softcapping``) and raises a ValueError when "sdpa" is
# requested, even with softcapping switched off.  We keep the real softcapping
# and default gemma2 to "eager"; an explicit ``attn_implementation`` override
# is passed through untouched.
_DEFAULT_ATTN: dict[str, str] = {"gemma2": "eager"}


def _sliding(family: str, window: int | None, layers: int) -> dict[str, Any]:
    """The config fields of ``family``'s sliding-window layout (module docstring) for ``window``
    over ``layers`` decoder layers."""
    if window is not None and window < 0:
        raise ValueError(f"sliding_window must be >= 0 or None, got {window}")
    if family in ("llama", "gemma"):
        if window:
            raise ValueError(f"family {family!r} has no sliding-window attention")
        return {}
    if family == "mistral":  # no ``layer_types``: one window for every layer (None = full attention)
        return {"sliding_window": DEFAULT_SLIDING_WINDOW if window is None else window or None}
    if family == "gemma2":
        types = ["sliding_attention" if window != 0 and i % 2 == 0 else "full_attention" for i in range(layers)]
        return {"sliding_window": window or DEFAULT_SLIDING_WINDOW, "layer_types": types}
    if family in ("qwen2", "qwen3"):
        if not window:
            return {"use_sliding_window": False}
        # Layers with index >= max_window_layers use the window.
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": NUM_LAYERS // 2}
    if family == "phi3":
        return {"sliding_window": window or None}
    # smollm3: when sliding is enabled, the NoPE layers are the sliding ones.
    return {"use_sliding_window": bool(window), "sliding_window": window or None}


def tiny_config(family: str, *, sliding_window: int | None = None, **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``family`` (one of :data:`FAMILIES`), ``sliding_window`` as in the module
    docstring; ``overrides`` are config fields applied last (e.g. ``num_hidden_layers``,
    ``attn_implementation``, ``initializer_range``). Raises ``ValueError`` for an unknown family or
    an unsupported window."""
    if family not in _FAMILY_CLASSES:
        raise ValueError(f"unknown model family {family!r}; expected one of: {', '.join(FAMILIES)}")
    config_cls, _, fields = _FAMILY_CLASSES[family]
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
    # gemma2's layer pattern follows the requested depth (unless ``layer_types`` is given too).
    kwargs |= fields | _sliding(family, sliding_window, overrides.get("num_hidden_layers", NUM_LAYERS))
    return config_cls(**kwargs | overrides)


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    suppress_eos: bool = True,
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny random causal LM of ``family`` in ``eval()`` mode: ``input_ids`` ``[B, T]`` to logits
    ``[B, T, 256]``; ``sliding_window`` and ``overrides`` as in :func:`tiny_config`.

    The weights are a pure function of ``(family, seed, config)`` (the global torch RNG state is left
    unchanged), drawn in float32 and then cast to ``dtype``, so dtypes share the same values.
    ``suppress_eos`` zeroes the EOS token's output-embedding row so its logit is exactly 0 while the
    other 255 random logits have their maximum far above 0: greedy and beam search never pick EOS
    and never stop early (with tied embeddings, gemma, gemma2 and smollm3, EOS's input embedding too,
    which is harmless).
    """
    config = tiny_config(family, sliding_window=sliding_window, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _FAMILY_CLASSES[family][1](config)
    if suppress_eos:
        eos = config.eos_token_id
        with torch.no_grad():
            for token_id in eos if isinstance(eos, list) else [eos]:
                if token_id is not None:
                    model.get_output_embeddings().weight[token_id].zero_()
    return model.to(dtype=dtype).eval()
