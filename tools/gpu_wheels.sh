#!/usr/bin/env bash
# Fetch the wheels tools/gpu_check.sh needs beside a GPU machine's image (torch, triton and
# transformers are there) into tools/wheels (git-ignored; pass it in the device tool's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip download -q --only-binary=:all: -d tools/wheels pytest
du -sh tools/wheels
