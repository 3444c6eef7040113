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

from families import FAMILIES, build_model, greedy, prompts, reference


#: Families this sweep cannot run, with the reason; the check is the same error type and the runs fail.
NOT_RUNNABLE: dict[str, str] = {
    "axk1": "DynamicCache: RuntimeError: shape '[-1, 8, 0]' is invalid for input of size 40",
    "axk2": 'DynamicCache: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dime',
    "bailing_hybrid": "DynamicCache: RuntimeError: shape '[-1, 8, 0]' is invalid for input of size 40",
    "beam": "DynamicCache: RuntimeError: shape '[-1, 8, 0]' is invalid for input of size 40",
    "blt": 'build: ValueError: blt: the tiny config still has 4475652672 parameters',
    "cohere_compass_text": "build: KeyError: 'full_attention'",
    "cpmant": 'build: ValueError: cpmant: the tiny config still has 4284736 parameters',
    "dbrx": "build: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "dots3_note": "build: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': Valu",
    "dots3_note_text": "build: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': Valu",
    "falcon_mamba": "DynamicCache: ValueError: The following `model_kwargs` are not used by the model: ['past_key_values'] (note: t",
    "fuyu": 'build: OSError: AutoConfig is designed to be instantiated using the `AutoConfig.from_pretrained(pretrained_mod',
    "gemma3": 'build: ValueError: gemma3: the tiny config still has 93165312 parameters',
    "gemma3n": 'build: ImportError: TimmWrapperModel requires the timm library but it was not found in your environment. You c',
    "gemma4": 'build: ValueError: gemma4: the tiny config still has 403561824 parameters',
    "gemma4_assistant": 'build: OSError: AutoConfig is designed to be instantiated using the `AutoConfig.from_pretrained(pretrained_mod',
    "gemma4_unified_assistant": 'build: OSError: AutoConfig is designed to be instantiated using the `AutoConfig.from_pretrained(pretrained_mod',
    "git": 'build: ValueError: git: the tiny config still has 85965120 parameters',
    "got_ocr2": 'build: OSError: AutoConfig is designed to be instantiated using the `AutoConfig.from_pretrained(pretrained_mod',
    "gpt_neo": "build: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': Valu",
    "inkling2_text": 'build: ValueError: inkling2_text: the tiny config still has 7181056 parameters',
    "inkling_text": 'build: ValueError: inkling_text: the tiny config still has 7245094 parameters',
    "kimi_linear": 'build: ValueError: kimi_linear: the tiny config still has 8850784 parameters',
    "lfm2_moe": "build: TypeError: 'NoneType' object is not subscriptable",
    "longcat_flash": 'build: ValueError: longcat_flash: the tiny config still has 73452160 parameters',
    "mamba": "DynamicCache: ValueError: The following `model_kwargs` are not used by the model: ['past_key_values'] (note: t",
    "mamba2": "build: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': Valu",
    "minimax": 'DynamicCache: ValueError: MiniMax uses cache of its own and is not compatible with `past_key_values` of type <',
    "moss_transcribe_diarize": 'build: OSError: AutoConfig is designed to be instantiated using the `AutoConfig.from_pretrained(pretrained_mod',
    "musicgen": "build: AttributeError: 'MusicgenConfig' object has no attribute 'dropout'",
    "musicgen_melody": "build: AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout'",
    "openai-gpt": "DynamicCache: ValueError: The following `model_kwargs` are not used by the model: ['past_key_values'] (note: t",
    "phi4_multimodal": 'build: ValueError: phi4_multimodal: the tiny config still has 870129792 parameters',
    "prophetnet": 'build: NotImplementedError: This model does not support the setting of `num_hidden_layers`. Please set `num_en',
    "qwen4_exp": "build: AttributeError: 'Qwen4ExpConfig' object has no attribute 'vocab_size'",
    "qwen4_exp_text": "build: TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
    "reformer": 'build: AssertionError: If you want to use `ReformerModelWithLMHead` make sure that `is_decoder=True`.',
    "roc_bert": 'build: ValueError: roc_bert: the tiny config still has 13624832 parameters',
    "xlm": 'build: ValueError: xlm: the tiny config still has 102031488 parameters',
    "xlnet": 'DynamicCache: TypeError: tuple indices must be integers or slices, not tuple',
    "xlstm": 'DynamicCache: ValueError: matC_old has wrong shape, got torch.Size([1, 4, 16, 16])',
    "xmod": 'DynamicCache: ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()`',
    "zamba": 'build: ValueError: There is an issue with your definition of `tie_weights_keys` for ^layers.2.shared_transf:^l',
    "zaya": "build: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': Valu",
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


@pytest.mark.parametrize("family", FAMILIES)
def test_family_generates_like_dynamic_cache(family):
    kind, why = _outcome(family)
    if family in NOT_RUNNABLE:
        assert kind == "not_runnable", f"{family} now runs ({kind}: {why}): remove it from NOT_RUNNABLE"
    elif family in EXPECTED_UNSUPPORTED:
        assert kind == "unsupported", f"{family} now {kind} ({why}): remove it from EXPECTED_UNSUPPORTED"
    else:
        assert kind == "ok", f"{family}: {kind}: {why}"


def test_tables_name_only_families_of_this_transformers():
    assert set(NOT_RUNNABLE) <= set(FAMILIES), set(NOT_RUNNABLE) - set(FAMILIES)
    assert set(EXPECTED_UNSUPPORTED) <= set(FAMILIES), set(EXPECTED_UNSUPPORTED) - set(FAMILIES)
    assert not set(NOT_RUNNABLE) & set(EXPECTED_UNSUPPORTED)
