#!/bin/bash
# call B: the NeRF MLP through ORT, this tree and the one before the skip (build/oldtree), in turns
export ONNXRUNTIME_INCLUDE_DIR=$PWD/.deps/ort-headers ONNX2FUSED_CUTLASS_DIR=$PWD/.deps/cutlass/include ONNX2FUSED_CUDA_ARCHS=90
python3 benchmarks/nerf_mlp.py /tmp/nb > /dev/null 2>&1
(cd build/oldtree && ln -sfn $PWD/../../.deps .deps)
for round in 1 2; do
  for tree in new old; do
    if [ $tree = new ]; then d=$PWD; c=/tmp/o2f-cache; else d=$PWD/build/oldtree; c=/tmp/o2f-old; fi
    echo "== $tree round $round"
    (cd $d && PYTHONPATH=/tmp/site:$d:$PWD/.deps/pylib ONNX2FUSED_CACHE=$c timeout 250 python3 -m onnx2fused bench /tmp/nb/nerf_mlp.onnx --batches 65536,1048576 --reps 50 --no-torch --out $OUT/bench_${tree}_$round -q 2>&1 | tail -6)
  done
done
