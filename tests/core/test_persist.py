"""Persistence, snapshots, forks and rollback through real (tiny) models.

References: an uninterrupted run of the same model with Hugging Face's ``DynamicCache`` (tokens
and logits), and the cache's own content before the operation (bit-exact). Damaged files are made
by cutting or flipping bytes of a real saved file, foreign ones with ``safetensors`` directly.
"""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from kvcache.layers import SlidingLayer, WindowLayer
from helpers import LOGITS_TOL, attention_for, hf_attention, model_for, prompt
from kvcache.apps.tiny import tiny_model

SPECS = ("growable", "static:capacity=96", "concat")
PERSIST_FAMILIES = ("llama", "mistral", "gemma2")  # full / all sliding / hybrid
PROMPT_LEN = 40  # longer than the sliding window (16)


# ---- shared helpers ---------------------------------------------------------------------------




def feed(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Run ``ids`` (the uncached tokens) through the model; last-position logits ``[B, V]``."""
    with torch.no_grad(), attention_for(model, cache):
        return model(ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]


def generate(model, ids: torch.Tensor, cache: kvcache.KVCache, n: int) -> torch.Tensor:
    """Greedy ``generate`` of ``n`` tokens into ``cache``, on the kvcache attention."""
    with attention_for(model, cache):
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, do_sample=False)


def greedy_loop(model, cache, first: torch.Tensor, n: int) -> torch.Tensor:
    """Feed ``first``, then greedily ``n`` tokens; returns them ``[B, n]`` (the last one not fed)."""
    tokens = [feed(model, cache, first).argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        tokens.append(feed(model, cache, tokens[-1]).argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def forced_logits(model, cache, first: torch.Tensor, then: torch.Tensor) -> list[torch.Tensor]:
    """Feed ``first``, then the tokens of ``then`` one at a time; logits after each call."""
    out = [feed(model, cache, first)]
    for t in range(then.shape[1]):
        out.append(feed(model, cache, then[:, t : t + 1]))
    return out


def reference_generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Uninterrupted greedy generation with Hugging Face's DynamicCache: ids + n new tokens."""
    with hf_attention(model):
        return model.generate(
            ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=n, do_sample=False
        )


def content(cache: kvcache.KVCache) -> list:
    """A deep copy of everything a cache holds, per layer: kind, options, seen, keys, values."""
    out = []
    for store in cache.kv_layers:
        if store is None:
            out.append(None)
            continue
        keys, values = store.view()
        out.append(
            (
                store.kind,
                store.options(),
                store.seen,
                store.length,
                None if keys is None else keys.clone(),
                None if values is None else values.clone(),
            )
        )
    return out


def assert_same_content(a: list, b: list, what: str = "") -> None:
    """Bit-exact equality of two ``content`` results (dtype included)."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what} layer {i}"
            continue
        assert x[:4] == y[:4], f"{what} layer {i}: (kind, options, seen, length) {x[:4]} vs {y[:4]}"
        for name, s, t in (("keys", x[4], y[4]), ("values", x[5], y[5])):
            if s is None or t is None:
                assert s is None and t is None, f"{what} layer {i} {name}"
                continue
            assert s.dtype == t.dtype and s.shape == t.shape, f"{what} layer {i} {name}"
            # Compare the bits, so that -0.0 vs 0.0 or NaN payloads count too.
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[s.element_size()]
            assert torch.equal(s.view(bits), t.view(bits)), f"{what} layer {i} {name}: bytes differ"


def assert_close_logits(ours: list[torch.Tensor], ref: list[torch.Tensor], what: str = "") -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, **LOGITS_TOL, msg=lambda m: f"{what} step {step}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what} step {step}: argmax differs"


def saved_file(tmp_path, family: str = "gemma2", spec: str = "growable", tokens: int = 12):
    """A real cache file: (model, cache, path, raw bytes, header length)."""
    model = model_for(family)
    cache = kvcache.make_cache(model, spec)
    greedy_loop(model, cache, prompt(PROMPT_LEN, seed=20), tokens)
    path = tmp_path / "cache.kv"
    cache.save(path)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    return model, cache, path, raw, header_len


def header_of(raw: bytes) -> dict:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


# ---- save / load / continue ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", PERSIST_FAMILIES)
def test_save_load_continue_matches_uninterrupted_generation(family, spec, tmp_path):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=1)
    ref = reference_generate(model, ids, 30)

    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, ids, 10)  # 49 tokens cached: past the window of 16
    assert torch.equal(first, ref[:, PROMPT_LEN : PROMPT_LEN + 10])
    before = content(cache)
    path = tmp_path / "chat.kv"
    cache.save(path)
    assert_same_content(content(cache), before, "saving changed the cache")

    loaded = kvcache.load_cache(path, model)
    assert isinstance(loaded, kvcache.KVCache)
    assert str(loaded.spec) == str(cache.spec)
    assert [type(s) for s in loaded.kv_layers] == [type(s) for s in cache.kv_layers]
    assert loaded.seen == cache.seen == PROMPT_LEN + 9
    assert_same_content(content(loaded), before, "loaded cache")

    # Continue with a manual loop from the last (not yet fed) token ...
    rest = greedy_loop(model, loaded, first[:, -1:], 20)
    assert torch.equal(torch.cat([ids, first, rest], dim=1), ref)
    # ... and with generate on a second copy: the full ids so far, generate feeds the uncached one.
    again = kvcache.load_cache(path, model)
    out = generate(model, torch.cat([ids, first], dim=1), again, 20)
    assert torch.equal(out, ref)
    # The original cache was not disturbed by any of it and continues the same way.
    assert_same_content(content(cache), before, "original after load")
    assert torch.equal(greedy_loop(model, cache, first[:, -1:], 20), rest)


def test_load_keeps_static_capacity(tmp_path):
    model = model_for("llama")
    cache = kvcache.make_cache(model, "static:capacity=45")
    first = greedy_loop(model, cache, prompt(PROMPT_LEN, seed=2), 5)  # 44 of 45 slots used
    cache.save(tmp_path / "s.kv")
    loaded = kvcache.load_cache(tmp_path / "s.kv", model)
    assert all(s.capacity == 45 and s.options() == {"capacity": 45} for s in loaded.kv_layers)
    nxt = feed(model, loaded, first[:, -1:]).argmax(-1, keepdim=True)  # slot 45 of 45
    with pytest.raises(kvcache.CacheFullError, match="45"):
        feed(model, loaded, nxt)


def test_save_load_empty_cache(tmp_path):
    model = model_for("gemma2")
    cache = kvcache.make_cache(model)
    cache.save(tmp_path / "empty.kv")
    loaded = kvcache.load_cache(tmp_path / "empty.kv", model)
    assert loaded.seen == 0
    ids = prompt(PROMPT_LEN, seed=3)
    out = generate(model, ids, loaded, 20)
    assert torch.equal(out, reference_generate(model, ids, 20))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_half_precision_round_trip_keeps_dtype_and_bytes(dtype, tmp_path):
    model = model_for("gemma2", dtype=dtype)
    cache = kvcache.make_cache(model)
    first = greedy_loop(model, cache, prompt(PROMPT_LEN, seed=4), 8)
    before = content(cache)
    assert all(c[4].dtype == dtype for c in before)
    cache.save(tmp_path / "half.kv")
    loaded = kvcache.load_cache(tmp_path / "half.kv", model)
    assert_same_content(content(loaded), before, f"{dtype} round trip")
    for store in loaded.kv_layers:
        keys, values = store.view()
        assert keys.dtype == values.dtype == dtype and store.geometry.dtype == dtype
    # Identical bytes in, identical tokens out.
    assert torch.equal(greedy_loop(model, loaded, first[:, -1:], 8), greedy_loop(model, cache, first[:, -1:], 8))


# ---- snapshot / restore -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", PERSIST_FAMILIES)
def test_snapshot_restore_replays_bit_exactly(family, spec):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=5)
    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, ids, 12)
    at_snapshot = content(cache)
    snap = cache.snapshot()

    # 30 more tokens: enough for sliding layers to move their kept window inside their buffers.
    cont1 = greedy_loop(model, cache, first[:, -1:], 30)
    after1 = content(cache)
    assert cache.seen == PROMPT_LEN + 41
    cache.restore(snap)
    assert_same_content(content(cache), at_snapshot, "after restore")
    cont2 = greedy_loop(model, cache, first[:, -1:], 30)
    assert torch.equal(cont1, cont2)
    assert_same_content(content(cache), after1, "second continuation")

    # The snapshot is a copy: restoring it again (after more tokens) still brings back the same.
    cache.restore(snap)
    assert_same_content(content(cache), at_snapshot, "second restore")
    # And it restores into another cache of the same layout.
    other = kvcache.make_cache(model, spec)
    other.restore(snap)
    assert_same_content(content(other), at_snapshot, "restore into another cache")
    assert torch.equal(greedy_loop(model, other, first[:, -1:], 30), cont1)

    # The continuation is the one an uninterrupted DynamicCache run gives.
    ref = reference_generate(model, ids, 42)
    assert torch.equal(torch.cat([ids, first, cont1], dim=1), ref)


@pytest.mark.parametrize("spec", SPECS)
def test_snapshot_survives_in_place_overwrites(spec):
    """Rollback then new tokens rewrite the store's slots in place: the snapshot must not see it."""
    model = model_for("llama")
    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, prompt(PROMPT_LEN, seed=15), 12)
    at_snapshot = content(cache)
    snap = cache.snapshot()
    cache.crop(-8)
    forced_logits(model, cache, prompt(8, seed=16), prompt(4, seed=17))  # rewrites the cropped slots
    assert cache.seen == PROMPT_LEN + 11 - 8 + 8 + 4
    cache.restore(snap)
    assert_same_content(content(cache), at_snapshot, "restore after in-place overwrites")
    ref = reference_generate(model, prompt(PROMPT_LEN, seed=15), 21)
    assert torch.equal(greedy_loop(model, cache, first[:, -1:], 9), ref[:, PROMPT_LEN + 12 :])


# ---- fork ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", PERSIST_FAMILIES)
def test_fork_is_independent(family, spec):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=6)
    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, ids, 10)
    base = content(cache)
    fork = cache.fork()
    assert_same_content(content(fork), base, "fresh fork")

    branch_a, branch_b = prompt(6, seed=7), prompt(6, seed=8)
    assert not torch.equal(branch_a, branch_b)
    # Appending to the fork does not change the original ...
    logits_b = forced_logits(model, fork, first[:, -1:], branch_b)
    assert_same_content(content(cache), base, "original after appending to the fork")
    fork_after = content(fork)
    # ... nor appending to the original the fork.
    logits_a = forced_logits(model, cache, first[:, -1:], branch_a)
    assert_same_content(content(fork), fork_after, "fork after appending to the original")

    # Each branch computes what a fresh DynamicCache run on its own sequence computes.
    prefix = torch.cat([ids, first[:, :-1]], dim=1)
    for name, branch, ours in (("a", branch_a, logits_a), ("b", branch_b, logits_b)):
        with hf_attention(model):
            ref = forced_logits(model, DynamicCache(config=model.config), prefix, torch.cat([first[:, -1:], branch], 1))
        assert_close_logits(ours, ref[1:], f"branch {name}")


def test_fork_of_static_with_caller_buffers_leaves_them_alone():
    model = model_for("llama")
    buffers = [(torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16)) for _ in range(4)]
    cache = kvcache.make_cache(model, "static", buffers=buffers)
    first = greedy_loop(model, cache, prompt(PROMPT_LEN, seed=9), 5)
    held = [(k.clone(), v.clone()) for k, v in buffers]
    fork = cache.fork()
    greedy_loop(model, fork, first[:, -1:], 10)
    for (k, v), (k0, v0) in zip(buffers, held):
        assert torch.equal(k, k0) and torch.equal(v, v0), "appending to the fork wrote into the caller's buffers"
    # The original still writes into the caller's buffers.
    greedy_loop(model, cache, first[:, -1:], 2)
    assert cache.kv_layers[0].view()[0].data_ptr() == buffers[0][0].data_ptr()
    assert not torch.equal(buffers[0][0][:, :, PROMPT_LEN + 4], held[0][0][:, :, PROMPT_LEN + 4])


# ---- crop (rollback) ----------------------------------------------------------------------------


def _crop_and_continue(model, spec, prompt_len: int, generated: int, k: int):
    ids = prompt(prompt_len, seed=10)
    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, ids, generated)
    seq = torch.cat([ids, first], dim=1)  # the cache holds seq[:, :-1]
    held = seq.shape[1] - 1
    cache.crop(-k)
    assert cache.seen == held - k
    assert all(s.seen == held - k for s in cache.kv_layers)
    # Continue from the shortened sequence: generate feeds the one uncached token.
    short = seq[:, : held - k + 1]
    ours = generate(model, short, cache, 15)
    ref = reference_generate(model, short, 15)
    assert torch.equal(ours, ref), f"after crop(-{k}): {ours.tolist()} vs {ref.tolist()}"


@pytest.mark.parametrize("spec", SPECS)
def test_crop_then_continue_equals_fresh_run_full_attention(spec):
    _crop_and_continue(model_for("llama"), spec, PROMPT_LEN, generated=12, k=5)


@pytest.mark.parametrize("family", ("mistral", "gemma2"))
def test_crop_then_continue_with_sliding_layers_inside_window(family):
    # 6 + 5 - 1 = 10 tokens cached: the window (16) has not dropped anything yet, so crop can work.
    _crop_and_continue(model_for(family), "growable", 6, generated=5, k=4)


def test_crop_past_stored_length_raises_and_changes_nothing():
    model = model_for("llama")
    cache = kvcache.make_cache(model)
    greedy_loop(model, cache, prompt(10, seed=11), 5)  # 14 cached
    before = content(cache)
    with pytest.raises(kvcache.UnsupportedOperation, match="14"):
        cache.crop(-15)
    assert_same_content(content(cache), before, "after a refused crop")
    with pytest.raises(ValueError):
        cache.crop(3)  # positive: the old "crop to length" form, refused
    assert_same_content(content(cache), before, "after a refused positive crop")
    cache.crop(0)
    assert_same_content(content(cache), before, "crop(0)")
    cache.crop(-14)
    assert cache.seen == 0


@pytest.mark.parametrize(
    ("family", "window"),
    (("mistral", None), ("gemma2", None), ("qwen2", 16)),  # qwen2: layers 0-1 full, 2-3 sliding
)
@pytest.mark.parametrize("spec", ("growable", "h2o:budget=4096"))  # sliding layers in order; rings beside a bounded kind
def test_crop_on_sliding_layer_past_dropped_tokens_raises_and_changes_nothing(family, window, spec):
    model = model_for(family, sliding_window=window)
    ids = prompt(PROMPT_LEN, seed=12)
    cache = kvcache.make_cache(model, spec)
    first = greedy_loop(model, cache, ids, 6)
    before = content(cache)
    sliding = [s for s in cache.kv_layers if isinstance(s, (WindowLayer, SlidingLayer)) and s.seen > s.length]
    assert sliding
    # A ring has overwritten every slot a crop needs; the buffer in order still holds the tokens the
    # 5 decode steps moved past the window, not those the 40-token prompt did.
    limit = min(s.rollback_tokens for s in sliding)
    assert limit == (0 if spec != "growable" else 5)
    for k in (limit + 1, limit + 3, 20):
        with pytest.raises(kvcache.UnsupportedOperation, match="window"):
            cache.crop(-k)
        # No layer changed, the full-attention ones (which could have cropped) included.
        assert_same_content(content(cache), before, f"after refused crop(-{k})")
    # And the cache goes on exactly as if nothing had been tried.
    rest = greedy_loop(model, cache, first[:, -1:], 8)
    assert torch.equal(torch.cat([ids, first, rest], dim=1), reference_generate(model, ids, 14))


# ---- damaged and foreign files ------------------------------------------------------------------


def test_truncated_files_are_refused(tmp_path):
    _, _, path, raw, header_len = saved_file(tmp_path)
    data_start = 8 + header_len
    cuts = sorted(
        {0, 1, 7, 8, 9, 8 + header_len // 2, data_start - 1, data_start, data_start + 1,
         (data_start + len(raw)) // 2, len(raw) - 1}
    )
    bad = tmp_path / "cut.kv"
    wrong = []
    for cut in cuts:
        bad.write_bytes(raw[:cut])
        try:
            kvcache.load_cache(bad, model_for("gemma2"))
        except kvcache.TruncatedFileError as e:
            if str(bad) not in str(e) or not re.search(r"truncat|too short|only \d+", str(e)):
                wrong.append(f"cut at {cut}: message does not name the problem: {e}")
        except Exception as e:  # noqa: BLE001 - collect, report all cuts at once
            wrong.append(f"cut at {cut} of {len(raw)}: {type(e).__name__}: {e}")
        else:
            wrong.append(f"cut at {cut} of {len(raw)}: loaded without error")
    assert not wrong, "\n".join(wrong)


def test_flipped_byte_in_tensor_data_fails_checksum(tmp_path):
    model, _, path, raw, header_len = saved_file(tmp_path)
    entries = {k: v for k, v in header_of(raw).items() if k != "__metadata__"}
    data_start = 8 + header_len
    bad = tmp_path / "flip.kv"
    for name in ("layer.0.keys", "layer.1.values", "layer.3.keys"):
        lo, hi = entries[name]["data_offsets"]
        for offset in (lo, (lo + hi) // 2, hi - 1):
            damaged = bytearray(raw)
            damaged[data_start + offset] ^= 0x10
            bad.write_bytes(damaged)
            with pytest.raises(kvcache.CorruptedFileError) as info:
                kvcache.load_cache(bad, model)
            message = str(info.value)
            assert "checksum" in message and name in message, message


def test_flipped_structural_byte_in_header_is_refused(tmp_path):
    model, _, path, raw, header_len = saved_file(tmp_path)
    damaged = bytearray(raw)
    assert damaged[8] == ord("{")
    damaged[8] ^= 0x01
    path.write_bytes(damaged)
    with pytest.raises(kvcache.CorruptedFileError, match="header"):
        kvcache.load_cache(path, model)


def test_checksum_in_header_changed_is_refused(tmp_path):
    model, _, path, raw, header_len = saved_file(tmp_path)
    checksums = json.loads(header_of(raw)["__metadata__"]["checksums"])
    digest = checksums["layer.1.keys"].encode()
    at = raw.index(digest, 8, 8 + header_len)
    damaged = bytearray(raw)
    damaged[at] = ord("0") if damaged[at] != ord("0") else ord("1")
    path.write_bytes(damaged)
    # The metadata checksum covers the stored tensor checksums, so the change is caught there.
    with pytest.raises(kvcache.CorruptedFileError, match="metadata checksum mismatch"):
        kvcache.load_cache(path, model)


def test_every_single_byte_flip_in_header_is_refused_or_harmless(tmp_path):
    """Flip each header byte in turn: load must raise a CacheFileError (named problem) or give back
    exactly the saved cache. Any other exception, or a silently different cache, is a failure."""
    model, cache, path, raw, header_len = saved_file(tmp_path, tokens=10)
    original = content(cache)
    bad = tmp_path / "flip.kv"
    other_errors: dict[str, list[int]] = {}
    silent: list[int] = []
    for pos in range(8 + header_len):
        damaged = bytearray(raw)
        damaged[pos] ^= 0x01
        bad.write_bytes(damaged)
        try:
            loaded = kvcache.load_cache(bad, model)
        except kvcache.CacheFileError:
            continue
        except Exception as e:  # noqa: BLE001 - collect every escape, report them together
            other_errors.setdefault(f"{type(e).__name__}: {str(e)[:80]}", []).append(pos)
            continue
        got = content(loaded)
        try:
            assert_same_content(got, original)
            assert str(loaded.spec) == str(cache.spec)
        except AssertionError:
            silent.append(pos)

    def where(pos: int) -> str:
        return repr(raw[max(8, pos - 25) : pos].decode(errors="replace")) + f" >{chr(raw[pos])}<"

    report = []
    if silent:
        report.append(f"{len(silent)} flips loaded silently as a DIFFERENT cache, e.g.:")
        report += [f"  byte {p}: {where(p)} -> {chr(raw[p] ^ 1)!r}" for p in silent[:8]]
    if other_errors:
        n = sum(len(v) for v in other_errors.values())
        report.append(f"{n} flips raised something other than a CacheFileError, e.g.:")
        for msg, positions in list(other_errors.items())[:8]:
            report.append(f"  {msg} (x{len(positions)}, byte {positions[0]}: {where(positions[0])})")
    assert not report, f"header of {header_len} bytes:\n" + "\n".join(report)


def test_foreign_safetensors_file_is_refused(tmp_path):
    model = model_for("llama")
    plain = tmp_path / "plain.safetensors"
    st_save_file({"weight": torch.randn(4, 4)}, plain)
    with pytest.raises(kvcache.ForeignFileError, match="not a kvcache file"):
        kvcache.load_cache(plain, model)
    other = tmp_path / "other.safetensors"
    st_save_file({"layer.0.keys": torch.randn(1, 2, 3, 16)}, other, metadata={"format": "pt"})
    with pytest.raises(kvcache.ForeignFileError, match="not a kvcache file"):
        kvcache.load_cache(other, model)


def test_unknown_format_version_is_refused(tmp_path):
    model, _, path, raw, _ = saved_file(tmp_path, family="llama")
    tensors = st_load(raw)
    meta = dict(header_of(raw)["__metadata__"], format_version="99")
    (tmp_path / "v99.kv").write_bytes(st_save(tensors, metadata=meta))
    with pytest.raises(kvcache.ForeignFileError, match="version"):
        kvcache.load_cache(tmp_path / "v99.kv", model)


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_random_bytes_file_is_refused(seed, tmp_path):
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    path = tmp_path / "random.kv"
    path.write_bytes(data.numpy().tobytes())
    with pytest.raises(kvcache.ForeignFileError, match="not a safetensors file"):
        kvcache.load_cache(path, model_for("llama"))


def test_text_file_is_refused(tmp_path):
    path = tmp_path / "notes.kv"
    path.write_text("these are not the keys and values you are looking for\n" * 10)
    with pytest.raises(kvcache.ForeignFileError):
        kvcache.load_cache(path, model_for("llama"))


@pytest.mark.parametrize(
    ("family", "overrides", "field"),
    (
        ("llama", {"num_hidden_layers": 6}, "num_hidden_layers"),
        ("llama", {"num_key_value_heads": 4}, "num_key_value_heads"),
        ("llama", {"num_key_value_heads": 1}, "num_key_value_heads"),
        ("gemma2", {"sliding_window": 8}, "sliding_window"),
        ("qwen2", {}, "model_type"),
    ),
)
def test_other_model_config_is_refused(family, overrides, field, tmp_path):
    model, _, path, _, _ = saved_file(tmp_path, family="llama" if family != "gemma2" else "gemma2")
    other = tiny_model(family, **overrides)
    with pytest.raises(kvcache.ModelMismatchError) as info:
        kvcache.load_cache(path, other)
    assert field in str(info.value), str(info.value)
    # The matching model still loads it.
    assert kvcache.load_cache(path, model).seen == PROMPT_LEN + 11


# ---- atomic save --------------------------------------------------------------------------------


class _Boom(OSError):
    pass


def _raise(*args, **kwargs):
    raise _Boom("simulated failure")


@pytest.mark.parametrize("failure", ("replace", "fsync", "write", "interrupt"))
def test_failed_save_keeps_previous_file(failure, tmp_path, monkeypatch):
    model = model_for("gemma2")
    old_cache = kvcache.make_cache(model)
    greedy_loop(model, old_cache, prompt(PROMPT_LEN, seed=13), 5)
    old = content(old_cache)
    path = tmp_path / "chat.kv"
    old_cache.save(path)
    old_bytes = path.read_bytes()

    new_cache = kvcache.make_cache(model)
    greedy_loop(model, new_cache, prompt(PROMPT_LEN, seed=14), 15)
    error: type[BaseException] = kvcache.CacheSaveError  # an OSError, naming the file, caused by the failure
    if failure == "replace":
        monkeypatch.setattr(os, "replace", _raise)
    elif failure == "fsync":
        monkeypatch.setattr(os, "fsync", _raise)
    elif failure == "write":
        real_save_file = kvcache.persist.fileformat.save_file

        def half_written(tensors, filename, metadata=None):
            # The real bytes, cut in half on disk, then the failure (a full disk, say).
            real_save_file(tensors, filename, metadata=metadata)
            with open(filename, "rb+") as f:
                f.truncate(os.path.getsize(filename) // 2)
            raise _Boom("disk full (simulated)")

        monkeypatch.setattr(kvcache.persist.fileformat, "save_file", half_written)
    else:

        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "fsync", interrupt)
        error = KeyboardInterrupt
    with pytest.raises(error) as info:
        new_cache.save(path)
    monkeypatch.undo()
    if failure != "interrupt":
        assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, _Boom)
        assert str(path) in str(info.value) and "\n" not in str(info.value)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"], "temporary files left behind"
    assert path.read_bytes() == old_bytes
    assert_same_content(content(kvcache.load_cache(path, model)), old, "previous file after a failed save")

    # A failed save to a new path leaves nothing at all.
    monkeypatch.setattr(os, "replace", _raise)
    with pytest.raises(kvcache.CacheSaveError):
        new_cache.save(tmp_path / "new.kv")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]
    # And the next save, working, replaces the file.
    new_cache.save(path)
    assert_same_content(content(kvcache.load_cache(path, model)), content(new_cache), "after a good save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]


# ---- a conversation's token ids, format versions -------------------------------------------------


def test_token_ids_round_trip_in_the_cache_file(tmp_path):
    model, cache, path, _, _ = saved_file(tmp_path, family="llama")
    assert kvcache.load_cache(path, model).token_ids is None  # saved without them
    ids = [(7 * i) % model.config.vocab_size for i in range(cache.seen)]
    for conversation in (ids, ids + [5]):  # the cached tokens, and generate's last one, not yet fed
        kvcache.save_cache(cache, path, token_ids=conversation)
        loaded = kvcache.load_cache(path, model)
        assert loaded.token_ids == conversation
        assert_same_content(content(loaded), content(cache))
    cache.save(path, token_ids=torch.tensor(ids))
    assert kvcache.load_cache(path, model).token_ids == ids
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.kv"]  # one file, no side file


@pytest.mark.parametrize(
    "ids, problem",
    [
        (lambda n, v: list(range(n - 1)), "for a cache of"),
        (lambda n, v: [1] * (n + 2), "for a cache of"),
        (lambda n, v: [1] * (n - 1) + [v], "vocabulary"),
        (lambda n, v: [1] * (n - 1) + [-1], "integers >= 0"),
        (lambda n, v: [1] * (n - 1) + [2.0], "integers >= 0"),
        (lambda n, v: [1] * (n - 1) + [True], "integers >= 0"),
    ],
)
def test_saving_token_ids_that_do_not_fit_raises_and_writes_nothing(ids, problem, tmp_path):
    model, cache, path, raw, _ = saved_file(tmp_path, family="llama")
    with pytest.raises(ValueError, match=problem):
        cache.save(path, token_ids=ids(cache.seen, model.config.vocab_size))
    assert path.read_bytes() == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.kv"]


def test_a_format_1_file_is_refused_naming_both_versions(tmp_path):
    model, _, path, raw, _ = saved_file(tmp_path, family="llama")
    meta = dict(header_of(raw)["__metadata__"], format_version="1")
    from kvcache.persist import metadata_checksum

    meta["meta_checksum"] = metadata_checksum(meta)
    path.write_bytes(st_save(st_load(raw), metadata=meta))
    with pytest.raises(kvcache.ForeignFileError, match=r"version '1'.*reads version 2"):
        kvcache.load_cache(path, model)

