"""``kvcache.train.chunked_loss`` against references written here, in float64 on tiny random models.

- A budget that covers the sequence: loss and every parameter gradient equal plain
  ``model(ids, labels=ids).loss.backward()`` on the model's own attention.
- With eviction: the gradients equal autograd through one forward pass over the whole sequence whose
  attention applies, per layer and KV head, the decisions ``kvcache.prefill`` made with the same
  cache (a query of chunk ``c`` sees its own chunk causally and what the cache kept after chunk
  ``c - 1``), keeping the whole graph. ``"detach"`` and ``k`` equal the same pass with the keys
  and values of earlier groups of chunks detached.

Tolerance: float64 throughout; the two computations order their sums differently, so they agree to
about 1e-13 relative; 1e-9 leaves room and still catches any missing or extra gradient term
(those are of the order of the gradients themselves).
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.apps.tiny import tiny_model
from kvcache.attention import Visibility
from kvcache.errors import UnsupportedOperation
from kvcache.hf import FORWARD_STEP, use_kvcache_attention
from kvcache.train import chunked_loss

TOL = {"rtol": 1e-9, "atol": 1e-12}


def model_of(family: str, **overrides) -> torch.nn.Module:
    return tiny_model(family, dtype=torch.float64, **overrides)


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(ours: dict, theirs: dict, rtol: float = TOL["rtol"]) -> None:
    """Every gradient equal within ``rtol``, elementwise and of the tensor's largest entry."""
    assert ours.keys() == theirs.keys()
    for name in theirs:
        scale = float(theirs[name].abs().max())
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=max(TOL["atol"], rtol * scale), msg=lambda m: f"{name}: {m}")


# ---- the reference with recorded decisions ------------------------------------------------------


def recorded_decisions(model, ids, spec, chunk) -> list[list[torch.Tensor]]:
    """The positions each layer of ``spec``'s cache kept after each chunk of ``kvcache.prefill``."""
    cache = kvcache.make_cache(model, spec)
    kept = []
    for start in range(0, ids.shape[1], chunk):
        kvcache.prefill(model, ids[:, start : start + chunk], cache, chunk=chunk)
        kept.append([layer.positions().expand(*layer.view()[0].shape[:3]).clone() for layer in cache.kv_layers])
    return kept


class WholeSequence:
    """One forward pass over the whole sequence whose attention applies recorded decisions as masks,
    and detaches the keys and values of earlier groups of ``per_group`` chunks."""

    def __init__(self, length, chunk, kept, bands, per_group):
        self.length, self.chunk, self.kept, self.bands, self.per_group = length, chunk, kept, bands, per_group

    def attend(self, module, query, key, value, scaling, kwargs):
        layer = module.layer_idx
        batch, q_heads, length, dim = query.shape
        kv_heads = key.shape[1]
        pos = torch.arange(length)
        chunk_of = pos // self.chunk
        n_chunks = int(chunk_of[-1]) + 1
        # in_state[b, h, c, t]: position t is in the state chunk c attends (kept after chunk c - 1)
        in_state = torch.zeros(batch, kv_heads, n_chunks, length, dtype=torch.bool)
        for c in range(1, n_chunks):
            in_state[:, :, c].scatter_(-1, self.kept[c - 1][layer], True)
        own_chunk = (chunk_of[:, None] == chunk_of[None, :]) & (pos[None, :] <= pos[:, None])
        allowed = own_chunk | in_state[:, :, chunk_of, :]  # [B, Hkv, L, L]
        band = self.bands[layer]
        if band is not None:
            allowed = allowed & band(pos.view(-1, 1), pos.view(1, -1))
        group_of = chunk_of // self.per_group
        dead = group_of[None, :] < group_of[:, None]  # [L, L]: a key of an earlier group
        g = q_heads // kv_heads
        allowed = allowed.repeat_interleave(g, dim=1)
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        live = query @ k.transpose(-1, -2) * scaling
        frozen = query @ k.detach().transpose(-1, -2) * scaling
        scores = torch.where(dead, frozen, live)
        if kwargs.get("softcap") is not None:
            cap = kwargs["softcap"]
            scores = cap * torch.tanh(scores / cap)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = (weights * ~dead) @ v + (weights * dead) @ v.detach()
        return out.transpose(1, 2)


def reference(model, ids, spec, chunk, per_group, bands) -> tuple[float, dict]:
    kept = recorded_decisions(model, ids, spec, chunk)
    step = WholeSequence(ids.shape[1], chunk, kept, bands, per_group)
    with use_kvcache_attention(model):
        loss = lm_loss(model(input_ids=ids, use_cache=False, **{FORWARD_STEP: step}).logits, ids)
    loss.backward()
    return float(loss.detach()), grads(model)


def model_bands(model) -> list[Visibility | None]:
    """Each layer's sliding band from the model's config (None: full attention)."""
    config = model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [Visibility(window) if t == "sliding_attention" and window else None for t in types]


def lm_loss(logits, labels):
    """transformers' causal LM loss (shift, ignore -100, mean) without its cast of the logits to
    float32, so a float64 model's loss stays float64."""
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def plain(model, ids, labels=None) -> tuple[float, dict]:
    loss = lm_loss(model(input_ids=ids).logits, ids if labels is None else labels)
    loss.backward()
    return float(loss.detach()), grads(model)


def ours(model, ids, spec, chunk, grad="replay", labels=None):
    result = chunked_loss(model, ids, spec, chunk=chunk, grad=grad, labels=labels)
    return result, grads(model)


# ---- a budget that covers the sequence is plain training -------------------------------------


#: gemma2 computes its RMSNorm in float32 even in a float64 model (and transformers' eager
#: attention, which it runs for its logit cap, takes the softmax in float32): its gradients carry
#: float32 rounding, summed in another order over chunks than over the whole sequence (1e-8 of the
#: largest entry here), so that family is compared at 1e-6.
RTOL = {"gemma2": 1e-6}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("spec", ["growable", "h2o:budget=64"])
def test_a_budget_covering_the_sequence_is_plain_autograd(family, spec):
    """mistral's layers all slide (window 16), gemma2's alternate and cap logits; 45 tokens in
    chunks of 13 (not a divisor)."""
    model = model_of(family)
    ids = ids_of(2, 45)
    loss, expected = plain(model, ids)
    result, got = ours(model, ids, spec, 13)
    rtol = RTOL.get(family, TOL["rtol"])
    assert result.loss == pytest.approx(loss, rel=rtol)
    assert result.tokens == 2 * 44 and result.chunks == 4 and result.groups == 1
    assert_same_grads(got, expected, rtol)


def test_labels_with_ignored_positions_count_only_the_rest():
    model = model_of("llama")
    ids = ids_of(1, 40, seed=1)
    labels = ids.clone()
    labels[:, :10] = -100
    labels[:, 25] = -100
    loss, expected = plain(model, ids, labels)
    result, got = ours(model, ids, "growable", 16, labels=labels)
    assert result.loss == pytest.approx(loss, rel=1e-12) and result.tokens == 40 - 1 - 9 - 1  # label 0 is nobody's target
    assert_same_grads(got, expected)


def test_only_parameters_that_require_gradients_get_them():
    model = model_of("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name or "v_proj" in name)
    ids = ids_of(1, 30)
    _, expected = plain(model, ids)
    _, got = ours(model, ids, "h2o:budget=64", 8)
    assert got.keys() == expected.keys() and all("q_proj" in n or "v_proj" in n for n in got)
    assert_same_grads(got, expected)


# ---- eviction: replayed decisions ----------------------------------------------------------------


EVICTING = [
    "h2o:budget=12", "tova:budget=12", "tova-layer:budget=12", "lastrec:budget=12", "snapkv:budget=12,window=4,pool=3",
    "pyramidkv:budget=14,window=4", "kvzip:budget=12,queries=prompt",
]  # fmt: skip


@pytest.mark.parametrize("spec", EVICTING)
def test_replay_equals_autograd_over_the_recorded_decisions(spec):
    model = model_of("llama")
    ids = ids_of(2, 50, seed=2)
    loss, expected = reference(model, ids, spec, 11, per_group=10**9, bands=[None] * 4)
    result, got = ours(model, ids, spec, 11)
    assert result.loss == pytest.approx(loss, rel=1e-12)
    assert_same_grads(got, expected)


def test_replay_of_a_window_with_sinks():
    spec = "window:window=10,sinks=2"
    model = model_of("qwen2")
    ids = ids_of(1, 47, seed=3)
    band = Visibility(10, 2)
    loss, expected = reference(model, ids, spec, 9, per_group=10**9, bands=[band] * 4)
    result, got = ours(model, ids, spec, 9)
    assert result.loss == pytest.approx(loss, rel=1e-12)
    assert_same_grads(got, expected)


def test_replay_on_a_model_with_sliding_layers_and_eviction():
    model = model_of("gemma2")  # sliding, full, sliding, full; window 16; logit cap
    ids = ids_of(1, 52, seed=4)
    spec = "tova:budget=10"
    loss, expected = reference(model, ids, spec, 12, per_group=10**9, bands=model_bands(model))
    result, got = ours(model, ids, spec, 12)
    assert result.loss == pytest.approx(loss, rel=1e-12)
    assert_same_grads(got, expected, RTOL["gemma2"])


@pytest.mark.parametrize(("grad", "per_group"), [("detach", 1), (2, 2), (3, 3)])
def test_detach_and_k_equal_autograd_with_earlier_groups_detached(grad, per_group):
    model = model_of("llama")
    ids = ids_of(1, 60, seed=5)
    spec = "h2o:budget=14"
    loss, expected = reference(model, ids, spec, 10, per_group=per_group, bands=[None] * 4)
    result, got = ours(model, ids, spec, 10, grad=grad)
    assert result.loss == pytest.approx(loss, rel=1e-12)
    assert result.groups == -(-6 // per_group)
    assert_same_grads(got, expected)


def test_detach_differs_from_replay():
    """The modes are not the same computation (the comparisons above could not tell otherwise)."""
    model = model_of("llama")
    ids = ids_of(1, 40, seed=6)
    _, replayed = ours(model, ids, "h2o:budget=12", 10)
    _, detached = ours(model, ids, "h2o:budget=12", 10, grad="detach")
    name = "model.layers.0.self_attn.k_proj.weight"
    assert (replayed[name] - detached[name]).abs().max() > 1e-6 * replayed[name].abs().max()


def test_a_lora_adapter_gets_the_gradients_plain_training_gives_it():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(model_of("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():  # lora_B starts at zero: give it values so every gradient path carries something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = ids_of(1, 36)
    _, expected = plain(model, ids)
    _, got = ours(model, ids, "growable", 10)
    assert got and all("lora_" in n for n in got)
    assert_same_grads(got, expected)


# ---- memory ------------------------------------------------------------------------------------


class SavedBytes:
    """Bytes autograd holds for backward, counted by saved-tensor hooks, now and at the peak: each
    storage once however many operations saved it; the parameters not at all (held anyway)."""

    def __init__(self, model):
        self.now = self.peak = 0
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.users = {}

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def pack(self, tensor):
        return _Held(tensor, self)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, tensor, counter):
        self.tensor, self.counter = tensor, counter
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        self.nbytes = 0 if self.key in counter.skip else storage.nbytes()
        counter.users[self.key] = counter.users.get(self.key, 0) + 1
        if counter.users[self.key] == 1:
            counter.now += self.nbytes
            counter.peak = max(counter.peak, counter.now)

    def __del__(self):
        users = self.counter.users
        users[self.key] -= 1
        if users[self.key] == 0:
            del users[self.key]
            self.counter.now -= self.nbytes


def test_bytes_held_for_backward_do_not_grow_with_the_sequence():
    """h2o at a budget of 32, chunks of 32: 128 and 512 tokens. Plain autograd holds about 4x (and
    more: its attention weights grow with the square); chunked training holds one chunk's graph
    and two states, the same at both lengths. The archive (keys and values by position, outside
    autograd) is the one store that grows: the sequence's keys and values, once."""
    model = tiny_model("llama", dtype=torch.float32)
    held, plain_held, archives = {}, {}, {}
    for length in (128, 512):
        ids = ids_of(1, length)
        with SavedBytes(model) as counter:
            result = chunked_loss(model, ids, "h2o:budget=32", chunk=32)
        held[length], archives[length] = counter.peak, result.archive_bytes
        with SavedBytes(model) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        plain_held[length] = counter.peak
        model.zero_grad(set_to_none=True)
    assert held[512] <= 1.10 * held[128], held
    assert plain_held[512] >= 3.5 * plain_held[128], plain_held
    config = model.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert archives == {n: (n + 1) * per_position for n in (128, 512)}


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk": 0}, "chunk must be a positive"),
        ({"grad": "all"}, "grad must be 'replay', 'detach' or a positive"),
        ({"grad": 0}, "grad must be"),
        ({"labels": torch.zeros(1, 5, dtype=torch.long)}, "labels must have input_ids' shape"),
        ({"labels": torch.full((1, 12), -100)}, "no position has a label"),
    ],
)
def test_bad_arguments_are_refused_before_any_gradient(kwargs, match):
    model = model_of("llama")
    with pytest.raises(ValueError, match=match):
        chunked_loss(model, ids_of(1, 12), **kwargs)
    assert all(p.grad is None for p in model.parameters())


def test_a_model_with_nothing_to_train_is_told_to_use_cache_loss():
    model = model_of("llama").requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of the model requires a gradient; for the loss alone use kvcache.train.cache_loss"):
        chunked_loss(model, ids_of(1, 12))


def test_cache_loss_is_the_loss_chunked_loss_reports():
    from kvcache.train import cache_loss

    model = model_of("llama")
    ids = ids_of(1, 40, seed=8)
    result = chunked_loss(model, ids, "tova:budget=10", chunk=12)
    assert cache_loss(model, ids, "tova:budget=10", chunk=12) == pytest.approx(result.loss, rel=1e-12)


def test_bad_input_ids_are_refused():
    model = model_of("llama")
    for bad in (torch.zeros(12, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 4)):
        with pytest.raises(ValueError, match="input_ids must be a non-empty"):
            chunked_loss(model, bad)


def test_unreplayable_kinds_and_dropout_are_refused():
    model = model_of("llama")
    with pytest.raises(UnsupportedOperation, match="cannot replay a 'adakv' cache"):
        chunked_loss(model, ids_of(1, 12), "adakv:budget=8")
    with pytest.raises(UnsupportedOperation, match="cannot replay a 'auto' cache: it may recode"):
        chunked_loss(model, ids_of(1, 12), "auto:bytes=0.25")
    with pytest.raises(UnsupportedOperation, match="cannot replay a 'auto-heads' cache: it keeps every head's slots in one flat"):
        chunked_loss(model, ids_of(1, 12), "auto-heads:bytes=0.25")
    for coded in ("quantized:bits=4", "h2o:budget=8,storage=int8"):
        with pytest.raises(UnsupportedOperation, match="does not replay coded storage yet"):
            chunked_loss(model, ids_of(1, 12), coded)
    assert all(p.grad is None for p in model.parameters())
    dropping = model_of("llama", attention_dropout=0.1).train()
    with pytest.raises(UnsupportedOperation, match="dropout is on"):
        chunked_loss(dropping, ids_of(1, 12))
    assert all(p.grad is None for p in dropping.parameters())
