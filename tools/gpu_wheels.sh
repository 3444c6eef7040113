#!/usr/bin/env bash
# Fetch the wheels tools/gpu_check.sh needs beside a GPU machine's image (torch, triton and
# transformers are there) into tools/wheels (git-ignored; pass it in the device tool's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip download -q --only-binary=:all: -d tools/wheels pytest
# The image's transformers (5.17) predates cache_utils.DummyLayer: carry ours, with its hub client.
python -m pip download -q --only-binary=:all: --no-deps -d tools/wheels transformers==5.24.0 huggingface_hub==2.4.0 httpx2 httpcore2 truststore
du -sh tools/wheels
