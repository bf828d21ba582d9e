"""The whole FFN in one Hopper kernel: a wide plan's path for a two-layer chain (gated or not) on
compute capability 9.0 (templates/cuda_wide_ffn.cu.j2, o2f_ffn_pair.cuh; docs/DESIGN.md, "The FFN in one
kernel"; the prototype: benchmarks/sm90/ffn_wgmma.cu).

The wide design runs an FFN as two GEMMs with the hidden tensor written to the workspace in 16 bits and
read back (for SwiGLU 256 -> 1024 -> 256, 1 GB per 2^18 rows), after an fp32 -> fp16 conversion pass. This
kernel keeps the hidden values in registers: each warpgroup converts its 64 input rows into a swizzled
fp16 tile in shared memory, computes the hidden features a chunk of HC at a time (layer 0 as wgmma from
shared memory), and feeds each chunk's activations straight from registers into layer 1's wgmma, which
accumulates the tile's outputs across the chunks. The weights stream through a ring of chunk slots
(the streamed wgmma design's), read from L2 by every CTA once per pass of 128 rows.

`ffn_pair(spec, workspace_offset)` is the kernel's layout where it can run the spec, else None;
`ffn_reason_refused(spec)` says why not. The chain's unit takes it on a 9.0 device for batches of at least
MIN_ROWS_PER_SM rows per SM (fewer leave SMs idle: the GEMMs split the columns too), with 16-byte aligned
x and y, unless ONNX2FUSED_WIDE_FFN=0 (FFN_ENV: A/B timing and tests; =N moves the threshold to N rows
in all) or the sm80 kernels are forced. Its image is reserved in the workspace on every GPU (the size of
the weights again, in fp16). It rounds x to fp16 as the conversion pass does, where a plan's first GEMM may
read fp32 rows in place as tf32: the numerics model judges fp16 chains with fp16 operands either way.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import MLPSpec
from .padding import round_up

FFN_ENV = "ONNX2FUSED_WIDE_FFN"   # "0": the chain's GEMMs even where the FFN kernel could run; "N": the
                                  # kernel from N rows (in place of MIN_ROWS_PER_SM per SM)
HC = 32                 # hidden features per chunk: the layer-0 accumulators (32 or 64 a thread) stay small
K0_MAX = 256            # the input tile: 64 rows x K0 fp16 per warpgroup, a whole-atom multiple of 64 features
N_MAX = 256             # layer 1's accumulators: 64 x N fp32 per warpgroup, N/2 registers a thread
STAGES = 3              # ring slots (the streamed wgmma design's measured best)
SMEM_LIMIT = 227 * 1024
NWG = 2                 # warpgroups a CTA, each on its own 64-row tile
# Rows a batch needs per SM before the kernel is taken. A pass is 2 x 64 rows and one round of passes takes
# about the same time from half the SMs busy to all (SwiGLU 256 -> 1024 -> 256 through ORT on an H100:
# 0.091 ms at 8192 rows, 0.095 at 16384), where the GEMMs took 0.080 and 0.113 (RESULTS.md, twenty-seventh
# run): the kernel from three quarters of a pass per SM.
MIN_ROWS_PER_SM = 96
# Registers a thread may give the accumulators (outputs, a chunk's layer-0 products), the hidden values' A
# fragments and the input's register k-steps (4 each): the rest of the kernel's 255 took ~30-40 (ptxas on
# SwiGLU 256 -> 1024 -> 256: 12 k-steps in registers 247, no spills; 16 spilled and serialized its wgmmas).
REG_BUDGET = 216
REGION_ALIGN = 1024      # the image's and the bias's start (bulk copies need 16 bytes)


@dataclass(frozen=True)
class FfnPair:
    k0: int             # input features
    kp0: int            # padded to a multiple of 64
    h: int              # hidden features
    hp: int             # padded to a multiple of HC
    n: int              # outputs
    np_: int            # padded to a multiple of 64 (the layer-1 wgmma's N)
    gated: bool
    image_offset: int   # bytes into the workspace: the weight image (fp16, chunk by chunk)
    image_bytes: int
    bias_offset: int    # bytes: layer 1's bias, fp32, NP values (layer 0's is in the image, chunk by chunk)
    bias_bytes: int
    stages: int = STAGES

    @property
    def l1_cols(self) -> int:
        """Layer 0's columns per chunk: HC, or HC gate and HC up columns."""
        return 2 * HC if self.gated else HC

    @property
    def chunk_bytes(self) -> int:
        """A chunk of the image: layer 0's columns, layer 1's rows (fp16), layer 0's bias (fp32)."""
        return chunk_bytes(self.kp0, self.np_, self.gated)

    @property
    def slot_bytes(self) -> int:
        return round_up(self.chunk_bytes, 1024)

    @property
    def x_reg_steps(self) -> int:
        """Layer 0's k-steps whose A fragments (the input tile's, 4 registers a thread each) stay in registers
        for the whole pass, the rest read from shared memory by every chunk: as many as REG_BUDGET leaves
        beside the output accumulators (np_/2), a chunk's layer-0 products (l1_cols/2) and its hidden
        values (HC/4)."""
        free = REG_BUDGET - self.np_ // 2 - self.l1_cols // 2 - HC // 4
        return max(0, min(self.kp0 // 16, free // 4))

    @property
    def end(self) -> int:
        """The workspace bytes up to and past the kernel's regions."""
        return round_up(self.bias_offset + self.bias_bytes, REGION_ALIGN)

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.kp0, self.np_, self.stages, self.slot_bytes)

    def describe(self) -> str:
        return (f"on sm_90 from {MIN_ROWS_PER_SM} rows per SM the whole FFN in one kernel (the hidden "
                f"{'act(gate) * up ' if self.gated else ''}values kept on chip, {self.hp // HC} chunks of {HC} "
                f"through a ring of {self.stages} x {self.slot_bytes // 1024} KB)")


def chunk_bytes(kp0: int, np_: int, gated: bool) -> int:
    cols = 2 * HC if gated else HC
    return cols * kp0 * 2 + np_ * HC * 2 + 4 * cols


def smem_bytes(kp0: int, np_: int, stages: int, slot_bytes: int) -> int:
    """The kernel's dynamic shared memory (o2f_ffn_pair.cuh's layout): ring, input tiles, layer 1's bias,
    barriers and counters, alignment slack. It does not grow with the hidden width."""
    return stages * slot_bytes + NWG * 64 * kp0 * 2 + 4 * np_ + 12 * stages + 1024


def ffn_reason_refused(spec: MLPSpec) -> str | None:
    """Why the FFN kernel cannot run this spec, or None."""
    if len(spec.layers) != 2:
        return f"{len(spec.layers)} layers (it runs exactly two)"
    if spec.precision not in ("fp16", "bf16"):
        return f"{spec.precision} operands (its wgmma forms are fp16 and bf16)"
    if spec.skip:
        return "a skip connection"
    if spec.norm is not None or spec.residual:
        return "a norm in front or a residual behind (the wide design's passes and epilogue take those)"
    first, last = spec.layers
    if last.gated:
        return "a gated last layer"
    k0, n = first.in_features, last.out_features
    if k0 % 8 or k0 > K0_MAX:
        return f"{k0} input features (it takes multiples of 8 up to {K0_MAX})"
    if n % 2 or n > N_MAX:
        return f"{n} outputs (it takes even counts up to {N_MAX})"
    return None


def ffn_pair(spec: MLPSpec, offset: int) -> FfnPair | None:
    """The kernel's layout with its workspace regions from byte `offset`, or None (ffn_reason_refused, or
    its shared memory would not fit)."""
    if ffn_reason_refused(spec):
        return None
    first, last = spec.layers
    kp0, hp, np_ = round_up(first.in_features, 64), round_up(first.out_features, HC), round_up(last.out_features, 64)
    image, image_off = (hp // HC) * chunk_bytes(kp0, np_, first.gated), round_up(offset, REGION_ALIGN)
    bias_off = round_up(image_off + image, REGION_ALIGN)
    pair = FfnPair(first.in_features, kp0, first.out_features, hp, last.out_features, np_, first.gated,
                   image_off, image, bias_off, 4 * np_)
    return pair if pair.smem_bytes <= SMEM_LIMIT else None
