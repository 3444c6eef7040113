"""Every causal-LM family in ``transformers``: greedy generation with ``make_cache(model)`` is
token-identical to ``DynamicCache(config=model.config)`` on the model's own attention, for one
prompt and a 2-row left-padded batch (``families.py`` builds the models), both on the model's own
attention (no switch: the default cache must just work) and on the ``"kvcache"`` attention
(``use_kvcache_attention``, the fast path). Prompts pass the tiny configs' windows of 4 tokens and
the runs are long enough for a sliding layer's kept run to move to the front of its buffer.

A family whose tokens differ fails: there is no list of expected mismatches. Two tables name the
exceptions, both asserted exact, so a new ``transformers`` shows what broke and what got fixed:
``NOT_RUNNABLE`` (cannot be built tiny here, or does not run on ``input_ids`` even with
``DynamicCache``) and ``REFUSED`` (kvcache refuses the family up front with ``UnsupportedOperation``,
before anything changed, naming what it cannot do). An entry that starts working fails its test
until it is removed.

Bounded kinds (a ring, an eviction policy, coded storage) run on the ``"kvcache"`` attention with
budgets no run reaches, so they too must give ``DynamicCache``'s tokens, unless kvcache refuses
them for the family before the first token is written (``support.py`` says which and why).
"""

import contextlib
import functools
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

import kvcache

from families import CASES, build_model, greedy, prompts, reference


#: Families this sweep cannot run, with the reason; the check is the same error type and the runs fail.
NOT_RUNNABLE: dict[str, str] = {
    'blt': 'builder limit, not yet shrunk: patcher/encoder/decoder/global sub-configs keep their defaults (4.5G parameters)',
    'cpmant': 'builder limit, not yet shrunk: 4.3M parameters (its own dim_model/dim_ff/prompt fields)',
    'dots3_note': 'builder limit, not yet shrunk: 39M parameters (vision/audio adapters sized by their own fields)',
    'falcon_mamba': 'no Cache path: the model takes no past_key_values (its state goes in cache_params, a MambaCache of its own)',
    'fuyu': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'gemma3n': 'needs timm (uninstalled): its vision tower is a TimmWrapperModel; gemma3n_text covers the decoder',
    'gemma4_assistant': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'gemma4_unified_assistant': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
    'git': 'builder limit, not yet shrunk: its vision_config keeps its defaults (86M parameters)',
    'got_ocr2': 'from_pretrained only: its config cannot be built from defaults (AutoConfig raises OSError)',
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

#: Families kvcache refuses up front (``UnsupportedOperation`` from ``make_cache`` or the switch,
#: before anything changed), with a fragment of the message it gives.
REFUSED: dict[str, str] = {}

if Version(transformers.__version__) >= Version("5.24"):
    # transformers 5.24 runs the Mamba family through the generic Cache (their state as
    # linear-attention layers): nothing for kvcache to hold, which make_cache says.
    for _family in ("falcon_mamba", "mamba", "mamba2"):
        del NOT_RUNNABLE[_family]
        REFUSED[_family] = "this model has no attention layer"
    del NOT_RUNNABLE["xlnet"]  # 5.24 gave XLNet a Cache path; it runs like DynamicCache
    NOT_RUNNABLE["dory"] = "the reference breaks in 5.24: DynamicCache generation raises a size mismatch in its attention"
    REFUSED["inkling2_loop_text"] = "runs some of its 6 layers more than once"

#: New tokens per run: a 10-token prompt plus these passes a sliding layer's spare room
#: (``window - 1 + 16`` slots for the tiny configs' window of 4), so the kept run moves once.
NEW_TOKENS = 12


@functools.cache
def _built(family: str) -> torch.nn.Module | str:
    """The family's tiny model, built once for both sweeps of this file (no run changes its
    weights; the switch is undone after each), or why it cannot be built."""
    try:
        return build_model(family)
    except Exception as e:  # noqa: BLE001 - the sweep records why a family cannot be built
        return f"build: {type(e).__name__}: {str(e)[:120]}"


@functools.cache
def _expected(family: str, which: int) -> torch.Tensor | str:
    """``DynamicCache``'s tokens for prompt ``which`` of ``prompts()``, computed once, or why not."""
    model = _built(family)
    if isinstance(model, str):
        return model
    ids, mask = prompts()[which]
    try:
        return reference(model, ids, mask, NEW_TOKENS)
    except Exception as e:  # noqa: BLE001
        return f"DynamicCache: {type(e).__name__}: {str(e)[:120]}"


def _outcome(family: str) -> tuple[str, str]:
    """("ok", ""), ("not_runnable", why), ("refused", message) or ("differs", how), from one build
    and, for each prompt, the reference and our default cache without and with the switch."""
    model = _built(family)
    if isinstance(model, str):
        return "not_runnable", model
    for which, (ids, mask) in enumerate(prompts()):
        expected = _expected(family, which)
        if isinstance(expected, str):
            return "not_runnable", expected
        for switch in (False, True):
            where = "on the kvcache attention" if switch else "on its own attention"
            try:
                with kvcache.use_kvcache_attention(model) if switch else contextlib.nullcontext():
                    cache = kvcache.make_cache(model)
                    got = greedy(model, ids, mask, cache, NEW_TOKENS)
            except kvcache.UnsupportedOperation as e:
                return "refused", f"{where}: {e}"
            except Exception as e:  # noqa: BLE001
                return "differs", f"{where}: raised {type(e).__name__}: {str(e)[:200]}"
            if not torch.equal(got, expected):
                return "differs", f"{where}, batch {ids.shape[0]}: expected {expected.tolist()}, got {got.tolist()}"
    return "ok", ""


#: Bounded kinds whose budgets a sweep run never reaches: each must give DynamicCache's tokens, or
#: be refused before anything is written (``UnsupportedOperation``, the cache still empty).
BOUNDED = ("h2o:budget=4096", "window:window=4096", "quantized:bits=8,group_size=4,residual=64")


def _bounded_outcome(family: str, spec: str) -> tuple[str, str]:
    """Like ``_outcome`` for a bounded spec on the ``"kvcache"`` attention, with the left-padded batch."""
    model, expected = _built(family), _expected(family, 1)
    if isinstance(expected, str):
        return "not_runnable", expected
    ids, mask = prompts()[1]
    cache = None
    try:
        with kvcache.use_kvcache_attention(model):
            cache = kvcache.make_cache(model, spec)
            got = greedy(model, ids, mask, cache, NEW_TOKENS)
    except kvcache.UnsupportedOperation as e:
        if cache is not None and cache.seen:
            return "differs", f"refused only after {cache.seen} tokens: {e}"
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001
        return "differs", f"raised {type(e).__name__}: {str(e)[:200]}"
    if not torch.equal(got, expected):
        return "differs", f"expected {expected.tolist()}, got {got.tolist()}"
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
    elif family in REFUSED:
        assert kind == "refused" and REFUSED[family] in why, f"{family}: expected a refusal saying {REFUSED[family]!r}, got {kind}: {why}"
    else:
        assert kind == "ok", f"{family}: {kind}: {why}"


@pytest.mark.parametrize("family", [c for c in CASES if c not in NOT_RUNNABLE])
def test_bounded_kinds_with_unreached_budgets_generate_like_dynamic_cache_or_refuse_up_front(family):
    outcomes = {spec: _bounded_outcome(family, spec) for spec in BOUNDED}
    wrong = {spec: why for spec, (kind, why) in outcomes.items() if kind == "differs"}
    assert not wrong, f"{family}: {wrong}"


def test_tables_name_only_families_of_this_transformers():
    assert set(NOT_RUNNABLE) <= set(CASES), set(NOT_RUNNABLE) - set(CASES)
    assert set(REFUSED) <= set(CASES), set(REFUSED) - set(CASES)
    assert not set(NOT_RUNNABLE) & set(REFUSED)
