"""Whether half-precision matmul works on this CPU, found in a subprocess so a crash costs nothing.

On some CPUs that advertise AMX (``amx_bf16``, ``amx_tile``), torch 2.13's oneDNN kernels for
bfloat16 matmul kill the process with ``SIGILL`` (``Fatal Python error: Illegal instruction``),
while the same call runs once oneDNN is capped below AMX with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``.
A process cannot catch that signal, so the check runs a few half-precision matmuls in a child
process, first with the environment as it is, then, if that child died, with the cap:

- :attr:`HalfPrecision.WORKS`: nothing to do;
- :attr:`HalfPrecision.NEEDS_ISA_CAP`: works with the cap; :func:`use_safe_isa` sets it in this
  process, which oneDNN honours as long as it has not run a kernel yet;
- :attr:`HalfPrecision.BROKEN`: crashes either way; use float32 on this CPU.

The test suite (``tests/conftest.py``) and the CLI (a model in bfloat16 or float16 on the CPU) run
the check; the library itself never does, since it would cost a subprocess per process.
``KVCACHE_HALF_PROBE_FAULT`` lets tests stand in for such a CPU: ``always`` makes every probe die
with ``SIGILL``, ``uncapped`` only a probe without the cap.

This module uses only the standard library: it must run before anything touches oneDNN.
"""

from __future__ import annotations

import enum
import functools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["FAULT_ENV", "ISA_ENV", "SAFE_ISA", "HalfPrecision", "ProbeResult", "half_precision_support", "use_safe_isa"]

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
SAFE_ISA = "AVX512_CORE_BF16"
FAULT_ENV = "KVCACHE_HALF_PROBE_FAULT"
PROBE_TIMEOUT_S = 300.0

# What the failing machines crashed on: a Linear, a batched matmul and SDPA in both half dtypes.
_PROBE = """
import os, signal
fault = os.environ.get({fault!r}, "")
if fault == "always" or (fault == "uncapped" and {isa!r} not in os.environ):
    os.kill(os.getpid(), signal.SIGILL)
import torch
for dtype in (torch.bfloat16, torch.float16):
    x = torch.randn(4, 256).to(dtype)
    torch.nn.Linear(256, 512).to(dtype)(x)
    q = torch.randn(1, 4, 8, 64).to(dtype)
    (q @ q.transpose(-1, -2)).sum()
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
""".format(fault=FAULT_ENV, isa=ISA_ENV)


class HalfPrecision(enum.Enum):
    WORKS = "works"
    NEEDS_ISA_CAP = "needs_isa_cap"
    BROKEN = "broken"


@dataclass(frozen=True)
class ProbeResult:
    status: HalfPrecision
    detail: str  # how the failing probe ended ("" when it worked)

    def describe(self) -> str:
        """One line for a report header or an error."""
        if self.status is HalfPrecision.WORKS:
            return "bfloat16/float16 matmul works on this CPU"
        if self.status is HalfPrecision.NEEDS_ISA_CAP:
            return (
                f"bfloat16/float16 matmul crashes this process on this CPU ({self.detail}) unless oneDNN is "
                f"capped below AMX: {ISA_ENV}={SAFE_ISA}"
            )
        return (
            f"bfloat16/float16 matmul crashes on this CPU ({self.detail}), even with {ISA_ENV}={SAFE_ISA}: "
            "use float32"
        )


def _probe(env: dict[str, str]) -> str:
    """How a child running half-precision matmuls under ``env`` ended: "" if it exited cleanly."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return ""
    if done.returncode < 0:
        try:
            return f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            return f"killed by signal {-done.returncode}"
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return f"exit code {done.returncode}: {last}"


@functools.lru_cache(maxsize=None)
def _support(isa: str | None, fault: str | None) -> ProbeResult:
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    if isa is not None:
        env[ISA_ENV] = isa
    failure = _probe(env)
    if not failure:
        return ProbeResult(HalfPrecision.WORKS, "")
    if isa is not None:  # the user's own cap is what we would try: no second chance
        return ProbeResult(HalfPrecision.BROKEN, f"{failure}, with {ISA_ENV}={isa}")
    if _probe(env | {ISA_ENV: SAFE_ISA}):
        return ProbeResult(HalfPrecision.BROKEN, failure)
    return ProbeResult(HalfPrecision.NEEDS_ISA_CAP, failure)


def half_precision_support() -> ProbeResult:
    """Whether half-precision matmul works in a process with this environment (probed once per
    value of ``$ONEDNN_MAX_CPU_ISA`` and the test hook, in child processes; a few seconds)."""
    return _support(os.environ.get(ISA_ENV), os.environ.get(FAULT_ENV))


def use_safe_isa() -> ProbeResult:
    """Probe, and where only the cap makes half precision work, set ``$ONEDNN_MAX_CPU_ISA`` in this
    process (and so in its children). Call it before the first half-precision kernel runs: oneDNN
    reads the variable once, when it first dispatches. Returns what the probe found."""
    found = half_precision_support()
    if found.status is HalfPrecision.NEEDS_ISA_CAP:
        os.environ[ISA_ENV] = SAFE_ISA
    return found
