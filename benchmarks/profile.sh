#!/usr/bin/env bash
# Nsight Compute summary (speed of light, occupancy, warp stall reasons) of the generated kernels of
# the kernel_check cases named as arguments. GPU host only. Usage: benchmarks/profile.sh OUTDIR CASE...
set -euo pipefail
out=$1; shift
for c in "$@"; do
  ncu --target-processes all -k regex:'fused_resident|tiles::kernel|fp32_kernel' -c 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section SchedulerStats --section InstructionStats --print-details all \
      python3 benchmarks/kernel_check.py --out "$out/prof_$c" --only "$c" --profile > "$out/ncu_$c.txt" 2>&1 || true
  grep -E "Duration|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles|Executed Ipc|Issue Slots|Pipe|Eligible|Issued Warp" "$out/ncu_$c.txt" | head -60
done
