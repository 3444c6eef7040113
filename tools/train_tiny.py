#!/usr/bin/env python
"""Train kvcache's small Llama-style model for the quality harness, on the CPU.

The model must retrieve facts from long contexts, so that what a bounded cache (eviction,
quantization) loses shows up as lost accuracy. Data, all generated here on the fly:

* synthetic retrieval rows from :mod:`kvcache.apps.tasks` (passkey, multi-query associative recall,
  variable tracking; needle depth uniform in [0, 1]; filler from the ``"train"`` split of the
  Python standard library's sources, PSF License);
* plain rows of that same stdlib text;
* "repeat" rows: a random alphanumeric chunk (8 to length/3 characters) written over and over.
  Every copy after the first is predictable only by looking back at it, the simplest way to make
  the copying circuits (induction heads) that retrieval is built from appear within a CPU budget.

Each row is ``<bos> prompt answer \\n``, exactly the row length long. The loss is the mean
next-token cross-entropy over the row, plus ``--answer-weight`` times the mean over the answer
tokens (every answered query), plus ``--pointer-weight`` times a retrieval-head loss: one head
(``--pointer-layer``, ``--pointer-head``) is taught to attend, at each answer position, to the
token the answer copies (the pass key's digits in the needle, the asked key's value, the previous
copy of a repeated chunk). From the next-token loss alone the copying circuit did not appear in
1400 steps (retrieval stayed at chance); with this signal the head finds its source within a few
hundred. The model is a plain ``LlamaForCausalLM`` either way.

Reproducible: the weights start from ``--seed``; the rows of step ``s`` are a pure function of
``(seed, s)``, so a resumed run (``--resume``) sees the same data as an uninterrupted one.

Schedule: ``--phases 128:600:16,256:1400:8,512:600:6,1024:350:3,2048:150:2``
(``length[/length...]:share[:batch]``) gives each phase its share of the ``--steps``, in that
order, with that many rows per step (default ``--tokens-per-step // length``). A phase that names
several lengths (``256/512/1024``) cycles through them step by step, with ``--tokens-per-step //
length`` rows each. AdamW (betas 0.9/0.95, weight decay on the matrices), linear warmup over
``--warmup`` steps to ``--lr``, cosine decay to ``--min-lr-ratio * lr`` at the last step, gradient
clipping at ``--clip``.

Stages: ``--init DIR`` starts from the weights of another run's folder, with a fresh optimizer and
schedule; the model card lists every stage's command. A strict curriculum forgets: after the
1024 phase the first stage solved pass keys at 1K and no longer at 256. The shipped model is
that first stage (up to step 3000), a second stage on mixed lengths up to 1K, and a third that
adds 2K rows:

    python tools/train_tiny.py --out .train/ckpt-step3000 --seed 0 --threads 2 --steps 3100 --stop-at 3000
    python tools/train_tiny.py --out .train/stage2 --init .train/ckpt-step3000 --seed 1 --threads 2 \
        --steps 1600 --lr 8e-4 --warmup 50 --phases 256/512/1024:1 \
        --mix passkey=0.25,assoc=0.5,vartrack=0.05,text=0.05,repeat=0.15 \
        --eval-lengths 256,512,1024 --final-eval-lengths 256,512,1024,2048
    python tools/train_tiny.py --out .train/stage3 --init .train/stage2 --seed 2 --threads 2 \
        --steps 700 --lr 3e-4 --warmup 30 --phases 256/512/1024/2048:1 \
        --mix passkey=0.25,assoc=0.5,vartrack=0.05,text=0.05,repeat=0.15 \
        --eval-lengths 256,1024,2048 --final-eval-lengths 256,512,1024,2048

About 90 minutes on 2 CPU cores in all (about 40 + 34 + 18).

Every ``--eval-every`` steps: a quick held-out eval (``"heldout"`` filler split, held-out seeds)
of passkey and associative-recall accuracy at ``--eval-lengths``, needle depths evenly spread
over [0, 1], measured by teacher forcing: an instance counts as right when the argmax at every
answer position is the answer's token, which is exactly when greedy decoding produces the
answer. Results go to ``<out>/train_log.jsonl`` (one JSON object per line) and to stdout.

Every ``--ckpt-every`` steps and at the end, ``<out>`` is a Hugging Face model folder
(``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``README.md``) loadable with ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained``; ``trainer_state.pt`` (optimizer, step) beside them is for
``--resume`` only and is not part of the model.

The tokenizer is byte-level: ids 0..255 are the bytes, 256 ``<pad>``, 257 ``<bos>``, 258
``<eos>``; encoding adds ``<bos>`` in front (the training rows start with it).

    python tools/train_tiny.py --out /tmp/train/ckpt --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259
ROW_TASKS = ("passkey", "assoc", "vartrack", "text", "repeat")
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


# ---- tokenizer ---------------------------------------------------------------------------------


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary.

    Bytes that are visible, non-space Latin-1 characters stand for themselves; the others (control
    characters, space, DEL, NBSP, soft hyphen) are given the code points from 256 up, in byte
    order. This is the alphabet of the ``tokenizers`` ``ByteLevel`` pre-tokenizer.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols = {}
    extra = 0
    for b in range(256):
        if b in visible:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer():
    """Byte-level ``PreTrainedTokenizerFast``: token id ``b`` is byte ``b``; specials after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: b for b, symbol in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    assert [tok.token_to_id(s) for s in SPECIALS] == [PAD_ID, BOS_ID, EOS_ID]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=4096,
        add_bos_token=True,
    )


def encode(text: str) -> list[int]:
    """What the saved tokenizer gives for ``text`` (``<bos>`` + UTF-8 bytes), without calling it."""
    return [BOS_ID, *text.encode("utf-8")]


# ---- model -------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


# ---- data --------------------------------------------------------------------------------------


def parse_pairs(text: str, sep: str, cast) -> list[tuple[str, float]]:
    out = []
    for item in text.split(","):
        key, _, value = item.partition(sep)
        out.append((key.strip(), cast(value)))
    return out


def make_row(rng: random.Random, kind: str, length: int) -> tuple[list[int], list[tuple[int, int]], list]:
    """One training row of exactly ``length`` token ids, its answer spans and its pointers.

    Spans are ``[start, end)`` token positions of answers. Pointers are ``(query, source)`` token
    positions: the output at ``query`` predicts a token that is a copy of the token at ``source``
    (the pass key's digits in the needle, an asked key's value in the pairs block, the previous
    copy of a repeated chunk); the retrieval head is taught to look there (see ``pointer_loss``).
    """
    from kvcache.apps import tasks

    if kind == "text":
        return encode(tasks.filler(rng, length - 1, "train")), [], []
    if kind == "repeat":
        # A random alphanumeric chunk written over and over: every copy after the first can only
        # be predicted by looking back (what induction heads do), which retrieval builds on.
        n = rng.randint(8, max(8, (length - 1) // 3))
        chunk = "".join(rng.choice(ALNUM) for _ in range(n))
        body = (chunk * ((length - 1) // n + 1))[: length - 1]
        return encode(body), [(1 + n, length)], [(t - 1, t - n) for t in range(1 + n, length)]
    seed = rng.randrange(2**62)
    depth = rng.random()
    options: dict = {}
    if kind == "assoc":
        # Pairs block 18 + 10 n, queries 9 + 10 q - 5: keep at least a fifth of the row filler.
        budget = int(0.8 * length) - 22
        n_pairs = rng.randint(2, max(2, min(24, budget // 14)))
        room = (budget - 10 * n_pairs) // 10
        options = {"n_pairs": n_pairs, "n_queries": max(1, min(n_pairs, rng.randint(n_pairs // 2, n_pairs), room))}
    elif kind == "vartrack":
        hops, chains = rng.randint(1, 4), rng.randint(1, 3)
        while (hops * chains * 16 + 50) > 0.8 * length and hops * chains > 1:
            hops, chains = max(1, hops - 1), max(1, chains - 1)
        options = {"hops": hops, "chains": chains}
    # The answer does not depend on the length: probe it, then fill the row exactly.
    probe = tasks.make_instance(kind, seed, length=length, depth=depth, split="train", **options)
    prompt_len = length - 2 - len(probe.answer)  # <bos> ... answer "\n"
    inst = tasks.make_instance(kind, seed, length=prompt_len, depth=depth, split="train", **options)
    ids = encode(inst.text + "\n")
    assert len(ids) == length, (kind, len(ids), length)
    spans = [(a + 1, b + 1) for a, b in inst.spans]
    return ids, spans, _pointers(inst, spans)


def _pointers(inst, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(query, source)`` token positions for each answer token that copies a needle token."""
    start = inst.needle[0] + 1  # token position of the needle's first character
    needle = inst.prompt[slice(*inst.needle)]
    if inst.task == "passkey":
        sources = [start + needle.index(" " + inst.meta["key"])]
    elif inst.task == "assoc":
        sources = [start + needle.index(f"\n{k}:") + len(k) + 2 for k in inst.meta["queries"]]
    else:
        return []
    out = []
    for (a, b), src in zip(spans, sources):
        out += [(a + i - 1, src + i) for i in range(b - a)]
    return out


def make_batch(seed: int, step: int, length: int, batch: int, mix: list[tuple[str, float]]):
    """``ids [batch, length]``, ``answer_mask [batch, length]`` (True at answer tokens) and the
    pointers as three index tensors ``(row, query, source)``."""
    kinds = [k for k, _ in mix]
    weights = [w for _, w in mix]
    ids = torch.empty(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    rows, queries, sources = [], [], []
    for r in range(batch):
        rng = random.Random(f"train_tiny:{seed}:{step}:{r}")
        kind = rng.choices(kinds, weights)[0]
        row, spans, pointers = make_row(rng, kind, length)
        ids[r] = torch.tensor(row)
        for a, b in spans:
            mask[r, a:b] = True
        for q, src in pointers:
            rows.append(r)
            queries.append(q)
            sources.append(src)
    pointers = tuple(torch.tensor(x, dtype=torch.long) for x in (rows, queries, sources))
    return ids, mask, pointers


def parse_phases(text: str) -> list[tuple[tuple[int, ...], float, int | None]]:
    """``length[/length...]:share[:batch]`` items -> ``[(lengths, share, batch), ...]``.

    A phase with several lengths (``256/512/1024``) cycles through them step by step, so the model
    keeps every length it has learned; its batch is ``tokens_per_step // length`` per step. A
    one-length phase takes ``batch`` if given. Shares are relative (counts of steps work too)."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise SystemExit(f"--phases: expected length[/length...]:share[:batch], got {item!r}")
        lengths, share = tuple(int(x) for x in parts[0].split("/")), float(parts[1])
        batch = int(parts[2]) if len(parts) == 3 else None
        out.append((lengths, share, batch))
    return out


def phase_schedule(phases: list[tuple[tuple[int, ...], float, int | None]], steps: int) -> list[tuple[int, tuple[int, ...], int | None]]:
    """``[(first_step, lengths, batch), ...]``: each phase gets its share of ``steps``, in order."""
    total = sum(share for _, share, _ in phases)
    out, start = [], 0
    for lengths, share, batch in phases:
        out.append((start, lengths, batch))
        start += round(steps * share / total)
    return out


def phase_at(schedule: list[tuple[int, tuple[int, ...], int | None]], step: int, tokens_per_step: int) -> tuple[int, int]:
    """``(length, batch)`` of ``step``: its phase's length (cycled if the phase mixes lengths)."""
    current = schedule[0]
    for phase in schedule:
        if step >= phase[0]:
            current = phase
    _, lengths, batch = current
    length = lengths[step % len(lengths)]
    if batch is None or len(lengths) > 1:
        batch = max(1, tokens_per_step // length)
    return length, batch


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


# ---- loss and evaluation -----------------------------------------------------------------------


def losses(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over all tokens and over the answer tokens."""
    logits = model(input_ids=ids[:, :-1]).logits  # [B, T-1, V]
    per_token = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    answer = mask[:, 1:].flatten()
    lm = per_token.mean()
    ans = per_token[answer].mean() if answer.any() else per_token.new_zeros(())
    return lm, ans


class RetrievalProbe:
    """Captures the input of one attention layer so that one of its heads can be supervised.

    Training a byte-level model from scratch, the copying circuit that retrieval needs appears
    late (after a long plateau) from the next-token loss alone: more steps than a CPU budget has.
    ``pointer_loss`` shortcuts the plateau: it teaches head ``head`` of layer ``layer`` (the
    "retrieval head") to attend, at each answer position, to the token the answer copies. The
    model stays a plain ``LlamaForCausalLM``; this only adds a training signal.
    """

    def __init__(self, model, layer: int, head: int) -> None:
        self.attn = model.model.layers[layer].self_attn
        config = model.config
        self.head = head
        self.kv_head = head // (config.num_attention_heads // config.num_key_value_heads)
        self.head_dim = config.head_dim
        self.inputs: tuple | None = None
        self.attn.register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.inputs = (hidden, kwargs["position_embeddings"])

    def pointer_loss(self, pointers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean ``-log attention(query -> source)`` of the retrieval head over the pointers."""
        rows, queries, sources = pointers
        hidden, (cos, sin) = self.inputs
        self.inputs = None
        if rows.numel() == 0:
            return hidden.new_zeros(())
        d = self.head_dim
        q = F.linear(hidden, self.attn.q_proj.weight[self.head * d : (self.head + 1) * d])  # [B, T, D]
        k = F.linear(hidden, self.attn.k_proj.weight[self.kv_head * d : (self.kv_head + 1) * d])
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        used = torch.unique(rows)  # only rows that have pointers
        remap = torch.full((hidden.shape[0],), -1, dtype=torch.long)
        remap[used] = torch.arange(used.numel())
        scores = q[used] @ k[used].transpose(1, 2) * d**-0.5  # [R, T, T]
        t = scores.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        logp = scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
        return -logp[remap[rows], queries, sources].mean()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def heldout_accuracy(model, task: str, length: int, n: int, batch: int = 8) -> float:
    """Share of ``n`` held-out instances (depths evenly spread over [0, 1]) whose answer greedy
    decoding would produce (teacher forcing: argmax equals the answer at every answer token)."""
    from kvcache.apps import tasks

    was_training = model.training
    model.eval()
    right = 0
    insts = [
        tasks.make_instance(task, i, length=length, depth=i / max(1, n - 1), split="heldout") for i in range(n)
    ]
    for start in range(0, n, batch):
        chunk = insts[start : start + batch]
        ids = torch.tensor([encode(inst.text) for inst in chunk])
        logits = model(input_ids=ids[:, :-1]).logits
        k = len(chunk[0].answer)
        pred = logits[:, -k:].argmax(-1)
        right += int((pred == ids[:, -k:]).all(-1).sum())
    model.train(was_training)
    return right / n


def evaluate(model, lengths: list[int], n: int) -> dict[str, float]:
    out = {}
    for length in lengths:
        for task in ("passkey", "assoc"):
            out[f"{task}@{length}"] = heldout_accuracy(model, task, length, n)
    return out


# ---- checkpoints -------------------------------------------------------------------------------


def model_card(args: argparse.Namespace, model, step: int, evals: dict | None) -> str:
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        "# kvcache tiny retrieval model",
        "",
        f"A {n_params / 1e6:.2f}M-parameter Llama-style causal LM (`LlamaForCausalLM`: {c.num_hidden_layers} "
        f"layers, hidden {c.hidden_size}, MLP {c.intermediate_size}, {c.num_attention_heads} query / "
        f"{c.num_key_value_heads} key-value heads of {c.head_dim}, RoPE theta {args.rope_theta:g}, "
        f"max positions {c.max_position_embeddings}) trained on the CPU by `tools/train_tiny.py` "
        f"(step {step} of {args.steps}, seed {args.seed}) for kvcache's quality harness.",
        "",
        "Tokenizer: byte-level, ids 0..255 are the bytes, 256 `<pad>`, 257 `<bos>`, 258 `<eos>`; "
        "encoding adds `<bos>`.",
        "",
        "Training data: synthetic retrieval instances (passkey, multi-query associative recall, "
        "variable tracking; `kvcache.apps.tasks`, train split) and plain text, all drawn from the Python "
        "standard library's own `*.py` sources (Copyright Python Software Foundation, used under the "
        "PSF License Agreement, https://docs.python.org/3/license.html). Nothing else.",
        "",
    ]
    stages = args.history + [args.argv]
    lines += ["", "Commands, in order:" if len(stages) > 1 else "Command:", ""]
    lines += [f"{i}. `python tools/train_tiny.py {' '.join(argv)}`" for i, argv in enumerate(stages, 1)]
    if evals:
        lines += ["", "Held-out accuracy at this step (teacher-forced exact match = greedy):", ""]
        lines += [f"- {k}: {v:.3f}" for k, v in evals.items()]
    return "\n".join(lines) + "\n"


def save_checkpoint(out: Path, model, tokenizer, optimizer, step: int, args, evals: dict | None) -> None:
    """Write the model folder and ``trainer_state.pt``; each file is renamed into place."""
    staging = out / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "README.md").write_text(model_card(args, model, step, evals), encoding="utf-8")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "argv": args.argv, "history": args.history}, staging / "trainer_state.pt")
    for path in sorted(staging.iterdir(), key=lambda p: p.name == "trainer_state.pt"):
        os.replace(path, out / path.name)
    staging.rmdir()


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="checkpoint folder (a Hugging Face model folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3100)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--phases",
        default="128:600:16,256:1400:8,512:600:6,1024:350:3,2048:150:2",
        help="sequence-length curriculum: length:share[:batch] items, in order; shares are relative",
    )
    p.add_argument("--tokens-per-step", type=int, default=4096, help="batch = this // length where a phase names none")
    p.add_argument(
        "--mix",
        default="passkey=0.3,assoc=0.4,vartrack=0.05,text=0.05,repeat=0.2",
        help="row kinds (passkey, assoc, vartrack, text, repeat) and their weights",
    )
    p.add_argument("--answer-weight", type=float, default=1.0)
    p.add_argument("--pointer-weight", type=float, default=1.0, help="weight of the retrieval-head loss (0: off)")
    p.add_argument("--pointer-layer", type=int, default=2, help="layer of the supervised retrieval head")
    p.add_argument("--pointer-head", type=int, default=0, help="query head of the supervised retrieval head")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-lengths", default="256,1024")
    p.add_argument("--eval-n", type=int, default=20, help="held-out instances per task and length")
    p.add_argument("--final-eval-lengths", default="256,512,1024,2048")
    p.add_argument("--final-eval-n", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from <out>/trainer_state.pt if present")
    p.add_argument(
        "--init",
        default=None,
        help="start from the weights of this model folder (a later training stage; fresh optimizer and schedule)",
    )
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and checkpoint) after this long")
    p.add_argument(
        "--stop-at", type=int, default=None, help="stop (and checkpoint) at this step; the schedule stays that of --steps"
    )
    args = p.parse_args(argv)
    args.argv = list(argv)
    args.mix_pairs = parse_pairs(args.mix, "=", float)
    unknown = [k for k, _ in args.mix_pairs if k not in ROW_TASKS]
    if unknown:
        p.error(f"--mix: unknown row kind {unknown[0]!r}; expected {', '.join(ROW_TASKS)}")
    args.phase_list = parse_phases(args.phases)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"

    def log(record: dict) -> None:
        print(json.dumps(record), flush=True)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    tokenizer = build_tokenizer()
    model = build_model(args)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    start = 0
    args.history = []
    if args.init:
        from safetensors.torch import load_file

        init = Path(args.init)
        model.load_state_dict(load_file(init / "model.safetensors"))
        previous = torch.load(init / "trainer_state.pt", weights_only=False) if (init / "trainer_state.pt").exists() else {}
        args.history = previous.get("history", []) + ([previous["argv"]] if "argv" in previous else [])
        log({"event": "init", "from": str(init), "history": args.history})
    state_path = out / "trainer_state.pt"
    if args.resume and state_path.exists():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(out / "model.safetensors"))
        state = torch.load(state_path, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        args.history = state.get("history", args.history)
        log({"event": "resume", "step": start})
    model.train()
    probe = RetrievalProbe(model, args.pointer_layer, args.pointer_head) if args.pointer_weight > 0 else None

    schedule = phase_schedule(args.phase_list, args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    log({"event": "start", "params": n_params, "schedule": schedule, "argv": args.argv, "threads": args.threads,
         "torch": torch.__version__})
    eval_lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    t0 = time.time()
    window: list[tuple[float, float, float, float]] = []
    step = start
    evals = None
    while step < args.steps:
        length, batch = phase_at(schedule, step, args.tokens_per_step)
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t_step = time.time()
        ids, mask, pointers = make_batch(args.seed, step, length, batch, args.mix_pairs)
        t_data = time.time() - t_step
        lm, ans = losses(model, ids, mask)
        ptr = probe.pointer_loss(pointers) if probe else lm.new_zeros(())
        loss = lm + args.answer_weight * ans + args.pointer_weight * ptr
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        step += 1
        window.append((lm.item(), ans.item(), time.time() - t_step, ptr.item()))
        if step % args.log_every == 0 or step == args.steps:
            n = len(window)
            log({
                "step": step, "len": length, "batch": batch, "lr": round(lr, 6),
                "loss": round(sum(w[0] for w in window) / n, 4), "answer_loss": round(sum(w[1] for w in window) / n, 4),
                "pointer_loss": round(sum(w[3] for w in window) / n, 4),
                "grad_norm": round(float(grad_norm), 3), "step_s": round(sum(w[2] for w in window) / n, 3),
                "data_s": round(t_data, 3), "elapsed_min": round((time.time() - t0) / 60, 2),
            })
            window = []
        timed_out = args.max_minutes is not None and (time.time() - t0) / 60 >= args.max_minutes
        stop_here = args.stop_at is not None and step >= args.stop_at and step < args.steps
        if step % args.eval_every == 0 and step < args.steps:
            t_eval = time.time()
            evals = evaluate(model, eval_lengths, args.eval_n)
            log({"event": "eval", "step": step, **evals, "eval_s": round(time.time() - t_eval, 1)})
        if step % args.ckpt_every == 0 or timed_out or stop_here:
            save_checkpoint(out, model, tokenizer, optimizer, step, args, evals)
            log({"event": "checkpoint", "step": step, "dir": str(out)})
        if timed_out or stop_here:
            reason = f"--max-minutes {args.max_minutes}" if timed_out else f"--stop-at {args.stop_at}"
            log({"event": "stopped", "step": step, "reason": reason})
            return 0
    t_eval = time.time()
    evals = evaluate(model, [int(x) for x in args.final_eval_lengths.split(",") if x], args.final_eval_n)
    log({"event": "final_eval", "step": step, **evals, "eval_s": round(time.time() - t_eval, 1)})
    save_checkpoint(out, model, tokenizer, optimizer, step, args, evals)
    size = (out / "model.safetensors").stat().st_size
    log({"event": "done", "step": step, "minutes": round((time.time() - t0) / 60, 2), "model_bytes": size})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
