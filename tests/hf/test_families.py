"""Every causal-LM family in ``transformers``: greedy generation with ``make_cache(model)`` on the
``"kvcache"`` attention is token-identical to ``DynamicCache(config=model.config)`` on the model's
own attention, for one prompt and a 2-row left-padded batch (``families.py`` builds the models).

Two tables name the exceptions, and both are asserted exact, so a new ``transformers`` shows
what broke and what got fixed: ``NOT_RUNNABLE`` (cannot be built tiny here, or does not run on
``input_ids`` even with ``DynamicCache``) and ``EXPECTED_UNSUPPORTED`` (our cache fails: refuses,
raises or differs). An entry that starts working fails its test until it is removed.
"""

import warnings

import pytest
import torch
import transformers

import kvcache

from families import CASES, build_model, greedy, prompts, reference


#: Families this sweep cannot run, with the reason; the check is the same error type and the runs fail.
NOT_RUNNABLE: dict[str, str] = {
    'blt': 'builder limit, not yet shrunk: patcher/encoder/decoder/global sub-configs keep their defaults (4.5G parameters)',
    'cpmant': 'builder limit, not yet shrunk: 4.3M parameters (its own dim_model/dim_ff/prompt fields)',
    'dots3_note': 'builder limit, not yet shrunk: 39M parameters (vision/audio adapters sized by their own fields)',
    'dots3_note_text': 'builder limit, not yet shrunk: 39M parameters (MLA + mlp_layer_types fields not shrunk)',
    'falcon_mamba': 'no Cache path: the model takes no past_key_values (its state goes in cache_params, a MambaCache of its own)',
    'fuyu': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'gemma3n': 'needs timm (uninstalled): its vision tower is a TimmWrapperModel; gemma3n_text covers the decoder',
    'gemma4_assistant': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'gemma4_unified_assistant': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'git': 'builder limit, not yet shrunk: its vision_config keeps its defaults (86M parameters)',
    'got_ocr2': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'inkling2_text': 'builder limit, not yet shrunk: 7.2M parameters (fields of its own not shrunk)',
    'inkling_text': 'builder limit, not yet shrunk: 7.2M parameters (fields of its own not shrunk)',
    'kimi_linear': 'builder limit, not yet shrunk: 8.9M parameters (its linear-attention head fields not shrunk)',
    'longcat_flash': 'builder limit, not yet shrunk: 73M parameters (its own MoE/MLA fields not shrunk)',
    'mamba': 'no Cache path: the model takes no past_key_values (its state goes in cache_params, a MambaCache of its own)',
    'mamba2': 'no Cache path: the model takes no past_key_values (its state goes in cache_params, a Mamba2Cache of its own)',
    'minimax': 'the reference refuses: MiniMax raises on any past_key_values that is not its own cache class',
    'moss_transcribe_diarize': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'musicgen': 'builder limit, not yet shrunk: the composite MusicgenConfig is given, the decoder needs MusicgenDecoderConfig (no dropout)',
    'musicgen_melody': 'builder limit, not yet shrunk: the composite config is given, the decoder needs MusicgenMelodyDecoderConfig (no dropout)',
    'openai-gpt': 'no Cache path: the model takes no past_key_values (GPT-1 recomputes the whole prefix each step)',
    'phi4_multimodal': 'builder limit, not yet shrunk: audio/vision sub-configs keep their defaults (870M parameters)',
    'prophetnet': 'builder limit, not yet shrunk: refuses num_hidden_layers: needs num_encoder_layers/num_decoder_layers',
    'reformer': 'builder limit, not yet shrunk: needs is_decoder=True (and its own LSH/local attention layer sizes)',
    'roc_bert': 'builder limit, not yet shrunk: 13.6M parameters (its pronunciation/shape embedding vocabularies)',
    'xlm': 'builder limit, not yet shrunk: 102M parameters (emb_dim/n_layers spelled its own way)',
    'xlnet': "no Cache path: the model takes no past_key_values: the reference breaks (XLNet's mems are a tuple, generate hands it a Cache: TypeError)",
    'xlstm': "the reference breaks: DynamicCache is not xLSTM's cache (ValueError: matC_old has wrong shape)",
    'xmod': 'no input_ids-only path: X-MOD needs a language id (set_default_language) before any forward',
}

#: Families where our cache fails, with the reason (shrink after merging the named branches).
EXPECTED_UNSUPPORTED: dict[str, str] = {
    "doge": "differs: Doge builds its additive dynamic mask over the slots the cache returns and slices Hugging Face's position mask to that many columns, which assumes slots in position order; its sliding layers are ring buffers here (per-head masks themselves are supported)",
}


def _outcome(family: str) -> tuple[str, str]:
    """("ok", ""), ("not_runnable", why) or ("unsupported", why), from one build and two runs each."""
    try:
        model = build_model(family)
    except Exception as e:  # noqa: BLE001 - the sweep records why a family cannot be built
        return "not_runnable", f"build: {type(e).__name__}: {str(e)[:120]}"
    for ids, mask in prompts():
        try:
            expected = reference(model, ids, mask)
        except Exception as e:  # noqa: BLE001
            return "not_runnable", f"DynamicCache: {type(e).__name__}: {str(e)[:120]}"
        try:
            with kvcache.use_kvcache_attention(model):
                got = greedy(model, ids, mask, kvcache.make_cache(model))
        except Exception as e:  # noqa: BLE001
            return "unsupported", f"{type(e).__name__}: {str(e)[:200]}"
        if not torch.equal(got, expected):
            return "unsupported", f"tokens differ (batch {ids.shape[0]}): expected {expected.tolist()}, got {got.tolist()}"
    return "ok", ""


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("family", CASES)
def test_family_generates_like_dynamic_cache(family):
    kind, why = _outcome(family)
    if family in NOT_RUNNABLE:
        assert kind == "not_runnable", f"{family} now runs ({kind}: {why}): remove it from NOT_RUNNABLE"
    elif family in EXPECTED_UNSUPPORTED:
        assert kind == "unsupported", f"{family} now {kind} ({why}): remove it from EXPECTED_UNSUPPORTED"
    else:
        assert kind == "ok", f"{family}: {kind}: {why}"


def test_tables_name_only_families_of_this_transformers():
    assert set(NOT_RUNNABLE) <= set(CASES), set(NOT_RUNNABLE) - set(CASES)
    assert set(EXPECTED_UNSUPPORTED) <= set(CASES), set(EXPECTED_UNSUPPORTED) - set(CASES)
    assert not set(NOT_RUNNABLE) & set(EXPECTED_UNSUPPORTED)
