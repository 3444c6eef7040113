"""Pilot of `kvcache bench finetune` at 2K tokens, 8 steps, three seeds: `python benchmarks/finetune_pilot.py` (needs ".[bench,train]"; about 25 minutes)."""
from dataclasses import replace
from pathlib import Path
from kvcache.apps.bench import finetune
from kvcache.apps.run_options import RunOptions

finetune.FULL = replace(finetune.FULL, length=2048, steps=8)
finetune.run(RunOptions(out=Path("benchmarks/results/finetune-pilot-2k"), progress=False))
