#!/usr/bin/env bash
# Builds and runs benchmarks/sm90/light_gemm.cu (the wide design's own Hopper GEMM, templates/o2f_light_gemm.cuh,
# alone: docs/DESIGN.md, "A Hopper GEMM of our own"): ViT-B's two GEMMs, mnist's first layer and a case with
# tails in every dimension; time, TFLOP/s and error for each beside cuBLAS, and the nvcc time. Log in $OUT
# (else benchmarks/sm90/out). No CUTLASS, no ORT.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
BIN=/tmp/light_gemm_$$
BLAS=""   # cuBLAS times the reference GEMM where the toolkit has it
echo '#include <cublas_v2.h>' | "${NVCC:-nvcc}" -E -x cu - >/dev/null 2>&1 && BLAS="-lcublas"
start=$(date +%s.%N)
"${NVCC:-nvcc}" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I"$ROOT/templates" -Xptxas -v \
  -o "$BIN" "$HERE/light_gemm.cu" $BLAS 2>&1 | grep -i "registers\|spill\|warn\|error" || true
end=$(date +%s.%N)
python3 -c "print(f'nvcc: {$end - $start:.1f} s')" | tee "$LOG/light_gemm.txt"
# a barrier that never completes hangs the kernel: the time limit names it instead of eating the call
timeout 120 "$BIN" "$@" 2>&1 | tee -a "$LOG/light_gemm.txt" || echo "light_gemm: failed or timed out (exit ${PIPESTATUS[0]})" | tee -a "$LOG/light_gemm.txt"
rm -f "$BIN"
