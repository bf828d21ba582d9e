"""Tile and shared-memory plan of the fused CUDA kernel for one MLPSpec.

The kernel (templates/cuda_kernel.cu.j2) keeps a tile of rows' activations on chip through every
layer, in two ping-pong shared-memory buffers (buffer A feeds layers 0, 2, 4..., buffer B layers 1,
3, ...). Each warp owns 16*MT rows of the tile: it loads them, multiplies them through every layer
with `mma.sync` (fp32 accumulators; bias and activation applied to the accumulators), and writes the
last layer straight from registers to global memory. Warps never read each other's rows.

Weights are pre-packed once per session (S_cuda_pack) into "chunks": a chunk is NC output columns x
KC input features of one layer, stored n-major with a row stride of KC+8 halves (16 bytes of padding
makes the ldmatrix rows of 8 consecutive n fall in distinct banks). Two ways to feed them:

  resident  every chunk fits in shared memory: the block copies them in once and keeps them for all
            its tiles; warps then run their own tiles with no block-wide barrier at all.
  streamed  chunks pass through a ring of STAGES slots (cp.async, multistage pipeline); all warps of a
            block work on one block tile in lock step, one barrier per chunk.

Widths are padded to the tile (K to a multiple of KC, N to a multiple of NC); padding columns of the
activations are written as zeros, so padded weights (zeros) never multiply garbage.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import expr as ex
from .spec import MLPSpec, SpecError

SMEM_LIMIT = 227 * 1024       # usable dynamic shared memory per block on sm_90 (sm_80: 163 KB)
SMEM_LIMIT_SM80 = 163 * 1024
KC_MAX = 64                   # input features per chunk
NC_MAX = 64                   # output columns per chunk (accumulators: MT * NC/8 * 4 floats a thread)
STAGES = 3                    # ring depth of the streamed path
RESIDENT_BUDGET = 150 * 1024  # weights above this are streamed, leaving room for activations


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


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
    w_offset: int     # offset of the layer's first chunk in the packed weights (halves)
    b_offset: int     # offset of the layer's bias in the packed biases (floats)

    @property
    def n_kchunks(self) -> int:
        return self.kp // self.kc

    @property
    def n_nchunks(self) -> int:
        return self.np_ // self.nc

    @property
    def chunk_elems(self) -> int:
        return self.nc * (self.kc + 8)

    @property
    def n_chunks(self) -> int:
        return self.n_kchunks * self.n_nchunks


@dataclass(frozen=True)
class CudaPlan:
    spec: MLPSpec
    layers: tuple[LayerPlan, ...]
    resident: bool
    warps: int
    mt: int             # m16 tiles per warp: a warp owns 16*mt rows
    stages: int
    width_a: int        # padded width of activation buffer A (halves, without the +8)
    width_b: int
    smem_bytes: int

    @property
    def rows_per_warp(self) -> int:
        return 16 * self.mt

    @property
    def weight_elems(self) -> int:
        return sum(l.n_chunks * l.chunk_elems for l in self.layers)

    @property
    def bias_elems(self) -> int:
        return sum(l.np_ for l in self.layers)

    @property
    def slot_elems(self) -> int:
        return max(l.chunk_elems for l in self.layers)

    @property
    def total_chunks(self) -> int:
        return sum(l.n_chunks for l in self.layers)


def _layer_plans(spec: MLPSpec) -> list[LayerPlan]:
    plans, chunk, w_off, b_off = [], 0, 0, 0
    for i, l in enumerate(spec.layers):
        kc = min(_round_up(l.in_features, 16), KC_MAX)
        nc = min(_round_up(l.out_features, 16), NC_MAX)
        p = LayerPlan(i, l.in_features, l.out_features, kc, nc, _round_up(l.in_features, kc),
                      _round_up(l.out_features, nc), chunk, w_off, b_off)
        plans.append(p)
        chunk += p.n_chunks
        w_off += p.n_chunks * p.chunk_elems
        b_off += p.np_
    return plans


def _act_widths(layers: list[LayerPlan]) -> tuple[int, int]:
    """Buffer A holds the inputs of even layers, B of odd layers (each written by the layer before)."""
    wa = max(l.kp for l in layers[0::2])
    wb = max((l.kp for l in layers[1::2]), default=0)
    return wa, wb


def make_plan(spec: MLPSpec, smem_limit: int = SMEM_LIMIT) -> CudaPlan:
    if spec.precision not in ("fp16", "bf16"):
        raise SpecError(f"{spec.precision} has no tensor-core plan (handled by the CUDA-core kernel)")
    layers = _layer_plans(spec)
    wa, wb = _act_widths(layers)
    bias_bytes = sum(l.np_ for l in layers) * 4
    weight_bytes = sum(l.n_chunks * l.chunk_elems for l in layers) * 2
    slot_bytes = max(l.chunk_elems for l in layers) * 2

    def act_bytes(rows: int) -> int:
        return rows * ((wa + 8) + ((wb + 8) if wb else 0)) * 2

    resident = weight_bytes <= RESIDENT_BUDGET
    # Candidate (warps, mt) from most to least rows per block; the first that fits wins.
    candidates = [(8, 2), (4, 2), (8, 1), (4, 1), (2, 1), (1, 1)]
    if not resident:
        # Streamed tiles re-read the weights from L2 once per block tile: favour tall tiles.
        candidates = [(4, 2), (8, 1), (2, 2), (4, 1), (2, 1), (1, 2), (1, 1)]
    for warps, mt in candidates:
        rows = warps * 16 * mt
        smem = act_bytes(rows) + bias_bytes + (weight_bytes if resident else STAGES * slot_bytes)
        if smem <= min(smem_limit, 200 * 1024):
            return CudaPlan(spec, tuple(layers), resident, warps, mt, STAGES, wa, wb, smem)
    need = act_bytes(16) + bias_bytes + STAGES * slot_bytes
    raise SpecError(
        f"{spec.describe()}: a 16-row tile needs {need // 1024} KB of shared memory, over the "
        f"{smem_limit // 1024} KB limit; split the chain or use --precision fp32")


def template_params(spec: MLPSpec) -> dict:
    """The flat dict templates/cuda_kernel.cu.j2 is rendered with."""
    params = {
        "sym": spec.name,
        "io_half": spec.io_dtype == "f16",
        "num_layers": len(spec.layers),
        "prelude": ex.C_PRELUDE,
        "widths": list(spec.widths),
        "describe": spec.describe(),
        "tensor_cores": spec.precision in ("fp16", "bf16"),
        "bf16": spec.precision == "bf16",
        "fp32_layers": [
            {"index": i, "k": l.in_features, "n": l.out_features, "has_bias": l.has_bias,
             "act": ex.render_c(l.activation, "v"), "last": i == len(spec.layers) - 1}
            for i, l in enumerate(spec.layers)
        ],
        "max_width": max(spec.widths),
    }
    if not params["tensor_cores"]:
        return params
    plan = make_plan(spec)
    params.update({
        "resident": plan.resident,
        "warps": plan.warps,
        "mt": plan.mt,
        "stages": plan.stages,
        "rows_per_warp": plan.rows_per_warp,
        "width_a": plan.width_a,
        "width_b": plan.width_b,
        "smem_bytes": plan.smem_bytes,
        "weight_elems": plan.weight_elems,
        "bias_elems": plan.bias_elems,
        "slot_elems": plan.slot_elems,
        "total_chunks": plan.total_chunks,
        "layers": [
            {"index": l.index, "k": l.k, "n": l.n, "kc": l.kc, "nc": l.nc, "kp": l.kp, "np": l.np_,
             "n_kchunks": l.n_kchunks, "n_nchunks": l.n_nchunks, "n_chunks": l.n_chunks, "chunk_elems": l.chunk_elems,
             "chunk_first": l.chunk_first, "chunk_end": l.chunk_first + l.n_chunks,
             "w_offset": l.w_offset, "b_offset": l.b_offset,
             "has_bias": spec.layers[l.index].has_bias,
             "act": ex.render_c(spec.layers[l.index].activation, "v"),
             "src": "A" if l.index % 2 == 0 else "B", "dst": "B" if l.index % 2 == 0 else "A",
             "last": l.index == len(plan.layers) - 1}
            for l in plan.layers
        ],
    })
    return params
