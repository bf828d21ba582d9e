"""The fused CUDA kernels (one kernel runs the whole chain): the tensor-core designs' tile and
shared-memory plans for one MLPSpec (`FusedPlan`: resident or streamed) and the fp32 CUDA-core kernel's
(`Fp32Plan`). Which design a spec gets is plan/choose.py's decision.

Weights are pre-packed once per session (S_cuda_pack) into "chunks": a chunk is NC output columns x
KC input features of one layer, stored n-major with a row stride of KC+8 halves (the 16 bytes of
padding put the 8 rows an ldmatrix reads in distinct banks). Activations stay on chip in shared
memory through every layer; products use `mma.sync` m16n8k16 with fp32 accumulators, and the bias and
activation are applied to the accumulators before the result is rounded to the compute type.

Two designs, chosen per spec:

  resident  all weights fit in shared memory. The block copies them in once and keeps them for all
            its row tiles. Each warp owns 16*MT rows and runs them through every layer on its own: a
            layer's whole output row block is accumulated in registers (NC = full padded width), then
            written back over the layer's input in the warp's private activation buffer. No block
            barrier after the weights are in; many warps per SM hide the load latency.
  streamed  weights are too large to keep. Chunks flow through a ring of STAGES slots (cp.async);
            all warps of a block share one tile of BM rows and one chunk per step (one barrier per
            step), each warp taking an MT x NT8 piece of the chunk's BM x NC outputs. Activations
            ping-pong between two buffers (layer inputs of even layers in A, odd in B). Two variants
            are compiled: "tall" tiles (many rows: weights re-read from L2 once per 128 rows) for
            large batches and "short" tiles (32 rows, warps split the columns) for small ones; the
            launcher picks by the batch size.
            FFN-shaped pairs: where a wide layer i (more than one chunk of columns) feeds a layer i+1
            whose output fits one chunk, the pair runs as one loop over HC-column blocks of layer i's
            output: each block (bias + activation) goes to a small BM x HC buffer H and is multiplied
            at once into layer i+1's accumulators, which stay in registers across all the blocks. The
            wide hidden tensor never exists in full, so the A/B buffers only hold the narrow ones and
            tall tiles fit (pairs are fused only where they do make the tallest tile taller: at equal
            tiles the narrower blocks only add chunk steps). Chunk sequence of a pair, per block hb:
            layer i's k-chunks of column block hb, then layer i+1's k-chunks of features
            [hb*HC, (hb+1)*HC).

Widths are padded to the tile (K to a multiple of KC, N to a multiple of NC); padding columns of the
activations are written as zeros, so padded weights (zeros) never multiply garbage.

Gated layers (SwiGLU/GeGLU, `LayerSpec.gated`: W [K, 2N], gate columns first) are one GEMM of 2*NP
columns (`LayerPlan.cols`; NP the padded output width) whose packed weights and bias interleave gate and
up in blocks of 8 columns (pack time: GEMM n8 tile 2q = gate columns [8q, 8q+8), tile 2q+1 = up columns
[8q, 8q+8)). With mma.sync's accumulator layout a lane then holds the gate and up values of the same
output columns in acc[mt][2q] and acc[mt][2q+1]; the epilogues (templates/o2f_gated.cuh) form
act(gate) * up there and write NP output columns. The MMA loops are the same; a chunk is NC GEMM columns
(NC/2 output columns), a warp's n8 tiles always come in (gate, up) pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import MLPSpec, SpecError
from .padding import norm_floats, round_up

SMEM_LIMIT = 227 * 1024   # dynamic shared memory a block may use on sm_90 (sm_80: 163 KB)
KC_MAX = 64               # input features per chunk
NC_STREAMED_MAX = 256     # output columns per streamed chunk
RESIDENT_NP_MAX = 256     # widest layer the resident design accumulates in registers (MT=1)


ELEM_BYTES = {"fp16": 2, "bf16": 2, "tf32": 4}  # tensor-core operand size per precision


def elem_bytes(spec: MLPSpec) -> int:
    return ELEM_BYTES[spec.precision]


def row_pad(spec: MLPSpec) -> int:
    """Padding elements at the end of each chunk/tile row: 16 bytes, so the 8 rows one ldmatrix reads
    fall in distinct shared-memory banks."""
    return 16 // elem_bytes(spec)


@dataclass(frozen=True)
class LayerPlan:
    index: int
    k: int        # true input features
    n: int        # true output features
    kc: int       # chunk depth (features)
    nc: int       # chunk width (columns)
    kp: int       # padded input features (multiple of kc)
    np_: int      # padded output columns (multiple of nc)
    chunk_first: int  # id of the layer's first chunk in the per-tile sequence
    w_offset: int     # offset of the layer's first chunk in the packed weights (elements)
    b_offset: int     # offset of the layer's bias in the packed biases (floats)
    pad: int = 8      # padding elements per chunk row (16 bytes)
    gated: bool = False  # the GEMM computes 2*np_ columns, gate and up interleaved in 8s (nc: GEMM columns)
    skip: int = 0     # the skip layer: its first `skip` input features are x's (SKIP_MMA_SYNC), a multiple of kc

    @property
    def cols(self) -> int:
        """Columns the layer's GEMM computes (packed weights, bias, accumulators): 2*np_ when gated."""
        return 2 * self.np_ if self.gated else self.np_

    @property
    def n_kchunks(self) -> int:
        return self.kp // self.kc

    @property
    def n_nchunks(self) -> int:
        return self.cols // self.nc

    @property
    def n_chunks(self) -> int:
        return self.n_kchunks * self.n_nchunks

    @property
    def chunk_elems(self) -> int:
        return self.nc * (self.kc + self.pad)


@dataclass(frozen=True)
class WarpTiling:
    """How the warps of a streamed block split one layer's BM x NC chunk outputs."""
    wm: int    # warps along rows
    wn: int    # warps along columns
    mt: int    # m16 tiles per warp
    nt8: int   # n8 tiles per warp


@dataclass(frozen=True)
class Variant:
    name: str
    bm: int
    warps: int
    stages: int
    tilings: tuple[WarpTiling, ...]
    smem_bytes: int


@dataclass(frozen=True)
class FusedPlan:
    """A tensor-core plan of the fused kernel: templates/cuda_resident.cu.j2 or cuda_streamed.cu.j2."""
    spec: MLPSpec
    layers: tuple[LayerPlan, ...]
    resident: bool
    # resident design
    warps: int = 0
    mt: int = 0
    act_ld: int = 0
    smem_bytes: int = 0
    prefetch_vectors: int = 0  # 16-byte registers per lane holding the next input tile (0: no prefetch)
    register_activations: bool = False  # hidden activations stay in registers (act_ld: input staging only)
    # streamed design
    width_a: int = 0
    width_b: int = 0
    width_x: int = 0   # a skip connection's input tile X (layer 0's padded input), which layer 0 and the skip read
    variants: tuple[Variant, ...] = field(default_factory=tuple)
    pairs: tuple[int, ...] = ()  # first layers i of the fused (i, i+1) pairs; H is BM x hidden_ld (+ pad)
    smem_limit: int = SMEM_LIMIT  # the shared memory a block may use, which the plan was made to fit

    @property
    def design(self) -> str:
        return "resident" if self.resident else "streamed"

    @property
    def uses_scratch(self) -> bool:
        """The kernel only reads its workspace (the packed weights): runs on any streams may overlap."""
        return False

    @property
    def workspace_bytes(self) -> int:
        """The packed weights (compute type) then the biases (fp32): S_cuda_workspace_bytes()."""
        return self.weight_elems * elem_bytes(self.spec) + self.bias_elems * 4

    @property
    def weight_elems(self) -> int:
        return sum(l.n_chunks * l.chunk_elems for l in self.layers)

    @property
    def bias_elems(self) -> int:
        """The layers' biases, then a block's norm scale (and bias): one fp32 array, copied to shared memory."""
        return _bias_floats(self.spec, self.layers)

    @property
    def norm_offset(self) -> int:
        """Where a block's norm parameters start in the bias array (after every layer's bias)."""
        return sum(l.cols for l in self.layers)

    @property
    def slot_elems(self) -> int:
        return max(l.chunk_elems for l in self.layers)

    @property
    def total_chunks(self) -> int:
        return sum(l.n_chunks for l in self.layers)

    @property
    def tallest_rows(self) -> int:
        """Rows of the streamed design's tallest tile (its large-batch variant)."""
        return max(v.bm for v in self.variants)

    @property
    def hidden_ld(self) -> int:
        """Columns of the hidden-block buffer H (the widest block of any pair; 0 without pairs)."""
        return max((self.layers[i].nc for i in self.pairs), default=0)

    def describe(self) -> str:
        if self.resident:
            pf = ", next input prefetched" if self.prefetch_vectors else ""
            regs = ", activations in registers" if self.register_activations else ""
            return (f"resident weights, {self.warps} warps x {16 * self.mt} rows, {self.smem_bytes // 1024} KB smem"
                    f"{regs}{pf}")
        pairs = "".join(f"hidden {self.layers[i].n} in {self.layers[i].nc}-column blocks straight into layer {i + 2}, "
                        for i in self.pairs)  # layers counted from 1, as in the model
        return ("streamed weights, " + pairs
                + ", ".join(f"{v.name} {v.bm}-row tiles ({v.smem_bytes // 1024} KB)" for v in self.variants))


def _layer_plans(spec: MLPSpec, nc_of, kc_max: int = KC_MAX,
                 hidden_blocks: dict[int, int] | None = None, gated_nc_of=None) -> list[LayerPlan]:
    """Chunk shapes per layer. A layer's padded input width is exactly the padded output width of the
    layer before (the columns that layer writes, zeros included), so no unwritten column is ever read.
    `hidden_blocks` {i: HC}: layer i of a fused pair is built HC columns at a time (its chunk width),
    and layer i+1's chunk depth divides HC, so each of its k-chunks lies within one hidden block.
    A gated layer's chunk is 2 * `gated_nc_of(N)` GEMM columns (default `nc_of`): both halves."""
    hidden_blocks = hidden_blocks or {}
    plans, chunk, w_off, b_off = [], 0, 0, 0
    kp = None
    for i, l in enumerate(spec.layers):
        block = hidden_blocks.get(i - 1, 0)
        skip = spec.skip_part(i)   # x's columns first (SKIP_MMA_SYNC)
        if kp is None:
            kc = min(round_up(l.in_features, 16), kc_max)
            kp = round_up(l.in_features, kc)
        else:
            kc = next(c for c in (kc_max, 48, 32, 16)
                      if c <= kc_max and kp % c == 0 and skip % c == 0 and (not block or block % c == 0))
            kp += skip
        if l.gated:  # chunks of NC GEMM columns: NC/2 output columns (gate and up interleaved)
            nco = (gated_nc_of or nc_of)(l.out_features)
            p = LayerPlan(i, l.in_features, l.out_features, kc, 2 * nco, kp,
                          round_up(l.out_features, nco), chunk, w_off, b_off, row_pad(spec), gated=True)
        else:
            nc = hidden_blocks.get(i) or nc_of(l.out_features)
            p = LayerPlan(i, l.in_features, l.out_features, kc, nc, kp,
                          round_up(l.out_features, nc), chunk, w_off, b_off, row_pad(spec), skip=skip)
        kp = p.np_
        plans.append(p)
        chunk += p.n_chunks
        w_off += p.n_chunks * p.chunk_elems
        b_off += p.cols
    return plans


def _streamed_nc(n: int) -> int:
    n16 = round_up(n, 16)
    if n16 <= NC_STREAMED_MAX:
        return n16
    # Wider layers: the chunk width (256, 192 or 128) that pads least.
    return min((256, 192, 128), key=lambda c: (round_up(n, c) - n, -c))


def _streamed_gated_nc(n: int) -> int:
    """Output columns per chunk of a gated layer: its GEMM chunk (gate and up) is twice that, so at most
    NC_STREAMED_MAX / 2."""
    n16 = round_up(n, 16)
    if n16 <= NC_STREAMED_MAX // 2:
        return n16
    return min((128, 96, 64), key=lambda c: (round_up(n, c) - n, -c))


def _bias_floats(spec: MLPSpec, layers: list[LayerPlan]) -> int:
    """The fp32 array each block keeps in shared memory: the layers' biases and a block's norm parameters."""
    return sum(l.cols for l in layers) + norm_floats(spec)


# A skip connection (spec.skip = j: layer j reads [x padded to skip_width, layer j-1's output]): layer j's
# first skip_width / KC k-chunks multiply x's columns of the staged input tile, which no layer overwrites
# (the register design's A; the streamed design's own buffer X, which only layer 0 reads besides), the others
# the layer before's output (its fragments; the streamed buffer it wrote). Its KC divides skip_width.
# The resident design with activations in shared memory (tf32, wide layers) overwrites the tile: refused.
SKIP_MMA_SYNC = ("a skip connection (the chain's input into a later layer) needs the input tile kept beside the "
                 "activations: the resident design with activations in shared memory overwrites it")
RESIDENT_WARPS = (16, 12, 8, 4)  # warps per block tried by the shared-memory design, best occupancy first
REGISTER_FRAGMENTS_MAX = 96  # accumulator + operand registers per lane the register design may hold


def _fragment_registers(layers: list[LayerPlan], mt: int) -> int:
    """Registers per lane a warp of `mt` m16-tiles holds at once in the register design: a layer's
    fp32 accumulators (np/2 per m-tile) plus its input as packed 16-bit A fragments (kp/4)."""
    return max(mt * (l.cols // 2 + ((l.kp - l.skip) // 4 if l.index else 0)) for l in layers)


def resident_plan(spec: MLPSpec, smem_limit: int = SMEM_LIMIT, mt: int | None = None,
                  warp_choices: tuple[int, ...] | None = None, prefetch: bool = True,
                  register_activations: bool | None = None) -> FusedPlan | None:
    """All weights in shared memory. With 16-bit operands and layers up to 128 wide, the register
    design: a layer's accumulator fragments, after bias and activation, are packed in registers into
    exactly the A fragments of the next layer's mma.sync (m16n8k16's C and A layouts agree), so hidden
    activations never go through shared memory; only the input tile is staged there. Otherwise each
    warp keeps its activation tile in shared memory and overwrites it layer by layer."""
    layers = _layer_plans(spec, lambda n: round_up(n, 16))
    widest = max(l.cols for l in layers)   # accumulator columns (a gated layer's GEMM: 2x its outputs)
    if widest > RESIDENT_NP_MAX:
        return None
    if register_activations is None:
        register_activations = (elem_bytes(spec) == 2 and _fragment_registers(layers, 1) <= REGISTER_FRAGMENTS_MAX)
    if register_activations and elem_bytes(spec) != 2:
        raise SpecError("register activations need 16-bit operands (tf32's A and C fragments differ)")
    if spec.skip and not register_activations:
        return None   # SKIP_MMA_SYNC
    if warp_choices is None:
        # Registers, not shared memory, bound the register design's occupancy: 12 warps leave 168
        # registers a lane, which the fragments and the input prefetch need (16 warps cap them at 128
        # and spill; measured on an H100: nerf 0.162 vs 0.198 ms, gelu 0.682 vs 0.787 ms).
        warp_choices = (12,) if register_activations else RESIDENT_WARPS
    if mt is not None:
        mts = (mt,)
    elif register_activations:
        # two m16 tiles a warp where the fragments fit, else (or where their staging does not fit) one
        mts = (2, 1) if _fragment_registers(layers, 2) <= REGISTER_FRAGMENTS_MAX else (1,)
    else:
        mts = (2, 1) if widest <= 64 else (1,)
    eb = elem_bytes(spec)
    if register_activations:
        act_ld = layers[0].kp + row_pad(spec)
    else:
        act_ld = max([l.kp for l in layers] + [l.np_ for l in layers[:-1]]) + row_pad(spec)
    fixed = _bias_floats(spec, layers) * 4 + sum(l.n_chunks * l.chunk_elems for l in layers) * eb
    best = None
    for tiles in mts:   # the first m-tile count any warp count fits
        for warps in warp_choices:
            smem = fixed + warps * 16 * tiles * act_ld * eb
            if smem > smem_limit:
                continue
            per_sm = min(228 * 1024 // (smem + 1024), 64 // warps)
            score = min(per_sm * warps, 32)
            if best is None or score > best[0]:
                best = (score, warps, smem, tiles)
        if best is not None:
            break
    if best is None:
        return None
    _, warps, smem, mt = best
    return FusedPlan(spec, tuple(layers), True, warps=warps, mt=mt, act_ld=act_ld, smem_bytes=smem,
                     prefetch_vectors=_prefetch_vectors(spec, 16 * mt) if prefetch else 0,
                     register_activations=register_activations, smem_limit=smem_limit)


PREFETCH_VECTORS_MAX = 8  # 16-byte registers per lane for the next tile's input (32 registers)


def _prefetch_vectors(spec: MLPSpec, rows: int) -> int:
    """16-byte vectors per lane that hold a warp's next input tile (rows x K0 in the io type), or 0
    when the tile does not split evenly into whole vectors over 32 lanes or needs too many registers.
    The warp loads its next tile into these registers before computing the current one, so the
    global-memory latency of the input overlaps the tensor-core work. None with a block's norm in front:
    its rows are read by groups of lanes that normalise them (norm_rows), not in this vector layout."""
    if spec.norm is not None:
        return 0
    io_bytes = 4 if spec.io_dtype == "f32" else 2
    k0 = spec.layers[0].in_features
    tile = rows * k0 * io_bytes
    if (k0 * io_bytes) % 16 or tile % (16 * 32):
        return 0
    vectors = tile // (16 * 32)
    return vectors if vectors <= PREFETCH_VECTORS_MAX else 0


def _tiling(bm: int, warps: int, nc: int, prefer_rows: bool, max_acc: int = 128) -> WarpTiling:
    """Split a bm x nc chunk output over at most `warps` warps, each holding <= max_acc accumulators."""
    best = None
    for wn in (1, 2, 4, 8, 16):
        for wm in (1, 2, 4, 8, 16):
            if wm * wn > warps or nc % (8 * wn) or bm % (16 * wm):
                continue
            mt, nt8 = bm // (16 * wm), nc // (8 * wn)
            if nt8 % 2 or mt * nt8 * 4 > max_acc:
                continue
            # Most warps busy first; then squarer warp tiles (fewer shared-memory bytes per mma).
            key = (wm * wn, min(mt * 2, nt8) if prefer_rows else -wm, mt * nt8)
            if best is None or key > best[0]:
                best = (key, WarpTiling(wm, wn, mt, nt8))
    if best is None:
        raise SpecError(f"no warp tiling for a {bm} x {nc} chunk")
    return best[1]


PAIR_ACC_MAX = 160  # fp32 accumulators per lane of a fused pair: layer i+1's whole chunk plus one hidden block


def _hidden_blocks(spec: MLPSpec) -> dict[int, int]:
    """{i: HC} for the FFN-shaped pairs (i, i+1) the streamed design fuses: layer i wider than one chunk,
    layer i+1 within one (its accumulators then stay in registers across layer i's column blocks). HC is
    64 when layer i+1 is over 128 wide, else 128, so both accumulators fit PAIR_ACC_MAX. A pair's second
    layer is narrow, so it never heads a pair itself: pairs cannot overlap."""
    widths = [round_up(l.out_features, 16) for l in spec.layers]
    blocks = {}
    for i in range(len(widths) - 1):
        if spec.layers[i].gated or spec.layers[i + 1].gated:  # gated layers are never paired
            continue
        if i in spec.skip or i + 1 in spec.skip:   # a skip layer reads X beside its src: not H
            continue
        if widths[i] > NC_STREAMED_MAX and widths[i + 1] <= NC_STREAMED_MAX and i - 1 not in blocks:
            blocks[i] = 64 if widths[i + 1] > 128 else 128
    return blocks


def _variant_tilings(layers: list[LayerPlan], pairs: tuple[int, ...], bm: int, warps: int,
                     prefer_rows: bool) -> tuple[WarpTiling, ...]:
    """Warp tilings per layer. In a pair, layer i+1's accumulators are live through layer i's, so layer i
    gets what is left of PAIR_ACC_MAX."""
    tilings = [_tiling(bm, warps, l.nc, prefer_rows) for l in layers]
    for i in pairs:
        t = tilings[i + 1]
        tilings[i] = _tiling(bm, warps, layers[i].nc, prefer_rows, max_acc=PAIR_ACC_MAX - t.mt * t.nt8 * 4)
    return tuple(tilings)


def streamed_plan(spec: MLPSpec, smem_limit: int = SMEM_LIMIT, kc_max: int = KC_MAX,
                  tall_rows: tuple[int, ...] = (128, 64), stages_choices: tuple[int, ...] = (3, 2),
                  pair_hidden: bool | None = None) -> FusedPlan:
    """`pair_hidden`: fuse the FFN-shaped pairs (see _hidden_blocks) wherever they exist (True), never
    (False: every layer's output in the A/B buffers), or (None, the default) where that makes the
    tallest tile taller. At equal tiles the pair only costs: its hidden blocks (64/128 columns) take
    more chunk steps, one barrier each, than 256-column chunks. Measured on an H100 at 135k rows (fp16):
    256 -> 4096 -> 256 2.62 ms paired (128-row tiles) vs 5.56 ms (16), 512 -> 2048 -> 128 1.52 vs 3.84 ms,
    64 -> 1000 -> 48 0.207 vs 0.286 ms; but 128 -> 2048 -> 2048 -> 64, 16-row tiles either way, 16.6 vs
    11.7 ms."""
    blocks = _hidden_blocks(spec) if pair_hidden is not False else {}
    if not blocks or pair_hidden:
        return _streamed_build(spec, smem_limit, blocks, kc_max, tall_rows, stages_choices)
    try:
        paired = _streamed_build(spec, smem_limit, blocks, kc_max, tall_rows, stages_choices)
    except SpecError:
        paired = None
    try:
        plain = _streamed_build(spec, smem_limit, {}, kc_max, tall_rows, stages_choices)
    except SpecError:
        if paired is None:
            raise
        return paired
    if paired is not None and paired.tallest_rows > plain.tallest_rows:
        return paired
    return plain


def _streamed_build(spec: MLPSpec, smem_limit: int, blocks: dict[int, int], kc_max: int,
                    tall_rows: tuple[int, ...], stages_choices: tuple[int, ...]) -> FusedPlan:
    """The streamed plan with the pairs of `blocks` ({i: HC}, _hidden_blocks) fused."""
    layers = _layer_plans(spec, _streamed_nc, kc_max, blocks, _streamed_gated_nc)
    pairs = tuple(sorted(blocks))
    # A holds the inputs of even layers, B of odd ones; a pair's second layer reads H instead. With a skip
    # the input tile is X, which no layer writes: layer 0 reads it, the skip layer its x columns again.
    seconds = {i + 1 for i in pairs}
    wx = layers[0].kp if spec.skip else 0
    wa = max((l.kp - l.skip for l in layers[0::2] if l.index not in seconds and not (wx and l.index == 0)), default=0)
    wb = max((l.kp - l.skip for l in layers[1::2] if l.index not in seconds), default=0)
    hc = max((layers[i].nc for i in pairs), default=0)
    bias = _bias_floats(spec, layers) * 4
    eb, pad = elem_bytes(spec), row_pad(spec)
    slot = max(l.chunk_elems for l in layers) * eb
    row_elems = sum(w + pad for w in (wa, wb, hc, wx) if w)  # one tile row in A, B, H and X
    variants = []
    for name, bms, warps, prefer_rows in (("tall_tiles", tall_rows, 8, True), ("short_tiles", (32, 16), 8, False)):
        for bm in bms:
            for stages in stages_choices:
                smem = bias + stages * slot + bm * row_elems * eb
                if smem <= smem_limit:
                    variants.append(Variant(name, bm, warps, stages,
                                            _variant_tilings(layers, pairs, bm, warps, prefer_rows), smem))
                    break
            else:
                continue
            break
    if not variants:
        need = bias + 2 * slot + 16 * row_elems * eb
        raise SpecError(f"{spec.describe()}: even a 16-row tile needs {need // 1024} KB of shared memory "
                        f"(over {smem_limit // 1024} KB); use --precision fp32 or split the chain")
    if len(variants) == 2 and variants[0].bm == variants[1].bm:
        variants = variants[:1]
    return FusedPlan(spec, tuple(layers), False, width_a=wa, width_b=wb, width_x=wx, variants=tuple(variants),
                     pairs=pairs, smem_limit=smem_limit)


@dataclass(frozen=True)
class Fp32Plan:
    """precision=fp32: one thread a row on CUDA cores, exact (templates/cuda_fp32.cu.j2). Nothing to tile:
    the workspace holds each layer's fp32 weights then its bias, then a block's norm parameters."""
    spec: MLPSpec

    design = "fp32"
    uses_scratch = False

    @property
    def workspace_bytes(self) -> int:
        return (sum(l.in_features * l.weight_columns + l.weight_columns for l in self.spec.layers)
                + norm_floats(self.spec)) * 4

    def describe(self) -> str:
        return "CUDA cores, fp32"


