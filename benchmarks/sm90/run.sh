#!/usr/bin/env bash
# Build, then run every case (or the ones named: nerf gelu gelu-n128 silu sdf). Then a second build with
# the cheaper MUFU activation forms (-DO2F_SILU_TANH=1 -DO2F_TANH_F16X2=1) runs silu and sdf again.
# Logs (build with ptxas -v, SASS HGMMA counts, run output) go to $OUT when set, else benchmarks/sm90/out.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
LOG=${OUT:-$HERE/out}
mkdir -p "$LOG"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv 2>&1 | tee "$LOG/sm90_gpu.txt"

build_and_report() {  # $1 = binary, $2 = log tag; EXTRA_FLAGS from the environment
  if ! BIN="$1" "$HERE/build.sh" > "$LOG/sm90_build$2.txt" 2>&1; then
    tail -40 "$LOG/sm90_build$2.txt"; echo "BUILD FAILED ($2)"; return 1
  fi
  echo "--- ptxas (fused kernels)$2"
  awk '/Compiling entry function/ { f = ($0 ~ /fused_mlp_kernel/); if (f) { match($0, /Act[0-9]E[A-Za-z0-9]*/); n = substr($0, RSTART, 60) } }
       f && /stack frame|Used [0-9]+ registers|C7512|serialized/ { print "  " n ": " $0 }' "$LOG/sm90_build$2.txt"
  grep -i "warning" "$LOG/sm90_build$2.txt" | head -5
  if cuobjdump -sass "$1" > "$LOG/sm90_sass$2.txt" 2>/dev/null; then
    awk '/Function :/ { f = $3 } /HGMMA/ { c[f]++ } /STL|LDL/ { l[f]++ }
         END { for (k in c) printf "  HGMMA %4d  local ld/st %d  %s\n", c[k], l[k] + 0, substr(k, 1, 90) }' "$LOG/sm90_sass$2.txt"
  fi
}

BIN1=/tmp/fused_wgmma_$$
BIN2=/tmp/fused_wgmma_mufu_$$
EXTRA_FLAGS="${EXTRA_FLAGS:-}" build_and_report "$BIN1" "" || exit 1
"$BIN1" "$@" 2>&1 | tee "$LOG/sm90_run.txt"
rc=${PIPESTATUS[0]}
echo "exit code $rc" | tee -a "$LOG/sm90_run.txt"

if [ $# -eq 0 ]; then
  echo; echo "=== variant build: -DO2F_SILU_TANH=1 -DO2F_TANH_F16X2=1 (silu, sdf) ==="
  if EXTRA_FLAGS="-DO2F_SILU_TANH=1 -DO2F_TANH_F16X2=1" build_and_report "$BIN2" "_mufu"; then
    "$BIN2" silu sdf 2>&1 | tee "$LOG/sm90_run_mufu.txt"
    echo "exit code ${PIPESTATUS[0]}" | tee -a "$LOG/sm90_run_mufu.txt"
  fi
fi
rm -f "$BIN1" "$BIN2"
exit $rc
