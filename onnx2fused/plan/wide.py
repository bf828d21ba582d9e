"""The "wide" CUDA design: one tensor-core GEMM per layer, Y_i = act_i(X_i @ W_i + b_i), and its plan.

templates/cuda_wide.cu.j2 (cuda_wide_tune.cu.j2 for the tuning build) holds CUTLASS 2.x device-level
GEMMs (sm_80 `mma.sync` kernels, which also run on sm_90) whose epilogue is `LinearCombinationGeneric`
over a generated activation functor (the layer's expr IR, render_c):

    X (io type) --convert--> X16 [MB, KP0]  (skipped when X is already fp16/bf16 of the compute type
                                            and K0 is a multiple of 8: the GEMM reads X in place)
    H_0 = act_0(X16 @ W_0 + b_0)            fp16/bf16 [MB, NP_0], in the workspace
    H_1 = act_1(H_0 @ W_1 + b_1)            ping-pong between two workspace buffers
    Y   = act_L(H_{L-2} @ W_L + b_L)        io type, true width, straight to the output

The plugin gives a kernel no per-run allocator (ort_plugin/plugin.cc allocates one workspace per device,
once), so the intermediates live in that workspace, sized for MB rows ("row block"); a call loops over
passes of at most MB rows on the stream, of even size (pass_rows: 4096 rows in 1792-row blocks as
1408 + 1408 + 1280): no cudaMalloc, no synchronisation, capturable in a CUDA graph. Runs of one
kernel share the workspace: the registry marks the kernel (`uses_scratch`) and the plugin orders runs
that come on different streams.

tf32 first layer: where converting an fp32 input costs more than the first GEMM (cost.tf32_first_wins:
DLRM's 512 -> 256), that GEMM reads x in place with a tf32 kernel (sm90.TF32_KERNELS) and an fp32 copy of
its weights; no conversion pass. Narrow last layer (<= NARROW_MAX outputs): a thread-per-row kernel.

Segmented plan (`tail_from` > 0): the GEMMs stop at layer tail_from - 1, and layers [tail_from:] run as
ONE fused kernel of the resident or streamed design (`tail`: its plan, made by plan/choose.py for those
layers on fp16 rows in and out), rendered into its own translation unit. It reads the fp16 hidden tensor
the last GEMM wrote, keeps the narrower trailing activations on chip, and writes y (through a widening
pass when y is fp32). The cost model takes it where it wins (choose.best_tail): DLRM's 256 -> 64 -> 1
after the tf32 first GEMM is one pass over the 256-wide rows instead of two GEMM launches and a round
trip of the 64-wide tensor. `$ONNX2FUSED_WIDE_TAIL=off` (PlanOptions.wide_tail) turns it off.

Gated layers (SwiGLU, GeGLU: act(x Wg + bg) * (x Wu + bu), W [K, 2N]): one GEMM of 2*NP columns (gate
columns [0, NP), up columns [NP, 2NP), each half padded to ALIGN; LLaMA's 4096 -> 2 x 11008 reads x once
for both) with an identity epilogue, into the gate buffer `hg` [MB, 2NP] of the workspace, then the glu
pass (templates/o2f_wide_glu.cuh): h[r, j] = act(hg[r, j]) * hg[r, NP + j] in fp32, written once as the
16-bit hidden tensor the next GEMM reads. A padded gate column holds act(0) and its up column 0, so the
padded hidden columns are zeros. The gate and up products are rounded to 16 bits before act(g) * u, as
stock ORT's fp16 model rounds its two GEMMs' outputs. A gated last layer is refused (the GEMM would need
the io type's gate buffer; no exporter writes one), and a gated first layer never reads fp32 in place.
On sm_90, where a row bucket's choice is the light kernel (the untuned default), the glu runs in that
kernel's epilogue instead (templates/o2f_light_gemm.cuh, kGated): each 128 x 64 output tile's W stage holds
its 64 gate rows and the 64 matching up rows, so the same roundings give h directly, and the 2NP-wide
products never reach memory (LLaMA-7B's MLP at 4096 rows: 360 MB of the gate buffer's traffic, and a
launch, fewer). The gate buffer stays in the workspace for the other kernels (CUTLASS's, sm80).

Padding: K of every GEMM and the widths of the hidden tensors are rounded up to ALIGN (16-byte vectors).
Padded weight entries and biases are zero, so a padded hidden column holds act(0), and the next layer
multiplies it by zero weights: act(0) must be finite, which `wide_reason_refused` checks.
The bias enters as CUTLASS's source operand C with a row stride of 0 (a broadcast row); it is stored in
the GEMM's output type: fp16/bf16 for hidden layers (rounded like the weights), the io type last.

Transformer blocks (spec.norm, spec.residual): the conversion pass normalises each row
(templates/o2f_block_norm.cuh's norm_rows, the fused kernels' arithmetic; the scale and bias copied into
the workspace at `norm_offset` by cuda_pack) while it writes the 16-bit rows, and the residual enters the
last GEMM as its source operand. A Hopper kernel reads x's rows as C beside the bias row:
D = act(acc + C + bias) (LinCombPerColBiasEltAct, beta 1), so nothing is written first. Where the pass
runs the CUTLASS 2.x kernels or the GEMV path (run_chain's residual_on_sm90 decides per pass, with the
Hopper dispatch's conditions), y = x + b_last (io type) is written first (by the norm pass from the rows
it reads, else by a pass of its own, init_residual), and the last GEMM computes D = act(acc + C) with
C = y in place (C's row stride instead of the bias broadcast). Either way that is the block only for an
identity last activation (wide_reason_refused).
So the stock LayerNormalization and Add around a wide FFN disappear; a tail has no source operand, so a
residual plan never segments.

GEMV path (`gemv_rows`, PlanOptions.wide_gemv; on by default, `$ONNX2FUSED_WIDE_GEMV=off` turns it off):
a pass of at most GEMV_MAX_ROWS rows (decode, small batches) fills few of a 128-row tile's rows, so the
tensor cores idle while every weight is read once anyway, and reading the weights once is the
floor (LLaMA-7B's 270 MB MLP: 0.09 ms at 3 TB/s, vs 0.19 ms measured with the GEMMs at 1 and 16 rows,
0.15 ms for stock ORT at 1 row). Such a pass runs one weight-streaming kernel per layer instead
(templates/o2f_wide_gemv.cuh): mma.sync m16n8k16 with the pass's rows padded to 16 in registers; a block
of 8 warps owns 16 output columns (a gated layer: 8 gate and up column pairs) and splits K, each lane
streaming 16-byte vectors of its column's contiguous n-major weights (no L1 allocation) against the rows'
16-byte vectors at the same k, both copied through a cp.async ring in shared memory (3 chunks in flight
per warp without holding registers: the register-staged version read at 2.2 TB/s on an H200). The first
layer reads the conversion pass's rows (or x in place), and a gated layer writes act(gate) * up straight into its hidden buffer (no gate buffer, no glu pass), with
the GEMM path's roundings. A segmented plan's fused tail runs after them as usual. (A first version, a
warp per column on the CUDA cores, converted every activation to fp32 for every column: 1.17x ORT fp16
at LLaMA's 1 row but 0.25x at 16.)

Tiles come from TILE_TABLE, keyed by arch: a "large" tile for GEMMs with enough output tiles to fill the
GPU and a "small" one otherwise; the launcher picks per GEMM and row block at run time from the SM count.

Hopper (sm_90a): when the build's arch list has 90, build.py compiles the wide sources for sm_90a and
defines ONNX2FUSED_WIDE_SM90A; the chain then also runs TMA + wgmma kernels: by default our own
(sm90's Light128x128: templates/o2f_light_gemm.cuh, ping-pong 128 x 128 tiles, no CUTLASS, data-parallel
persistent tiles), or the CUTLASS 3.x kernel the search chose (TMA loads, wgmma,
KernelTmaWarpSpecializedCooperative, TMA warp-specialized epilogue whose fusion is
LinCombPerColBiasEltAct over the same generated activation functor) with the stream-K tile scheduler:
with few output tiles (the 256-row head: 32 tiles of 128x256 for 132 SMs) it splits the K loop across
the idle SMs and reduces the partial tiles through sm90.SM90_SCRATCH bytes of the workspace; with many
tiles it is data-parallel (persistent). The launcher takes them on compute capability 9.0 for every GEMM
whose output rows are 16-byte multiples (TMA stores; `WideGemm.sm90`), with 16-byte aligned pointers;
anything else (other GPUs, a last layer of width 1 or 999, `$ONNX2FUSED_WIDE_KERNELS=sm80` at run
time for comparisons) runs the CUTLASS 2.x kernels.

Hopper kernel choice (plan/sm90.py): each GEMM has one `Sm90Choice` per row bucket. The library
instantiates only the kernels its choices name, each (kernel, types, epilogue) as its own translation unit
(wide_params.wide_instances: shared by every chain and library that runs it, compiled once, in parallel). The choices are sm90.DEFAULT_CHOICE unless wide_tune.py measured better ones on
the GPU the library is built for (a "tuning build" holds every kernel and times each candidate on each
GEMM and bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import expr as ex
from ..spec import MLPSpec, SpecError
from .ffn import ffn_pair, ffn_reason_refused
from .cost import converts_input, tf32_eligible, tf32_first_wins
from .padding import ALIGN, norm_floats, round_up
from .sm90 import (default_choice, default_tf32_choice, ROW_BUCKETS, SM90_KERNELS, SM90_SCRATCH, Sm90Choice,
                   row_buckets)

SCRATCH_BUDGET = 128 << 20      # bytes of workspace for the intermediates of one row block
ROW_QUANTUM = 128               # the row block is a multiple of the largest tile's rows
MAX_ROW_BLOCK = 65536
REGION_ALIGN = 256              # byte alignment of each workspace region


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


def sm80_tiles() -> tuple[GemmTile, ...]:
    """The distinct tiles of TILE_TABLE (the sm80 kernel instances hold them all), in a fixed order."""
    seen: dict[GemmTile, None] = {}
    for arch in sorted(TILE_TABLE):
        for t in TILE_TABLE[arch]:
            seen.setdefault(t)
    return tuple(seen)


GEMV_MAX_ROWS = 16             # passes of at most this many rows may take the GEMV kernels (`gemv_rows`)
NARROW_MAX = 8                  # last-layer outputs that take narrow_layer (DLRM's score, binary heads)
NARROW_SMEM = 32 * 1024         # its weights as fp32 in shared memory
# Run-time switches of the generated code (read by the library, not by planning):
SM80_ENV = "ONNX2FUSED_WIDE_KERNELS"   # =sm80 at run time: sm_90 GPUs run the CUTLASS 2.x kernels too
LAUNCH_CACHE_ENV = "ONNX2FUSED_WIDE_LAUNCH_CACHE"  # =off at run time: initialize every sm90 GEMM (comparisons)
# Programmatic dependent launch of the Hopper GEMMs (CUTLASS's griddepcontrol wait, the norm pass letting
# the first GEMM launch early) was measured and left out: without it the gaps between a block's kernels
# are ~1 us each (ViT-B: 274 us from the first kernel's start to the last one's end, 271 us of kernels),
# and with it the same run took 301 us (H100, RESULTS.md fifteenth run).


def pass_rows(rows: int, block: int) -> int:
    """Rows per pass of a call of `rows` rows through the chain in passes of at most `block` rows (the
    generated run_chain computes the same): as few passes as `block` allows, of even size rounded up to
    ROW_QUANTUM, so 4096 rows in 1792-row blocks run as 1408 + 1408 + 1280, not 1792 + 1792 + 512."""
    passes = -(-rows // block)
    return min(block, round_up(-(-rows // passes), ROW_QUANTUM))


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
    gated: bool = False   # np_ = 2 * half: gate and up columns into the gate buffer, then the glu pass into dst
    half: int = 0         # gated: the padded output width NP (the glu pass's output columns; next layer's K)


@dataclass(frozen=True)
class WidePlan:
    """The wide design's plan: templates/cuda_wide.cu.j2, or cuda_wide_tune.cu.j2 for a tuning build."""
    spec: MLPSpec
    gemms: tuple[WideGemm, ...]
    row_block: int          # MB: rows of one pass through the chain
    convert_input: bool     # a conversion pass writes X16; else the first GEMM reads X in place
    xc_offset: int          # bytes: converted input [MB][kp0] (when convert_input)
    sm90_offset: int        # bytes: SM90_SCRATCH of stream-K reduction workspace for the sm90a kernels (none
                            # where no cooperative kernel can run: the next region starts here)
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
    tail_from: int = 0      # segmented: layers [tail_from:] run as one fused kernel (the resident or
                            # streamed design, `tail`) on the hidden tensor the last GEMM wrote; 0: none
    tail_offset: int = 0    # bytes: that kernel's packed weights and biases (tail_bytes)
    tail_bytes: int = 0
    tail_out_offset: int = 0  # bytes: its 16-bit output [MB][N] when the io type is fp32 (widened into y)
    tail: object = None     # the fused tail's plan (a plan.Plan of the resident or streamed design), or None
    hg_offset: int = 0      # bytes: the gate buffer [MB][hg_width] of the gated layers' GEMMs (16-bit)
    hg_width: int = 0       # its row stride: the widest gated GEMM's 2 * NP (0: no gated layer)
    gemv_rows: int = 0      # passes of at most this many rows run GEMV kernels, not GEMMs (0: never)
    norm_offset: int = 0    # bytes: a block's norm scale (and bias) as fp32 (padding.norm_floats; with spec.norm)
    ffn: object = None      # plan.ffn.FfnPair: the whole FFN in one kernel on sm_90 (its workspace regions), or None

    design = "wide"
    uses_scratch = True     # cuda_run writes the workspace's scratch regions: the plugin orders runs

    @property
    def sm90_kernels(self) -> tuple[int, ...]:
        """Indices into SM90_KERNELS that the library instantiates (a unit per GEMM output type and activation)."""
        if self.tuning:
            return tuple(i for i, k in enumerate(SM90_KERNELS) if self.tf32_first or not k.tf32)
        return tuple(sorted({c.kernel for per_gemm in self.choices for c in per_gemm}))

    def _default_kernels(self) -> bool:
        """Every choice is an untuned default (the environment read once, not per choice)."""
        defaults = (default_choice(), default_tf32_choice())
        return all(c in defaults for per in self.choices for c in per)

    def describe(self) -> str:
        conv = "fp32->16-bit conversion pass, " if self.convert_input else ""
        n, n90 = len(self.gemms), sum(g.sm90 for g in self.gemms)
        hopper = "all" if n90 == n else f"{n90} of {n}"  # the others' output rows are not TMA-storable
        if self.tuned_on:
            tuned = f"kernels tuned on {self.tuned_on}"
        elif self.tuning or self._default_kernels():
            tuned = "default kernels (not tuned)"
        else:   # choices given without a GPU to name (WideOptions.choices: benchmarks, tests)
            tuned = "kernels as given (not tuned here)"
        passes = f", {self.chain_block}-row passes" if self.chain_block != self.row_block else ""
        if self.tf32_first and any(SM90_KERNELS[c.kernel].tf32 for c in self.choices[0]):
            conv = "the first GEMM reads the fp32 input in place (tf32), " + conv.replace("pass, ", "pass elsewhere, ")
        last = len(self.spec.layers) - 1
        tail = (f"; segmented: layers {self.tail_from}..{last} in one fused kernel on the 16-bit hidden tensor "
                f"({self.tail.describe()})" if self.tail_from else "")
        fused_glu = any(SM90_KERNELS[c.kernel].light for g, per in zip(self.gemms, self.choices) if g.gated
                        for c in per)
        glu = (f", gated layer{'s' if sum(g.gated for g in self.gemms) > 1 else ''} "
               + ", ".join(str(g.index) for g in self.gemms if g.gated)
               + " as one GEMM of gate and up columns and a glu pass"
               + (" (on sm_90 the glu in the light kernel's epilogue)" if fused_glu else "") if self.hg_width else "")
        gemv = f", passes of <= {self.gemv_rows} rows as weight-streaming GEMV kernels" if self.gemv_rows else ""
        if self.spec.norm is not None:   # the norm pass is the conversion pass
            conv = f"a {self.spec.norm.label} pass writing the 16-bit rows, "
        if self.spec.residual:
            conv += "the residual as the last GEMM's source operand (x's rows on sm_90, else y = x + b first), "
        light = {SM90_KERNELS[c.kernel].light for per in self.choices for c in per}
        family = "onnx2fused's" if light == {True} else "CUTLASS 3.x" if light == {False} else "onnx2fused's and CUTLASS 3.x"
        ffn = f"; {self.ffn.describe()}" if self.ffn else ""
        if not self.ffn and len(self.spec.layers) == 2 and not self.tuning:   # say why an FFN pair keeps its GEMMs
            ffn = f"; no one-kernel FFN: {ffn_reason_refused(self.spec) or ('a segmented plan' if self.tail_from else 'its shared memory would not fit')}"
        return (f"wide: {n} tensor-core GEMM{'s' if n > 1 else ''} with a bias+activation epilogue{glu} (on sm_90: {hopper} as {family} "
                f"wgmma/TMA kernels, {tuned}, the rest CUTLASS 2.x; other GPUs: CUTLASS 2.x sm80 mma.sync), "
                f"{conv}16-bit intermediates in the workspace, {self.row_block}-row blocks{passes}{gemv}{tail}{ffn}; {self.reason}")

    def choice_text(self) -> str:
        """Per GEMM, the Hopper kernel of each row bucket: `inspect` shows it."""
        return "; ".join(f"layer {g.index}: " + ", ".join(f"{b} rows {c.label}" for b, c in zip(self.buckets, per))
                         for g, per in zip(self.gemms, self.choices))


# ------------------------------------------------------------------------------------------ refusals
# A transformer block's residual Add folds into the last GEMM's source operand (x's rows, or y = x + b
# written first), which adds it before the activation: only an identity last layer computes
# act(h W + b) + x that way. A narrow last layer (its own kernel) or a fused tail has no source operand.
WIDE_RESIDUAL_ACT = ("the residual enters the last GEMM's epilogue before its activation, so the last layer must "
                     "have none")
WIDE_RESIDUAL_NARROW = f"a residual after a last layer of at most {NARROW_MAX} outputs (no GEMM epilogue to take it)"


def wide_reason_refused(spec: MLPSpec) -> str | None:
    """Why the wide design cannot run this spec, or None."""
    if spec.precision not in ("fp16", "bf16"):
        return f"{spec.precision} has no tensor-core GEMM"
    if spec.skip:
        return "a skip connection (each GEMM reads one tensor)"
    if spec.layers[-1].gated:
        return "a gated last layer has no GEMM epilogue here (the glu pass reads 16-bit products)"
    if spec.residual and spec.layers[-1].activation != ex.identity():
        return WIDE_RESIDUAL_ACT
    if spec.residual and spec.layers[-1].out_features <= NARROW_MAX:
        return WIDE_RESIDUAL_NARROW
    for i, l in enumerate(spec.layers):
        if ex.chan_leaves(l.activation):
            return (f"layer {i}'s activation has per-channel constants, which the GEMM epilogue "
                    "(it does not see the column) cannot apply")
        if i < len(spec.layers) - 1 and not np.isfinite(ex.evaluate(l.activation, np.zeros(1, np.float32))).all():
            return f"layer {i}'s activation is not finite at 0 (padded hidden columns would poison the next layer)"
    return None


# ------------------------------------------------------------------------------------------ layout
def make_wide_plan(spec: MLPSpec, reason: str = "", *, tail_from: int = 0, tail=None, choices=None,
                   tuning: bool = False, tuned_on: str = "", chain_block: int = 0, gemv_rows: int = 0) -> WidePlan:
    """The workspace layout and kernel choices of the wide design. `tail_from`: the first layer of the
    fused tail (0: every layer a GEMM), whose plan `tail` is (plan/choose.py makes it). `choices`: per
    GEMM, per row bucket, a Sm90Choice (wide_tune.py's measured ones), else the default everywhere;
    `chain_block`: rows per pass (0: the row block). `tuning`: the tuning build (all kernels, the timing
    entries). `gemv_rows`: passes of at most that many rows run the GEMV kernels (0: none; at most
    GEMV_MAX_ROWS, the kernels' accumulator rows)."""
    why = wide_reason_refused(spec)
    if why:
        raise SpecError(f"{spec.describe()}: no wide plan: {why}")
    if tail_from and tail is None:
        raise SpecError(f"{spec.describe()}: layers {tail_from}.. cannot run as one fused kernel")
    if tail_from and spec.residual:
        raise SpecError(f"{spec.describe()}: a fused tail has no source operand to take the block's residual")
    n_gemms = tail_from or len(spec.layers)
    io_bytes = 2 if spec.io_dtype == "f16" else 4
    out_bytes_last = io_bytes
    k0 = spec.layers[0].in_features
    kp0 = round_up(k0, ALIGN)
    convert = converts_input(spec)  # fp16 input of an fp16 kernel with aligned rows is already the GEMM's A operand
    off = 0
    kp = kp0
    hidden = [round_up(l.out_features, ALIGN) for l in spec.layers[:min(n_gemms, len(spec.layers) - 1)]]
    h_width = max(hidden, default=0)
    layouts = []
    for i, l in enumerate(spec.layers[:n_gemms]):
        last = i == len(spec.layers) - 1
        half = round_up(l.out_features, ALIGN) if l.gated else 0
        np_ = 2 * half if l.gated else l.out_features if last else round_up(l.out_features, ALIGN)
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
                                np_ * out_bytes % 16 == 0 and not narrow, narrow, l.gated, half))
        kp = half or np_
    n_hbuf = min(2, len(hidden))   # hidden tensors ping-pong between two buffers
    n_out = spec.layers[-1].out_features
    stage_tail = bool(tail) and spec.io_dtype != "f16"   # the tail writes fp16; a pass widens it into y
    hg_width = max((g.np_ for g in layouts if g.gated), default=0)
    per_row = (kp0 * 2 if convert else 0) + (n_hbuf * h_width + hg_width) * 2 + (n_out * 2 if stage_tail else 0)
    mb = SCRATCH_BUDGET // max(per_row, 1) // ROW_QUANTUM * ROW_QUANTUM
    mb = max(ROW_QUANTUM, min(MAX_ROW_BLOCK, mb))
    # tf32 first layer: fp32 rows TMA can load (16-byte multiples) and an output row it can store
    tf32_ok = tf32_eligible(spec) and layouts[0].sm90
    buckets = row_buckets(mb)
    if choices is None:
        default = default_choice()
        first = default_tf32_choice() if tf32_ok and tf32_first_wins(spec) else default
        choices = ((first,) * len(buckets),) + tuple((default,) * len(buckets) for _ in layouts[1:])
    choices = tuple(tuple(per) for per in choices)
    if len(choices) != len(layouts) or any(len(per) != len(buckets) for per in choices) or any(
            not c.fits(g == 0 and tf32_ok) for g, per in enumerate(choices) for c in per):
        raise SpecError(f"{spec.describe()}: kernel choices do not fit the plan "
                        f"({len(layouts)} GEMMs x {len(buckets)} row buckets)")
    # the stream-K / split-K reduction scratch, only where a kernel that may use it can run (a cooperative
    # one, or the tuning build's every kernel): the ping-pong kernels, CUTLASS's and ours, need none
    sm90_off = off
    if tuning or any(SM90_KERNELS[c.kernel].stream_k for per in choices for c in per):
        off = round_up(off + SM90_SCRATCH, REGION_ALIGN)
    xc_off = off
    if convert:
        off = round_up(off + mb * kp0 * 2, REGION_ALIGN)
    h0 = off
    off = round_up(off + mb * h_width * 2, REGION_ALIGN) if n_hbuf >= 1 else off
    h1 = off
    off = round_up(off + mb * h_width * 2, REGION_ALIGN) if n_hbuf >= 2 else off
    hg = off
    off = round_up(off + mb * hg_width * 2, REGION_ALIGN)
    # the fp32 copy of layer 0's weights only where a tf32 kernel may run (the tuning build times them)
    tf32_first = tf32_ok and (tuning or any(SM90_KERNELS[c.kernel].tf32 for c in choices[0]))
    w0f_off = off
    if tf32_first:
        off = round_up(off + layouts[0].np_ * k0 * 4, REGION_ALIGN)
    tail_off = tail_bytes = tail_out_off = 0
    if tail:
        tail_off, tail_bytes = off, tail.workspace_bytes   # its _cuda_workspace_bytes
        off = round_up(off + tail_bytes, REGION_ALIGN)
        tail_out_off = off
        if stage_tail:
            off = round_up(off + mb * n_out * 2, REGION_ALIGN)
    if chain_block and not (0 < chain_block <= mb and chain_block % ROW_QUANTUM == 0):
        raise SpecError(f"{spec.describe()}: a pass of {chain_block} rows does not fit the {mb}-row workspace")
    if not 0 <= gemv_rows <= GEMV_MAX_ROWS:
        raise SpecError(f"{spec.describe()}: the GEMV kernels take at most {GEMV_MAX_ROWS} rows, not {gemv_rows}")
    norm_off = off
    off = round_up(off + norm_floats(spec) * 4, REGION_ALIGN)
    # the one-kernel FFN (not in a tuning build, which times the GEMMs): its image and bias after the rest
    pair = None if tuning or tail_from else ffn_pair(spec, off)
    if pair is not None:
        off = pair.end
    return WidePlan(spec, tuple(layouts), mb, convert, xc_off, sm90_off, (h0, h1), h_width, off, reason,
                    buckets, choices, tuning, tuned_on, tf32_first, w0f_off, chain_block or mb,
                    tail_from, tail_off, tail_bytes, tail_out_off, tail, hg, hg_width, gemv_rows, norm_off, pair)


def with_kernels(plan: WidePlan, choices=None, tuning: bool = False, tuned_on: str = "",
                 chain_block: int = 0) -> WidePlan:
    """`plan` with other kernel choices (a tuning run's), or as the tuning build: the same design
    decision, segmentation, GEMV path and reason; SpecError where the choices do not fit it."""
    return make_wide_plan(plan.spec, plan.reason, tail_from=plan.tail_from, tail=plan.tail, choices=choices,
                          tuning=tuning, tuned_on=tuned_on, chain_block=chain_block, gemv_rows=plan.gemv_rows)
