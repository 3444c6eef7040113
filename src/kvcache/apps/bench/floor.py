"""The floor of one decode step: the roofline of a dense decoder on this machine.

A decode step reads every weight once and every cached key and value once, and does about two
FLOPs per weight per sequence plus the attention products. Its floor is the larger of

- bytes / read bandwidth: (weight bytes + K/V bytes read) / the measured read bandwidth, and
- FLOPs / matmul throughput: the step's FLOPs / the measured fp32 matrix-multiply throughput,

both measured in the same run as the decode they judge (:func:`measure_machine`). A step's time
divided by its floor is >= 1 for any real implementation; 1.0 is "at the floor".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from .common import clock, median, read_bandwidth


@dataclass(frozen=True)
class Machine:
    """Measured rates: ``read_bytes_per_s`` (median of a large fp32 ``sum``),
    ``matmul_flops_per_s`` (median of a large square fp32 GEMM, the roofline's compute roof) and
    ``gemv_flops_per_s`` (a decode-shaped ``[batch, hidden] @ [hidden, 4 hidden]``, for reference:
    what a weight product at this batch actually gets)."""

    read_bytes_per_s: float
    matmul_flops_per_s: float
    gemv_flops_per_s: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def product_throughput(m: int, k: int, n: int, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an fp32 ``[m, k] @ [k, n]`` product (2 m k n FLOPs), median of ``repeats``."""
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    a @ b  # warm up the library's kernels and the pages
    seconds = median([clock(lambda: a @ b, device) for _ in range(repeats)])
    return 2 * m * k * n / seconds


def measure_machine(batch: int, hidden: int, device: str = "cpu", bandwidth_mib: int = 512, gemm: int = 1024) -> Machine:
    """The rates the floor divides by, measured now (``bandwidth_mib`` should dwarf the caches)."""
    return Machine(
        read_bytes_per_s=read_bandwidth(device, mib=bandwidth_mib),
        matmul_flops_per_s=product_throughput(gemm, gemm, gemm, device=device),
        gemv_flops_per_s=product_throughput(batch, hidden, 4 * hidden, device=device),
    )


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs from a decoder: parameter counts and attention geometry."""

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    body_params: int  # parameters outside the input embedding and the LM head
    weight_bytes: int  # bytes one step reads: every parameter but an untied input embedding

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 keys and values of one token over all layers, one sequence."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a ``transformers`` decoder (Llama-like config fields)."""
    config = model.config.get_text_config(decoder=True)
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # a tied weight once
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    ends = {w.data_ptr(): w for w in (embedding, head)}
    # A step reads ``batch`` rows of the input embedding, not all of it, unless the LM head is it (tied).
    unread = 0 if embedding.data_ptr() == head.data_ptr() else embedding.numel() * embedding.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        layers=config.num_hidden_layers,
        query_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        body_params=sum(p.numel() for p in params) - sum(w.numel() for w in ends.values()),
        weight_bytes=sum(p.numel() * p.element_size() for p in params) - unread,
    )


def step_flops(shape: ModelShape, batch: int, context: int) -> float:
    """FLOPs of one decode step of ``batch`` sequences over ``context`` cached tokens:
    2 x non-embedding params x batch (the weight products), + 2 x hidden x vocab x batch (the LM
    head; the embedding lookup reads ``batch`` rows and is not counted), + 4 x layers x query heads x head_dim x context x batch (scores and weighted values)."""
    weights = 2 * shape.body_params * batch
    head = 2 * shape.hidden * shape.vocab * batch
    attention = 4 * shape.layers * shape.query_heads * shape.head_dim * context * batch
    return float(weights + head + attention)


def floor_seconds(shape: ModelShape, machine: Machine, batch: int, context: int, kv_bytes_read: int) -> dict[str, float]:
    """The roofline of one step: ``memory_s`` (bytes / read bandwidth) and its parts ``weights_s``
    and ``kv_s``, ``compute_s`` (FLOPs / matmul throughput) and ``floor_s``, the larger of the two."""
    weights = shape.weight_bytes / machine.read_bytes_per_s
    kv = kv_bytes_read / machine.read_bytes_per_s
    memory = float(shape.weight_bytes + kv_bytes_read) / machine.read_bytes_per_s  # every weight once, and the K/V
    compute = step_flops(shape, batch, context) / machine.matmul_flops_per_s
    return {"memory_s": memory, "weights_s": weights, "kv_s": kv, "compute_s": compute, "floor_s": max(memory, compute)}
