"""Tiny models of every causal-LM family in ``transformers`` and the greedy runs the sweep compares.

``tiny_config(model_type)`` starts from the family's own config class and shrinks what it has:
hidden 64, 4 query heads over 2 key/value heads, head_dim 16, vocab 128, sliding windows and
attention chunks of 4 tokens (so a 10-token prompt passes them), 4 experts, and as few layers as
keep every layer kind of the family's default pattern (at least 2). Composite configs (vision +
text) get these settings in their text config. ``FAMILY_OVERRIDES`` fixes the few families whose
own constraints the generic sizes break; ``SUB_CONFIGS`` shrinks or drops the towers of composite
families; a text-only ``*ForCausalLM`` of a composite family gets its text config alone. MLA
families get one key/value head per query head. ``VARIANTS`` sweeps settings a default config
leaves off (Gemma 4 with K/V sharing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvcache import cache_kwargs

FAMILIES = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 128
PAD = 0
MAX_PARAMETERS = 4_000_000  # the default configs of some families are large: refuse them before allocating

#: Applied to every config (and text config) that has the field; older families spell them their way.
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, sliding_window=4, attention_chunk_size=4,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, initializer_range=0.1, init_std=0.1,
    pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    d_model=64, n_embd=64, n_head=4, num_heads=4, n_inner=128, ffn_dim=128, d_ff=128,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    n_positions=512, n_ctx=512, max_seq_len=512, n_group=2, topk_group=1, rotary_dim=8,
    # Gated delta-net layers (Qwen3-Next, Qwen3.5): 32 value heads of 128 by default.
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
)
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")

#: Per family: settings on top of GENERIC (for the text config) that its own checks need.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Gemma 4's per-layer input embeddings default to a 262K vocabulary; global layers' own head_dim.
    **{f: dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32)
       for f in ("gemma4", "gemma4_text", "gemma4_unified_text")},
    # Moshi's attention does not apply its sliding window, while a sliding cache (DynamicCache's
    # too) drops what lies beyond it, so the reference disagrees with generate(use_cache=False):
    # keep the window longer than the runs.
    "moshi": dict(sliding_window=64),
    # Falcon-H1's Mamba mixer defaults to 128 heads x 8, a 256-wide state and 256-token chunks: a
    # tenth of the whole sweep's time on a tiny model. The same layers, narrower.
    "falcon_h1": dict(mamba_n_heads=16, mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=16),
    # Nemotron-H's Mamba mixer: 128 heads of 64, 128-wide state, 8 groups, a 7,688-wide shared expert.
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=16,
                       moe_shared_expert_intermediate_size=32),
    # Gemma 3n: per-layer inputs from a 262K vocabulary by default; the last 2 of 4 layers share the
    # K/V of the last earlier layer of their kind (num_kv_shared_layers).
    "gemma3n_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8,
                         num_hidden_layers=4, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "zaya": dict(num_experts_per_tok=1),  # its only supported routing
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                                                 for t in ("sliding_attention", "full_attention")}),
    # Dbrx reads rope_theta and clip_qkv from its attn_config, which only checkpoints carry.
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # clamps with it unchecked
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    # Mamba-2 mixers: intermediate (expand x hidden = 128) = heads x head_dim; short chunks.
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=4),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=8,
                             mamba_d_state=16, mamba_chunk_size=4, shared_intermediate_size=32),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, chunk_size=4, n_groups=1),
    "zamba2": dict(n_mamba_heads=8, mamba_d_state=16, chunk_size=4, adapter_rank=8, num_hidden_layers=2,
                   layers_block_type=["linear_attention", "hybrid"]),
    "zamba": dict(n_mamba_heads=2, num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # Inkling: sliding layers with heads and a window of their own; a relative-position extent.
    **{f: dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4,
               rel_extent=32) for f in ("inkling_text", "inkling2_text")},
    # Inkling 2 Loop (transformers 5.24): layers 2-3 run twice, gated by a low-rank gate.
    "inkling2_loop_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                               sliding_window_size=4, rel_extent=32, loop_gate_rank=8,
                               n_layers_per_attn_res_block=2, loop_layer_index_start=2, loop_layer_index_end=4,
                               loop_num_passes=2),
    # dots3: the indexer (DSA) sizes and the shared experts; index_topk below the runs' length.
    "dots3_note_text": dict(index_topk=4, index_head_dim=16, index_n_heads=2, shared_experts_intermediate_size=32,
                            swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,
                            swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
    # Kimi Linear: its linear-attention (KDA) heads; LongCat-Flash: its dense and expert FFNs.
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4),
    "longcat_flash": dict(ffn_hidden_size=128, expert_ffn_hidden_size=32, zero_expert_num=2, moe_topk=2),
    # Qwen4-Exp's indexed (QSA) layers need their indexer sizes; a budget of 4 tokens in blocks of 2.
    **{f: dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
               indexer_compress_ratio=2, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8)
       for f in ("qwen4_exp", "qwen4_exp_text")},
}


#: Per composite family: its other sub-configs, shrunk (vision towers) or left out (None).
SUB_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=32, patch_size=8),
                   mm_tokens_per_image=4),
    "gemma4": dict(vision_config=None, audio_config=None),
}


#: Settings of a family that its default config leaves off, swept as cases of their own:
#: name -> (family, settings on top of the family's).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # The last 2 of 4 layers reuse the K/V of the last earlier layer of their kind.
    "gemma4_text+kv_shared": ("gemma4_text", dict(
        num_hidden_layers=4, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2)),
}
CASES = FAMILIES + tuple(VARIANTS)


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
    aliases = getattr(cls, "attribute_map", None) or {}
    if default_types and ("layer_types" in fields or aliases.get("layer_types") in fields):
        out["layer_types"] = list(default_types[:n])
    for k in list(out):
        if k in aliases and aliases[k] in fields:
            out[aliases[k]] = out.pop(k)
    if "kv_lora_rank" in out:  # MLA: keys and values come per query head, rope sees only its part
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
    out.update(FAMILY_OVERRIDES.get(model_type, {}))
    return out


def tiny_config(name: str):
    """The tiny config of a family (a ``model_type``) or of one of ``VARIANTS``."""
    model_type, extra = VARIANTS.get(name, (name, {}))
    cls = CONFIG_MAPPING[model_type]
    key, text_cls = _text_key(cls)
    overrides = {**_overrides(text_cls, model_type), **extra}
    own = getattr(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]), "config_class", None)
    if key and own is text_cls:  # a text-only *ForCausalLM of a composite family takes the text config
        return text_cls(**overrides)
    return cls(**{key: overrides}, **SUB_CONFIGS.get(model_type, {})) if key else cls(**overrides)


def build_model(name: str, config=None) -> torch.nn.Module:
    """A tiny random ``*ForCausalLM`` of the family or variant (seeded), in eval mode, on its default attention."""
    config = tiny_config(name) if config is None else config
    model_type = VARIANTS.get(name, (name,))[0]
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
        input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
    )


def reference(model, ids, mask, new_tokens: int = 6) -> torch.Tensor:
    """Hugging Face's DynamicCache on the model's own attention."""
    return greedy(model, ids, mask, DynamicCache(config=model.config), new_tokens)
