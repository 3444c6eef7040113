"""``kvcache generate`` (``--model tiny`` is the shipped trained model) and ``kvcache bench``, and the
byte tokenizer and token streamer.

References are independent of the code under test: Hugging Face ``generate`` with its own
``DynamicCache`` on the same model and token ids (greedy, or sampling from the same seed), and
Python's one-shot ``bytes.decode`` / the tokenizer's own ``decode`` for text.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvcache
from kvcache import cache_kwargs
from kvcache.apps import cli
from kvcache.apps.cli import main
from helpers import hf_attention
from kvcache.apps.tiny import tiny_model
from kvcache.apps.tokenizer import ByteTokenizer, TokenStreamer, stream_decoder

BYTES = ByteTokenizer()
KINDS = ("growable", "static", "concat")


# ---- helpers -------------------------------------------------------------------------------


def reference(model, ids: list[int], new_tokens: int, **options) -> list[int]:
    """The tokens Hugging Face's own cache gives: greedy unless options say otherwise."""
    options.setdefault("do_sample", False)
    with hf_attention(model):
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            **cache_kwargs(model, DynamicCache(config=model.config)),
            max_new_tokens=new_tokens,
            pad_token_id=model.config.pad_token_id,
            **options,
        )
    return out[0, len(ids) :].tolist()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def saved_conversation(path, model) -> dict:
    """What ``--save-cache`` wrote: the token ids and how many of them the cache holds."""
    cache = kvcache.load_cache(path, model)
    return {"ids": cache.token_ids, "cached": cache.seen}


@pytest.fixture(scope="module")
def tiny():
    """What ``--model tiny`` loads: the shipped trained model and its byte-level tokenizer."""
    from kvcache.apps.trained import load_trained

    return load_trained()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local checkpoint folder: a tiny llama plus a byte-level BPE tokenizer, both saved with
    ``save_pretrained``. Specials <pad>, <s>, </s> get ids 0, 1, 2 like the tiny config's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world", "the cache keeps keys and values", "héllo wörld"], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    folder = tmp_path_factory.mktemp("checkpoint")
    tokenizer.save_pretrained(folder)
    tiny_model("llama", seed=3, vocab_size=len(tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded_dir(model_dir):
    """The checkpoint as any transformers user would load it (the reference side)."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    return model, tok


# ---- the byte tokenizer and streaming decoders --------------------------------------------------


def test_byte_tokenizer_round_trip_and_replacement():
    text = "Hello, wörld ☃ 🙂"
    ids = BYTES.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert BYTES.decode(ids) == text
    assert BYTES.decode(torch.tensor(ids)) == text
    assert BYTES.decode([0xE2, 0x98, ord("x")]) == b"\xe2\x98x".decode("utf-8", errors="replace")
    with pytest.raises(ValueError, match="0..255"):
        BYTES.decode([256])


def test_byte_stream_decoder_holds_back_incomplete_characters():
    decoder = BYTES.stream_decoder()
    pieces = [decoder.feed([b]) for b in "a☃".encode()]  # 'a' then the 3 bytes of the snowman
    assert pieces == ["a", "", "", "☃"]
    decoder = BYTES.stream_decoder()
    assert decoder.feed([0xF0, 0x9F]) == ""  # half an emoji ...
    assert decoder.flush() == b"\xf0\x9f".decode("utf-8", errors="replace")  # ... is replaced at the end


def test_byte_stream_decoder_equals_one_shot_decode_on_random_bytes():
    rng = random.Random(0)
    for _ in range(200):
        data = [rng.choice([rng.randrange(256), *"é☃🙂".encode()]) for _ in range(rng.randrange(1, 40))]
        decoder, text, i = BYTES.stream_decoder(), "", 0
        while i < len(data):
            step = rng.randrange(1, 4)
            text += decoder.feed(data[i : i + step])
            i += step
        assert text + decoder.flush() == bytes(data).decode("utf-8", errors="replace"), data


def test_stream_decoder_for_hf_tokenizer_never_prints_half_characters(loaded_dir):
    _, tok = loaded_dir
    text = "héllo wörld ☃ ünïcödé\nthe cache keeps ☃☃"
    ids = tok.encode(text, add_special_tokens=False)
    # The case under test occurs: some prefix of the ids ends inside a multi-byte character.
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    decoder = stream_decoder(tok)
    pieces = [decoder.feed([i]) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == tok.decode(ids)


class Recorder:
    """A text stream that logs each write and flush into a shared event list."""

    def __init__(self, events: list, tty: bool = False):
        self.events, self.tty, self.text = events, tty, ""

    def write(self, text: str) -> int:
        self.events.append(("write", text))
        self.text += text
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush",))

    def isatty(self) -> bool:
        return self.tty


def test_streamer_skips_prompt_and_escapes_control_characters_on_a_terminal():
    events: list = []
    streamer = TokenStreamer(BYTES, Recorder(events, tty=True))
    streamer.put(torch.tensor([list(b"prompt")]))
    for b in b"a\x1b[2J\tb\n":
        streamer.put(torch.tensor([b]))
    streamer.end()
    assert streamer.tokens == 8
    assert "".join(e[1] for e in events if e[0] == "write") == "a\\x1b[2J\tb\n\n"


# ---- kvcache generate -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["nosuch", "static", "growable:growth=1", "static:capacity=0", "concat:size=3"])
def test_bad_cache_spec_exits_2_listing_valid_kinds(spec, capsys):
    rc, out, err = run(capsys, "generate", "--cache", spec, "--prompt", "hi")
    assert rc == 2 and out == ""
    assert "argument --cache" in err and "Valid cache specs" in err
    for kind in KINDS:
        assert f"\n  {kind} (" in err


def test_generate_tiny_streams_tokens_as_they_come(tiny, capsys, monkeypatch):
    events: list = []
    real_load = cli.load_model

    def load_with_hook(name, device, dtype):
        model, tokenizer = real_load(name, device, dtype)
        model.register_forward_hook(lambda *_: events.append(("forward",)))
        return model, tokenizer

    monkeypatch.setattr(cli, "load_model", load_with_hook)
    recorder = Recorder(events)
    monkeypatch.setattr(sys, "stdout", recorder)
    prompt, new = "Once upon a time", 6
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", str(new)]) == 0
    model, tok = tiny
    expected = reference(model, encode(tok, prompt), new)
    assert recorder.text == decode(tok, expected) + "\n"
    # Streaming: text is written (and flushed) between forward passes, not all at the end.
    kinds = [e[0] for e in events]
    assert kinds.count("forward") == new  # prefill + new-1 decode steps
    last_forward = len(kinds) - 1 - kinds[::-1].index("forward")
    first_write = kinds.index("write")
    assert first_write < last_forward
    assert all(kinds[i + 1] == "flush" for i, k in enumerate(kinds) if k == "write")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"{new} tokens in" in err[0] and "tokens/s" in err[0] and "cache growable" in err[0]
    assert "bytes)" in err[0]


@pytest.mark.parametrize("spec", ["growable:initial_capacity=8", "static:capacity=64", "concat"])
def test_save_then_load_continues_exactly_like_one_uninterrupted_run(spec, tiny, tmp_path, capsys):
    first, second = tmp_path / "first.kv", tmp_path / "second.kv"
    p1, p2, n1, n2 = "The cache keeps ", " naïve ☃ next", 7, 9
    rc, out, err = run(
        capsys, "generate", "--cache", spec, "--prompt", p1, "--max-new-tokens", n1, "--save-cache", first
    )
    assert rc == 0, err
    model, tok = tiny
    ids1 = encode(tok, p1)
    gen1 = reference(model, ids1, n1)
    assert out == decode(tok, gen1) + "\n"
    saved = saved_conversation(first, model)
    assert saved["ids"] == ids1 + gen1
    assert saved["cached"] == len(ids1) + n1 - 1  # generate never feeds its last token back

    rc, out, err = run(
        capsys, "generate", "--load-cache", first, "--prompt", p2, "--max-new-tokens", n2, "--save-cache", second
    )
    assert rc == 0, err
    whole = ids1 + gen1 + tok.encode(p2, add_special_tokens=False)
    gen2 = reference(model, whole, n2)  # one uninterrupted run over the concatenated ids
    assert saved_conversation(second, model)["ids"] == whole + gen2
    assert out == decode(tok, gen2) + "\n"
    assert f"cache {spec.split(':')[0]}" in err and f"({saved['cached']} already cached)" in err


def test_load_cache_on_a_checkpoint_folder_continues_exactly(model_dir, loaded_dir, tmp_path, capsys):
    model, tok = loaded_dir
    path = tmp_path / "chat.kv"
    argv = ["generate", "--model", model_dir, "--prompt", "hello world", "--max-new-tokens", 5, "--save-cache", path]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    ids = tok.encode("hello world")
    gen1 = reference(model, ids, 5)
    assert out == tok.decode(gen1, skip_special_tokens=True) + "\n"
    argv = ["generate", "--model", model_dir, "--load-cache", path, "--prompt", " the cache", "--max-new-tokens", 6]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    whole = ids + gen1 + tok.encode(" the cache", add_special_tokens=False)
    assert out == tok.decode(reference(model, whole, 6), skip_special_tokens=True) + "\n"


def test_generate_with_model_folder(model_dir, loaded_dir, capsys):
    model, tok = loaded_dir
    argv = ["generate", "--model", model_dir, "--cache", "static:capacity=32", "--prompt", "héllo wörld"]
    rc, out, err = run(capsys, *argv, "--max-new-tokens", 8)
    assert rc == 0, err
    expected = reference(model, tok.encode("héllo wörld"), 8)
    assert out == tok.decode(expected, skip_special_tokens=True) + "\n"
    assert "cache static:capacity=32" in err


def test_sampling_is_reproducible_from_the_seed(tiny, capsys):
    argv = ["generate", "--sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5"]
    argv += ["--prompt", "abc", "--max-new-tokens", "12"]
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    model, tok = tiny
    torch.manual_seed(5)
    expected = reference(model, encode(tok, "abc"), 12, do_sample=True, temperature=0.7, top_p=0.9, top_k=None)
    assert out == decode(tok, expected) + "\n"
    assert expected != reference(model, encode(tok, "abc"), 12)  # it did sample, not argmax


@pytest.mark.parametrize("damage", ["missing", "other_cache", "not_json"])
def test_load_cache_refuses_missing_or_mismatched_token_ids(damage, tiny, tmp_path, capsys):
    """The token ids live in the cache file (format 2; format 1 kept them in FILE.ids.json): a file
    saved without them, ids of another conversation, or ids that are not JSON (checksums
    recomputed, as a tamperer would) are refused in one line naming the file."""
    from mutations import Parts

    path = tmp_path / "c.kv"
    assert run(capsys, "generate", "--prompt", "abc", "--max-new-tokens", 3, "--save-cache", path)[0] == 0
    parts = Parts(path.read_bytes())
    if damage == "missing":  # saved through the API, without ids
        kvcache.load_cache(path, tiny[0]).save(path)
    elif damage == "other_cache":  # the ids of a longer conversation, with a cache of this one
        assert run(capsys, "generate", "--prompt", "abcd", "--max-new-tokens", 3, "--save-cache", tmp_path / "d.kv")[0] == 0
        parts.meta["token_ids"] = Parts((tmp_path / "d.kv").read_bytes()).meta["token_ids"]
        path.write_bytes(parts.build())
    else:
        parts.meta["token_ids"] = "{not json"
        path.write_bytes(parts.build())
    rc, out, err = run(capsys, "generate", "--load-cache", path, "--prompt", "x", "--max-new-tokens", 2)
    assert rc == 2 and out == ""
    assert err.startswith("kvcache: error: ") and err.count("\n") == 1
    assert "c.kv" in err
    assert {"missing": "no token ids", "other_cache": "token ids", "not_json": "not valid JSON"}[damage] in err


def test_an_empty_prompt_starts_from_bos_or_continues_a_loaded_cache(tiny, tmp_path, capsys):
    model, tok = tiny
    path = tmp_path / "c.kv"
    rc, out, err = run(capsys, "generate", "--prompt", "", "--max-new-tokens", 4, "--save-cache", path)
    assert rc == 0, err
    gen1 = reference(model, [tok.bos_token_id], 4)
    assert out == decode(tok, gen1) + "\n"
    # The last generated token was never fed back, so there is still one token to feed.
    rc, out, err = run(capsys, "generate", "--load-cache", path, "--prompt", "", "--max-new-tokens", 3)
    assert rc == 0, err
    assert out == decode(tok, reference(model, [tok.bos_token_id] + gen1, 3)) + "\n"


def test_an_empty_prompt_with_a_tokenizer_that_adds_nothing_is_an_error(model_dir, capsys):
    rc, out, err = run(capsys, "generate", "--model", model_dir, "--prompt", "")
    assert rc == 2 and out == ""
    assert "prompt is empty" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "x", "--temperature", "0.5"], "only with --sample"),
        (["--prompt", "x", "--model", "/nonexistent/model"], "neither 'tiny' nor a model directory"),
        (["--prompt", "x", "--load-cache", "/nonexistent.kv"], "does not exist"),
        (["--prompt", "x", "--cache", "concat", "--load-cache", "a.kv"], "not allowed with argument"),
        (["--prompt", "x", "--greedy", "--sample"], "not allowed with argument"),
        (["--prompt", "x", "--top-p", "1.5", "--sample"], "(0, 1]"),
        (["--prompt", "x", "--max-new-tokens", "0"], ">= 1"),
        (["--max-new-tokens", "3"], "--prompt"),
    ],
)
def test_generate_argument_errors_exit_2(argv, message, capsys):
    rc, out, err = run(capsys, "generate", *argv)
    assert rc == 2 and out == ""
    assert message in err


def test_full_static_cache_mid_stream_exits_2_after_ending_the_line(capsys):
    rc, out, err = run(
        capsys, "generate", "--cache", "static:capacity=8", "--prompt", "abcde", "--max-new-tokens", 10
    )
    assert rc == 2
    assert out.endswith("\n") and len(out) > 1  # some tokens streamed before the cache filled up
    assert err.startswith("kvcache: error: static cache is full") and "capacity 8" in err


def test_cuda_unavailable_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (
        ["generate", "--prompt", "x", "--device", "cuda"],
        ["bench", "update", "--tiny", "--device", "cuda", "--out", tmp_path],
    ):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == ""
        assert err.startswith("kvcache: error: --device cuda: CUDA is not available")
    assert list(tmp_path.iterdir()) == []


# ---- kvcache bench --------------------------------------------------------------------------

ROW_FIELDS = {
    "update": {
        "contender", "tokens", "us_per_token", "speedup_vs_concat", "reallocations", "peak_bytes", "final_bytes",
    },
    "decode": {
        "variant", "query_heads", "context", "contender", "tokens_per_s", "speedup_vs_dynamic",
        "identical_to_dynamic", "cache_bytes",
    },
}


@pytest.mark.parametrize("suite", ["update", "decode"])
def test_bench_tiny_writes_json_markdown_and_plot(suite, tmp_path, capsys):
    out_dir = tmp_path / "results"
    rc, out, err = run(capsys, "bench", suite, "--tiny", "--no-progress", "--out", out_dir)
    assert rc == 0, err
    data = json.loads((out_dir / f"{suite}.json").read_text())
    assert data["suite"] == suite
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["transformers"] == transformers.__version__
    assert data["machine"]["device"] == "cpu"
    assert isinstance(data["config"], dict) and data["config"]["quick"] is False
    assert data["rows"] and all(ROW_FIELDS[suite] <= set(row) for row in data["rows"])
    markdown = (out_dir / f"{suite}.md").read_text()
    assert markdown.startswith("| ") and markdown in out  # the table is printed too
    assert (out_dir / f"{suite}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line for line in out.splitlines() if line.startswith("wrote ")] == [
        f"wrote {out_dir / f'{suite}.{ext}'}" for ext in ("json", "md", "png")
    ]


def test_bench_decode_rows_match_dynamic_cache(tmp_path, capsys):
    assert run(capsys, "bench", "decode", "--tiny", "--no-progress", "--out", tmp_path)[0] == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert all(row["identical_to_dynamic"] is True for row in rows)


def test_unknown_suite_exits_2_listing_suites(capsys):
    from kvcache.apps.bench import SUITES

    rc, out, err = run(capsys, "bench", "nosuch", "--tiny")
    assert rc == 2 and out == ""
    assert "invalid choice: 'nosuch'" in err and all(name in err for name in SUITES)


def test_bench_suite_module_missing_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "kvcache.apps.bench.memory", None)  # makes its import fail
    rc, out, err = run(capsys, "bench", "memory", "--tiny", "--out", tmp_path)
    assert rc == 2
    assert err == "kvcache: error: benchmark suite 'memory' is not available in this version of kvcache\n"


def test_bench_out_must_be_a_directory(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    rc, _, err = run(capsys, "bench", "update", "--tiny", "--out", file)
    assert rc == 2 and "is not a directory" in err


def test_building_the_parser_imports_no_suite(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("kvcache.apps.bench.")]:
        monkeypatch.delitem(sys.modules, name)
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "attention"]).suite == "attention"
    assert not [m for m in sys.modules if m.startswith("kvcache.apps.bench.")]


@pytest.mark.parametrize("spec", ["growable", "h2o:budget=64"])
def test_prompt_store_reuses_the_shared_beginning_and_says_how_much(spec, tiny, tmp_path, capsys):
    store = tmp_path / "prompts"
    shared = "The key value cache keeps every past token. " * 16  # 704 bytes: two 256-token chunks
    first, second = shared + "What does it keep?", shared + "Why?"
    rc, out, err = run(capsys, "generate", "--cache", spec, "--prompt-store", store, "--prompt", first, "--max-new-tokens", 5)
    assert rc == 0, err
    assert "(0 reused from the prompt store)" in err and f"prompt store {store}" in err
    rc, out, err = run(capsys, "generate", "--cache", spec, "--prompt-store", store, "--prompt", second, "--max-new-tokens", 5)
    assert rc == 0, err
    model, tok = tiny
    ids = encode(tok, second)
    assert f"prefill {len(ids) - 512} tokens (512 reused from the prompt store)" in err
    if spec == "growable":  # a state kind's reuse is a prefill split at the boundary, not one pass
        assert out == decode(tok, reference(model, ids, 5)) + "\n"


def test_prompt_store_that_cannot_be_reached_warns_once_and_generates(tiny, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt = "Nothing listens on that port. " * 10  # over one chunk: the store is asked
    with pytest.warns(RuntimeWarning, match="prompt store unavailable") as caught:
        rc, out, err = run(capsys, "generate", "--prompt-store", f"redis://127.0.0.1:{port}/0", "--prompt", prompt, "--max-new-tokens", 3)
    assert rc == 0, err
    assert len([w for w in caught if "prompt store unavailable" in str(w.message)]) == 1
    model, tok = tiny
    assert out == decode(tok, reference(model, encode(tok, prompt), 3)) + "\n"
