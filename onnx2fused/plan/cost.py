"""The cost model that picks a design: seconds at NOMINAL_ROWS rows from a roofline with a fixed
efficiency per design, calibrated on the H100 (benchmarks/RESULTS.md, fourth run): the tuned GEMMs'
efficiency, a kernel's fixed GPU time and a CUTLASS launch's host time (a chain of short GEMMs is host
bound). Plans come in as arguments; this module imports neither design.
"""
from __future__ import annotations

from ..spec import MLPSpec
from . import ffn
from .padding import ALIGN, round_up

# H100 SXM figures: NOTES.md measured 665 TFLOP/s fp16 matmul, 3.0 TB/s copy.
NOMINAL_ROWS = 16384            # the batch the compile-time decision is made for
TC_FLOPS = 660e12
HBM_BPS = 3.0e12
L2_BPS = 8.0e12                 # streamed weights are re-read from L2 once per row tile
LAUNCH_S = 3e-6                 # a kernel's fixed GPU time (prologue, pipeline fill, tail)
HOST_LAUNCH_S = 8e-6            # a CUTLASS GEMM's host-side setup + launch: back to back, the tuning runs
                                # time the smallest GEMMs at >= 8 us; a chain of short GEMMs is host bound
WIDE_GEMM_EFF = 0.78            # the tuned CUTLASS 3.x GEMMs, fraction of TC_FLOPS: measured on the H100
                                # (RESULTS.md): FFN 768->3072 GELU 0.78, 3072->768 1.0, head 9216->4096 0.97
TF32_FLOPS = TC_FLOPS / 2       # tf32 wgmma: half the fp16 rate
# Streamed kernel, 128-row tiles: 183 TFLOP/s measured on silu (RESULTS.md, kernel only); shorter tiles
# re-read each weight chunk for fewer rows: x sqrt(bm/128) fits mnist's 32-row tiles (108 TFLOP/s).
STREAMED_EFF_128 = 0.28
FFN_EFF = 0.69                  # the one-kernel FFN: 458 TFLOP/s on SwiGLU 256 -> 1024 -> 256, 456 on a GELU
                                # 256 -> 4096 -> 256 (H100, kernel alone: RESULTS.md twenty-seventh run)
SMS = 132                       # an H100 SXM's SMs (the FFN kernel's row threshold)
WIDE_MARGIN = 1.25              # wide replaces a working streamed plan only when estimated this much faster
                                # (the estimates are rooflines: keep near-ties on the single fused kernel)


def converts_input(spec: MLPSpec) -> bool:
    """Whether the wide design's 16-bit path needs the conversion pass (WidePlan.convert_input): not for
    fp16 rows of an fp16 chain whose width is already a multiple of ALIGN (the GEMM reads them in place),
    always for a block's norm (the pass normalises the rows it converts)."""
    k0 = spec.layers[0].in_features
    in_place = spec.io_dtype == "f16" and spec.precision == "fp16" and round_up(k0, ALIGN) == k0
    return spec.norm is not None or not in_place


def tf32_eligible(spec: MLPSpec) -> bool:
    """fp32 input rows that TMA can load in place (16-byte multiples), into a first layer that is not
    gated (a gated GEMM's 16-bit products feed the glu pass), not behind a norm (the rows it reads are
    the norm pass's) and not a block's only layer (whose epilogue reads x as the residual: the tf32
    dispatch has no source operand)."""
    return (spec.io_dtype == "f32" and spec.layers[0].in_features % 4 == 0 and not spec.layers[0].gated
            and spec.norm is None and not (spec.residual and len(spec.layers) == 1))


def _wide_layer_seconds(rows: int, l, k: int, last: bool, io: int, a_bytes: int = 2) -> float:
    """One layer of the wide design on 16-bit operands: its GEMM; a gated layer's (2 * NP columns of gate
    and up products) as the Hopper default runs it, the glu in the light kernel's epilogue: the flops of
    2 * NP columns, the NP-wide hidden tensor written (the model is the H100's)."""
    if l.gated:
        half = round_up(l.out_features, ALIGN)
        flops = 2.0 * rows * k * 2 * half
        traffic = rows * k * a_bytes + k * 2 * half * 2 + rows * half * 2
        return max(flops / (TC_FLOPS * WIDE_GEMM_EFF), traffic / HBM_BPS) + LAUNCH_S
    n = l.out_features if last else round_up(l.out_features, ALIGN)
    return _gemm_seconds(rows, k, n, a_bytes, 2, io if last else 2, TC_FLOPS)


def _gemm_seconds(rows: int, k: int, n: int, a_bytes: int, w_bytes: int, out_bytes: int, rate: float) -> float:
    flops = 2.0 * rows * k * n
    traffic = rows * k * a_bytes + k * n * w_bytes + rows * n * out_bytes
    return max(flops / (rate * WIDE_GEMM_EFF), traffic / HBM_BPS) + LAUNCH_S


def _first_layer_seconds(spec: MLPSpec, rows: int, tf32: bool) -> float:
    """Layer 0 from the io-type input: a tf32 GEMM on it in place, or the conversion pass + fp16 GEMM."""
    l, io = spec.layers[0], 2 if spec.io_dtype == "f16" else 4
    last = len(spec.layers) == 1
    n = l.out_features if last else round_up(l.out_features, ALIGN)
    out = io if last else 2
    if tf32:
        return _gemm_seconds(rows, l.in_features, n, 4, 4, out, TF32_FLOPS)
    k = round_up(l.in_features, ALIGN)
    conversion = (rows * l.in_features * io + rows * k * 2) / HBM_BPS + LAUNCH_S if converts_input(spec) else 0.0
    return conversion + _wide_layer_seconds(rows, l, k, last, io)


# The tf32 first layer is a CUTLASS 3.x instance of its own (~40 s of nvcc on the GPU host, where a cold
# build of our own 16-bit GEMMs takes ~10 s: issue 14 §5's cold convert): an untuned library takes it only
# where it is estimated this much faster than the conversion pass + the fp16 GEMM (DLRM's 512 -> 256:
# 1.6x); near ties (mnist's 784 -> 512: 1.05x) keep the fp16 path.
# The kernel search (`--tune`) times both either way.
TF32_FIRST_MARGIN = 1.25


def tf32_first_wins(spec: MLPSpec, rows: int = NOMINAL_ROWS) -> bool:
    """Whether reading the fp32 input in place (tf32 first GEMM) beats converting it first by
    TF32_FIRST_MARGIN: the memory-bound first layers (DLRM's 512 -> 256: the conversion pass costs more
    than the GEMM)."""
    return TF32_FIRST_MARGIN * _first_layer_seconds(spec, rows, True) < _first_layer_seconds(spec, rows, False)


def _tail_seconds(spec: MLPSpec, tail, rows: int) -> float:
    """A segmented plan's fused tail (`tail`: its resident or streamed plan, on 16-bit rows): one pass
    over the fp16 hidden rows (the streamed estimate for a streamed plan; a resident one at the streamed
    kernel's efficiency too: conservative), and the pass widening its 16-bit output into an fp32 y."""
    t_spec = tail.spec
    if tail.design == "resident":
        compute = t_spec.flops_per_row * rows / (TC_FLOPS * STREAMED_EFF_128)
        t = max(compute, rows * (t_spec.widths[0] + t_spec.widths[-1]) * 2 / HBM_BPS) + LAUNCH_S
    else:
        t = estimate_streamed(t_spec, tail, rows)
    if spec.io_dtype != "f16":
        t += rows * t_spec.widths[-1] * (2 + 4) / HBM_BPS + LAUNCH_S
    return t


def estimate_wide(spec: MLPSpec, rows: int = NOMINAL_ROWS, tail_from: int = 0, tail=None) -> float:
    """Seconds: each GEMM at max(compute, HBM traffic) plus its fixed GPU time, the first layer as the
    cheaper of the tf32 in-place read and the conversion pass (where the tf32 kernels apply); at least
    the host's time to launch them all. `tail_from` > 0: layers from there run as the fused tail
    (`tail`: its plan)."""
    io = 2 if spec.io_dtype == "f16" else 4
    n_gemms = tail_from or len(spec.layers)
    first = _first_layer_seconds(spec, rows, False)
    # one kernel per layer (a gated one's glu in its epilogue), and the conversion pass
    launches = len(spec.layers) + converts_input(spec)
    if tf32_eligible(spec) and tf32_first_wins(spec, rows):   # the plan's own choice (untuned)
        first, launches = _first_layer_seconds(spec, rows, True), len(spec.layers)
    t = first + _residual_seconds(spec, rows, in_epilogue=True)
    if tail_from:
        t += _tail_seconds(spec, tail, rows)
        launches -= len(spec.layers) - tail_from - 1 - (io != 2)   # one kernel (and the widening pass)
    for i, l in enumerate(spec.layers[1:n_gemms], start=1):
        t += _wide_layer_seconds(rows, l, round_up(l.in_features, ALIGN), i == len(spec.layers) - 1, io)
    t = max(t, launches * HOST_LAUNCH_S)   # the GPU's time, or the host's when the kernels are short
    if not tail_from and ffn_possible(spec) and rows >= ffn.MIN_ROWS_PER_SM * SMS:
        t = min(t, estimate_ffn(spec, rows))   # the wide plan's one-kernel FFN on sm_90 (plan/ffn.py)
    return t


def ffn_possible(spec: MLPSpec) -> bool:
    """Whether a wide plan of `spec` carries the one-kernel FFN (plan/ffn.py: its conditions and its fit)."""
    return ffn.ffn_pair(spec, 0) is not None


def estimate_ffn(spec: MLPSpec, rows: int = NOMINAL_ROWS) -> float:
    """Seconds of the whole FFN in one kernel (plan/ffn.py): both layers' flops at FFN_EFF of the tensor-core
    rate, or the input and output rows at HBM speed (the weights come from L2)."""
    io = 2 if spec.io_dtype == "f16" else 4
    compute = spec.flops_per_row * rows / (TC_FLOPS * ffn_efficiency(spec))
    return max(compute, rows * (spec.widths[0] + spec.widths[-1]) * io / HBM_BPS) + LAUNCH_S


def ffn_efficiency(spec: MLPSpec) -> float:
    """The one-kernel FFN's fraction of TC_FLOPS: FFN_EFF at 256 inputs and outputs, less for narrower ones
    (a chunk's wgmmas are K0 and N wide, its epilogue and weight copy are not): x sqrt(K0/256 * N/256).
    Measured (H100, kernel alone): 192 -> 768 -> 192 at 0.55 (model 0.52), 64 -> 1000 -> 48 at 0.26 (0.15)."""
    k0, n = min(spec.widths[0], 256), min(spec.widths[-1], 256)
    return FFN_EFF * (k0 * n / 65536) ** 0.5


def _residual_seconds(spec: MLPSpec, rows: int, in_epilogue: bool = False) -> float:
    """A block's residual: three passes over the output rows and a launch as the stock Add (reads two
    tensors, writes one). `in_epilogue`: the wide design's, whose Hopper last GEMM reads x's rows as its
    source operand, one pass and no launch (its sm80 kernels write y = x + b first instead: two or
    three passes, not modelled, like the rest of this H100 model). 0 without a residual. (The wide
    design's norm costs what the conversion pass it replaces does: _first_layer_seconds counts that.)"""
    if not spec.residual:
        return 0.0
    io = 2 if spec.io_dtype == "f16" else 4
    if in_epilogue:
        return rows * spec.widths[-1] * io / HBM_BPS
    return 3 * rows * spec.widths[-1] * io / HBM_BPS + LAUNCH_S


def estimate_stock_block(spec: MLPSpec, rows: int = NOMINAL_ROWS) -> float:
    """Seconds of a block's norm and residual Add as the stock ops around a wide plan (ORT's kernels,
    memory bound): the norm reads and writes the input rows, the Add reads two tensors and writes one."""
    io = 2 if spec.io_dtype == "f16" else 4
    t = _residual_seconds(spec, rows)
    if spec.norm is not None:
        t += 2 * rows * spec.widths[0] * io / HBM_BPS + LAUNCH_S
    return t


def estimate_streamed(spec: MLPSpec, streamed_plan, rows: int = NOMINAL_ROWS) -> float:
    """Seconds of the streamed kernel: its tallest tile sets the tensor-core efficiency (short tiles
    re-read every weight chunk per few rows: shared-memory bound) and the L2 weight traffic."""
    io = 2 if spec.io_dtype == "f16" else 4
    bm = max(v.bm for v in streamed_plan.variants)
    eff = STREAMED_EFF_128 * min(1.0, bm / 128) ** 0.5
    weight_bytes = streamed_plan.weight_elems * 2
    compute = spec.flops_per_row * rows / (TC_FLOPS * eff)
    l2 = -(-rows // bm) * weight_bytes / L2_BPS
    hbm = rows * (spec.widths[0] + spec.widths[-1]) * io / HBM_BPS
    return max(compute, l2, hbm) + LAUNCH_S


# The wgmma design (plan/wgmma.py) against the mma.sync fused kernels on the H100. The standalone
# prototype, kernel only (benchmarks/sm90/NOTES.md, h100-run1): nerf 32->64x4->16 ReLU 2^21 rows 0.172 vs
# 0.192 ms, gelu 64->128x4->64 2^20 0.532 vs 0.70, sdf 3->128x4->1 Tanh 2^20 0.196 vs 0.657. The integrated
# design through ORT (benchmarks/RESULTS.md, seventh run): gelu 0.598 vs 0.760, sdf 0.489 vs 0.704, but
# nerf 0.214 vs 0.199 (64-wide layers: too little tensor work per epilogue to pay for the chunked
# schedule). On the H100 (RESULTS.md, fourteenth run): kernels alone, 64 -> SwiGLU 256 -> 64 at 2^20 rows
# 0.351 ms vs 0.634 streamed mma.sync, 256 -> SwiGLU 256 -> 256 at 2^18 0.325 vs 0.489; through ORT the
# zoo's swiglu (64 -> 256 gated -> 64) 0.122 vs 0.233 ms at 2^18 rows, but then its geglu (64 -> 128 gated
# -> 64) 0.119 vs 0.105, so a chain needed two layers of >= 128 outputs (a gated one of >= 256 counting
# twice). The kernel has gained since (turns of the input copies, quad stores, packed activations on
# prescaled accumulators, the fp16 bias): on an H100 (thirty-second run) one hidden layer of >= 128 outputs pays:
# geglu through ORT 0.090 vs 0.117 ms at 2^18 rows and 0.233 vs 0.339 at 2^20, the zoo's ffn3d (64 -> GELU
# 256 -> 64) 0.311 vs 0.738 at 2^20, kernels alone 64 -> GELU 128 -> 64 0.209 vs 0.231. nerf's 64-wide
# layers still do not (0.168 vs 0.160 ms, twentieth run). It only runs on compute capability 9.0; the
# library keeps the mma.sync kernel for the others.
WGMMA_MIN_WIDTH = 128


def wgmma_wide_layers(spec: MLPSpec) -> int:
    """The chain's hidden layers of at least WGMMA_MIN_WIDTH outputs (every measurement behind the rule had
    one; a chain whose only wide layer is its last is left to mma.sync, as before). A pooled chain's last
    layer counts: it writes no rows, its outputs only raise the pool's entries, so it is compute like a
    hidden layer (MobileNetV2's head, 320 -> 1280 and a mean over 7 x 7 positions at 256 images on an
    H200: the streamed mma.sync kernel took 124 us, RESULTS.md fifty-second run)."""
    counted = spec.layers if spec.pool is not None else spec.layers[:-1]
    return sum(l.out_features >= WGMMA_MIN_WIDTH for l in counted)


def wgmma_wins(spec: MLPSpec) -> bool:
    """Whether the wgmma kernel is expected to beat the mma.sync fused kernels on an H100."""
    return wgmma_wide_layers(spec) >= 1
