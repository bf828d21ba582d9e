#!/usr/bin/env bash
# Nsight Compute summary (speed of light, occupancy, warp stall reasons) of the generated kernels of
# the kernel_check cases named as arguments. GPU host only. Usage: benchmarks/profile.sh OUTDIR CASE...
set -euo pipefail
out=$1; shift
for c in "$@"; do
  ncu --target-processes all -k regex:'fused_resident|tiles::kernel|fp32_kernel' -c 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/kernel_check.py --out "$out/prof_$c" --only "$c" --profile > "$out/ncu_$c.txt" 2>&1 || true
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles|Block Limit|L2 Cache Throughput|Executed Ipc" "$out/ncu_$c.txt" | head -40
done
