#!/usr/bin/env bash
# Build, then run every case (or the ones named: nerf gelu gelu-n128 silu sdf).
# Logs (build with ptxas -v, SASS HGMMA counts, run output) go to $OUT when set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
BIN=${BIN:-/tmp/fused_wgmma_$$}
export BIN
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv 2>&1 | tee "$LOG/sm90_gpu.txt"
if ! "$HERE/build.sh" > "$LOG/sm90_build.txt" 2>&1; then
  tail -40 "$LOG/sm90_build.txt"; echo "BUILD FAILED"; exit 1
fi
grep -E "registers|spill|stack|Compiling entry" "$LOG/sm90_build.txt" | grep -B1 -A2 fused_mlp | head -60
cuobjdump -sass "$BIN" > "$LOG/sm90_sass.txt" 2>/dev/null && \
  echo "HGMMA instructions in the SASS: $(grep -c HGMMA "$LOG/sm90_sass.txt")"
"$BIN" "$@" 2>&1 | tee "$LOG/sm90_run.txt"
rc=${PIPESTATUS[0]}
echo "exit code $rc" | tee -a "$LOG/sm90_run.txt"
exit $rc
