"""Score once, compress many ways (``kvcache.hf.scoring``), and KVzip's repetition scores.

References: each spec's own one-pass prefill through ``generate`` (what ``compress`` must
reproduce: the same kept slots and the same greedy tokens after), and for KVzip the softmax
weights of Hugging Face's eager attention (``output_attentions``) over the context, maximised over
the repetition's queries in plain torch.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from helpers import model_for, prompt
from kvcache import cache_kwargs
from kvcache.hf import scoring

PROMPT, NEW = 40, 8
SPECS = (
    "h2o:budget=16",
    "tova:budget=12,sinks=2",
    "lastrec:budget=0.5",
    "kvzip:budget=20,queries=prompt",
    "snapkv:budget=16,window=8,pool=3",
    "pyramidkv:budget=0.5,window=4",
    "tova-layer:budget=12",
    "adakv:budget=12,window=4",
    "h2o:budget=16,storage=int4",
    "quantized:bits=4,group_size=16,residual=8",
    "growable",
)
MODES = ("sum", "last", "max", "window:8", "window:4")


def _stores(cache):
    return [s for s in cache.kv_layers if s is not None]


def _greedy_from(model, cache, first: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy tokens after ``first`` ``[B, 1]`` (the prompt's next token), one pass each."""
    out, token = [first], first
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        for _ in range(steps):
            logits = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            out.append(token)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("spec", SPECS)
def test_compress_from_one_recording_equals_each_specs_own_prefill(spec):
    """One recording pass, then ``compress`` for a spec, holds the slots the spec's own prefill
    keeps (positions and keys per head) and decodes the same greedy tokens."""
    model = model_for("llama")
    ids = prompt(PROMPT, seed=3, batch=2)
    rec = scoring.recording_cache(model, MODES)
    own = kvcache.make_cache(model, spec)
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        logits = model(ids, **cache_kwargs(model, rec), use_cache=True).logits[:, -1]
        own_logits = model(ids, **cache_kwargs(model, own), use_cache=True).logits[:, -1]
    torch.testing.assert_close(logits, own_logits, rtol=1e-4, atol=1e-4)  # the same pass: attention order only
    weights = {mode: scoring.recorded(rec, mode) for mode in MODES}
    ours = scoring.compress(model, spec, scoring.keys_values(rec), weights)
    for mine, theirs in zip(_stores(ours), _stores(own)):
        assert mine.length == theirs.length and mine.seen == theirs.seen == PROMPT
        if hasattr(theirs, "positions"):
            assert torch.equal(mine.positions(), theirs.positions())
        k1, _ = mine.view()
        k2, _ = theirs.view()
        # Bit-equal where both passes attend alike; a spec that asks for fewer weights attends its
        # early rows through fused SDPA, whose float32 sums come in another order (1e-6 measured).
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
    first = logits.argmax(-1, keepdim=True)
    assert torch.equal(_greedy_from(model, ours, first, NEW), _greedy_from(model, own, first, NEW))


def test_compress_says_which_weights_are_missing():
    model = model_for("llama")
    rec = scoring.recording_cache(model, ("last",))
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        model(prompt(20), **cache_kwargs(model, rec), use_cache=True)
    with pytest.raises(KeyError, match="'sum'"):
        scoring.compress(model, "h2o:budget=8", scoring.keys_values(rec), {"last": scoring.recorded(rec, "last")})
    with pytest.raises(ValueError, match="does not attend every earlier token"):
        scoring.compress(model, "window:window=8,sinks=2", scoring.keys_values(rec))
    with pytest.raises(ValueError, match="no weights recorded in mode 'max'"):
        scoring.recorded(rec, "max")
