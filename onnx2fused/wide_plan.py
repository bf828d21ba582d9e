"""The "wide" CUDA design, and the cost model that picks resident vs streamed vs wide per chain.

Wide design (templates/cuda_wide.cu.j2): one tensor-core GEMM per layer, Y_i = act_i(X_i @ W_i + b_i),
with CUTLASS 2.x device-level GEMMs (sm_80 `mma.sync` kernels, which also run on sm_90) whose epilogue
is `LinearCombinationGeneric` over a generated activation functor (the layer's expr IR, render_c):

    X (io type) --convert--> X16 [MB, KP0]  (skipped when X is already fp16/bf16 of the compute type
                                            and K0 is a multiple of 8: the GEMM reads X in place)
    H_0 = act_0(X16 @ W_0 + b_0)            fp16/bf16 [MB, NP_0], in the workspace
    H_1 = act_1(H_0 @ W_1 + b_1)            ping-pong between two workspace buffers
    Y   = act_L(H_{L-2} @ W_L + b_L)        io type, true width, straight to the output

The plugin gives a kernel no per-run allocator (ort_plugin/plugin.cc allocates one workspace per device,
once), so the intermediates live in that workspace, sized for MB rows ("row block"); a call loops over
row blocks on the stream: no cudaMalloc, no synchronisation, capturable in a CUDA graph. Runs of one
kernel share the workspace: the registry marks the kernel (`cuda_uses_scratch`) and the plugin orders
runs that come on different streams.

tf32 first layer: where converting an fp32 input costs more than the first GEMM (`tf32_first_wins`:
DLRM's 512 -> 256), that GEMM reads x in place with a tf32 kernel (TF32_KERNELS) and an fp32 copy of its
weights; no conversion pass. Narrow last layer (<= NARROW_MAX outputs): a thread-per-row kernel.

Segmented plan (`tail_from` > 0): the GEMMs stop at layer tail_from - 1, and layers [tail_from:] run as
ONE fused kernel of cuda_plan's resident or streamed design (`tail_spec`: those layers on fp16 rows in
and out), rendered into its own translation unit under `tail_symbol`. It reads the fp16 hidden tensor the
last GEMM wrote, keeps the narrower trailing activations on chip, and writes y (through a widening pass
when y is fp32). The cost model takes it where it wins (`best_tail`): DLRM's 256 -> 64 -> 1 after the
tf32 first GEMM is one pass over the 256-wide rows instead of two GEMM launches and a round trip of
the 64-wide tensor. `$ONNX2FUSED_WIDE_TAIL=off` turns it off, for comparisons.

Padding: K of every GEMM and the widths of the hidden tensors are rounded up to 8 (16-byte vectors).
Padded weight entries and biases are zero, so a padded hidden column holds act(0), and the next layer
multiplies it by zero weights: act(0) must be finite, which `wide_reason_refused` checks.
The bias enters as CUTLASS's source operand C with a row stride of 0 (a broadcast row); it is stored in
the GEMM's output type: fp16/bf16 for hidden layers (rounded like the weights), the io type last.

Tiles come from TILE_TABLE, keyed by arch: a "large" tile for GEMMs with enough output tiles to fill the
GPU and a "small" one otherwise; the launcher picks per GEMM and row block at run time from the SM count.

Hopper (sm_90a): when the build's arch list has 90, build.py compiles the wide sources for sm_90a and
defines ONNX2FUSED_WIDE_SM90A; the source then also holds CUTLASS 3.x kernels (TMA loads, wgmma,
KernelTmaWarpSpecializedCooperative, TMA warp-specialized epilogue whose fusion is
LinCombPerColBiasEltAct over the same generated activation functor) with the stream-K tile scheduler:
with few output tiles (the 256-row head: 32 tiles of 128x256 for 132 SMs) it splits the K loop across
the idle SMs and reduces the partial tiles through SM90_SCRATCH bytes of the workspace; with many tiles
it is data-parallel (persistent). The launcher takes them on compute capability 9.0 for every GEMM
whose output rows are 16-byte multiples (TMA stores; `WideGemm.sm90`), with 16-byte aligned pointers;
anything else (other GPUs, a last layer of width 1 or 999, `$ONNX2FUSED_WIDE_KERNELS=sm80` at run
time for comparisons) runs the CUTLASS 2.x kernels.

Hopper kernel choice: SM90_KERNELS lists the CUTLASS 3.x kernel configurations a library can hold
(schedule, CTA tile, cluster); a `Sm90Choice` is one of them plus the stream-K scheduler's runtime
decomposition (heuristic, data-parallel, split-K with S splits, stream-K). Each GEMM has one choice per
row bucket (ROW_BUCKETS: the launcher takes the bucket nearest the rows of the call on a log scale),
because the best kernel for 256 rows is not the best for 16384. The library instantiates only the
kernels its choices name, one translation unit per kernel (`parts`) so nvcc builds them in parallel.
The choices are DEFAULT_CHOICE unless wide_tune.py measured better ones on the GPU the library is built
for (a "tuning build" holds every kernel and times each candidate on each GEMM and bucket).

Cost model (`estimate_*`): seconds at NOMINAL_ROWS rows from a roofline with a fixed efficiency per
design, calibrated on the H100 (benchmarks/RESULTS.md, fourth run): the tuned GEMMs' efficiency, a
kernel's fixed GPU time and a CUTLASS launch's host time (a chain of short GEMMs is host bound).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import expr as ex
from .cuda_plan import round_up
from .spec import MLPSpec, SpecError

ALIGN = 8                       # elements per 16-byte vector of fp16/bf16: GEMM K and hidden widths round to it
SCRATCH_BUDGET = 128 << 20      # bytes of workspace for the intermediates of one row block
ROW_QUANTUM = 128               # the row block is a multiple of the largest tile's rows
MAX_ROW_BLOCK = 65536
REGION_ALIGN = 256              # byte alignment of each workspace region
# Stream-K partial-tile reductions of the sm90 kernels (fp32 128x256 tiles, 128 KiB each; CUTLASS sizes it
# per problem and SM count: ~100 partials for 132 SMs; split-K 8 of the head's 256 x 4096 layers in 128 x
# 128 tiles: 64 tiles x 8 partials of 64 KiB). Larger needs fall back to data-parallel tiles.
SM90_SCRATCH = 48 << 20

# Cost model (H100 SXM figures: NOTES.md measured 665 TFLOP/s fp16 matmul, 3.0 TB/s copy).
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
WIDE_MARGIN = 1.25              # wide replaces a working streamed plan only when estimated this much faster
                                # (the estimates are rooflines: keep near-ties on the single fused kernel)

DESIGN_ENV = "ONNX2FUSED_CUDA_DESIGN"   # "wide" | "streamed" | "resident" | "auto": force a design (experiments, tests)
TAIL_ENV = "ONNX2FUSED_WIDE_TAIL"       # "off": no segmented plans (every layer a GEMM), to compare; else "auto"


@dataclass(frozen=True)
class GemmTile:
    """A CUTLASS threadblock / warp tile and pipeline depth (instruction shape is always 16x8x16)."""
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    wk: int
    stages: int

    @property
    def name(self) -> str:
        return f"Tile{self.bm}x{self.bn}x{self.bk}_w{self.wm}x{self.wn}_s{self.stages}"

    @property
    def smem_bytes(self) -> int:
        return (self.bm + self.bn) * self.bk * 2 * self.stages


# Per arch: (large, small). Both archs run the sm_80 mma.sync kernels; sm_90 (227 KB of shared memory)
# takes the wider 128x256 tile, which halves the A-tile re-reads on the wide GEMMs.
TILE_TABLE: dict[int, tuple[GemmTile, GemmTile]] = {
    80: (GemmTile(128, 128, 32, 64, 64, 32, 4), GemmTile(64, 64, 64, 32, 32, 64, 4)),
    90: (GemmTile(128, 256, 32, 64, 64, 32, 3), GemmTile(64, 64, 64, 32, 32, 64, 4)),
}

@dataclass(frozen=True)
class Sm90Kernel:
    """A CUTLASS 3.x sm_90a GEMM kernel configuration (TMA loads, wgmma). Cooperative: two consumer
    warpgroups share one CTA tile, with the stream-K tile scheduler (any decomposition at run time).
    Ping-pong: each consumer warpgroup owns a tile, so one's epilogue overlaps the other's main loop;
    it has the persistent data-parallel scheduler only. Pipeline stages: CUTLASS fills the shared
    memory the epilogue leaves. Each one costs about a minute of nvcc per (activation, output type)."""
    name: str
    schedule: str                 # "cooperative" | "pingpong"
    tile: tuple[int, int, int]    # CTA tile M, N, K
    cluster: tuple[int, int]      # CTAs per cluster along M, N (TMA multicast of the shared operand)
    tf32: bool = False            # fp32 operands on tf32 wgmma: the first layer reads the fp32 input in
                                  # place (the conversion pass fused into its loads); first layers only

    @property
    def stream_k(self) -> bool:
        return self.schedule == "cooperative"


SM90_KERNELS: tuple[Sm90Kernel, ...] = (
    Sm90Kernel("Coop128x256", "cooperative", (128, 256, 64), (1, 1)),
    Sm90Kernel("Coop128x128", "cooperative", (128, 128, 64), (1, 1)),
    Sm90Kernel("Pingpong128x128", "pingpong", (128, 128, 64), (1, 1)),
    Sm90Kernel("Pingpong64x128", "pingpong", (64, 128, 64), (1, 1)),      # few rows: more, shorter tiles
    Sm90Kernel("Coop256x128", "cooperative", (256, 128, 64), (1, 1)),     # few rows, split-K: A read once
    Sm90Kernel("Pingpong128x128C2", "pingpong", (128, 128, 64), (2, 1)),  # B multicast to 2 row tiles
    Sm90Kernel("Pingpong128x64", "pingpong", (128, 64, 64), (1, 1)),      # narrow layers (DLRM's 256 -> 64)
    # Few rows (the head's 256): every row tile re-reads the weights from L2, and the GEMM is L2-bound.
    # A cluster along M multicasts each weight tile to all of its row tiles (4 x 64 = 256 rows: once).
    Sm90Kernel("Pingpong64x128C4", "pingpong", (64, 128, 64), (4, 1)),
    Sm90Kernel("Pingpong128x64C2", "pingpong", (128, 64, 64), (2, 1)),
    Sm90Kernel("Tf32Coop128x256", "cooperative", (128, 256, 32), (1, 1), tf32=True),
    Sm90Kernel("Tf32Pingpong128x128", "pingpong", (128, 128, 32), (1, 1), tf32=True),
)
TF32_KERNELS = tuple(i for i, k in enumerate(SM90_KERNELS) if k.tf32)

# The stream-K scheduler's decompositions (CUTLASS DecompositionMode, same order as its enum).
MODES = ("heuristic", "split_k", "stream_k", "data_parallel")


@dataclass(frozen=True)
class Sm90Choice:
    kernel: int           # index into SM90_KERNELS
    mode: str = "heuristic"
    splits: int = 1       # split_k only

    @property
    def label(self) -> str:
        k = SM90_KERNELS[self.kernel].name
        if not SM90_KERNELS[self.kernel].stream_k:
            return k
        return f"{k}/{self.mode}" + (f"x{self.splits}" if self.mode == "split_k" else "")


DEFAULT_CHOICE = Sm90Choice(0, "heuristic")
DEFAULT_TF32_CHOICE = Sm90Choice(TF32_KERNELS[0], "heuristic")   # a first layer the cost model reads in place
ROW_BUCKETS = (32, 256, 2048, 16384)   # rows the choices are made (and tuned) for; calls take the nearest
# (32: GEMV-like calls, where one row tile leaves most SMs idle unless split-K fills them)


def sm90_candidates() -> tuple[Sm90Choice, ...]:
    """Everything the tuning build times per GEMM and bucket (tf32 ones on an in-place first layer only)."""
    out = []
    for i, k in enumerate(SM90_KERNELS):
        if k.stream_k:
            out += [Sm90Choice(i, "heuristic"), Sm90Choice(i, "data_parallel"), Sm90Choice(i, "stream_k"),
                    Sm90Choice(i, "split_k", 2), Sm90Choice(i, "split_k", 4),
                    # few rows, long K (the head's 256 rows through K = 4096: 16 output tiles of the
                    # 4096 -> 1000 layer for 132 SMs): deeper splits fill the GPU
                    Sm90Choice(i, "split_k", 8), Sm90Choice(i, "split_k", 16)]
        else:
            out.append(Sm90Choice(i, "data_parallel"))
    return tuple(out)


def row_buckets(row_block: int) -> tuple[int, ...]:
    """ROW_BUCKETS up to the plan's row block (a call never has more rows per GEMM than that)."""
    top = min(row_block, ROW_BUCKETS[-1])
    return tuple(b for b in ROW_BUCKETS if b < top) + (top,)


NARROW_MAX = 8                  # last-layer outputs that take narrow_layer (DLRM's score, binary heads)
NARROW_SMEM = 32 * 1024         # its weights as fp32 in shared memory
SM80_ENV = "ONNX2FUSED_WIDE_KERNELS"   # =sm80 at run time: sm_90 GPUs run the CUTLASS 2.x kernels too
LAUNCH_CACHE_ENV = "ONNX2FUSED_WIDE_LAUNCH_CACHE"  # =off at run time: initialize every sm90 GEMM (comparisons)


@dataclass(frozen=True)
class WideGemm:
    index: int
    k: int            # true input features
    n: int            # true output features
    kp: int           # padded K: the row stride of A and of the packed (n-major) weights
    np_: int          # columns the GEMM computes and writes: padded to ALIGN (hidden), true N (last)
    last: bool
    align_out: int    # elements per epilogue access (divides np_)
    w_offset: int     # bytes into the workspace: packed weights [np_][kp], compute type
    b_offset: int     # bytes: bias [np_] in the output type
    src: str          # "x" (the input in place), "xc" (converted input), "h0", "h1"
    dst: str          # "h0", "h1" or "y"
    sm90: bool = True  # output rows are 16-byte multiples, so the sm90a kernel's TMA store can write them
    narrow: bool = False  # a last layer of at most NARROW_MAX outputs: the template's narrow_layer kernel (a
                          # thread per row, weights in shared memory), not a tensor-core tile of mostly padding


@dataclass(frozen=True)
class WidePlan:
    spec: MLPSpec
    gemms: tuple[WideGemm, ...]
    row_block: int          # MB: rows of one pass through the chain
    convert_input: bool     # a conversion pass writes X16; else the first GEMM reads X in place
    xc_offset: int          # bytes: converted input [MB][kp0] (when convert_input)
    sm90_offset: int        # bytes: SM90_SCRATCH of stream-K reduction workspace for the sm90a kernels
    h_offsets: tuple[int, int]
    h_width: int            # row stride (elements) of both hidden buffers
    workspace_bytes: int
    reason: str             # why the cost model chose this design
    buckets: tuple[int, ...] = ROW_BUCKETS
    choices: tuple[tuple[Sm90Choice, ...], ...] = ()   # per GEMM, per bucket: the Hopper kernel it runs
    tuning: bool = False    # a tuning build: every SM90_KERNELS entry, and the exported timing entry
    tuned_on: str = ""      # the GPU the choices were measured on ("" = DEFAULT_CHOICE)
    tf32_first: bool = False  # layer 0 may read the fp32 input in place with tf32 kernels (TF32_KERNELS)
    w0f_offset: int = 0       # bytes: layer 0's weights as fp32 [np0][k0], tf32-rounded (when tf32_first)
    chain_block: int = 0    # rows per pass through the chain (<= row_block; 0: row_block). Smaller passes
                            # keep the hidden activations in L2 between the GEMMs; wide_tune.py measures it
    tail_from: int = 0      # segmented: layers [tail_from:] run as one fused kernel (cuda_plan's resident or
                            # streamed design, `tail_spec`) on the hidden tensor the last GEMM wrote; 0: none
    tail_offset: int = 0    # bytes: that kernel's packed weights and biases (tail_bytes)
    tail_bytes: int = 0
    tail_out_offset: int = 0  # bytes: its 16-bit output [MB][N] when the io type is fp32 (widened into y)
    tail_text: str = ""     # the fused kernel's plan, as describe() says it
    resident: bool = False  # cuda_plan.CudaPlan compatibility: callers test plan.resident
    design: str = "wide"

    @property
    def sm90_kernels(self) -> tuple[int, ...]:
        """Indices into SM90_KERNELS that the library instantiates (one translation unit each)."""
        if self.tuning:
            return tuple(i for i, k in enumerate(SM90_KERNELS) if self.tf32_first or not k.tf32)
        return tuple(sorted({c.kernel for per_gemm in self.choices for c in per_gemm}))

    @property
    def tiles(self) -> tuple[GemmTile, ...]:
        """The distinct tiles the kernel instantiates, in a fixed order."""
        seen: dict[GemmTile, None] = {}
        for arch in sorted(TILE_TABLE):
            for t in TILE_TABLE[arch]:
                seen.setdefault(t)
        return tuple(seen)

    def describe(self) -> str:
        conv = "fp32->16-bit conversion pass, " if self.convert_input else ""
        n, n90 = len(self.gemms), sum(g.sm90 for g in self.gemms)
        hopper = "all" if n90 == n else f"{n90} of {n}"  # the others' output rows are not TMA-storable
        tuned = f"kernels tuned on {self.tuned_on}" if self.tuned_on else "default kernels (not tuned)"
        passes = f", {self.chain_block}-row passes" if self.chain_block != self.row_block else ""
        if self.tf32_first and any(SM90_KERNELS[c.kernel].tf32 for c in self.choices[0]):
            conv = "the first GEMM reads the fp32 input in place (tf32), " + conv.replace("pass, ", "pass elsewhere, ")
        last = len(self.spec.layers) - 1
        tail = (f"; segmented: layers {self.tail_from}..{last} in one fused kernel on the 16-bit hidden tensor "
                f"({self.tail_text})" if self.tail_from else "")
        return (f"wide: {n} tensor-core GEMM{'s' if n > 1 else ''} with a bias+activation epilogue (on sm_90: {hopper} as CUTLASS "
                f"3.x wgmma/TMA kernels, {tuned}, the rest CUTLASS 2.x; other GPUs: CUTLASS 2.x sm80 mma.sync), "
                f"{conv}16-bit intermediates in the workspace, {self.row_block}-row blocks{passes}{tail}; {self.reason}")

    def choice_text(self) -> str:
        """Per GEMM, the Hopper kernel of each row bucket: `inspect` shows it."""
        return "; ".join(f"layer {g.index}: " + ", ".join(f"{b} rows {c.label}" for b, c in zip(self.buckets, per))
                         for g, per in zip(self.gemms, self.choices))


# ------------------------------------------------------------------------------------------ refusals
def wide_reason_refused(spec: MLPSpec) -> str | None:
    """Why the wide design cannot run this spec, or None."""
    if spec.precision not in ("fp16", "bf16"):
        return f"{spec.precision} has no tensor-core GEMM"
    for i, l in enumerate(spec.layers):
        if ex.chan_leaves(l.activation):
            return (f"layer {i}'s activation has per-channel constants, which the GEMM epilogue "
                    "(it does not see the column) cannot apply")
        if i < len(spec.layers) - 1 and not np.isfinite(ex.evaluate(l.activation, np.zeros(1, np.float32))).all():
            return f"layer {i}'s activation is not finite at 0 (padded hidden columns would poison the next layer)"
    return None


@lru_cache(maxsize=None)
def _cutlass_found() -> str | None:
    from .headers import find_cutlass_headers
    try:
        find_cutlass_headers()
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "not found"; the message says what to do
        return str(e)


# ------------------------------------------------------------------------------------------ layout
def make_wide_plan(spec: MLPSpec, reason: str = "", choices=None, tuning: bool = False,
                   tuned_on: str = "", chain_block: int = 0, tail_from: int | None = None) -> WidePlan:
    """`choices`: per GEMM, per row bucket, a Sm90Choice (wide_tune.py's measured ones), else the
    default everywhere; `chain_block`: rows per pass (0: the row block). `tuning`: the tuning build
    (all kernels, the timing entries). `tail_from`: the first layer of the fused tail (0: every layer a
    GEMM; None: the cost model's `best_tail`)."""
    why = wide_reason_refused(spec)
    if why:
        raise SpecError(f"{spec.describe()}: no wide plan: {why}")
    if tail_from is None:
        tail_from = best_tail(spec)
    tail = tail_plan(spec, tail_from) if tail_from else None
    if tail_from and tail is None:
        raise SpecError(f"{spec.describe()}: layers {tail_from}.. cannot run as one fused kernel")
    n_gemms = tail_from or len(spec.layers)
    io_bytes = 2 if spec.io_dtype == "f16" else 4
    out_bytes_last = io_bytes
    k0 = spec.layers[0].in_features
    kp0 = round_up(k0, ALIGN)
    convert = _converts(spec)  # fp16 input of an fp16 kernel with aligned rows is already the GEMM's A operand
    off = 0
    kp = kp0
    hidden = [round_up(l.out_features, ALIGN) for l in spec.layers[:min(n_gemms, len(spec.layers) - 1)]]
    h_width = max(hidden, default=0)
    layouts = []
    for i, l in enumerate(spec.layers[:n_gemms]):
        last = i == len(spec.layers) - 1
        np_ = l.out_features if last else round_up(l.out_features, ALIGN)
        out_bytes = out_bytes_last if last else 2
        align = next(a for a in (16 // out_bytes, 4, 2, 1) if np_ % a == 0)
        w_off = off
        off = round_up(off + np_ * kp * 2, REGION_ALIGN)
        b_off = off
        off = round_up(off + np_ * out_bytes, REGION_ALIGN)
        src = ("xc" if convert else "x") if i == 0 else f"h{(i - 1) % 2}"
        dst = "y" if last else f"h{i % 2}"
        narrow = last and l.out_features <= NARROW_MAX and np_ * kp * 4 <= NARROW_SMEM
        layouts.append(WideGemm(i, l.in_features, l.out_features, kp, np_, last, align, w_off, b_off, src, dst,
                                np_ * out_bytes % 16 == 0 and not narrow, narrow))
        kp = np_
    n_hbuf = min(2, len(hidden))   # hidden tensors ping-pong between two buffers
    n_out = spec.layers[-1].out_features
    stage_tail = bool(tail) and spec.io_dtype != "f16"   # the tail writes fp16; a pass widens it into y
    per_row = (kp0 * 2 if convert else 0) + n_hbuf * h_width * 2 + (n_out * 2 if stage_tail else 0)
    mb = SCRATCH_BUDGET // max(per_row, 1) // ROW_QUANTUM * ROW_QUANTUM
    mb = max(ROW_QUANTUM, min(MAX_ROW_BLOCK, mb))
    sm90_off = off
    off = round_up(off + SM90_SCRATCH, REGION_ALIGN)
    xc_off = off
    if convert:
        off = round_up(off + mb * kp0 * 2, REGION_ALIGN)
    h0 = off
    off = round_up(off + mb * h_width * 2, REGION_ALIGN) if n_hbuf >= 1 else off
    h1 = off
    off = round_up(off + mb * h_width * 2, REGION_ALIGN) if n_hbuf >= 2 else off
    # tf32 first layer: fp32 rows TMA can load (16-byte multiples) and an output row it can store
    tf32_ok = tf32_eligible(spec) and layouts[0].sm90
    buckets = row_buckets(mb)
    if choices is None:
        first = DEFAULT_TF32_CHOICE if tf32_ok and tf32_first_wins(spec) else DEFAULT_CHOICE
        choices = ((first,) * len(buckets),) + tuple((DEFAULT_CHOICE,) * len(buckets) for _ in layouts[1:])
    choices = tuple(tuple(per) for per in choices)
    if len(choices) != len(layouts) or any(len(per) != len(buckets) for per in choices) or any(
            not 0 <= c.kernel < len(SM90_KERNELS) or c.mode not in MODES or c.splits < 1
            or (SM90_KERNELS[c.kernel].tf32 and (g > 0 or not tf32_ok))
            for g, per in enumerate(choices) for c in per):
        raise SpecError(f"{spec.describe()}: kernel choices do not fit the plan "
                        f"({len(layouts)} GEMMs x {len(buckets)} row buckets)")
    # the fp32 copy of layer 0's weights only where a tf32 kernel may run (the tuning build times them)
    tf32_first = tf32_ok and (tuning or any(SM90_KERNELS[c.kernel].tf32 for c in choices[0]))
    w0f_off = off
    if tf32_first:
        off = round_up(off + layouts[0].np_ * k0 * 4, REGION_ALIGN)
    tail_off = tail_bytes = tail_out_off = 0
    if tail:
        tail_off, tail_bytes = off, tail.weight_elems * 2 + tail.bias_elems * 4   # its _cuda_workspace_bytes
        off = round_up(off + tail_bytes, REGION_ALIGN)
        tail_out_off = off
        if stage_tail:
            off = round_up(off + mb * n_out * 2, REGION_ALIGN)
    if chain_block and not (0 < chain_block <= mb and chain_block % ROW_QUANTUM == 0):
        raise SpecError(f"{spec.describe()}: a pass of {chain_block} rows does not fit the {mb}-row workspace")
    return WidePlan(spec, tuple(layouts), mb, convert, xc_off, sm90_off, (h0, h1), h_width, off, reason,
                    buckets, choices, tuning, tuned_on, tf32_first, w0f_off, chain_block or mb,
                    tail_from, tail_off, tail_bytes, tail_out_off, tail.describe() if tail else "")


# ------------------------------------------------------------------------------------------ segments
def tail_spec(spec: MLPSpec, start: int) -> MLPSpec:
    """Layers [start:] as a chain of their own, fp16 in and out: the fused kernel that finishes a
    segmented plan reads the hidden tensor the last GEMM wrote and writes 16-bit rows."""
    return MLPSpec(spec.layers[start:], "fp16", "f16")


def tail_plan(spec: MLPSpec, start: int):
    """cuda_plan's fused kernel (resident or streamed, never wide) for layers [start:], or None where a
    tail cannot start there: fp16 chains only (the hidden tensor is fp16), a hidden width that is a
    multiple of ALIGN (the GEMM writes rows of exactly that stride, the tail reads them contiguously)."""
    from . import cuda_plan
    if spec.precision != "fp16" or not 0 < start < len(spec.layers) or spec.layers[start].in_features % ALIGN:
        return None
    try:
        return cuda_plan.make_plan(tail_spec(spec, start), wide_allowed=False)
    except SpecError:
        return None


def _tail_seconds(spec: MLPSpec, start: int, plan, rows: int) -> float:
    """The fused tail: one pass over the fp16 hidden rows (the streamed estimate for a streamed plan; a
    resident one at the streamed kernel's efficiency too: conservative), and the pass widening its
    16-bit output into an fp32 y."""
    t_spec = tail_spec(spec, start)
    if plan.resident:
        compute = t_spec.flops_per_row * rows / (TC_FLOPS * STREAMED_EFF_128)
        t = max(compute, rows * (t_spec.widths[0] + t_spec.widths[-1]) * 2 / HBM_BPS) + LAUNCH_S
    else:
        t = estimate_streamed(t_spec, plan, rows)
    if spec.io_dtype != "f16":
        t += rows * t_spec.widths[-1] * (2 + 4) / HBM_BPS + LAUNCH_S
    return t


def best_tail(spec: MLPSpec, rows: int = NOMINAL_ROWS) -> int:
    """The first layer of the fused tail the cost model prefers, or 0 (every layer a GEMM). A tail
    replaces the GEMMs of narrow trailing layers (DLRM's 256 -> 64 -> 1: two launches and a round trip
    of the 64-wide tensor) by one pass over the hidden rows."""
    return _tail_choice(spec, rows)[0]


def _tail_choice(spec: MLPSpec, rows: int) -> tuple[int, float]:
    """best_tail's start, and the wide design's estimate with it (seconds)."""
    best, best_t = 0, estimate_wide(spec, rows)
    if os.environ.get(TAIL_ENV, "auto").strip().lower() == "off":
        return best, best_t
    for start in range(1, len(spec.layers)):
        plan = tail_plan(spec, start)
        if plan is not None and (t := estimate_wide(spec, rows, start, plan)) < best_t:
            best, best_t = start, t
    return best, best_t


# ------------------------------------------------------------------------------------------ cost model
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
    conversion = (rows * l.in_features * io + rows * k * 2) / HBM_BPS + LAUNCH_S if _converts(spec) else 0.0
    return conversion + _gemm_seconds(rows, k, n, 2, 2, out, TC_FLOPS)


def _converts(spec: MLPSpec) -> bool:
    """Whether the 16-bit path needs the conversion pass (make_wide_plan's convert_input)."""
    k0 = spec.layers[0].in_features
    return not (spec.io_dtype == "f16" and spec.precision == "fp16" and round_up(k0, ALIGN) == k0)


def tf32_eligible(spec: MLPSpec) -> bool:
    """fp32 input rows that TMA can load in place (16-byte multiples)."""
    return spec.io_dtype == "f32" and spec.layers[0].in_features % 4 == 0


def tf32_first_wins(spec: MLPSpec, rows: int = NOMINAL_ROWS) -> bool:
    """Whether reading the fp32 input in place (tf32 first GEMM) beats converting it first: the memory-
    bound first layers (DLRM's 512 -> 256: the conversion pass costs more than the GEMM)."""
    return _first_layer_seconds(spec, rows, True) < _first_layer_seconds(spec, rows, False)


def estimate_wide(spec: MLPSpec, rows: int = NOMINAL_ROWS, tail_from: int = 0, tail=None) -> float:
    """Seconds: each GEMM at max(compute, HBM traffic) plus its fixed GPU time, the first layer as the
    cheaper of the tf32 in-place read and the conversion pass (where the tf32 kernels apply); at least
    the host's time to launch them all. `tail_from` > 0: layers from there run as the fused tail
    (`tail`: its cuda_plan plan)."""
    io = 2 if spec.io_dtype == "f16" else 4
    n_gemms = tail_from or len(spec.layers)
    first = _first_layer_seconds(spec, rows, False)
    launches = len(spec.layers) + _converts(spec)       # one kernel per layer, and the conversion pass
    if tf32_eligible(spec) and _first_layer_seconds(spec, rows, True) < first:
        first, launches = _first_layer_seconds(spec, rows, True), len(spec.layers)
    t = first
    if tail_from:
        t += _tail_seconds(spec, tail_from, tail, rows)
        launches -= len(spec.layers) - tail_from - 1 - (io != 2)   # one kernel (and the widening pass)
    for i, l in enumerate(spec.layers[1:n_gemms], start=1):
        last = i == len(spec.layers) - 1
        k, n = round_up(l.in_features, ALIGN), l.out_features if last else round_up(l.out_features, ALIGN)
        t += _gemm_seconds(rows, k, n, 2, 2, io if last else 2, TC_FLOPS)
    return max(t, launches * HOST_LAUNCH_S)   # the GPU's time, or the host's when the kernels are short


def estimate_streamed(spec: MLPSpec, streamed_plan, rows: int = NOMINAL_ROWS) -> float:
    """Seconds of the streamed kernel (cuda_plan): its tallest tile sets the tensor-core efficiency
    (short tiles re-read every weight chunk per few rows: shared-memory bound) and the L2 weight traffic."""
    io = 2 if spec.io_dtype == "f16" else 4
    bm = max(v.bm for v in streamed_plan.variants)
    eff = STREAMED_EFF_128 * min(1.0, bm / 128) ** 0.5
    weight_bytes = streamed_plan.weight_elems * 2
    compute = spec.flops_per_row * rows / (TC_FLOPS * eff)
    l2 = -(-rows // bm) * weight_bytes / L2_BPS
    hbm = rows * (spec.widths[0] + spec.widths[-1]) * io / HBM_BPS
    return max(compute, l2, hbm) + LAUNCH_S


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us"


def choose_plan(spec: MLPSpec, resident_plan, streamed_plan, streamed_error: SpecError | None,
                wide_options: dict | None = None):
    """The plan cuda_plan.make_plan returns: resident when it exists (narrow chains: one kernel, weights
    on chip), else the faster of streamed and wide by the cost model at NOMINAL_ROWS rows.
    `$ONNX2FUSED_CUDA_DESIGN` forces a design where it is possible (experiments and tests).
    `wide_options`: make_wide_plan's choices / tuning / tuned_on, when the wide design is taken."""
    wide_options = dict(wide_options or {})

    forced = os.environ.get(DESIGN_ENV, "auto").strip().lower() or "auto"
    if forced not in ("auto", "wide", "streamed", "resident"):
        raise SpecError(f"{DESIGN_ENV}={forced!r}: expected auto, wide, streamed or resident")
    wide_why = wide_reason_refused(spec) or _cutlass_found()
    if not wide_options.pop("allowed", True):   # a segmented plan's tail: its fused kernel, never GEMMs again
        wide_why = "a segmented plan's tail is one fused kernel"
    if forced == "resident" and resident_plan is not None:
        return resident_plan
    if forced == "streamed" and streamed_plan is not None:
        return streamed_plan
    if forced == "wide" and wide_why is None:
        return make_wide_plan(spec, f"forced by {DESIGN_ENV}=wide", **wide_options)
    if resident_plan is not None:
        return resident_plan
    if streamed_plan is None:
        if wide_why is not None:
            raise SpecError(f"{streamed_error}; the wide design cannot take it either: {wide_why}")
        return make_wide_plan(spec, f"chosen because the streamed kernel cannot hold it ({_short(streamed_error)})",
                              **wide_options)
    if wide_why is not None:
        return streamed_plan
    start = wide_options.get("tail_from")
    if start is None:   # the cost model's split, searched once: make_wide_plan takes it as it is
        start, t_wide = _tail_choice(spec, NOMINAL_ROWS)
        wide_options["tail_from"] = start
    else:
        t_wide = estimate_wide(spec, NOMINAL_ROWS, start, tail_plan(spec, start) if start else None)
    t_streamed = estimate_streamed(spec, streamed_plan)
    if t_wide * WIDE_MARGIN < t_streamed:
        return make_wide_plan(spec, f"chosen by the cost model at {NOMINAL_ROWS} rows: "
                                    f"~{_us(t_wide)} vs ~{_us(t_streamed)} streamed", **wide_options)
    return streamed_plan


def _short(err) -> str:
    text = str(err)
    return text.split(": ", 1)[1] if ": " in text else text


# ------------------------------------------------------------------------------------------ template
def template_params(plan: WidePlan, acts: list[dict]) -> dict:
    """The keys templates/cuda_wide.cu.j2 needs beyond cuda_plan.template_params' common ones. `acts`:
    cuda_plan's per-layer activation code; layers with the same code share one functor, hence one
    GEMM instantiation per (functor, output type, alignment, tile): less to compile."""
    spec = plan.spec
    functors: dict[str, str] = {}
    for a in acts:
        functors.setdefault(a["code"], f"Act{len(functors)}")
    act_of = [functors[a["code"]] for a in acts]
    large = {arch: TILE_TABLE[arch][0].name for arch in TILE_TABLE}
    small = {arch: TILE_TABLE[arch][1].name for arch in TILE_TABLE}
    return {
        "template": "cuda_wide.cu.j2",
        "plan_text": plan.describe(),
        "k0": spec.widths[0],
        "kp0": plan.gemms[0].kp,
        "row_block": plan.row_block,
        "chain_block": plan.chain_block,
        "convert_input": plan.convert_input,
        "xc_offset": plan.xc_offset,
        "sm90_offset": plan.sm90_offset, "sm90_scratch": SM90_SCRATCH,
        **_sm90_params(plan, act_of),
        "sm80_env": SM80_ENV,
        "launch_cache_env": LAUNCH_CACHE_ENV,
        "h0_offset": plan.h_offsets[0], "h1_offset": plan.h_offsets[1],
        "h_width": plan.h_width,
        "workspace_bytes": plan.workspace_bytes,
        "tiles": [{"name": t.name, "bm": t.bm, "bn": t.bn, "bk": t.bk, "wm": t.wm, "wn": t.wn, "wk": t.wk,
                   "stages": t.stages} for t in plan.tiles],
        # arch major -> tile names; the launcher takes the entry of the largest arch <= the device's
        "arch_tiles": [{"major": arch // 10, "large": large[arch], "small": small[arch]}
                       for arch in sorted(TILE_TABLE, reverse=True)],
        "act_functors": [{"name": name, "code": code} for code, name in functors.items()],
        "gemms": [{"index": g.index, "act": act_of[g.index], "k": g.k, "n": g.n, "kp": g.kp, "np": g.np_, "last": g.last,
                   "align": g.align_out, "w_offset": g.w_offset, "b_offset": g.b_offset,
                   "src": g.src, "dst": g.dst, "sm90": g.sm90, "narrow": g.narrow,
                   "choices": [_choice_param(c) for c in per],
                   # the launch arguments after the input (run_chain's names: ws, y, r0)
                   "w_expr": f"reinterpret_cast<const elem_t*>(ws + {g.w_offset})",
                   "tail_expr": (f"reinterpret_cast<const {'io_t' if g.last else 'elem_t'}*>(ws + {g.b_offset}), "
                                 + (f"static_cast<io_t*>(y) + r0 * {g.n}, {g.n}" if g.last else f"{g.dst}, {g.np_}")),
                   # the 16-bit kernels its dispatch switch holds; tf32 ones go to layer0_tf32
                   "kernels": sorted(i for i in plan.sm90_kernels if not SM90_KERNELS[i].tf32
                                     and (plan.tuning or any(c.kernel == i for c in per)))}
                  for g, per in zip(plan.gemms, plan.choices)],
        "tail": _tail_params(plan),
        "tf32_first": plan.tf32_first,
        "w0f_offset": plan.w0f_offset,
        "tf32_kernels": [i for i in plan.sm90_kernels if SM90_KERNELS[i].tf32],
        "is_tf32": [int(k.tf32) for k in SM90_KERNELS],
    }


def tail_symbol(spec: MLPSpec) -> str:
    """The C symbol prefix of a segmented plan's fused tail (its own translation unit, codegen.render)."""
    return f"{spec.name}_tail"


def _tail_params(plan: WidePlan) -> dict | None:
    if not plan.tail_from:
        return None
    last_gemm = plan.gemms[-1]
    return {"sym": tail_symbol(plan.spec), "start": plan.tail_from, "src": last_gemm.dst,
            "n": plan.spec.layers[-1].out_features, "offset": plan.tail_offset, "bytes": plan.tail_bytes,
            "stage": plan.spec.io_dtype != "f16", "out_offset": plan.tail_out_offset}


def _sm90_params(plan: WidePlan, act_of: list[str]) -> dict:
    """The Hopper kernels the library instantiates: one translation unit ("part") per kernel, holding
    its explicit instantiations for every (activation, output type, alignment) of a GEMM that may run
    it; part 0 is everything else (build.py compiles each part with -DO2F_PART=p, in parallel)."""
    kernels = []
    # the C++ output type: io_t and elem_t are one type for fp16 kernels on fp16 I/O, and an explicit
    # instantiation may appear only once
    same = plan.spec.io_dtype == "f16" and plan.spec.precision == "fp16"
    for part, i in enumerate(plan.sm90_kernels, start=1):
        k = SM90_KERNELS[i]
        uses = {(act_of[g.index], "io_t" if g.last and not same else "elem_t", g.align_out)
                for g, per in zip(plan.gemms, plan.choices)
                if g.sm90 and (g.index == 0 or not k.tf32) and (plan.tuning or any(c.kernel == i for c in per))}
        kernels.append({"index": i, "name": k.name, "part": part, "coop": k.stream_k, "tf32": k.tf32,
                        "bm": k.tile[0], "bn": k.tile[1], "bk": k.tile[2], "cm": k.cluster[0], "cn": k.cluster[1],
                        "uses": [{"act": a, "out": o, "align": al} for a, o, al in sorted(uses)]})
    b = plan.buckets
    return {
        "sm90_kernels": kernels,
        "parts": len(kernels),
        "buckets": list(b),
        # a call of m rows takes the first bucket whose upper bound (geometric mean with the next) >= m
        "bucket_bounds": [int((lo * hi) ** 0.5) for lo, hi in zip(b, b[1:])],
        "modes": list(MODES),
        "sm90_names": [k.name for k in SM90_KERNELS],
        "tuning": plan.tuning,
        "default_choice": _choice_param(DEFAULT_CHOICE),
        "candidates": [_choice_param(c) for c in sm90_candidates()],
    }


def _choice_param(c: Sm90Choice) -> dict:
    return {"kernel": c.kernel, "mode": MODES.index(c.mode), "splits": c.splits}
