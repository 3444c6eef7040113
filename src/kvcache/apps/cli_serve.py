"""``kvcache serve``: the OpenAI-compatible server (:mod:`kvcache.apps.serve`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from ..errors import KVCacheError
from .cli_options import DTYPES, add_command

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "serve", cmd_serve)
    p.add_argument("--model", default="smollm2", metavar="NAME|DIR", help="a model name (kvcache models list), tiny, or a local Hugging Face model folder (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and cache dtype; auto: as the checkpoint stores them; bfloat16 is the faster pick on CPUs with avx512_bf16 or AMX (default: %(default)s)")
    p.add_argument("--cache", default="growable", metavar="SPEC", help="the engine's block format: growable, quantized:bits=8|4, snapkv:budget=0.25 (default: %(default)s)")
    p.add_argument("--prompt-store", default=None, metavar="DIR|redis://...", help="a prompt store behind the pool: memory, a folder, or Redis (shared by replicas)")
    p.add_argument("--store-chunk", type=int, default=256, metavar="N", help="tokens per prompt-store entry (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--max-seqs", type=int, default=32, metavar="N", help="requests running at once (default: %(default)s)")
    p.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE", help="the pool's size, e.g. 512M or 2G (default: 1,024 tokens for each of --max-seqs)")
    p.add_argument("--block-size", type=int, default=32, metavar="N", help="tokens per pool block (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, metavar="N", help="tokens per forward pass (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="run steps as compiled graphs, decode steps one per batch size up to --max-seqs and prompt steps one of any length, compiled before serving (a float --cache on the CPU; about a minute per size for SmolLM2 on 2 cores, less once inductor has them on disk)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N", help="requests waiting before new ones get 503 (default: %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY' (default: $KVCACHE_API_KEY, else none)")
    p.add_argument("--ray", action="store_true", help="serve from replicas on Ray Serve (a local cluster, or --ray-address): needs 'pip install kvcache[ray]'")
    p.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas with --ray, each with its own pool (default: 2)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="M", help="with --ray: let Ray Serve scale the replicas between --replicas and M with load (a replica's target: --max-seqs requests)")
    p.add_argument("--router", default=None, choices=("blocks", "prefix", "default"), help="with --ray: blocks (the replica whose pool holds the longest prefix of the prompt's blocks), prefix (Ray Serve's PrefixCacheAffinityRouter, on text) or default (power of two choices) (default: blocks)")
    p.add_argument("--imbalance", type=float, default=None, metavar="N", help="with --router blocks or prefix: the queue-length difference beyond which load wins over prefix (default: 4)")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="with --ray: a running Ray cluster (default: start a local one)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="(default: %(default)s)")


def byte_size(text: str) -> int:
    found = re.fullmatch(r"\s*(\d+)\s*([kmg]?)i?b?\s*", text.lower())
    if not found or int(found.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 2G, got {text!r}")
    return int(found.group(1)) * _UNITS[found.group(2)]


def cmd_serve(args: argparse.Namespace) -> int:
    """serve a model over the OpenAI API (completions, chat, streaming) from one engine

    An OpenAI-compatible HTTP server on kvcache's engine: POST /v1/completions and
    /v1/chat/completions (streamed by server-sent events or not), GET /v1/models, /health and
    /metrics (Prometheus). Requests share one paged pool (continuous batching, shared prefixes,
    the block format of --cache); with --prompt-store, computed prompts are kept there and
    replicas on the same Redis serve each other's prompts. SIGTERM drains: running requests finish,
    new ones are refused, then the process exits 0. Needs 'pip install kvcache[serve]'.

    With --ray, N replicas (--replicas), each an engine with its own pool, serve behind one
    address on Ray Serve, a request going to the replica whose pool holds the longest prefix of
    its prompt (--router blocks); Ray restarts a replica that dies. Needs 'pip install kvcache[ray]'.
    """
    from .serve.server import ServeOptions, serve

    for name in ("store_chunk", "port", "max_seqs", "block_size", "max_batch_tokens", "max_queue"):
        if getattr(args, name) < 1:
            raise KVCacheError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    # every ServeOptions field is an option of the same name, but device (no --device: the CPU)
    options = ServeOptions(**{f.name: getattr(args, f.name) for f in fields(ServeOptions) if f.name != "device"})
    ray_flags = {"--replicas": args.replicas, "--max-replicas": args.max_replicas, "--router": args.router, "--imbalance": args.imbalance,
                 "--ray-address": args.ray_address}  # fmt: skip
    if not args.ray:
        given = [name for name, value in ray_flags.items() if value is not None]
        if given:
            raise KVCacheError(f"{', '.join(given)} only apply with --ray")
        return serve(options)
    from .serve.ray_app import RayOptions, serve_ray

    if args.replicas is not None and args.replicas < 1:
        raise KVCacheError(f"--replicas must be at least 1, got {args.replicas}")
    if args.imbalance is not None and args.imbalance <= 0:
        raise KVCacheError(f"--imbalance must be positive, got {args.imbalance}")
    replicas = args.replicas or 2
    if args.max_replicas is not None and args.max_replicas < replicas:
        raise KVCacheError(f"--max-replicas must be at least --replicas ({replicas}), got {args.max_replicas}")
    imbalance = RayOptions.imbalance if args.imbalance is None else args.imbalance
    ray_options = RayOptions(replicas=replicas, router=args.router or "blocks", imbalance=imbalance,
                             max_replicas=args.max_replicas)
    return serve_ray(options, ray_options, args.ray_address)
