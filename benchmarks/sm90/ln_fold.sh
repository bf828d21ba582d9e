#!/usr/bin/env bash
# Builds and runs benchmarks/sm90/ln_fold_gemm.cu (the LayerNorm folded into the first GEMM, against the
# norm pass + GEMM): ViT-B's first GEMM (16384 x 768 -> 3072) at row means of 0 and 5 (in units of the
# rows' spread). Log in $OUT (else benchmarks/sm90/out). CUTLASS_INC as for build.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CUTLASS_INC=${CUTLASS_INC:-$ROOT/.deps/cutlass/include}
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
BIN=/tmp/ln_fold_$$
"${NVCC:-nvcc}" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I"$CUTLASS_INC" -I"$ROOT/templates" --expt-relaxed-constexpr \
  -o "$BIN" "$HERE/ln_fold_gemm.cu"
for mean in 0 5; do "$BIN" 16384 3072 "$mean"; done 2>&1 | tee "$LOG/ln_fold.txt"
rm -f "$BIN"
