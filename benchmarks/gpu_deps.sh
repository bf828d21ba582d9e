#!/usr/bin/env bash
# Builds .deps/ (ignored by git), what every `run` on the GPU host carries beside the working tree
# (benchmarks/gpu_host.sh's header): the host has Python 3.12, torch, nvcc and onnx, no internet, no
# onnxruntime-gpu (see ../shared/gpu-deps/split-ort-gpu.sh for that) and none of these:
#   .deps/ort-headers      the ONNX Runtime C/C++ headers this checkout's builds use (onnx2fused.headers)
#   .deps/cutlass/include  the CUTLASS headers of the venv's nvidia-cutlass (the wide design's GEMMs)
#   .deps/pylib            cp312 wheels unpacked: jinja2, markupsafe, pytest and the plugins gpu_host.sh
#                          uses (xdist: one nvcc build per core; timeout: a hang names itself). pytest
#                          stays below 9 as pyproject.toml pins it: pytest 9 with pytest-xdist 3.8 ignores
#                          xdist_group, and every worker then builds test_gpu_wide.py's shared plugin.
# Run from the repository root after `make venv` (it needs .venv for the headers and CUTLASS).
# Usage: bash benchmarks/gpu_deps.sh   (idempotent: it rebuilds .deps/ from scratch)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VPY=${VPY:-.venv/bin/python}
[ -x "$VPY" ] || { echo "gpu_deps.sh: no $VPY (run make venv first)"; exit 2; }
rm -rf .deps.new && mkdir -p .deps.new/cutlass .deps.new/pylib   # (.gitignore lists .deps/)

headers=$("$VPY" -c "from onnx2fused.headers import find_ort_headers; print(find_ort_headers())")
cp -r "$headers" .deps.new/ort-headers
cutlass=$("$VPY" -c "from onnx2fused.headers import find_cutlass_headers; print(find_cutlass_headers().path)")
cp -r "$cutlass" .deps.new/cutlass/include

wheels=$(mktemp -d)
trap 'rm -rf "$wheels" .deps.new' EXIT
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$wheels" \
  jinja2 markupsafe "pytest>=8,<9" pluggy iniconfig packaging pygments pytest-xdist execnet pytest-timeout
for w in "$wheels"/*.whl; do "$VPY" -m zipfile -e "$w" .deps.new/pylib; done

rm -rf .deps && mv .deps.new .deps
trap 'rm -rf "$wheels"' EXIT
du -sh .deps | sed 's/^/gpu_deps.sh: /'
"$VPY" -c "import sys; sys.path.insert(0, '.deps/pylib'); import pytest, xdist; print('pytest', pytest.__version__, '(.deps/pylib)')"
