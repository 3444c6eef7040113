"""Tiny models of every causal-LM family in ``transformers`` and the greedy runs the sweep compares.

``tiny_config(model_type)`` starts from the family's own config class and shrinks what it has:
hidden 64, 4 query heads over 2 key/value heads, head_dim 16, vocab 128, sliding windows and
attention chunks of 4 tokens (so a 10-token prompt passes them), 4 experts, and as few layers as
keep every layer kind of the family's default pattern (at least 2). Composite configs (vision +
text) get these settings in their text config. ``FAMILY_OVERRIDES`` fixes the few families whose
own constraints the generic sizes break.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

FAMILIES = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 128
PAD = 0
MAX_PARAMETERS = 4_000_000  # the default configs of some families are large: refuse them before allocating

#: Applied to every config (and text config) that has the field; older families spell them their way.
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, sliding_window=4, attention_chunk_size=4,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, initializer_range=0.1, init_std=0.1,
    pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    d_model=64, n_embd=64, n_head=4, num_heads=4, n_inner=128, ffn_dim=128, d_ff=128,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    n_positions=512, n_ctx=512, max_seq_len=512,
)
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")

#: Per family: settings on top of GENERIC (for the text config) that its own checks need.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Gemma 4's per-layer input embeddings default to a 262K vocabulary; global layers' own head_dim.
    **{f: dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32)
       for f in ("gemma4_text", "gemma4_unified_text")},
    # Moshi's attention does not apply its sliding window, while a sliding cache (DynamicCache's
    # too) drops what lies beyond it, so the reference disagrees with generate(use_cache=False):
    # keep the window longer than the runs.
    "moshi": dict(sliding_window=64),
    # Multi-head latent attention: as many key/value heads as query heads.
    **{f: dict(num_key_value_heads=4) for f in (
        "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3", "youtu")},
    # Partial rotary embeddings: the rotated slice must fit the 16-wide heads.
    **{f: dict(rotary_dim=8) for f in ("codegen", "gptj")},
    # Hybrids whose default pattern starts with Mamba layers: one Mamba layer, then attention.
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    # Zamba2: a Mamba layer, then a "hybrid" layer (shared attention block beside its Mamba state).
    "zamba2": dict(
        num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_headdim=16, mamba_expand=1,
        n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=1,
    ),
    # Gemma 3n's text model with two of four layers reading the K/V of the last unshared layer of
    # their type (the real checkpoints share 15 of 35), per-layer embeddings and sizes made tiny.
    "gemma3n_text": dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, intermediate_size=[128] * 4,
        activation_sparsity_pattern=[0.0] * 4, laurel_rank=8,
    ),
}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _text_key(cls) -> tuple[str | None, type]:
    sub = getattr(cls, "sub_configs", None) or {}
    for key in ("text_config", "decoder_config", "language_config"):
        if key in sub:
            return key, sub[key]
    return None, cls


def _layer_count(default_types: list[str] | None) -> int:
    """The shortest prefix of the default pattern that has every layer kind, at least 2 layers."""
    if not default_types:
        return 2
    kinds = set(default_types)
    return max(2, next(i for i in range(1, len(default_types) + 1) if set(default_types[:i]) == kinds))


def _overrides(cls, model_type: str) -> dict[str, Any]:
    fields = _fields(cls)
    default_types = getattr(cls(), "layer_types", None)
    n = _layer_count(default_types)
    out = {k: v for k, v in GENERIC.items() if k in fields}
    out.update({k: n for k in LAYER_COUNT_FIELDS if k in fields or k == "num_hidden_layers"})
    if default_types and "layer_types" in fields:
        out["layer_types"] = list(default_types[:n])
    aliases = getattr(cls, "attribute_map", None) or {}
    for k in list(out):
        if k in aliases and aliases[k] in fields:
            out[aliases[k]] = out.pop(k)
    out.update(FAMILY_OVERRIDES.get(model_type, {}))
    return out


def tiny_config(model_type: str):
    cls = CONFIG_MAPPING[model_type]
    key, text_cls = _text_key(cls)
    overrides = _overrides(text_cls, model_type)
    model_config = getattr(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]), "config_class", None)
    if key and model_config is text_cls:  # the causal LM takes the text config alone (Qwen3.5, Llama 4)
        return text_cls(**overrides)
    return cls(**{key: overrides}) if key else cls(**overrides)


def build_model(model_type: str, config=None) -> torch.nn.Module:
    """A tiny random ``*ForCausalLM`` of the family (seeded), in eval mode, on its default attention."""
    config = tiny_config(model_type) if config is None else config
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        size = sum(p.numel() for p in model_cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{model_type}: the tiny config still has {size} parameters")
    torch.manual_seed(0)
    return model_cls(config).eval()


def prompts(vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One 10-token row, and two rows of which the second is left-padded by 3: (ids, attention_mask)."""
    g = torch.Generator().manual_seed(0)
    one = torch.randint(3, vocab, (1, 10), generator=g)
    two = torch.randint(3, vocab, (2, 10), generator=g)
    mask = torch.ones_like(two)
    two[1, :3], mask[1, :3] = PAD, 0
    return [(one, torch.ones_like(one)), (two, mask)]


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, cache, new_tokens: int = 6) -> torch.Tensor:
    return model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
    )


def reference(model, ids, mask, new_tokens: int = 6) -> torch.Tensor:
    """Hugging Face's DynamicCache on the model's own attention."""
    return greedy(model, ids, mask, DynamicCache(config=model.config), new_tokens)
