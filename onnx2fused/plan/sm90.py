"""The Hopper (sm_90a) GEMM kernels the wide design can instantiate, and the choices among them.

A `Sm90Kernel` is a CUTLASS 3.x kernel configuration (TMA loads, wgmma): a schedule, a CTA tile and a
cluster; its C++ name is made from those (`Coop128x256`, `Pingpong64x128C4`, `Tf32Coop128x256`). A
`Sm90Choice` is one of them plus the stream-K scheduler's run-time decomposition (heuristic, data-parallel,
split-K with S splits, stream-K) and either scheduler's tile order (swizzle, raster), run-time arguments
that need no instance of their own (the search times the orders for the ping-pong kernels). A wide GEMM has one choice per row bucket (ROW_BUCKETS: a call takes the
bucket nearest its rows on a log scale), because the best kernel for 256 rows is not the best for 16384.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConversionError

# Stream-K partial-tile reductions of the sm90 kernels (fp32 128x256 tiles, 128 KiB each; CUTLASS sizes it
# per problem and SM count: ~100 partials for 132 SMs; split-K 8 of the head's 256 x 4096 layers in 128 x
# 128 tiles: 64 tiles x 8 partials of 64 KiB). Larger needs fall back to data-parallel tiles.
SM90_SCRATCH = 48 << 20
K_TILE_BYTES = 128   # a CTA tile's K depth in bytes of one operand row: 64 fp16/bf16 elements, 32 fp32 (tf32)


@dataclass(frozen=True)
class Sm90Kernel:
    """A CUTLASS 3.x sm_90a GEMM kernel configuration (TMA loads, wgmma). Cooperative: two consumer
    warpgroups share one CTA tile, with the stream-K tile scheduler (any decomposition at run time).
    Ping-pong: each consumer warpgroup owns a tile, so one's epilogue overlaps the other's main loop;
    it has the persistent data-parallel scheduler only. Pipeline stages: CUTLASS fills the shared
    memory the epilogue leaves. Each one costs about a minute of nvcc per (activation, output type).
    Light: our own ping-pong kernel without CUTLASS (templates/o2f_light_gemm.cuh), 128 x 128 tiles,
    persistent, the tile order its only run-time choice; a few seconds of nvcc."""
    schedule: str                 # "cooperative" | "pingpong" | "light"
    tile_mn: tuple[int, int]      # CTA tile M, N (K: K_TILE_BYTES of the operand type)
    cluster: tuple[int, int]      # CTAs per cluster along M, N (TMA multicast of the shared operand)
    tf32: bool = False            # fp32 operands on tf32 wgmma: the first layer reads the fp32 input in
                                  # place (the conversion pass fused into its loads); first layers only

    @property
    def name(self) -> str:
        """The C++ struct name: [Tf32]Coop|Pingpong|Light<M>x<N>[C<cluster>]."""
        cm, cn = self.cluster
        cluster = "" if (cm, cn) == (1, 1) else f"C{cm}" if cn == 1 else f"C{cm}x{cn}"
        schedule = {"cooperative": "Coop", "pingpong": "Pingpong", "light": "Light"}[self.schedule]
        return f"{'Tf32' if self.tf32 else ''}{schedule}{self.tile_mn[0]}x{self.tile_mn[1]}{cluster}"

    @property
    def tile(self) -> tuple[int, int, int]:
        """CTA tile M, N, K."""
        return (*self.tile_mn, K_TILE_BYTES // (4 if self.tf32 else 2))

    @property
    def stream_k(self) -> bool:
        return self.schedule == "cooperative"

    @property
    def light(self) -> bool:
        """Our own kernel (no CUTLASS: templates/cuda_wide_light.cu.j2)."""
        return self.schedule == "light"


SM90_KERNELS: tuple[Sm90Kernel, ...] = (
    Sm90Kernel("cooperative", (128, 256), (1, 1)),
    Sm90Kernel("cooperative", (128, 128), (1, 1)),
    Sm90Kernel("pingpong", (128, 128), (1, 1)),
    Sm90Kernel("pingpong", (64, 128), (1, 1)),      # few rows: more, shorter tiles
    Sm90Kernel("cooperative", (256, 128), (1, 1)),  # few rows, split-K: A read once
    Sm90Kernel("pingpong", (128, 128), (2, 1)),     # B multicast to 2 row tiles
    Sm90Kernel("pingpong", (128, 64), (1, 1)),      # narrow layers (DLRM's 256 -> 64)
    # Few rows (the head's 256): every row tile re-reads the weights from L2, and the GEMM is L2-bound.
    # A cluster along M multicasts each weight tile to all of its row tiles (4 x 64 = 256 rows: once).
    Sm90Kernel("pingpong", (64, 128), (4, 1)),
    Sm90Kernel("pingpong", (128, 64), (2, 1)),
    Sm90Kernel("cooperative", (128, 256), (1, 1), tf32=True),
    Sm90Kernel("pingpong", (128, 128), (1, 1), tf32=True),
    # CUTLASS's Pingpong128x128 without CUTLASS: 4 s of nvcc where a CUTLASS 3.x instance takes 35-40
    # (benchmarks/RESULTS.md, eighteenth run)
    Sm90Kernel("light", (128, 128), (1, 1)),
    # the same on fp32 operands (tf32 wgmma, 32-column k-blocks): a first layer reading x in place, in the
    # search, and by name (DEFAULT_TF32_KERNEL_ENV). Not the tf32 default: through ORT, DLRM at 65536 rows took
    # 0.120 ms with it against 0.106-0.111 with CUTLASS's Tf32Pingpong128x128 (H200, RESULTS.md twentieth
    # run), although alone it beat cuBLAS's tf32 GEMM (66 against 81 us, H100). (With an fp32 erf GELU, both
    # forms spill 5 registers once per tile, stored after the mainloop's start and loaded in the epilogue,
    # under the 168-register cap; ReLU, SiLU, packed GELU none.)
    Sm90Kernel("light", (128, 128), (1, 1), tf32=True),
)
# Tried and left out (every kernel here is one more CUTLASS instance per epilogue in a tuning build):
# - Coop128x256 with a cluster of 2 along M (the weight tile multicast: half the L2 traffic per flop of
#   Pingpong128x128): on ViT-B's FFN GEMMs at 16384 rows not among the 8 fastest of the search (H100,
#   RESULTS.md fourteenth run; Pingpong128x128C2 won at 0.121 ms).
# - Pingpong64x256 (wgmma's m64n256 with the overlapped epilogue), the same with a cluster of 2 along M,
#   and Pingpong128x128 with a cluster of 2 along N (A multicast): on ViT-B's two GEMMs at 16384 rows
#   0.133-0.141 / 0.128 ms against 0.123 for Pingpong128x128C2; only 2048 rows took one (C1x2, 0.0176
#   against 0.0177 for Pingpong128x128C2 along N) (fifteenth run).
# - Coop256x128 with a cluster of 2 along N (A multicast), the tile and cluster of cuBLAS's kernel for both
#   of ViT-B's FFN GEMMs in ORT's fp16 model (nvjet 256x128 1x2, 107 us each at 16384 rows): as CUTLASS
#   3.x 0.163-0.167 ms on the first GEMM and 0.134 on the second, against 0.124-0.125 for the fastest
#   here (H100, RESULTS.md sixteenth run; a new kernel goes at the end: stored results index this table).
TF32_KERNELS = tuple(i for i, k in enumerate(SM90_KERNELS) if k.tf32)

# The stream-K scheduler's decompositions (CUTLASS DecompositionMode, same order as its enum).
MODES = ("heuristic", "split_k", "stream_k", "data_parallel")
# Both schedulers' tile order (CUTLASS RasterOrderOptions, same order as its enum; the heuristic walks along
# N when there are more row tiles than column tiles) and its swizzle: max_swizzle_size, tiles grouped in
# bands of up to that many rows (or columns) of tiles, so that the tiles running at once share operand
# panels in L2.
RASTERS = ("heuristic", "along_m", "along_n")
SWIZZLES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Sm90Choice:
    kernel: int           # index into SM90_KERNELS
    mode: str = "heuristic"
    splits: int = 1       # split_k only
    swizzle: int = 1      # SWIZZLES: the scheduler's max_swizzle_size
    raster: str = "heuristic"   # RASTERS

    @property
    def label(self) -> str:
        k = SM90_KERNELS[self.kernel].name
        order = (f"/sw{self.swizzle}" if self.swizzle != 1 else "") + (f"/{self.raster}" if self.raster != "heuristic" else "")
        if not SM90_KERNELS[self.kernel].stream_k:
            return k + order
        return f"{k}/{self.mode}" + (f"x{self.splits}" if self.mode == "split_k" else "") + order

    def fits(self, first_layer_tf32: bool) -> bool:
        """A known kernel, mode and tile order; a tf32 kernel only where the layer may read fp32 in place."""
        return (0 <= self.kernel < len(SM90_KERNELS) and self.mode in MODES and self.splits >= 1
                and self.swizzle in SWIZZLES and self.raster in RASTERS
                and (first_layer_tf32 or not SM90_KERNELS[self.kernel].tf32))


# The untuned default: our own 128 x 128 ping-pong kernel (Light128x128, no CUTLASS), CUTLASS's
# Pingpong128x128 rewritten. The ping-pong schedule won or came within 3% in every search measured on the
# H100 (benchmarks/RESULTS.md: FFN, head, DLRM at 256 and 16384 rows), and it has twice the tiles of the
# 128 x 256 cooperative kernel, which was the default before that: on an H200 that kernel with the
# stream-K heuristic took 83 us for one of ViT-tiny's two FFN GEMMs (12608 rows, 192 -> 768 -> 192: one or
# two column tiles, a few K tiles, split over the SMs), 7x stock ORT's cuBLAS GEMM, and 170 us for one of
# ViT-B's at 16384 rows (stock: 108). Light128x128 measured at cuBLAS's speed on ViT-B's and mnist's GEMMs
# (eighteenth run), and its unit compiles in seconds: an untuned build compiles no CUTLASS 3.x instance.
LIGHT_KERNEL = next(i for i, k in enumerate(SM90_KERNELS) if k.light)
DEFAULT_CHOICE = Sm90Choice(LIGHT_KERNEL, "data_parallel")
# Convert-time override of the untuned default's kernel, by name (Pingpong128x128: CUTLASS's, as before
# Light128x128; A/B comparisons, or a way back should our kernel misbehave somewhere).
DEFAULT_KERNEL_ENV = "ONNX2FUSED_WIDE_DEFAULT_KERNEL"
# Convert-time override of the tf32 default's kernel, by name (Tf32Light128x128: ours, no CUTLASS 3.x
# instance in an untuned build of a chain whose first layer reads fp32 in place: a faster cold convert).
DEFAULT_TF32_KERNEL_ENV = "ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL"
ROW_BUCKETS = (32, 256, 2048, 16384)   # rows the choices are made (and tuned) for; calls take the nearest
# (32: GEMV-like calls, where one row tile leaves most SMs idle unless split-K fills them)


def kernel_index(name: str) -> int:
    """The index into SM90_KERNELS of the kernel named `name` (Sm90Kernel.name); ValueError if none."""
    for i, k in enumerate(SM90_KERNELS):
        if k.name == name:
            return i
    raise ValueError(f"no Hopper kernel named {name!r}")


# The untuned default of a first layer read in place (tf32): CUTLASS's Tf32Pingpong128x128 (measured faster
# through ORT than ours on fp32 operands, Tf32Light128x128: see SM90_KERNELS).
DEFAULT_TF32_CHOICE = Sm90Choice(kernel_index("Tf32Pingpong128x128"), "data_parallel")


def _choice_from_env(env: str, tf32: bool, default: Sm90Choice) -> Sm90Choice:
    """`default`, or data-parallel tiles of the kernel $env names (among the tf32 kernels or the others)."""
    name = os.environ.get(env, "").strip()
    if not name:
        return default
    names = [k.name for k in SM90_KERNELS if k.tf32 == tf32]
    if name not in names:
        raise ConversionError(f"{env}={name!r}: expected one of {', '.join(names)}")
    return Sm90Choice(kernel_index(name), "data_parallel")


def default_choice() -> Sm90Choice:
    """DEFAULT_CHOICE, or the 16-bit kernel $ONNX2FUSED_WIDE_DEFAULT_KERNEL names (data-parallel tiles)."""
    return _choice_from_env(DEFAULT_KERNEL_ENV, False, DEFAULT_CHOICE)


def default_tf32_choice() -> Sm90Choice:
    """DEFAULT_TF32_CHOICE, or the tf32 kernel $ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL names (data-parallel)."""
    return _choice_from_env(DEFAULT_TF32_KERNEL_ENV, True, DEFAULT_TF32_CHOICE)


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
        elif k.light:   # the tile order is its only run-time choice (no swizzle)
            out += [Sm90Choice(i, "data_parallel")] + [Sm90Choice(i, "data_parallel", raster=r) for r in RASTERS[1:]]
        else:   # the ping-pong kernels: the tile order too (their scheduler has no other run-time choice)
            out += [Sm90Choice(i, "data_parallel")] + [Sm90Choice(i, "data_parallel", swizzle=s) for s in SWIZZLES[1:]]
            out += [Sm90Choice(i, "data_parallel", raster=r) for r in RASTERS[1:]]
    return tuple(out)


def row_buckets(row_block: int) -> tuple[int, ...]:
    """ROW_BUCKETS up to the plan's row block (a call never has more rows per GEMM than that)."""
    top = min(row_block, ROW_BUCKETS[-1])
    return tuple(b for b in ROW_BUCKETS if b < top) + (top,)
