#!/bin/bash
# call A: install, kernels alone, GPU tests
bash benchmarks/gpu_host.sh install > /tmp/inst.log 2>&1 || { tail -5 /tmp/inst.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/.deps/pylib ONNXRUNTIME_INCLUDE_DIR=$PWD/.deps/ort-headers ONNX2FUSED_CUTLASS_DIR=$PWD/.deps/cutlass/include ONNX2FUSED_CUDA_ARCHS=90 ONNX2FUSED_CACHE=/tmp/o2f-cache
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 300 python3 benchmarks/kernel_check.py --case-timeout 150 --interleave 3 --only nerf_trunk nerf_trunk_f16io skip_odd nerf_skip --out $OUT/kc 2>&1 | tail -25
ONNX2FUSED_COMMIT=d74e384 O2F_TEST_TIMEOUT=300 timeout 280 bash benchmarks/gpu_host.sh test tests/test_gpu_convert.py -k "nerf_mlp or skip_chain" -q 2>&1 | grep -E "passed|failed|Error|assert" | head -20
