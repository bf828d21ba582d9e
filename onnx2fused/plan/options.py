"""What planning may be told, as frozen values: read from the environment once, at the edge.

`PlanOptions.from_env()` is called by the entry points (the CLI, `convert()`, `inspect()`, the bench
and benchmark scripts); everything below them takes the options as an argument, so a plan is a function
of (spec, options) only:

  ONNX2FUSED_CUDA_DESIGN  = auto | resident | streamed | wide | wgmma: force a design where it is possible
                            (resident, streamed or wide forced: never wgmma)
  ONNX2FUSED_WGMMA        = off: auto never picks the Hopper wgmma design (plan/wgmma.py); on by default
                            since the whole GPU suite passed with it (benchmarks/RESULTS.md, eighth run)
  ONNX2FUSED_WIDE_TAIL    = off: no segmented wide plans (every layer a GEMM), for comparisons
  ONNX2FUSED_CUDA_BLOCKS  = off: a library with CUDA kernels keeps a transformer block's norm and residual
                            Add as stock ops around the fused layers; on by default: the fused kernel
                            (resident, streamed, fp32) runs them too, since tests/test_gpu_block.py and
                            kernel_check's block cases passed on the H100 (benchmarks/RESULTS.md)
  ONNX2FUSED_WIDE_GEMV    = off: wide plans run every pass as CUTLASS GEMMs; on by default: passes of at most
                            wide.GEMV_MAX_ROWS rows run weight-streaming GEMV kernels (plan/wide.py), since
                            they passed their GPU tests and beat ORT fp16 at LLaMA-7B's 1 and 16 rows
                            (benchmarks/RESULTS.md, eleventh run)
  (and whether the CUTLASS headers the wide design compiles against can be found)

The design-specific overrides (`ResidentOptions`, `StreamedOptions`) replace the heuristics of one design,
for benchmarks/kernel_check.py, which times a plan against its alternatives; None everywhere means the
heuristic's own choice. `WideOptions` are per spec: the wide kernels' choices a tuning run measured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from ..errors import ConversionError

DESIGN_ENV = "ONNX2FUSED_CUDA_DESIGN"
TAIL_ENV = "ONNX2FUSED_WIDE_TAIL"
WGMMA_ENV = "ONNX2FUSED_WGMMA"
CUDA_BLOCKS_ENV = "ONNX2FUSED_CUDA_BLOCKS"
WIDE_GEMV_ENV = "ONNX2FUSED_WIDE_GEMV"
DESIGNS = ("auto", "wide", "streamed", "resident", "wgmma")


def _given(options) -> dict:
    """The fields that are set (not None): keyword arguments of the design's planner."""
    return {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) is not None}


@dataclass(frozen=True)
class ResidentOptions:
    """Overrides of the resident design's heuristics (fused.resident_plan)."""
    mt: int | None = None                         # m16 tiles a warp
    warp_choices: tuple[int, ...] | None = None   # warps per block tried, best occupancy first
    prefetch: bool | None = None                  # the next input tile held in registers
    register_activations: bool | None = None      # hidden activations in registers (16-bit operands)

    def given(self) -> dict:
        return _given(self)


@dataclass(frozen=True)
class StreamedOptions:
    """Overrides of the streamed design's heuristics (fused.streamed_plan)."""
    kc_max: int | None = None                     # input features per weight chunk
    tall_rows: tuple[int, ...] | None = None      # row counts the tall-tile variant tries
    stages_choices: tuple[int, ...] | None = None  # weight-ring depths tried
    pair_hidden: bool | None = None               # FFN-shaped pairs: always, never (None: where it helps)

    def given(self) -> dict:
        return _given(self)


@dataclass(frozen=True)
class WgmmaOptions:
    """Overrides of the wgmma design's heuristics (wgmma.make_wgmma_plan), for benchmarks/kernel_check.py."""
    nwg: int | None = None        # warpgroups per CTA (the register estimate must fit its cap)
    prefetch: int | None = None   # k-steps of the next tile's input held in registers
    chunk_max: int | None = None  # widest chunk of a layer's columns (narrower: fewer accumulator registers)
    cluster: int | None = None    # streamed plans: CTAs of a cluster sharing each chunk's copy (1: none)
    stages: int | None = None     # ring slots (default: 3 where the weights do not fit; given: streams any plan)
    staged_input: bool | None = None   # the next tile's fp32 rows copied into shared memory (STAGED_INPUT)
    bulk_input: bool | None = None     # staged by one cp.async.bulk a row (BULK_INPUT)
    quad_stores: bool | None = None    # the last layer's outputs stored 4 at a time (QUAD_STORES)
    input_parts: int | None = None     # the next tile's rows copied in parts over a pass (plan.wgmma._input_parts)
    prescale: bool | None = None       # packed activations of halved accumulators (PRESCALE)
    store_rows: bool | None = None     # quads stored from per-tile row pointers (STORE_ROWS)
    bias16: bool | None = None         # packed hidden activations add their bias in fp16 (BIAS16)
    blocks: bool | None = None         # transformer blocks (norm, residual) in the wgmma kernel (BLOCKS)

    def given(self) -> dict:
        return _given(self)


@dataclass(frozen=True)
class WideOptions:
    """A wide plan's kernel choices (wide_tune.py's measured ones) and build kind, for one spec."""
    choices: tuple | None = None   # per GEMM, per row bucket, a sm90.Sm90Choice (None: the defaults)
    tuning: bool = False           # the tuning build: every Hopper kernel and the timing entries
    tuned_on: str = ""             # the GPU the choices were measured on
    chain_block: int = 0           # rows per pass through the chain (0: the row block)
    tail_from: int | None = None   # first layer of the fused tail (0: none; None: the cost model's)


@dataclass(frozen=True)
class PlanOptions:
    design: str = "auto"           # DESIGNS: a design to force where it is possible
    wide_tail: bool = True         # segmented wide plans allowed (a fused kernel for narrow trailing layers)
    wide_unavailable: str = ""     # why the wide design cannot be built here ("": it can)
    wgmma: bool = True             # auto may pick the wgmma design (ONNX2FUSED_WGMMA=off: never; forcing works either way)
    cuda_blocks: bool = True       # CUDA libraries fuse blocks' norms and residuals (ONNX2FUSED_CUDA_BLOCKS=off: not)
    wide_gemv: bool = True         # wide plans run passes of few rows as GEMV kernels (ONNX2FUSED_WIDE_GEMV=off: not)
    smem_limit: int | None = None  # shared memory a block may use (None: fused.SMEM_LIMIT, sm_90)
    resident: ResidentOptions = field(default_factory=ResidentOptions)
    streamed: StreamedOptions = field(default_factory=StreamedOptions)
    wgmma_overrides: WgmmaOptions = field(default_factory=WgmmaOptions)

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ConversionError(f"{DESIGN_ENV}={self.design!r}: expected auto, wide, streamed, resident or wgmma")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PlanOptions:
        """The options the environment asks for, and whether the CUTLASS headers can be found."""
        env = os.environ if environ is None else environ
        return cls(design=env.get(DESIGN_ENV, "auto").strip().lower() or "auto",
                   wide_tail=env.get(TAIL_ENV, "auto").strip().lower() != "off",
                   wgmma=env.get(WGMMA_ENV, "on").strip().lower() not in ("off", "0", "no", "false"),
                   cuda_blocks=env.get(CUDA_BLOCKS_ENV, "on").strip().lower() not in ("off", "0", "no", "false"),
                   wide_gemv=env.get(WIDE_GEMV_ENV, "on").strip().lower() not in ("off", "0", "no", "false"),
                   wide_unavailable=_cutlass_missing())


def _cutlass_missing() -> str:
    from ..headers import find_cutlass_headers
    try:
        find_cutlass_headers()
        return ""
    except Exception as e:  # noqa: BLE001 - any failure means "not found"; the message says what to do
        return str(e) or type(e).__name__
