#!/usr/bin/env bash
# Nsight Compute's full set on one launch of the wide design's own Hopper GEMM (templates/o2f_light_gemm.cuh,
# through benchmarks/sm90/light_gemm.cu's single-case mode) and on one of cuBLAS's GEMM for the same shape:
# where the two kernels' time goes, side by side. Usage: light_ncu.sh [M K N [RASTER]] (default ViT-B's up
# projection, 16384 768 3072). Reports in $OUT (else benchmarks/sm90/out) as text, one file per kernel.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
M=${1:-16384} K=${2:-768} N=${3:-3072} R=${4:-0}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "light_ncu.sh: no ncu (Nsight Compute) on this host"; exit 2; }
BIN=/tmp/light_gemm_ncu
"${NVCC:-nvcc}" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -I"$ROOT/templates" \
  -o "$BIN" "$HERE/light_gemm.cu" -lcublas
# the fifth launch of each kernel: past the warm-up, caches in their steady state
for who in "light:regex:light_gemm" "cublas:regex:^(?!.*light_gemm).*(nvjet|xmma|cutlass|gemm|Kernel)"; do
  name=${who%%:*} filter=${who#*:}
  timeout 300 "$ncu" --set full --import-source no -k "$filter" --launch-skip 4 --launch-count 1 \
    "$BIN" "$M" "$K" "$N" "$R" > "$LOG/ncu_${name}_${M}x${K}x${N}.txt" 2>&1 || echo "ncu $name: exit $?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Registers Per|Shared Memory Configuration Size|Achieved Occupancy|Issue Slots Busy|No Eligible|One or More Eligible" \
    "$LOG/ncu_${name}_${M}x${K}x${N}.txt" | head -30
done
