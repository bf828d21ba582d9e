"""Tile and shared-memory plan of the fused CUDA kernel for one MLPSpec.

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

Widths are padded to the tile (K to a multiple of KC, N to a multiple of NC); padding columns of the
activations are written as zeros, so padded weights (zeros) never multiply garbage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import expr as ex
from .spec import MLPSpec, SpecError

SMEM_LIMIT = 227 * 1024   # dynamic shared memory a block may use on sm_90 (sm_80: 163 KB)
KC_MAX = 64               # input features per chunk
NC_STREAMED_MAX = 256     # output columns per streamed chunk
RESIDENT_NP_MAX = 256     # widest layer the resident design accumulates in registers (MT=1)


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
    w_offset: int     # offset of the layer's first chunk in the packed weights (elements)
    b_offset: int     # offset of the layer's bias in the packed biases (floats)

    @property
    def n_kchunks(self) -> int:
        return self.kp // self.kc

    @property
    def n_nchunks(self) -> int:
        return self.np_ // self.nc

    @property
    def n_chunks(self) -> int:
        return self.n_kchunks * self.n_nchunks

    @property
    def chunk_elems(self) -> int:
        return self.nc * (self.kc + 8)


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
class CudaPlan:
    spec: MLPSpec
    layers: tuple[LayerPlan, ...]
    resident: bool
    # resident design
    warps: int = 0
    mt: int = 0
    act_ld: int = 0
    smem_bytes: int = 0
    # streamed design
    width_a: int = 0
    width_b: int = 0
    variants: tuple[Variant, ...] = field(default_factory=tuple)

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

    def describe(self) -> str:
        if self.resident:
            return f"resident weights, {self.warps} warps x {16 * self.mt} rows, {self.smem_bytes // 1024} KB smem"
        return "streamed weights, " + ", ".join(f"{v.name} {v.bm}-row tiles ({v.smem_bytes // 1024} KB)" for v in self.variants)


def _layer_plans(spec: MLPSpec, nc_of) -> list[LayerPlan]:
    """Chunk shapes per layer. A layer's padded input width is exactly the padded output width of the
    layer before (the columns that layer writes, zeros included), so no unwritten column is ever read."""
    plans, chunk, w_off, b_off = [], 0, 0, 0
    kp = None
    for i, l in enumerate(spec.layers):
        if kp is None:
            kc = min(_round_up(l.in_features, 16), KC_MAX)
            kp = _round_up(l.in_features, kc)
        else:
            kc = next(c for c in (KC_MAX, 48, 32, 16) if kp % c == 0)
        nc = nc_of(l.out_features)
        p = LayerPlan(i, l.in_features, l.out_features, kc, nc, kp,
                      _round_up(l.out_features, nc), chunk, w_off, b_off)
        kp = p.np_
        plans.append(p)
        chunk += p.n_chunks
        w_off += p.n_chunks * p.chunk_elems
        b_off += p.np_
    return plans


def _streamed_nc(n: int) -> int:
    n16 = _round_up(n, 16)
    if n16 <= NC_STREAMED_MAX:
        return n16
    # Wider layers: the chunk width (256, 192 or 128) that pads least.
    return min((256, 192, 128), key=lambda c: (_round_up(n, c) - n, -c))


def _resident_plan(spec: MLPSpec, smem_limit: int) -> CudaPlan | None:
    layers = _layer_plans(spec, lambda n: _round_up(n, 16))
    widest = max(l.np_ for l in layers)
    if widest > RESIDENT_NP_MAX:
        return None
    mt = 2 if widest <= 64 else 1
    act_ld = max([l.kp for l in layers] + [l.np_ for l in layers[:-1]]) + 8
    fixed = sum(l.np_ for l in layers) * 4 + sum(l.n_chunks * l.chunk_elems for l in layers) * 2
    best = None
    for warps in (16, 12, 8, 4):
        smem = fixed + warps * 16 * mt * act_ld * 2
        if smem > smem_limit:
            continue
        per_sm = min(228 * 1024 // (smem + 1024), 64 // warps)
        score = min(per_sm * warps, 32)
        if best is None or score > best[0]:
            best = (score, warps, smem)
    if best is None:
        return None
    return CudaPlan(spec, tuple(layers), True, warps=best[1], mt=mt, act_ld=act_ld, smem_bytes=best[2])


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


def _streamed_plan(spec: MLPSpec, smem_limit: int) -> CudaPlan:
    layers = _layer_plans(spec, _streamed_nc)
    wa = max(l.kp for l in layers[0::2])
    wb = max((l.kp for l in layers[1::2]), default=0)
    bias = sum(l.np_ for l in layers) * 4
    slot = max(l.chunk_elems for l in layers) * 2
    variants = []
    for name, bms, warps, prefer_rows in (("tall_tiles", (128, 64), 8, True), ("short_tiles", (32, 16), 8, False)):
        for bm in bms:
            for stages in (3, 2):
                smem = bias + stages * slot + bm * ((wa + 8) + ((wb + 8) if wb else 0)) * 2
                if smem <= smem_limit:
                    tilings = tuple(_tiling(bm, warps, l.nc, prefer_rows) for l in layers)
                    variants.append(Variant(name, bm, warps, stages, tilings, smem))
                    break
            else:
                continue
            break
    if not variants:
        need = bias + 2 * slot + 16 * ((wa + 8) + (wb + 8)) * 2
        raise SpecError(f"{spec.describe()}: even a 16-row tile needs {need // 1024} KB of shared memory "
                        f"(over {smem_limit // 1024} KB); use --precision fp32 or split the chain")
    if len(variants) == 2 and variants[0].bm == variants[1].bm:
        variants = variants[:1]
    return CudaPlan(spec, tuple(layers), False, width_a=wa, width_b=wb, variants=tuple(variants))


def make_plan(spec: MLPSpec, smem_limit: int = SMEM_LIMIT) -> CudaPlan:
    if spec.precision not in ("fp16", "bf16"):
        raise SpecError(f"{spec.precision} has no tensor-core plan (it runs on the CUDA-core kernel)")
    return _resident_plan(spec, smem_limit) or _streamed_plan(spec, smem_limit)


def _layer_params(spec: MLPSpec, plan: CudaPlan) -> list[dict]:
    out = []
    for l in plan.layers:
        src = "A" if (plan.resident or l.index % 2 == 0) else "B"
        dst = "A" if (plan.resident or l.index % 2 == 1) else "B"
        out.append({
            "index": l.index, "k": l.k, "n": l.n, "kc": l.kc, "nc": l.nc, "kp": l.kp, "np": l.np_,
            "n_kchunks": l.n_kchunks, "n_nchunks": l.n_nchunks, "n_chunks": l.n_chunks,
            "chunk_elems": l.chunk_elems, "chunk_first": l.chunk_first, "chunk_end": l.chunk_first + l.n_chunks,
            "w_offset": l.w_offset, "b_offset": l.b_offset, "src": src, "dst": dst,
            "last": l.index == len(plan.layers) - 1,
        })
    return out


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
        # Hidden layers of the tensor-core kernel round their activations to fp16/bf16 at once: they use
        # the fast intrinsic forms. The last layer (written in the io type) and fp32 keep libm's.
        "acts": [{"index": i, "code": ex.render_c(l.activation, "v",
                                                  fast=spec.precision in ("fp16", "bf16") and i < len(spec.layers) - 1)}
                 for i, l in enumerate(spec.layers)],
        "fp32_layers": [{"index": i, "k": l.in_features, "n": l.out_features, "last": i == len(spec.layers) - 1}
                        for i, l in enumerate(spec.layers)],
        "max_width": max(spec.widths),
    }
    if not params["tensor_cores"]:
        params["plan_text"] = "CUDA cores, fp32"
        return params
    plan = make_plan(spec)
    params.update({
        "plan_text": plan.describe(),
        "resident": plan.resident,
        "weight_elems": plan.weight_elems,
        "bias_elems": plan.bias_elems,
        "slot_elems": plan.slot_elems,
        "total_chunks": plan.total_chunks,
        "layers": _layer_params(spec, plan),
        "warps": plan.warps, "mt": plan.mt, "act_ld": plan.act_ld, "smem_bytes": plan.smem_bytes,
        "width_a": plan.width_a, "width_b": plan.width_b,
        "variants": [
            {"name": v.name, "bm": v.bm, "warps": v.warps, "stages": v.stages, "smem_bytes": v.smem_bytes,
             "tilings": [{"wm": t.wm, "wn": t.wn, "mt": t.mt, "nt8": t.nt8} for t in v.tilings]}
            for v in plan.variants
        ],
    })
    return params
