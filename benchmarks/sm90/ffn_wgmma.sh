#!/usr/bin/env bash
# Builds and runs benchmarks/sm90/ffn_wgmma.cu (a whole FFN in one Hopper kernel, the hidden layer kept on
# the SM) for issue 16's SwiGLU 256 -> 1024 -> 256, a GELU pair 256 -> 4096 -> 256 and ViT-tiny's FFN
# 192 -> 768 -> 192, each a binary of its own (built in parallel). Logs in $OUT (else benchmarks/sm90/out).
# `ffn_wgmma.sh NAME...` runs the named cases only; EXTRA_FLAGS adds nvcc flags; ROWS the batches.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
declare -A CASES=(
  [swiglu256]="-DFFN_K0=256 -DFFN_H=1024 -DFFN_N=256 -DFFN_GATED=1"
  [pair256]="-DFFN_K0=256 -DFFN_H=4096 -DFFN_N=256 -DFFN_GATED=0"
  [vitt]="-DFFN_K0=192 -DFFN_H=768 -DFFN_N=192 -DFFN_GATED=0"
  # the two warpgroups' wgmmas issued in turns (FFN_PINGPONG)
  [swiglu256_pp]="-DFFN_K0=256 -DFFN_H=1024 -DFFN_N=256 -DFFN_GATED=1 -DFFN_PINGPONG=1"
  [pair256_pp]="-DFFN_K0=256 -DFFN_H=4096 -DFFN_N=256 -DFFN_GATED=0 -DFFN_PINGPONG=1"
  [vitt_pp]="-DFFN_K0=192 -DFFN_H=768 -DFFN_N=192 -DFFN_GATED=0 -DFFN_PINGPONG=1"
)
NAMES=("$@")
[ ${#NAMES[@]} -eq 0 ] && NAMES=(swiglu256 pair256 vitt)
BLAS=""
echo '#include <cublas_v2.h>' | "${NVCC:-nvcc}" -E -x cu - >/dev/null 2>&1 && BLAS="-lcublas"
for n in "${NAMES[@]}"; do
  ( "${NVCC:-nvcc}" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I"$ROOT/templates" -Xptxas -v \
      ${CASES[$n]} ${EXTRA_FLAGS:-} -o "/tmp/ffn_$n" "$HERE/ffn_wgmma.cu" $BLAS > "$LOG/ffn_build_$n.txt" 2>&1
    grep -i "registers\|spill\|warn\|error" "$LOG/ffn_build_$n.txt" | sed "s/^/$n: /" ) &
done
wait
rc=0
for n in "${NAMES[@]}"; do
  command -v cuobjdump >/dev/null && echo "$n: $(cuobjdump -sass "/tmp/ffn_$n" | grep -c HGMMA) HGMMA in the SASS"
  # a barrier that never completes hangs the kernel: the time limit names it instead of eating the call
  timeout 120 "/tmp/ffn_$n" ${ROWS:-} 2>&1 | tee "$LOG/ffn_$n.txt" || { echo "$n: failed or timed out"; rc=1; }
done
exit $rc
