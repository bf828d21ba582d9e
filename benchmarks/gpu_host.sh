#!/usr/bin/env bash
# What a session runs on the GPU host (it has nvcc, torch and onnx, but onnxruntime without CUDA and no
# internet). Run from the repository root, with `.deps/` carried (ort-headers: the ORT C headers the
# build fetched here; cutlass/include: the nvidia-cutlass headers; pylib: jinja2, pytest < 9 and its
# plugins; `bash benchmarks/gpu_deps.sh` builds it here) and the onnxruntime-gpu wheel's parts moved to
# /tmp/ortparts beforehand (../shared/gpu-deps/split-ort-gpu.sh). Results go to $OUT.
#
#   benchmarks/gpu_host.sh install        rebuild and install the onnxruntime-gpu wheel into /tmp/site
#   benchmarks/gpu_host.sh test [ARGS]    the GPU-marked tests (pytest ARGS, default: all tests/test_gpu*.py)
#   benchmarks/gpu_host.sh kernels [ARGS] benchmarks/kernel_check.py (kernels alone, no ORT)
#   benchmarks/gpu_host.sh power [CASES] the issue-15 kernels (and CASES) sustained: time, SM clock, power (no ORT)
#   benchmarks/gpu_host.sh overhead       ORT's fixed cost per run: the issue-15 models at batch 1 and at their batch
#   benchmarks/gpu_host.sh floor          the same models beside a one-Relu model on their input, in turns (ort_floor.py)
#   benchmarks/gpu_host.sh blocks         the CUDA block kernels alone (issue 16): kernel_check's block cases
#   benchmarks/gpu_host.sh blocktests [ARGS] tests/test_gpu_block.py (the blocks through ORT)
#   benchmarks/gpu_host.sh gatedwide [ARGS] gated layers in the wide design (issue 16): their GPU tests
#   benchmarks/gpu_host.sh gatedwg       gated layers in the wgmma kernel (forced only): kernel_check glu cases,
#                                         then the zoo's gated blocks forced into wgmma (tests/test_gpu.py)
#   benchmarks/gpu_host.sh pointnet       PointNet through ORT (benchmarks/pointnet.py, 32 and 256 clouds): the wgmma
#                                         pooled chain vs mma.sync (ONNX2FUSED_WGMMA=off) by turns, then its kernels
#   benchmarks/gpu_host.sh pools [--no-tests] sum and mean pools and a CNN head's global pool: their GPU tests, then
#                                         Deep Sets (sum, mean) and MobileNetV2's head (benchmarks/cnn_head.py: a
#                                         7 x 7 map, and exported for any map size) and PointNet at 1000 points (groups
#                                         not a multiple of 16) through ORT at 32 and 256, the head and PointNet also
#                                         converted by the tree in $OLD where given (a `git archive` of an older
#                                         commit), then each model's kernels (profile_case.py)
#   benchmarks/gpu_host.sh llama [BATCHES] LLaMA-7B's MLP (wide_cases.py llama7b; default 4096,256,16,1)
#   benchmarks/gpu_host.sh gemv [--no-bench] the wide design's GEMV path for <= 16 rows (on by default;
#                                         ONNX2FUSED_WIDE_GEMV=off: the GEMMs): its GPU test, then LLaMA-7B at 1, 16
#   benchmarks/gpu_host.sh wideblock [--no-tests] [ARGS] blocks in the wide design (norm pass, residual epilogue): their
#                                         GPU tests, then ViT-B's pre-LN block (wide_cases.py vitb_block ARGS, 16384
#                                         rows) through ORT and kernel by kernel (profile_case.py; --fp16-model: the
#                                         fp16 copy converted too, and profiled in place of the fp32 model)
#   benchmarks/gpu_host.sh vitprof [N]    ViT-tiny fp16 (batch 64) stock vs converted, kernel by kernel (top N), and
#                                         ViT-B's block alone, fused vs stock fp16
#   benchmarks/gpu_host.sh vit            whole ViT-tiny and ViT-small (benchmarks/vit_model.py) at batch 64:
#                                         issue 16's end-to-end target, ORT fp32 / fp16 vs the fused model
#   benchmarks/gpu_host.sh bench          `onnx2fused bench` on the issue's four cases, then the wide cases
#   benchmarks/gpu_host.sh issue15        `onnx2fused bench --pipelined` on issue 15's four cases (bench.json: $OUT/issue15.tar)
#   benchmarks/gpu_host.sh wide [ARGS]    benchmarks/wide_cases.py only (issue 5's three cases)
#   benchmarks/gpu_host.sh tune [ARGS]    benchmarks/tune_wide.py: the wide kernel search, every candidate timed
#   benchmarks/gpu_host.sh times [ARGS]   benchmarks/convert_times.py: cold and warm convert of every zoo model
#   benchmarks/gpu_host.sh sm90           benchmarks/sm90/run.sh: the standalone wgmma fused-MLP prototype
#   benchmarks/gpu_host.sh lnfold         benchmarks/sm90/ln_fold.sh: the LayerNorm folded into ViT-B's first GEMM,
#                                         against the norm pass + GEMM (times and errors; no ORT needed)
#   benchmarks/gpu_host.sh lightgemm [sweep | M K N [RASTER]] benchmarks/sm90/light_gemm.sh: the wide design's own
#                                         Hopper GEMM alone beside cuBLAS (nvcc time, speed, errors; no ORT needed;
#                                         sweep: GELU packed / through fp32 / none, K 768..3072)
#   benchmarks/gpu_host.sh lightncu [M K N [RASTER]] benchmarks/sm90/light_ncu.sh: Nsight Compute's full set on it
#                                         and on cuBLAS's GEMM for one shape (default ViT-B's up projection)
#   benchmarks/gpu_host.sh ffnunit [ARGS]  benchmarks/ffn_unit_check.py: the library's one-kernel FFN unit alone (no ORT),
#                                         default swiglu256 (packed glu), swiglu256_a32 (fp32 glu), pair256 and pair64,
#                                         and swiglu256 again with the warpgroups in step (NO_TURNS) and with the bias
#                                         added in the activation (BIAS_EPI): RESULTS.md thirtieth run
#   benchmarks/gpu_host.sh gluab OLD [CASES [BATCHES]] gated wide cases (default swiglu256; llama7b at BATCHES,
#                                         default 256,4096) through ORT on this tree, then on commit OLD (A/B)
#   benchmarks/gpu_host.sh lightab [CASES] wide_cases.py (default vitb_block,ffn) converted twice, the untuned Hopper
#                                         kernels ours, then CUTLASS's (Pingpong128x128 and Tf32Pingpong128x128:
#                                         ONNX2FUSED_WIDE_DEFAULT_KERNEL, ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL)
#   benchmarks/gpu_host.sh ncuwide [CASE|M.onnx [KERNEL [ROWS]]] Nsight Compute on a wide case's (or a model's)
#                                         kernels through ORT (profile_case.py)
#   benchmarks/gpu_host.sh ncustall M.onnx [KERNEL [ROWS]] Nsight Compute's warp-stall breakdown of a model's kernels
#                                         through ORT (default: every kernel, 256 rows): cycles per issued instruction
#                                         by stall reason, largest first, and its source-level stall sampling
#   benchmarks/gpu_host.sh profile [CASES] Nsight Compute's full set on kernel_check.py --profile (default: the
#                                         four issue-15 cases; ONNX2FUSED_CUDA_DESIGN=wgmma for that design);
#                                         text and raw CSV reports in $OUT
# The device's copy of .git is the session's first: pass ONNX2FUSED_COMMIT=<the commit the tree is> in the
# call's command so that the bench JSONs say which commit ran (onnx2fused/bench/report.py).
# Kernel choices measured by an earlier call (.deps/tune/*.json, copied from $OUT/tune) seed the build
# cache, so convert does not tune again; every call leaves the cache's choices in $OUT/tune.
set -uo pipefail
R=$(pwd)
OUT=${OUT:-/tmp/o2f-out}
export PYTHONPATH=/tmp/site:$R:$R/.deps/pylib
workers=()   # pytest-xdist when carried: one nvcc build per core instead of one at a time
# --dist loadgroup: tests marked xdist_group share one worker (test_gpu_wide.py's on one CUTLASS library,
# whose module fixture each worker would otherwise build again: with 16 at once the OOM killer took cicc)
[ -d .deps/pylib/xdist ] && workers=(-n "${O2F_PYTEST_WORKERS:-16}" --dist loadgroup)
# pytest-timeout when carried: a test over O2F_TEST_TIMEOUT seconds fails with its stack, so a hang names
# itself instead of eating the call's time limit
[ -f .deps/pylib/pytest_timeout.py ] && workers+=(--timeout "${O2F_TEST_TIMEOUT:-240}")
# The GPU-marked tests: gpu_pytest SECONDS LOG LINES PYTEST_ARGS... (SECONDS 0: no limit; the whole output
# in $OUT/LOG, its last LINES here; -v: under xdist each result is named as it finishes, so a run cut by
# the time limit still says what failed; pytest-benchmark off: it only warns under xdist)
gpu_pytest() {
  local seconds=$1 log=$2 lines=$3
  shift 3
  timeout "$seconds" python3 -m pytest -v -m gpu -p no:cacheprovider -p no:benchmark -rs --tb=short "${workers[@]}" "$@" 2>&1 \
    | tee "$OUT/$log" | grep --line-buffered -v " PASSED \| SKIPPED " | tail -"$lines"
}
export ONNXRUNTIME_INCLUDE_DIR=$R/.deps/ort-headers ONNX2FUSED_CUTLASS_DIR=$R/.deps/cutlass/include
export ONNX2FUSED_CUDA_ARCHS=${ONNX2FUSED_CUDA_ARCHS:-90} ONNX2FUSED_CACHE=${ONNX2FUSED_CACHE:-/tmp/o2f-cache}
if compgen -G ".deps/tune/*.json" > /dev/null; then
  mkdir -p "$ONNX2FUSED_CACHE/tune" && cp .deps/tune/*.json "$ONNX2FUSED_CACHE/tune/"
fi
# bench_rows LABEL DIR LOG: each row of DIR/bench.json (batch, every variant's median ms) after LABEL, or LOG's end
bench_rows() {
  python3 -c "import json; [print('$1', r['batch'], ' '.join('%s=%.4f' % kv for kv in r['ms'].items() if kv[1])) for r in json.load(open('$2/bench.json'))['rows']]" \
    || tail -3 "$3"
}
save_tune() { mkdir -p "$OUT/tune" && cp "$ONNX2FUSED_CACHE"/tune/*.json "$OUT/tune/" 2>/dev/null; true; }
trap save_tune EXIT

case "${1:-}" in
install)
  (cd /tmp/ortparts && cat part-* > onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl \
     && sha256sum -c SHA256 && python3 -m pip install -q --no-index --no-deps --target /tmp/site onnxruntime_gpu-*.whl) \
    || exit 1
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
  ;;
test)
  shift
  args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(tests/test_gpu.py tests/test_gpu_activations.py tests/test_gpu_reliability.py tests/test_gpu_wide.py)
  gpu_pytest 0 pytest_gpu.txt 40 "${args[@]}"
  ;;
floor)
  # ORT's own cost per run (a model of one stock Relu) beside the issue-15 models stock and fused
  for c in "nerf 2097152" "silu 262144" "gelu 1048576"; do
    set -- $c
    python3 benchmarks/ort_floor.py "models/$1.opset17.onnx" --batches "1,$2" --out "$OUT/floor_$1" 2>&1 | tail -2
  done
  ;;
overhead)
  # batch 1: the fused op's run is ORT's own cost plus a launch; beside stock ORT's at the same batch
  for c in "nerf 2097152" "sdf 1048576" "gelu 1048576"; do
    set -- $c
    python3 -m onnx2fused bench "models/$1.opset17.onnx" --batches "1,$2" --no-torch --reps 200 \
      --out "$OUT/overhead_$1" -q 2>&1 | tail -8
  done
  ;;
blocks)
  # one line per case as it finishes (a time limit that cuts the run keeps what came before)
  timeout 300 python3 benchmarks/kernel_check.py --out /tmp/kc_blocks --no-time --case-timeout 90 --only ffn64 preln preln_streamed \
    preln_bf16 preln_tf32 preln_fp32 preln_f16io llama llama_streamed block40 block40_streamed block72_rms \
    block30_f16io block37_res block37_res_streamed block48_gres block48_gres_streamed 2>&1 \
    | grep --line-buffered -o '"case": "[a-z0-9_]*"\|"relerr": [0-9.e+-]*\|.*FAILED.*\|.*TIMED OUT.*\|compiled.*'
  cp /tmp/kc_blocks/kernel_check.json "$OUT/kc_blocks.json" 2>/dev/null; true   # not the libraries (MBs each)
  ;;
blocktests)
  shift
  gpu_pytest 560 pytest_gpu_block.txt 30 tests/test_gpu_block.py "$@"
  ;;
gatedwide)
  shift
  gpu_pytest 400 pytest_gpu_gated_wide.txt 20 tests/test_gpu_gated.py -k "wide or big_swiglu" "$@"
  ;;
gatedwg)
  # gated layers in the wgmma kernel (forced only until this runs): the kernels alone against the
  # mma.sync kernels the cost model picks, then the zoo's SwiGLU/GeGLU blocks forced into wgmma on the CUDA EP
  timeout 200 python3 benchmarks/kernel_check.py --out "$OUT/kc" --case-timeout 60 --only glu64 glu64_wg glu256 glu256_wg \
    2>&1 | grep -v '^{' | tail -8
  gpu_pytest 360 pytest_gpu_gated_wgmma.txt 20 tests/test_gpu.py -k "zoo_on and (swiglu or geglu)"
  ;;
pointnet)
  # PointNet's classifier (benchmarks/pointnet.py) through ORT at 32 and 256 clouds of 1024 points: the wgmma
  # kernel's pooled chain against the mma.sync one (ONNX2FUSED_WGMMA=off) by turns (ROUNDS, default 2), the
  # float16 copy beside; then its kernels per run (profile_case.py)
  [ -f /tmp/pn/pointnet.onnx ] || python3 benchmarks/pointnet.py /tmp/pn > /dev/null || exit 1
  for round in $(seq "${ROUNDS:-2}"); do
    for v in wgmma mma; do
      env $([ $v = mma ] && echo ONNX2FUSED_WGMMA=off) timeout 240 python3 -m onnx2fused bench /tmp/pn/pointnet.onnx \
        --batches 32,256 --reps 50 --no-torch --fp16-model --out /tmp/pn_$v -q > /tmp/pn_$v.log 2>&1
      cp /tmp/pn_$v/bench.json "$OUT/pointnet_${v}_$round.json" 2>/dev/null
      bench_rows "$v" /tmp/pn_$v /tmp/pn_$v.log
    done
  done
  timeout 150 python3 benchmarks/profile_case.py --model /tmp/pn/pointnet.onnx --batch 256 --runs 20 --out /tmp/pn_prof \
    > "$OUT/pointnet_profile.txt" 2>&1
  grep -A8 "kernel time per run" "$OUT/pointnet_profile.txt"
  ;;
pools)
  [ "${2:-}" = --no-tests ] || gpu_pytest 300 pytest_pools.txt 12 tests/test_gpu_convert.py \
    -k "deep_sets or cnn_head or sum_and_mean or pooled_float16"
  mkdir -p /tmp/pools
  python3 benchmarks/deepsets.py /tmp/pools > /dev/null && python3 benchmarks/deepsets.py /tmp/pools --pool mean > /dev/null \
    && python3 benchmarks/cnn_head.py /tmp/pools > /dev/null && python3 benchmarks/cnn_head.py /tmp/pools --any-size > /dev/null \
    && python3 benchmarks/pointnet.py /tmp/pools/pn1000 --points 1000 > /dev/null && cp /tmp/pools/pn1000/pointnet.onnx /tmp/pools/pointnet1000.onnx \
    || exit 1
  # (PointNet at 1000 points a cloud: groups not a multiple of 16, the wgmma kernel's kStraddle instance)
  runs=(deepsets:new deepsets_mean:new cnn_head:new cnn_head_any:new pointnet1000:new)
  [ -n "${OLD:-}" ] && [ -d "$OLD/onnx2fused" ] && runs+=(cnn_head:old pointnet1000:old)
  for run in "${runs[@]}"; do
    m=${run%%:*}; tree=${run#*:}; src=$R; [ "$tree" = old ] && src=$(cd "$OLD" && pwd)
    dims=(); [ "$m" = cnn_head_any ] && dims=(--dim h=7 --dim w=7)   # (its map's size dynamic: 7 x 7, as the other's)
    (cd "$src" && PYTHONPATH=/tmp/site:$src:$R/.deps/pylib ONNX2FUSED_CACHE=/tmp/pools/cache_$tree timeout 240 \
      python3 -m onnx2fused bench "/tmp/pools/$m.onnx" --batches 32,256 --reps 50 --no-torch "${dims[@]}" --out "/tmp/pools/b_${m}_$tree" \
      -q > "/tmp/pools/b_${m}_$tree.log" 2>&1)
    cp "/tmp/pools/b_${m}_$tree/bench.json" "$OUT/pools_${m}_$tree.json" 2>/dev/null
    bench_rows "$m $tree" "/tmp/pools/b_${m}_$tree" "/tmp/pools/b_${m}_$tree.log"
  done
  for m in deepsets cnn_head pointnet1000; do
    timeout 150 python3 benchmarks/profile_case.py --model "/tmp/pools/$m.onnx" --batch 256 --runs 20 --out /tmp/pools/prof \
      > "$OUT/pools_${m}_profile.txt" 2>&1
    grep -A6 "kernel time per run" "$OUT/pools_${m}_profile.txt"
  done
  ;;
llama)
  timeout 500 python3 benchmarks/wide_cases.py --out /tmp/wide_llama --cases llama7b --batch "${2:-4096,256,16,1}" \
    --kernels sm90 --reps 50 2>&1 | tail -24
  cp /tmp/wide_llama/wide_cases.json "$OUT/llama7b.json" 2>/dev/null; true
  ;;
gemv)
  gpu_pytest 300 pytest_gpu_gemv.txt 30 tests/test_gpu_wide.py -k gemv
  [ "${2:-}" = "--no-bench" ] && exit 0
  ONNX2FUSED_WIDE_GEMV=on timeout 280 python3 benchmarks/wide_cases.py --out /tmp/wide_gemv --cases llama7b --batch 1,16 \
    --kernels sm90 --reps 50 2>&1 | tail -8
  cp /tmp/wide_gemv/wide_cases.json "$OUT/llama7b_gemv.json" 2>/dev/null; true
  ;;
wideblock)
  # transformer blocks in the wide design (issue 16): their GPU tests, then ViT-B's block at 16384 rows
  shift
  if [ "${1:-}" = "--no-tests" ]; then shift; else gpu_pytest 420 pytest_gpu_wide_block.txt 30 tests/test_gpu_block.py -k wide; fi
  # further ARGS go to wide_cases.py (e.g. --env ONNX2FUSED_WIDE_KERNELS=sm80: the same library with a run-time switch)
  timeout 400 python3 benchmarks/wide_cases.py --out /tmp/wide_vitb --cases vitb_block --reps 50 "$@" 2>&1 | tail -12
  cp /tmp/wide_vitb/wide_cases.json "$OUT/vitb_block.json" 2>/dev/null
  # the block's kernels per run (through ORT the run-to-run spread is larger than a pass's time)
  # (with --fp16-model among ARGS: the converted fp16 copy's kernels, fp16 I/O, as wide_cases.py's fused_fp16)
  pf=(); for a in "$@"; do [ "$a" = --fp16-model ] && pf=(--fp16-model); done
  timeout 160 python3 benchmarks/profile_case.py vitb_block --out /tmp/prof "${pf[@]}" 2>&1 | grep -v -i warn | tail -12 \
    | tee "$OUT/vitb_block_kernels.txt"; true
  ;;
vit)
  for size in tiny small; do
    python3 benchmarks/vit_model.py --size $size --out /tmp/vit/vit_$size.onnx > /dev/null 2>&1 || { echo "vit_$size: export failed"; continue; }
    timeout 280 python3 -m onnx2fused bench /tmp/vit/vit_$size.onnx --batches 1,64 --no-torch --reps 50 --fp16-model \
      --out /tmp/vit/bench_$size -q 2>&1 | tail -6
    cp /tmp/vit/bench_$size/bench.json "$OUT/vit_$size.json" 2>/dev/null
  done
  ;;
vitprof)
  # where ViT-tiny's time goes at batch 64: stock ORT on the fp16 copy vs that copy converted, kernel by
  # kernel (benchmarks/ort_kernels.py); then ViT-B's block alone, fused vs stock fp16 (profile_case.py)
  python3 benchmarks/vit_model.py --size tiny --out /tmp/vit/vit_tiny.onnx > /dev/null 2>&1 || { echo "vit export failed"; exit 1; }
  python3 -c "
from pathlib import Path
from onnx2fused.bench.models import fp16_model_file
from onnx2fused.bench.variants import convert_model
p = fp16_model_file(Path('/tmp/vit/vit_tiny.onnx'), Path('/tmp/vit/vit_tiny.fp16.onnx'))
print(convert_model(p, Path('/tmp/vit/fused16'), 'fp16', with_cuda=True)[0])" 2>&1 | tail -2
  for m in /tmp/vit/vit_tiny.fp16.onnx /tmp/vit/fused16/vit_tiny.fp16.fused.onnx; do
    echo "== $m"; timeout 120 python3 benchmarks/ort_kernels.py "$m" --rows 64 --names "$OUT/$(basename "$m" .onnx).names.txt" 2>&1 \
      | grep -v -i warn | head -"${2:-32}"
  done | tee "$OUT/vit_kernels.txt"
  timeout 200 python3 benchmarks/profile_case.py vitb_block --stock --out /tmp/prof 2>&1 | grep -v -i warn | tail -30 \
    | tee "$OUT/vitb_block_kernels.txt"
  ;;
kernels)
  shift
  python3 benchmarks/kernel_check.py --out "$OUT/kc" "$@" 2>&1 | grep -v '^{' | tail -30
  ;;
power)
  # the issue-15 kernels back to back for 5 s each, nvidia-smi sampling the SM clock, power and throttle
  # reasons (kernel_check.py --sustain), then in turns for their 200-launch times
  shift
  python3 benchmarks/kernel_check.py --out "$OUT/kc" --case-timeout 120 --interleave 8 --sustain 5 \
    --only nerf64 w128gelu w256silu sdf1m "$@" 2>&1 | grep -v '^{' | sed 's/, "samples".*//' | tail -30
  ;;
issue15)
  # the issue-15 cases at their batch, latency (each run from an idle GPU) and pipelined (runs back to
  # back), one process each; the bench.json files to $OUT/issue15.tar
  for c in "nerf 2097152" "gelu 1048576" "silu 262144" "sdf 1048576"; do
    set -- $c
    python3 -m onnx2fused bench "models/$1.opset17.onnx" --batches "$2" --out "/tmp/issue15/$1" --reps 50 --pipelined -q > "/tmp/issue15_$1.log" 2>&1; head -3 "/tmp/issue15_$1.log"
  done
  (cd /tmp/issue15 && tar cf "$OUT/issue15.tar" */bench.json)
  ;;
bench)
  for c in "nerf 2097152" "gelu 1048576" "silu 262144" "mnist 4096"; do
    set -- $c
    python3 -m onnx2fused bench "models/$1.opset17.onnx" --batches "$2" --out "$OUT/bench_$1" --reps 100 2>&1 | tail -12
  done
  python3 benchmarks/wide_cases.py --out "$OUT/wide" 2>&1 | tail -20
  ;;
wide)
  shift
  python3 benchmarks/wide_cases.py --out "$OUT/wide" "$@" 2>&1 | tail -40
  ;;
lnfold)
  bash benchmarks/sm90/ln_fold.sh
  ;;
lightgemm)
  shift
  bash benchmarks/sm90/light_gemm.sh "$@"
  ;;
lightncu)
  shift
  bash benchmarks/sm90/light_ncu.sh "$@"
  ;;
ffnunit)
  shift
  args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(--cases swiglu256 swiglu256_a32 pair256 pair64 --diag swiglu256_nt=swiglu256:no_turns
    swiglu256_be=swiglu256:bias_epi)
  timeout 500 python3 benchmarks/ffn_unit_check.py --out "$OUT/ffn_unit" "${args[@]}" 2>&1 | tail -40
  ;;
gluab)
  # the glu in the light kernel's epilogue against the GEMM + glu pass of commit OLD (argument 2, run from a
  # git worktree: the device's .git is the session's first copy), wide_cases.py's gated cases (CASES,
  # argument 3: default swiglu256; llama7b at BATCHES, argument 4), new then old per case
  old=${2:?gluab needs OLD, the commit to compare with}
  git worktree add -f /tmp/gluab_old "$old" > /dev/null 2>&1; ln -sfn "$R/.deps" /tmp/gluab_old/.deps
  for case in $(echo "${3:-swiglu256}" | tr , ' '); do
    batch=(); [ "$case" = llama7b ] && batch=(--batch "${4:-256,4096}")
    for tree in "$R" /tmp/gluab_old; do
      tag=$([ "$tree" = "$R" ] && echo new || echo old)
      echo "== $case, $tag ($(git -C "$tree" rev-parse --short HEAD)$([ "$tree" = "$R" ] && echo ' + working tree'))"
      (cd "$tree" && timeout 290 python3 benchmarks/wide_cases.py --out "/tmp/gluab_$tag" --cases "$case" "${batch[@]}" \
        --kernels sm90 --reps 50 2>&1 | grep "^| \|rror")
      cp "/tmp/gluab_$tag/wide_cases.json" "$OUT/gluab_${case}_$tag.json" 2>/dev/null
    done
  done
  ;;
lightab)
  # ours (Light128x128, and Tf32Light128x128 for a first layer read in place) against CUTLASS's ping-pong
  # kernels as the untuned defaults; the wide_cases.json files only (the models are hundreds of MB)
  for k in Light128x128 Pingpong128x128; do
    echo "== the untuned Hopper kernels: $k, Tf32$k"
    ONNX2FUSED_WIDE_DEFAULT_KERNEL=$k ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL=Tf32$k timeout 280 python3 benchmarks/wide_cases.py \
      --out "/tmp/ab_$k" --cases "${2:-vitb_block,ffn}" --kernels sm90 --reps 50 2>&1 | grep "^| "
    cp "/tmp/ab_$k/wide_cases.json" "$OUT/ab_$k.json" 2>/dev/null
  done
  ;;
tune)
  shift
  python3 benchmarks/tune_wide.py --out "$OUT/tune_wide" --cache "$ONNX2FUSED_CACHE" "$@" 2>&1 | tail -60
  ;;
times)
  shift
  python3 benchmarks/convert_times.py --out "$OUT/times" "$@" 2>&1 | tail -30
  ;;
profile)
  # Nsight Compute's full set on one launch of each case's fused kernel (kernel_check.py --profile): a text
  # report per case, and the raw metrics as CSV (pipe utilisation: sm__inst_executed_pipe_*, tensor pipe
  # sm__pipe_tensor_op_*; warp stalls: smsp__average_warp_latency_issue_stalled_*), the lines that say
  # which unit limits the kernel printed here
  shift
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "gpu_host.sh profile: no ncu (Nsight Compute) on this host"; exit 2; }
  cases=("$@"); [ ${#cases[@]} -eq 0 ] && cases=(nerf64 w128gelu w256silu sdf1m)
  python3 benchmarks/kernel_check.py --only "${cases[@]}" --profile --out /tmp/kc_profile > /dev/null 2>&1   # build first
  for c in "${cases[@]}"; do
    timeout 240 "$ncu" --set full --import-source no -k "regex:^(fused_|kernel($|<))" -f -o "/tmp/ncu_$c" \
      python3 benchmarks/kernel_check.py --only "$c" --profile --out /tmp/kc_profile > "$OUT/ncu_$c.err" 2>&1
    echo "$c: ncu rc $?"
    "$ncu" --import "/tmp/ncu_$c.ncu-rep" --page details > "$OUT/ncu_$c.txt" 2>&1
    "$ncu" --import "/tmp/ncu_$c.ncu-rep" --page raw --csv > "$OUT/ncu_$c.csv" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|No Eligible" \
      "$OUT/ncu_$c.txt" | head -12
  done
  ;;
ncuwide)
  # Nsight Compute on one run of a wide case's kernels through ORT (default vitb_block; or a model file,
  # M.onnx, at ROWS rows (default 256): PointNet's /tmp/pn/pointnet.onnx for the pooled wgmma kernel;
  # KERNEL: a regex of the kernel names to profile, default every kernel of the run)
  shift
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "gpu_host.sh ncuwide: no ncu (Nsight Compute) on this host"; exit 2; }
  case_=${1:-vitb_block}; regex=${2:-.}
  if [[ $case_ == *.onnx ]]; then src=(--model "$case_" --batch "${3:-256}"); tag=$(basename "$case_" .onnx)
  else src=("$case_"); tag=$case_; fi
  python3 benchmarks/profile_case.py "${src[@]}" --runs 1 --external --out /tmp/ncuwide > /dev/null 2>&1   # build first
  "$ncu" --nvtx --nvtx-include "o2f_runs/" --kernel-name "regex:$regex" --launch-count 3 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    python3 benchmarks/profile_case.py "${src[@]}" --runs 1 --external --out /tmp/ncuwide > "$OUT/ncu_$tag.txt" 2>&1
  echo "ncu rc $?"; grep -E "^  [a-zA-Z_].*\(|Duration|Throughput|DRAM|Achieved Occupancy|Registers|Stall|One or More|No Eligible|Issued Warp|Pipe" \
    "$OUT/ncu_$tag.txt" | head -70
  ;;
ncustall)
  # Where a kernel's warps wait (the profile ncuwide gives says only that they do): the per-reason averages of
  # warps stalled per issued instruction, and the sampled stalls by source line (SourceCounters)
  shift
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "gpu_host.sh ncustall: no ncu (Nsight Compute) on this host"; exit 2; }
  [ -n "${1:-}" ] || { echo "gpu_host.sh ncustall: give a model file (M.onnx)"; exit 2; }
  src=(--model "$1" --batch "${3:-256}"); tag=$(basename "$1" .onnx); regex=${2:-.}
  python3 benchmarks/profile_case.py "${src[@]}" --runs 1 --external --out /tmp/ncustall > /dev/null 2>&1   # build first
  "$ncu" --nvtx --nvtx-include "o2f_runs/" --kernel-name "regex:$regex" --launch-count 1 --section WarpStateStats \
    --section SourceCounters --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/profile_case.py "${src[@]}" --runs 1 --external --out /tmp/ncustall > "$OUT/ncustall_$tag.txt" 2>&1
  echo "ncu rc $?"
  grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncustall_$tag.txt" | awk '{print $NF, $1}' | sort -rn | head -14
  grep -E "Warp Cycles Per Issued|Stall|stall" "$OUT/ncustall_$tag.txt" | grep -v smsp__average | head -30
  ;;
sm90)
  CUTLASS_INC=$R/.deps/cutlass/include bash benchmarks/sm90/run.sh 2>&1 | tail -60
  ;;
*)
  sed -n '2,/^# Kernel choices/p' "$0" | sed '$d'; exit 2
  ;;
esac
