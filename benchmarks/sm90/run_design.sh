#!/usr/bin/env bash
# The wgmma design (issue 15) through the code generator, on an H100: the four issue cases
#   nerf 32->64x4->16 ReLU 2^21 rows, gelu 64->128x4->64 2^20, silu 256x4 2^18 (refused: its weights do
#   not stay resident; it runs the streamed design either way), sdf 3->128x4->1 Tanh 2^20
# 1. kernel only (benchmarks/kernel_check.py: the generated sources compiled alone, checked against a
#    float64 reference at batches 0..70001, timed with CUDA events), wgmma forced vs the mma.sync plan;
# 2. through the normal convert path and ONNX Runtime (`onnx2fused bench`, fp16), wgmma forced vs
#    ONNX2FUSED_WGMMA=off (the mma.sync design auto picks otherwise).
# Logs go to $OUT (default benchmarks/sm90/out-design). Run from anywhere; uses the python on PATH
# (PYTHON=... to choose) with onnx2fused importable from this checkout.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOG=${OUT:-$HERE/out-design}
PY=${PYTHON:-python}
mkdir -p "$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,clocks.max.sm --format=csv 2>&1 | tee "$LOG/gpu.txt"
rc=0

echo "=== kernel only: wgmma forced ==="
ONNX2FUSED_CUDA_DESIGN=wgmma "$PY" "$ROOT/benchmarks/kernel_check.py" --out "$LOG/kc_wgmma" \
  --only nerf64 w128gelu w256silu sdf 2>&1 | tee "$LOG/kernel_wgmma.txt" || rc=1
grep -q "FAILED" "$LOG/kernel_wgmma.txt" && rc=1
grep -h "Used [0-9]* registers\|spill" "$LOG"/kc_wgmma/kernels/*.ptxas.txt 2>/dev/null | sort | uniq -c | head -20
echo "=== kernel only: mma.sync (ONNX2FUSED_WGMMA=off) ==="
ONNX2FUSED_WGMMA=off "$PY" "$ROOT/benchmarks/kernel_check.py" --out "$LOG/kc_mma" \
  --only nerf64 w128gelu w256silu sdf 2>&1 | tee "$LOG/kernel_mma.txt" || rc=1

echo "=== through ONNX Runtime (onnx2fused bench, fp16) ==="
for spec in nerf:2097152 gelu:1048576 silu:262144 sdf:1048576; do
  m=${spec%%:*}; b=${spec##*:}
  for design in wgmma mma; do
    if [ "$design" = wgmma ]; then env_=(ONNX2FUSED_CUDA_DESIGN=wgmma); else env_=(ONNX2FUSED_WGMMA=off); fi
    echo "--- $m batch $b: $design"
    env "${env_[@]}" "$PY" -m onnx2fused bench "$ROOT/models/$m.opset17.onnx" --batches "$b" --no-torch \
      --out "$LOG/bench_${m}_$design" 2>&1 | tail -12 | tee "$LOG/bench_${m}_$design.txt" || rc=1
  done
done
echo "exit code $rc"
exit $rc
