#!/usr/bin/env bash
# Builds the sm_90a wgmma fused-MLP prototype. Run from anywhere; CUTLASS_INC (CuTe headers) defaults to
# .deps/cutlass/include under the repository root. Extra nvcc flags: EXTRA_FLAGS, e.g.
#   EXTRA_FLAGS="-DO2F_SILU_TANH=1 -DO2F_TANH_F16X2=1" benchmarks/sm90/build.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CUTLASS_INC=${CUTLASS_INC:-$ROOT/.deps/cutlass/include}
NVCC=${NVCC:-nvcc}
BIN=${BIN:-$HERE/fused_wgmma}
if [ ! -f "$CUTLASS_INC/cute/tensor.hpp" ]; then
  echo "CuTe headers not found under CUTLASS_INC=$CUTLASS_INC" >&2
  exit 1
fi
set -x
"$NVCC" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo \
  -I"$CUTLASS_INC" -Xptxas -v --expt-relaxed-constexpr ${EXTRA_FLAGS:-} \
  -o "$BIN" "$HERE/fused_wgmma.cu"
