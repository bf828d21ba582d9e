"""The Hopper fused kernel on warpgroup MMA (`WgmmaPlan`, design "wgmma"; templates/cuda_wgmma.cu.j2).

Issue 15; the prototype and its H100 measurements: benchmarks/sm90/ (fused_wgmma.cu, NOTES.md).

  * A CTA is NWG warpgroups (128 threads each), persistent; a warpgroup owns a 64-row tile at a time.
  * Every layer is `wgmma.mma_async.m64nNCk16.f32.f16.f16` (bf16 chains: `.f32.bf16.bf16`) with A FROM
    REGISTERS: a layer's fp32 accumulators, after bias + activation, are rounded to fp16 (bf16) and are,
    register for register, the next layer's A fragments (the m64nN accumulator and m64k16 A layouts agree
    per warp, as mma.sync's do), so hidden activations never leave the registers.
  * The weights are packed once per session into an "image" in the workspace (fp16 or bf16, zero-padded,
    chunk by chunk in the canonical K-major swizzled layout that wgmma reads through a matrix descriptor)
    and copied verbatim with cp.async.bulk (completion on an mbarrier):
      - resident (stages == 0): the whole image, once per CTA;
      - streamed (stages > 0, where the image does not fit): chunk by chunk through a ring of `stages`
        slots, the prototype's form (benchmarks/sm90/NOTES.md). Every warpgroup of a CTA runs every pass
        over the chunks (a pass = one 64-row tile per warpgroup; rows past the batch are masked), so they
        share the ring; the last warp to finish with a slot refills it with the chunk `stages` ahead
        (3 slots by default: deeper rings measured slower).
        The image is read from L2 (all CTAs read the same bytes), once per pass per CTA. `cluster` > 1
        (an override, for measurements) makes the CTAs of a thread-block cluster run their passes in step,
        each copying 1/cluster of every chunk into the slot of every CTA of the cluster (cp.async.bulk
        multicast): half or a quarter of the L2 reads, but on an H100 1.6x and 2.6x slower than a CTA
        copying its own chunks (silu 256x4, 2^18 rows: 0.470 / 0.751 vs 0.289 ms, RESULTS.md twenty-second
        run; its warps wait 30 % of their time for ring slots), the refills waiting for the slowest warp of
        the cluster.
  * A layer's N columns run as chunks of NC <= CHUNK_MAX columns, each its own commit group, with two
    accumulator buffers: the epilogue of chunk c runs while the tensor core computes chunk c+1.
  * Bias: fp32 in shared memory, added in the epilogue (the form the H100 run verified).
  * The input tile is read straight from global memory into the A-fragment pattern (the next tile's
    first `prefetch` k-steps in registers while the current one computes), or (`staged_input`, where
    those cannot hold it all: STAGED_INPUT) copied into a shared-memory buffer per warpgroup a whole tile
    ahead, one cp.async.bulk a row (BULK_INPUT; a streamed plan issues them in parts over its pass);
    outputs are streaming stores, 4 adjacent outputs a store where the last layer is in 16s (QUAD_STORES).
    Every choice here was measured, kernel alone and sustained: these kernels run into the GPU's power
    limit when kept busy (docs/DESIGN.md, "The power limit"; `kernel_check.py --diag`, `--sustain`).

The generated source holds this kernel (sm_90a only) and dispatches at run time: compute capability 9.0
with the sm_90a kernel compiled in runs it, every other GPU the `fallback` plan's mma.sync kernel (the
resident or streamed design, rendered as a second translation unit under its own symbol).

Everything the template prints is computed here or in wgmma_params.py: padded widths, chunk widths,
swizzle widths, descriptor words, image offsets, warpgroups, prefetch depth, ring slots, shared-memory
bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import MLPSpec, SpecError
from .padding import round_up

ROWS = 64                 # rows of a warpgroup's tile (wgmma's M)
CHUNK_MAX = 64            # widest chunk: two m64n64 fp32 accumulator buffers = 64 registers a thread
WIDTH_MAX = 256           # widest layer: its A fragments (K/4 registers) and the next layer's (N/4)
# The first layer reads the chain's input, not a layer's output held in registers: it may be wider (NeRF's
# second half, 319 = 256 + the 63 input features its skip Concat adds, and its 283-wide view head), as far
# as the register estimate allows; a tile's input loads then go in groups of REST_GROUP k-steps.
FIRST_WIDTH_MAX = 512
# The last layer's outputs go to memory chunk by chunk, not into a next layer's A fragments: it may be wider
# too (NeuS's and VolSDF's SDF networks end in 1 + 256 = 257), as far as the register estimate allows.
LAST_WIDTH_MAX = 512
# A pooled chain's last layer (spec.pool: the max, sum or mean over each group's rows, PointNet's 128 -> 1024
# before its max over the points) writes no output rows: its chunks' values only raise (add to) the group's
# entries in the epilogue (o2f_wgmma_pool.cuh), so it may be wider still, as far as the register estimate allows
# (MobileNetV2's and EfficientNet-B0's heads: 320 -> 1280 before their global average pool).
POOLED_LAST_WIDTH_MAX = 2048
# A pooled chain's warpgroups combine a tile's maxima in two shared-memory copies of the group's entries each
# (o2f_wgmma_pool.cuh pool_tile; static shared memory beside the dynamic the plan lays out), and take the most
# warpgroups whose fragments fit their register cap without the per-chunk term (as an override is held):
# PointNet's 3 -> ... -> 128 -> 1024 pool through ORT on an H200 at 256 clouds, 2 / 3 / 4 warpgroups
# 0.82 / 0.57 / 0.45 ms (the 1024-wide layer's 16 chunks: more rows share each chunk the ring brings), and
# whose unstaged input load fits too (_input_peak: a CNN head's 320 inputs, 16 k-steps in fp32 beside 80
# registers of A fragments, spilled at 3 warpgroups' 168 registers).
POOL_COPIES = 2
POOL_NWG_MAX = 4


def _pool_smem(spec: MLPSpec, nwg: int = POOL_NWG_MAX) -> int:
    """Bytes of a pooled chain's static shared copies with `nwg` warpgroups (planning: the most), 0 without
    a pool."""
    return 4 * POOL_COPIES * nwg * spec.layers[-1].out_features if spec.pool is not None else 0
REST_GROUP = 16           # k-steps of a tile's input loaded into registers before they are converted
LAYER_ALIGN = 1024        # a layer's first chunk: the 128-byte swizzle pattern repeats every 1024 bytes
SLACK = 1024              # dynamic shared memory is aligned up to 1024 in the kernel
BULK_PIECE = 32768        # bytes per cp.async.bulk of the weight image
# Registers a thread may hold with NWG warpgroups on one SM (65536 / (128 NWG), at most 255), best first:
# 4 warpgroups (nerf: 86 registers), 3, 2.
REGISTER_CAPS = ((4, 128), (3, 168), (2, 255))
# Plans whose fragments (_registers) are at most this many take 4 warpgroups although the estimate with
# REGISTER_OVERHEAD is over their cap: ptxas fits the 128-wide chains in 122-127 registers without spills
# (gelu 64->128x4->64 fp32 and fp16 I/O, bf16, sdf 3->128x4->1; resident, not gated: the ones measured),
# and on an H100 gelu ran 5-7 % faster with 4 than with 3 (0.315 against 0.332 ms; fp16 I/O 0.345
# against 0.369), bf16 gelu and sdf alike (RESULTS.md, twentieth run).
FOUR_WARPGROUP_FRAGMENTS = 128
# More warpgroups (up to 8: 1024 threads) only on request (WgmmaOptions.nwg), until measured on a GPU.
OVERRIDE_CAPS = {**dict(REGISTER_CAPS), 5: 96, 6: 80, 8: 64}
REGISTER_OVERHEAD = 24    # addressing, loop state, bias pair, activation temporaries (fit to the H100 build)
PREFETCH_MAX = 4          # k-steps of the next tile's input held in registers (8 registers each)
SMEM_LIMIT = 227 * 1024   # dynamic shared memory a CTA may use on sm_90
STAGES_MAX = 6            # ring slots of a streamed plan at most (the prototype's silu: 6 x 32 KB)
STAGES_MIN = 3            # fewer cannot overlap a chunk's copy with the two chunks in flight
STAGES_DEFAULT = 3        # measured best (H100, silu 256x4 at 2^18 rows: 3 slots 0.361 ms, 4 0.430, 6 0.426;
                          # the shallow ring keeps the two warpgroups within a chunk or two of each other)
RING_REGISTERS = 8        # the ring's positions, phases and addresses (streamed plans)
CLUSTER = 1               # CTAs of a streamed plan's cluster: each CTA copies its own chunks (measured best)
CLUSTER_MAX = 4
# STAGED_INPUT: a warpgroup's next 64-row tile of fp32 rows copied (BULK_INPUT below; or by cp.async, 16 bytes
# a copy, zero-filled past the batch) into a buffer of its own in shared memory while it computes the current one, then read
# into A fragments from there: the whole tile's global-memory latency hidden behind a tile of work, where
# register prefetch holds at most PREFETCH_MAX k-steps (silu's 256-wide rows: 2 of 16; its warps' top stall
# was the input's loads). The default where the registers cannot hold the next tile's whole input and the
# tiles fit (H100, kernel alone: silu 256x4 at 2^18 rows 0.372 -> 0.332 ms, gelu 128x4 0.343 -> 0.343,
# RESULTS.md twentieth run), and (STAGED_WHOLE) for chains without a gated layer even where the registers
# could hold it (ffn64, 64 -> GELU 256 -> 64, 2 warpgroups: 0.279 -> 0.250 ms, its registers no longer at the
# cap of 255; a gated one, glu64 64 -> SwiGLU 256 -> 64, went 0.340 -> 0.363, so gated chains keep their
# registers: RESULTS.md, thirty-third run). fp32 rows of K0 % 4 == 0 only (16-byte copies of whole rows'
# chunks); a call whose x is not 16-byte aligned runs the mma.sync fallback.
STAGED_WHOLE = True
IN_ROW_ALIGN = 4          # K0 % IN_ROW_ALIGN == 0: a row's 16-byte chunks start 16-byte aligned
# BULK_INPUT: the staged tile's rows copied by cp.async.bulk, one copy a row issued by one thread each and
# completing on the warpgroup's mbarrier, instead of 16-byte cp.async copies by every thread. The rows sit
# unswizzled BULK_ROW_PAD bytes apart beyond their length, which puts the 8 rows of an A-fragment read
# in different banks (a row's length in bytes is a multiple of 64).
BULK_ROW_PAD = 32
BULK_INPUT = True         # H100, kernel alone: silu 256x4 at 2^18 rows 0.353 -> 0.330 ms, gelu 0.328 both
                          # (RESULTS.md, twenty-second run)
# QUAD_STORES: the last layer's packed columns permuted within each 16 (o2f_wgmma_pack.cuh) so that the
# pairs a thread holds in two n8 blocks are 4 adjacent outputs: one 16-byte store where 2 (8 bytes) were,
# half the store instructions. Where the last layer's padded width and chunks are multiples of 16.
QUAD_STORES = True
# PRESCALE: a hidden layer whose packed activation begins by halving its input (expr.PackedForm.prescale:
# sigmoid, SiLU, GELU) has its weights and bias packed halved, and the activation's _h form skips that
# HMUL2: the same values, one instruction a pair fewer (the mma.sync kernels always do it; here an
# override can turn it off for A/B timing).
PRESCALE = True
# STORE_ROWS: where the last layer stores quads and its width is a multiple of 4, every output row's quads
# are aligned once y is 16-byte aligned (a call whose y is not runs the mma.sync fallback), so the kernel
# stores them without deciding per store how y is aligned: the last layer computes each thread's two row
# pointers and row predicates once a tile, and a store is that pointer plus a constant, where each one
# recomputed its 64-bit address and branched on the alignment (silu: ~12 instructions a 16-byte store).
STORE_ROWS = True
# BIAS16: a hidden layer with a packed activation adds its bias in fp16 (one HADD2 a pair, after the
# accumulators are rounded to fp16x2) where the fp32 adds took two FADDs a pair; the hidden layers' bias is
# then also held as fp16 in shared memory. It rounds the accumulator before the bias, as stock ORT's fp16
# MatMul then Add does (errors ~10 % larger: silu 8.0e-4 -> 8.9e-4; the numerics model, precision.py,
# computes it so), and took 2-5 % off gelu, silu and sdf in 200 launches on an H100 (RESULTS.md,
# twenty-fifth run).
BIAS16 = True
# Transformer blocks (a norm in front, a residual behind; fp32 I/O): the norm normalises each input row in
# fp32 from the A fragments' values, held in registers for the whole row (all of K0's k-steps loaded before
# any is converted: 8 registers a k-step, so rows of up to BLOCK_K0_MAX features), the statistics summed
# across the row's quad of lanes; the residual adds x's row in the last layer's stores (o2f_wgmma_norm.cuh).
BLOCK_K0_MAX = 128
# A block's input tiles staged (BULK_INPUT, fp32 rows of K0 % 4 == 0): the norm reads the tile's values from
# shared memory, so the next tile's rows land a whole tile ahead, where register prefetch has no registers
# left beside the held row (preln 64 -> 256 -> 64 spilled with its 4 k-steps prefetched; without either,
# H100: 0.478 ms at 2^20 rows against ffn64's 0.28). With a residual each warpgroup has two tile buffers,
# used in turn: the residual then reads x's row from the tile it computes while the next one lands in the
# other (IN_BUFFERS_RESIDUAL).
BLOCK_STAGED = True
IN_BUFFERS_RESIDUAL = 2
# A residual read from global memory (one staged buffer, or none): the x values of a chunk of the last
# layer's stores are loaded before the wait for its MMAs, since each store orders memory and a load between
# two stores waited its whole latency alone (H200, kernel alone: 200 -> 256 -> 200 with x, 2^19 rows, 1.27
# -> 0.70 ms, where the chain without x takes 0.52; 64 -> 256 -> 64 with x, rows in registers, 0.28). The
# whole chunk (nc / 2 values a thread) under a cap of RESIDUAL_AHEAD_ROOMY registers or more, or where the
# estimate leaves that many below the cap; else each store loads its own (at 4 warpgroups' 128, a 72 -> 120
# -> 72 block's 64-column chunk spilled: 0.29 -> 0.37 ms; 37 -> 64 -> 37's 40 columns fit: 0.045 -> 0.038).
# The two-buffer residual's shared-memory reads loaded the same way measured even or worse (H200: preln
# 0.299 -> 0.298 ms, llama 0.219 -> 0.228): they keep their place beside each store. Pairs of x values in
# one 8-byte load where x allows it measured worse too (res64 in registers 0.271 -> 0.288 ms, res200 even).
RESIDUAL_AHEAD_ROOMY = 168
# Checked against float64 on an H100 (kernel_check: 0 to 1000003 rows; and against stock ORT, test_gpu_block)
# and on by default since; the cost rule (cost.wgmma_wins) then takes the zoo's preln and llama here. H100,
# kernel alone, 2^20 rows: preln 64 -> 256 -> 64 0.692 ms on mma.sync -> 0.295 (1.65x its floor), llama
# 0.503 -> 0.215 (1.20x), with the tile staged (BLOCK_STAGED) and the norm's parameters in shared memory
# (RESULTS.md, thirty-third run).
# WgmmaOptions(blocks=False) keeps blocks on the mma.sync kernels (comparisons).
BLOCKS = True
# SKIP: a skip connection (spec.skip = j: layer j reads [x, layer j-1's output]) takes x's k-steps of layer j's
# A fragments from global memory (L2: the tile's rows were read a few layers before) as the unstaged first
# layer does, ahead of layer j-1's MMAs; the layer before's epilogue packs its outputs into the k-steps after
# them. Layer j is one layer of skip_width + N_{j-1} inputs to the MMAs (its weight laid out so by the pass).
# Its other-GPU kernel (resident or streamed) reads x's columns of the staged input tile (plan.fused
# SKIP_MMA_SYNC).


@dataclass(frozen=True)
class WgmmaLayer:
    index: int
    k: int            # true input features
    n: int            # true output features
    kp: int           # padded K (multiple of 16: wgmma's k)
    np_: int          # padded N: multiple of 16 (hidden: the next layer's K), of 8 for the last layer
    nc: int           # chunk width (divides np_, multiple of 8, <= CHUNK_MAX; _chunk_width)
    atom: int         # swizzle atom row in bytes: 128, 64 or 32 (the largest that divides 2*kp)
    offset: int       # bytes: the layer's first chunk in the image (LAYER_ALIGN-aligned)
    bias_offset: int  # floats: the layer's padded bias in the bias array
    gated: bool = False   # gate and up columns interleaved by 8 (np_ = 2 x the padded hidden width)

    @property
    def hidden(self) -> int:
        """Padded features this layer hands the next one: np_, or half of it for a gated layer."""
        return self.np_ // 2 if self.gated else self.np_

    @property
    def chunks(self) -> int:
        return self.np_ // self.nc

    @property
    def chunk_bytes(self) -> int:
        return self.nc * self.kp * 2

    @property
    def k_steps(self) -> int:
        return self.kp // 16

    def kstep_offset(self, ks: int) -> int:
        """Bytes from a chunk's start to k-step ks's first row: 32 bytes on along k; past an atom row the
        next K atom, NC/8 atoms (of 8 rows) on."""
        kb = 32 * ks
        return kb % self.atom + (kb // self.atom) * (self.nc // 8) * 8 * self.atom

    @property
    def desc_hi(self) -> int:
        """The descriptor's high word: stride byte offset (8 rows of atoms) >> 4, swizzle mode in bits 62-63
        (1: 128 B, 2: 64 B, 3: 32 B). Base offset 0 (atoms aligned)."""
        return (8 * self.atom) >> 4 | {128: 1, 64: 2, 32: 3}[self.atom] << 30


@dataclass(frozen=True)
class WgmmaPlan:
    """The wgmma design's plan: templates/cuda_wgmma.cu.j2, with `fallback` (resident or streamed) for
    GPUs other than compute capability 9.0."""
    spec: MLPSpec
    layers: tuple[WgmmaLayer, ...]
    nwg: int                  # warpgroups per CTA
    prefetch: int             # k-steps of the next tile's input prefetched into registers
    registers: int            # the estimate that chose nwg and prefetch
    image_bytes: int          # the weight image (fp16 or bf16, swizzled)
    bias_floats: int
    fallback: object          # the resident or streamed plan (plan.fused.FusedPlan)
    fallback_bytes: int       # its workspace, then (LAYER_ALIGN-aligned) the image and the bias
    reason: str = ""
    stages: int = 0           # ring slots of streamed weights; 0: the image is resident
    slot_bytes: int = 0       # bytes of a ring slot (the largest chunk, LAYER_ALIGN-aligned)
    cluster: int = 1          # streamed: CTAs of a cluster, each copying 1/cluster of every chunk to all
    staged_input: bool = False   # STAGED_INPUT: the next tile's rows in shared memory, not registers
    bulk_input: bool = False     # BULK_INPUT: staged by one cp.async.bulk a row
    quad_stores: bool = False    # QUAD_STORES: the last layer's outputs stored 4 adjacent at a time
    input_parts: int = 1         # BULK_INPUT: the next tile's rows copied in this many parts over a pass (_input_parts; 1 without)
    prescale: bool = False       # PRESCALE: packed activations take prescaled accumulators
    store_rows: bool = False     # STORE_ROWS: quads stored from per-tile row pointers (y 16-byte aligned, else the fallback)
    bias16: bool = False         # BIAS16: packed hidden activations add an fp16 copy of their bias after rounding
    in_buffers: int = 1          # staged input tiles a warpgroup has (a staged block's residual: IN_BUFFERS_RESIDUAL)
    residual_ahead: bool = False   # a residual from global memory: a chunk's x values loaded ahead of its stores

    design = "wgmma"
    uses_scratch = False      # the kernels only read their packed weights

    def weight_scale(self, i: int) -> float:
        """What layer i's weights and bias are packed times: its packed activation's prescale (PRESCALE), or 1."""
        return self.spec.prescale(i) if self.prescale else 1.0

    @property
    def image_offset(self) -> int:
        return round_up(self.fallback_bytes, LAYER_ALIGN)

    @property
    def bias_offset(self) -> int:
        return self.image_offset + self.image_bytes

    @property
    def workspace_bytes(self) -> int:
        return self.bias_offset + self.bias_floats * 4

    @property
    def threads(self) -> int:
        return self.nwg * 128

    @property
    def staged_cols(self) -> int:
        """Columns of a row the staged input holds: those past the `prefetch` k-steps held in registers."""
        return self.layers[0].kp - 16 * self.prefetch if self.staged_input else 0

    @property
    def input_row_bytes(self) -> int:
        """Bytes of a staged input row in shared memory (BULK_INPUT: BULK_ROW_PAD more than its values)."""
        return _input_row_bytes(self.staged_cols, self.bulk_input)

    @property
    def input_bytes(self) -> int:
        """Shared memory of the staged input tiles: 64 rows of staged_cols fp32 values per warpgroup."""
        return self.nwg * self.in_buffers * ROWS * self.input_row_bytes

    @property
    def bias_halves(self) -> int:
        """BIAS16: the hidden layers' bias held as fp16 in shared memory too (0 without)."""
        return _bias_halves(list(self.layers), self.bias16)

    @property
    def smem(self) -> SmemLayout:
        """Where the kernel's shared memory holds what."""
        return SmemLayout.of(self.image_bytes, self.slot_bytes, self.stages, self.bias_floats, self.input_bytes,
                             self.nwg * self.in_buffers if self.bulk_input else 0, self.cluster, self.bias_halves)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (image or ring, bias, mbarriers, slack)."""
        return self.smem.bytes

    @property
    def pool_smem_bytes(self) -> int:
        """Static shared memory of a pooled chain's copies of a group's entries (POOL_COPIES a warpgroup)."""
        return _pool_smem(self.spec, self.nwg)

    @property
    def streamed(self) -> bool:
        return self.stages > 0

    @property
    def stream_chunks(self) -> tuple[tuple[int, int], ...]:
        """(image offset, bytes) of every chunk of a pass, in the order the kernel consumes them."""
        return tuple((l.offset + c * l.chunk_bytes, l.chunk_bytes) for l in self.layers for c in range(l.chunks))

    def describe(self) -> str:
        chunks = ", ".join(f"{l.chunks}x{l.nc}" for l in self.layers)
        why = f"; {self.reason}" if self.reason else ""
        shared = f", copied once per cluster of {self.cluster} CTAs" if self.cluster > 1 else ""
        weights = (f"weights streamed from L2 through a ring of {self.stages} x {self.slot_bytes // 1024} KB slots{shared} "
                   f"({self.image_bytes // 1024} KB {self.spec.precision} image" if self.streamed else
                   f"weights resident ({self.image_bytes // 1024} KB {self.spec.precision} image")
        inp = f"input prefetch {self.prefetch} k-steps"
        if self.staged_input:
            inp = ("input tiles staged in shared memory a tile ahead" +
                   (f" (the first {self.prefetch} k-step(s) in registers)" if self.prefetch else "") +
                   (f", {self.in_buffers} a warpgroup (the residual reads x's rows there)" if self.in_buffers > 1 else ""))
        pool = f" + {self.pool_smem_bytes // 1024} KB for the pool's copies" if self.pool_smem_bytes else ""
        return (f"wgmma (sm_90a): {self.nwg} warpgroups x 64 rows, activations in registers, {weights}, "
                f"{self.smem_bytes // 1024} KB smem{pool}), chunks {chunks}, "
                f"{inp}; other GPUs{' and groups of fewer than 16 rows' if self.spec.pool else ''}: "
                f"{self.fallback.design} ({self.fallback.describe()}){why}")


CHUNK_MIN = 32            # narrower chunks (many commit groups of little work each) are padded away


def _chunk_width(np_: int, chunk_max: int = CHUNK_MAX) -> tuple[int, int]:
    """(padded width, chunk width): the widest multiple of 8 up to chunk_max that divides the padded width;
    where that is under CHUNK_MIN (208: 13 chunks of 16), the width padded to chunk_max instead."""
    nc = next(c for c in range(min(np_, chunk_max), 7, -8) if np_ % c == 0)
    if nc < min(CHUNK_MIN, chunk_max) and np_ > chunk_max:
        return round_up(np_, chunk_max), chunk_max
    return np_, nc


def _gated_chunk_width(cols: int, chunk_max: int = CHUNK_MAX) -> int:
    """A gated layer's chunk: the widest multiple of 16 up to chunk_max (at least 16) that divides its
    interleaved columns (a multiple of 32): whole gate/up pairs of n8 blocks in every chunk."""
    return next(c for c in range(max(16, chunk_max // 16 * 16), 15, -16) if cols % c == 0)


def _layers(spec: MLPSpec, chunk_max: int = CHUNK_MAX) -> list[WgmmaLayer]:
    out, off, boff = [], 0, 0
    last = len(spec.layers) - 1
    kp = round_up(spec.layers[0].in_features, 16)
    for i, l in enumerate(spec.layers):
        kp += spec.skip_part(i)   # a skip layer: x's k-steps (SKIP: as the first layer's), then the layer before's
        if l.gated:   # gate block b, up block b interleaved: 8 gate columns, their 8 up columns, ...
            np_ = 2 * round_up(l.out_features, 16)
            nc = _gated_chunk_width(np_, chunk_max)
        else:
            np_, nc = _chunk_width(round_up(l.out_features, 8 if i == last else 16), chunk_max)
        atom = 128 if kp % 64 == 0 else 64 if kp % 32 == 0 else 32
        layer = WgmmaLayer(i, l.in_features, l.out_features, kp, np_, nc, atom, off, boff, l.gated)
        out.append(layer)
        off = round_up(off + layer.chunks * layer.chunk_bytes, LAYER_ALIGN)
        boff += np_
        kp = layer.hidden
    return out


def _skip_slack(spec: MLPSpec) -> int:
    """SKIP_SLACK: how far the estimate may pass the cap for a chain with skips: the x k-steps of its widest
    skip layer (4 registers each), which the estimate counts beside the layer before's fragments in full
    and ptxas does not (NeRF joined with its view head, x 90 wide into layers 5 and 8: ~256 estimated, 234
    used, no spills; the trunk alone ~248 estimated, 218 used). Only the refusal and the warpgroup count's
    cap take it: plans under the cap keep their estimate (and their prefetch)."""
    return max((spec.skip_part(j) // 4 for j in spec.skip), default=0)


CHUNK_REGISTERS = 4       # per chunk past the two buffers: ptxas holds more across a long unrolled chunk
                          # schedule (30 -> 80 -> 176 -> 7, 11 chunks of 16: ~40 registers over the count)


def _registers(layers: list[WgmmaLayer], per_chunk: int = CHUNK_REGISTERS) -> int:
    """Registers a thread holds at the busiest layer: its A fragments (kp/4), the next layer's (np/4; none
    after the last), one or two accumulator buffers of nc/2, and `per_chunk` per further chunk."""
    return max(l.kp // 4 + (layers[l.index + 1].kp // 4 if l.index < len(layers) - 1 else 0)
               + l.nc // 2 * min(2, l.chunks) + per_chunk * max(0, l.chunks - 2) for l in layers)


def wgmma_reason_refused(spec: MLPSpec, smem_limit: int = SMEM_LIMIT, blocks: bool | None = None) -> str | None:
    """Why the wgmma design cannot run this spec, or None. `blocks`: take transformer blocks (BLOCKS)."""
    smem_limit -= _pool_smem(spec)
    if spec.layers[-1].gated:
        return "a gated last layer (no exporter writes one) runs in the mma.sync kernels only"
    if spec.has_block:
        if not (BLOCKS if blocks is None else blocks):
            return ("a norm in front or a residual behind (transformer block) runs in the mma.sync kernels only "
                    "(the wgmma kernel's block support was switched off)")
        if spec.io_dtype != "f32":
            return "a norm in front or a residual behind (transformer block) with fp16 I/O runs in the mma.sync kernels only"
        if spec.norm is not None and spec.layers[0].in_features > BLOCK_K0_MAX:
            return (f"a norm in front of {spec.layers[0].in_features} features: the wgmma kernel normalises rows of up to "
                    f"{BLOCK_K0_MAX} in registers")
    if spec.precision not in ("fp16", "bf16"):
        return (f"{spec.precision} operands: the wgmma kernel takes fp16 and bf16 (tf32 would halve the k of a "
                "wgmma and needs another fragment layout)")
    last = len(spec.layers) - 1
    last_max = POOLED_LAST_WIDTH_MAX if spec.pool is not None else LAST_WIDTH_MAX
    for i, l in enumerate(spec.layers):
        if (l.out_features > (last_max if i == last and not l.gated else WIDTH_MAX)
                or spec.layer_input(i) > (FIRST_WIDTH_MAX if i == 0 else WIDTH_MAX) or l.in_features > FIRST_WIDTH_MAX):
            return (f"layer {i} is {l.in_features} -> {l.out_features}: the wgmma kernel takes layers up to "
                    f"{WIDTH_MAX} wide (a first layer's input, or a skip layer's with x's, up to {FIRST_WIDTH_MAX}, "
                    f"the last layer's output up to {last_max}{' with its pool' if spec.pool is not None else ''})")
    layers = _layers(spec)
    stages = _stages(layers, smem_limit, norm_floats=2 * layers[0].kp if spec.norm is not None else 0)
    if stages is None:
        return (f"its padded {spec.precision} weights ({_image_bytes(layers) // 1024} KB) do not stay resident in "
                f"{smem_limit // 1024} KB of shared memory, and a ring of {STAGES_MIN} of its "
                f"{_slot_bytes(layers) // 1024} KB chunks does not fit either")
    regs = _registers(layers) + REGISTER_OVERHEAD + (RING_REGISTERS if stages else 0)
    if regs - _skip_slack(spec) > REGISTER_CAPS[-1][1]:
        return f"its fragments need ~{regs} registers a thread (over {REGISTER_CAPS[-1][1]})"
    return None


def _input_parts(layers: list[WgmmaLayer], stages: int) -> int:
    """The parts BULK_INPUT's row copies for the next tile are issued in, one after each of a pass's first
    chunks' MMAs are issued, rather than all at the tile's start, where they meet the weight ring's copies
    and (the warpgroups of a streamed plan run in step) each other. Streamed plans spread them over every
    chunk before the last layer's (H100, kernel alone, silu 256x4 at 2^18 rows: all at the start 0.341 ms,
    8 parts 0.314, 12 0.313, 16 0.319); resident plans, whose warpgroups drift apart, and one-layer chains
    copy them at once (gelu: 0.337, in 4 or 9 parts 0.350; RESULTS.md, twenty-second run)."""
    return max(1, sum(l.chunks for l in layers[:-1])) if stages else 1


def _quads_fit(last: WgmmaLayer) -> bool:
    """QUAD_STORES takes the last layer's columns 16 at a time: its padded width and chunks in 16s."""
    return last.np_ % 16 == 0 and last.nc % 16 == 0 and not last.gated


def _input_row_bytes(cols: int, bulk: bool = False) -> int:
    """A staged input row: `cols` fp32 values (BULK_INPUT: BULK_ROW_PAD bytes more, the next row's gap)."""
    return cols * 4 + (BULK_ROW_PAD if bulk else 0)


def _image_bytes(layers: list[WgmmaLayer]) -> int:
    last = layers[-1]
    return round_up(last.offset + last.chunks * last.chunk_bytes, LAYER_ALIGN)


def _slot_bytes(layers: list[WgmmaLayer]) -> int:
    return round_up(max(l.chunk_bytes for l in layers), LAYER_ALIGN)


@dataclass(frozen=True)
class SmemLayout:
    """The kernel's dynamic shared memory: [image, or `stages` ring slots][bias (fp32)][BIAS16: the bias
    as fp16][mbarriers: one, or
    one per slot; BULK_INPUT: one per warpgroup's input tile; clusters: one per slot for the other CTAs'
    releases][release counters: one per slot][staged input tiles, 128-byte aligned][alignment slack].
    The plan sizes it, the template places its parts at these offsets (wgmma_params)."""
    weights: int      # bytes of the image or the ring
    bias_floats: int
    stages: int
    input_bytes: int = 0   # staged input tiles (STAGED_INPUT), all warpgroups'
    input_bars: int = 0    # their mbarriers (BULK_INPUT: one a warpgroup)
    peer_bars: int = 0     # clusters: a slot's mbarrier that the cluster's other CTAs arrive on once done with it
    bias_halves: int = 0   # BIAS16: the hidden layers' bias as fp16 (the bias array's first values), or 0

    @classmethod
    def of(cls, image_bytes: int, slot_bytes: int, stages: int, bias_floats: int, input_bytes: int = 0,
           input_bars: int = 0, cluster: int = 1, bias_halves: int = 0) -> SmemLayout:
        """The layout with the image resident (stages 0) or `stages` ring slots of `slot_bytes`."""
        return cls(stages * slot_bytes if stages else image_bytes, bias_floats, stages, input_bytes, input_bars,
                   stages if cluster > 1 else 0, bias_halves)

    @property
    def bias_offset(self) -> int:
        return self.weights

    @property
    def bias16_offset(self) -> int:
        return self.bias_offset + self.bias_floats * 4

    @property
    def bar_offset(self) -> int:
        return self.bias16_offset + round_up(self.bias_halves * 2, 8)

    @property
    def input_bar_offset(self) -> int:
        return self.bar_offset + 8 * max(1, self.stages)

    @property
    def peer_bar_offset(self) -> int:
        return self.input_bar_offset + 8 * self.input_bars

    @property
    def cnt_offset(self) -> int:
        return self.peer_bar_offset + 8 * self.peer_bars

    @property
    def input_offset(self) -> int:
        return round_up(self.cnt_offset + 4 * self.stages, 128)

    @property
    def bytes(self) -> int:
        return (self.input_offset + self.input_bytes if self.input_bytes else self.cnt_offset + 4 * self.stages) + SLACK


def _smem(layers: list[WgmmaLayer], stages: int = 0, input_bytes: int = 0, input_bars: int = 0, cluster: int = 1,
          bias16: bool = False, norm_floats: int = 0) -> int:
    """Bytes of dynamic shared memory with `stages` ring slots (0: the image resident), `input_bytes` of
    staged input tiles and `input_bars` mbarriers for them, in a cluster of `cluster` CTAs (BIAS16: with
    the bias's fp16 copy; a norm's parameters, `norm_floats`, after the layers' bias)."""
    return SmemLayout.of(_image_bytes(layers), _slot_bytes(layers), stages, sum(l.np_ for l in layers) + norm_floats,
                         input_bytes, input_bars, cluster, _bias_halves(layers, bias16)).bytes


def _bias_halves(layers: list[WgmmaLayer], bias16: bool) -> int:
    """BIAS16's fp16 copy: the hidden layers' padded bias (the bias array holds the last layer's last;
    only hidden layers add in fp16), or 0. A few KB: the copy of the whole array took silu's last staged
    input k-step back into registers (256 KB of ring and tiles beside it)."""
    return layers[-1].bias_offset if bias16 else 0


def _stages(layers: list[WgmmaLayer], smem_limit: int, resident: bool = True, bias16: bool = False,
            norm_floats: int = 0) -> int | None:
    """0 where the image stays resident (and `resident`), else the most ring slots (up to STAGES_MAX) that
    fit; None where not even STAGES_MIN do."""
    if resident and _smem(layers, bias16=bias16, norm_floats=norm_floats) <= smem_limit:
        return 0
    fits = [s for s in range(STAGES_MIN, STAGES_MAX + 1)
            if _smem(layers, s, bias16=bias16, norm_floats=norm_floats) <= smem_limit]
    return fits[-1] if fits else None


def make_wgmma_plan(spec: MLPSpec, fallback, reason: str = "", smem_limit: int = SMEM_LIMIT,
                    nwg: int | None = None, prefetch: int | None = None, chunk_max: int | None = None,
                    cluster: int | None = None, stages: int | None = None,
                    staged_input: bool | None = None, bulk_input: bool | None = None,
                    quad_stores: bool | None = None, input_parts: int | None = None,
                    prescale: bool | None = None, store_rows: bool | None = None,
                    bias16: bool | None = None, blocks: bool | None = None) -> WgmmaPlan:
    """The wgmma plan of `spec`, with `fallback` (its resident or streamed plan) for other GPUs. SpecError
    where the design cannot take it. `nwg`, `prefetch`, `chunk_max` (the widest chunk, a multiple of 8 up
    to CHUNK_MAX), `cluster` (streamed plans: 1, 2 or 4 CTAs sharing each chunk's copy), `stages` (ring
    slots, STAGES_MIN up to what fits; streams weights that would stay resident too), `staged_input`
    (STAGED_INPUT), `bulk_input` (BULK_INPUT), `quad_stores` (QUAD_STORES, where possible), `input_parts`
    (_input_parts, at most a pass's chunks), `prescale` (PRESCALE), `store_rows` (STORE_ROWS, where possible),
    `bias16` (BIAS16, where a hidden layer has a packed activation), `blocks` (BLOCKS): overrides of the
    heuristics (benchmarks)."""
    why = wgmma_reason_refused(spec, smem_limit, blocks)
    if why:
        raise SpecError(f"{spec.describe()}: no wgmma plan: {why}")
    smem_limit -= _pool_smem(spec)   # (the pool's copies: static shared memory)
    if fallback is None:
        raise SpecError(f"{spec.describe()}: no wgmma plan: no mma.sync plan for the other GPUs")
    if chunk_max is not None and (chunk_max % 8 or not 8 <= chunk_max <= CHUNK_MAX):
        raise SpecError(f"chunk width {chunk_max}: a multiple of 8 up to {CHUNK_MAX}")
    layers = _layers(spec, chunk_max or CHUNK_MAX)
    # a norm's scale and bias (first layer's K each, zero-padded) after the layers' bias: in shared memory with
    # it, read as pairs (the fallback's packed copy in global memory took two loads a value per tile)
    norm_floats = 2 * layers[0].kp if spec.norm is not None else 0
    # fp16 bias adds where a hidden layer's activation is packed (the others add in fp32 as before); by
    # default not where the fp16 copy's few KB would take the weights out of residency or a ring slot away
    # (nor, below, an input k-step out of shared memory)
    bias16_default = bias16 is None
    if bias16_default:
        bias16 = BIAS16 and spec.bias16 and (_stages(layers, smem_limit, bias16=True, norm_floats=norm_floats)
                                             == _stages(layers, smem_limit, norm_floats=norm_floats))
    bias16 = bias16 and spec.bias16   # (packed hidden layers, act_math "packed")
    most = _stages(layers, smem_limit, bias16=bias16, norm_floats=norm_floats)
    if most is None:   # a narrower chunk_max (or the fp16 bias copy) may leave too many chunks for the ring
        what = " and ".join(w for w in (f"chunks of {chunk_max}" if chunk_max else "",
                                        "the fp16 bias copy" if bias16 else "") if w)
        raise SpecError(f"{spec.describe()}: no wgmma plan{' with ' + what if what else ''}: the ring does not fit")
    if stages is not None:   # an override streams even weights that would stay resident
        most = _stages(layers, smem_limit, resident=False, bias16=bias16, norm_floats=norm_floats) or 0
        if not STAGES_MIN <= stages <= most:
            raise SpecError(f"{spec.describe()}: a ring of {stages} slots: {STAGES_MIN} to {most} fit")
    else:
        stages = min(STAGES_DEFAULT, most) if most else 0
    fragments = _registers(layers)
    overhead = REGISTER_OVERHEAD + (RING_REGISTERS if stages else 0)
    base = fragments + overhead
    # an override is held to the cap only where the estimate is far over: the estimate is conservative
    # (nerf: ~88 estimated, 78 used; silu 256x4 in chunks of 16: ~232 estimated without the ring, 166 used
    # with 3 warpgroups, no spills) and __launch_bounds__ makes ptxas fit the cap (spills show in -v); the
    # per-chunk term is left out here
    lean = _registers(layers, per_chunk=0) + overhead
    if nwg is not None and (nwg not in OVERRIDE_CAPS or lean > OVERRIDE_CAPS[nwg] + 24):
        raise SpecError(f"{spec.describe()}: no wgmma plan with {nwg} warpgroups: ~{base} registers a thread")
    if (nwg is None and not stages and not any(l.gated for l in layers)   # (gated: not measured)
            and fragments <= FOUR_WARPGROUP_FRAGMENTS):
        nwg = REGISTER_CAPS[0][0]
    if nwg is None and spec.pool is not None:   # POOL_NWG_MAX
        nwg = next((n for n, c in REGISTER_CAPS if n <= POOL_NWG_MAX and max(lean, _input_peak(layers) + overhead) <= c + 24),
                   None)
    nwg, cap = ((nwg, OVERRIDE_CAPS[nwg]) if nwg is not None else
                next(((n, c) for n, c in REGISTER_CAPS if base <= c), REGISTER_CAPS[-1]))   # (SKIP_SLACK)
    k0_steps = layers[0].k_steps
    register_prefetch = min(k0_steps, PREFETCH_MAX, max(0, cap - base) // 8)   # the registers the cap leaves, 8 a k-step
    bulk = BULK_INPUT if bulk_input is None else bulk_input
    # a norm holds each row's k-steps together in registers: its tile is staged whole (prefetch 0) by bulk
    # copies (the template's norm reads them from there), or loaded straight into registers
    stageable = (spec.io_dtype == "f32" and spec.layers[0].in_features % IN_ROW_ALIGN == 0
                 and (spec.norm is None or bulk))
    buffers = IN_BUFFERS_RESIDUAL if spec.residual and bulk else 1
    # the k-steps past `prefetch` wait in shared memory: the fewest prefetched ones that let them fit
    # (silu's 256-wide rows beside a 96 KB ring: 1 in registers, 15 staged)
    if cluster is not None and cluster not in (1, 2, CLUSTER_MAX):
        raise SpecError(f"cluster of {cluster} CTAs: 1, 2 or {CLUSTER_MAX}")
    # a chunk's slice per CTA must stay a multiple of 16 bytes (bulk copies): chunks are multiples of 256
    cluster = (cluster or CLUSTER) if stages else 1
    def register_room(p: int) -> bool:
        # a one-layer chain's staged tile: the k-steps it holds in registers wait there through every chunk,
        # 8 registers each, beside the layer's A fragments (a CNN head's 320 -> 1280 pool, whose 80 KB rows fit
        # beside its ring only with 13 of 20 k-steps in registers at 2 warpgroups: ~176 + 104 registers,
        # spilled 880 bytes; unstaged, none). Longer chains keep their measured plans (NeRF's 319-wide second
        # half holds 8 k-steps in 255 registers, over this estimate, without spills); an override is taken.
        return p == 0 or prefetch is not None or len(layers) > 1 or lean + 8 * p <= cap
    def input_fits(b16: bool, buffers: int) -> list[int]:
        # the norm's sums and the residual's reads from the tile take the whole row there: none in registers
        whole_rows = spec.norm is not None or buffers > 1
        return [p for p in range(k0_steps) if (not whole_rows or p == 0) and register_room(p)
                if _smem(layers, stages, nwg * buffers * ROWS * _input_row_bytes(16 * (k0_steps - p), bulk),
                         nwg * buffers if bulk else 0, cluster, b16, norm_floats) <= smem_limit]
    fits = input_fits(bias16, buffers)
    if not fits and buffers > 1:
        # two whole tiles a warpgroup do not fit beside the weights: one, the residual then read from global
        # memory as the register path does (a 200 -> 256 -> 200 residual chain keeps its staged columns)
        buffers = 1
        fits = input_fits(bias16, buffers)
    if bias16 and bias16_default and stageable and fits[:1] != input_fits(False, buffers)[:1]:
        # the copy would hold one more of the next tile's input k-steps in registers (silu 256x6: 225 -> 233
        # registers a thread): the bias in fp32 instead
        bias16, fits = False, input_fits(False, buffers)
    if staged_input is None:   # where registers cannot hold the next tile's whole input, a block, or not gated (and it fits)
        gated = any(l.gated for l in layers)
        staged_input = (stageable and (register_prefetch < k0_steps or (BLOCK_STAGED and spec.has_block)
                                       or (STAGED_WHOLE and not gated))
                        and bool(fits) and (prefetch is None or prefetch in fits))
    if staged_input:
        if not stageable:
            raise SpecError(f"{spec.describe()}: staged input takes fp32 rows of a multiple of {IN_ROW_ALIGN} features"
                            + (" and, with a norm, bulk copies" if spec.norm is not None else ""))
        if prefetch is None and fits:
            prefetch = fits[0]
        if prefetch not in fits:
            raise SpecError(f"{spec.describe()}: {nwg} staged input tiles do not fit in shared memory beside the weights")
    if prefetch is None:
        # a norm holds every k-step of a tile's rows in fp32 while it sums them: no registers are left for the
        # next tile's (preln 64 -> 256 -> 64 spilled at 255 registers with its 4 k-steps prefetched)
        prefetch = 0 if spec.norm is not None else register_prefetch
    prefetch = max(0, min(k0_steps, prefetch))
    bias = sum(l.np_ for l in layers) + norm_floats
    # (a pooled last layer stores no rows: its pairs of n8 blocks raise the maxima, QUAD_STORES has no use)
    quads = (QUAD_STORES if quad_stores is None else quad_stores) and _quads_fit(layers[-1]) and spec.pool is None
    store_rows = (STORE_ROWS if store_rows is None else store_rows) and quads and spec.layers[-1].out_features % 4 == 0
    bulk_staged = bool(staged_input) and bulk
    in_buffers = buffers if bulk_staged else 1   # two: the residual reads x from the staged tile
    return WgmmaPlan(spec, tuple(layers), nwg, prefetch, base + 8 * prefetch, _image_bytes(layers), bias, fallback,
                     fallback.workspace_bytes, reason, stages, _slot_bytes(layers) if stages else 0, cluster,
                     bool(staged_input), bulk_staged,
                     quads,
                     max(1, min(_input_parts(layers, stages) if input_parts is None else input_parts,
                                sum(l.chunks for l in layers))) if bulk_staged else 1,
                     PRESCALE if prescale is None else prescale, store_rows, bias16, in_buffers,
                     in_buffers == 1 and _residual_ahead(spec, layers[-1], cap, base + 8 * prefetch))


def _input_peak(layers: list[WgmmaLayer]) -> int:
    """Registers a thread holds while it loads a tile's input unstaged: the first layer's A fragments and a
    group of up to REST_GROUP k-steps in fp32 (8 registers each) before their conversion."""
    return layers[0].kp // 4 + 8 * min(REST_GROUP, layers[0].k_steps)


def _residual_ahead(spec: MLPSpec, last: WgmmaLayer, cap: int, estimate: int) -> bool:
    """Whether a residual read from global memory has a chunk's x values loaded ahead of its stores
    (RESIDUAL_AHEAD_ROOMY), else each store loads its own."""
    chunk = last.nc // 2   # x's values a thread adds: a 64-row tile's chunk of nc columns over 128 threads
    return spec.residual and (cap >= RESIDUAL_AHEAD_ROOMY or estimate + chunk <= cap)
