"""Which design runs a spec, and its plan: the only module that knows every design.

    make_plan(spec, options, wide) -> Plan      wgmma where it applies and cost.wgmma_wins (Hopper; the
                                                library keeps the resident/streamed kernel for other GPUs),
                                                else resident where it exists (narrow chains: one kernel,
                                                weights on chip), else the faster of streamed and wide by
                                                the cost model at cost.NOMINAL_ROWS rows; fp32: CUDA cores

`options.design` forces a design where it is possible (experiments and tests). The wide design's
segmentation is searched here: a fused tail (resident or streamed) for narrow trailing layers where the
cost model finds it faster (`best_tail`).
"""
from __future__ import annotations

from dataclasses import replace

from ..spec import MLPSpec, SpecError
from . import cost, fused, wgmma, wide
from .options import CUDA_BLOCKS_ENV, DESIGN_ENV, WGMMA_ENV, PlanOptions, WideOptions
from .padding import ALIGN
from .protocol import Plan

DEFAULT_OPTIONS = PlanOptions()


def make_plans(specs, options: PlanOptions = DEFAULT_OPTIONS,
               wide_options: dict[str, WideOptions] | None = None) -> dict[str, Plan]:
    """{spec name: plan} for the distinct specs of `specs`; `wide_options`: per spec name."""
    wide_options = wide_options or {}
    out: dict[str, Plan] = {}
    for spec in specs:
        if spec.name not in out:
            out[spec.name] = make_plan(spec, options, wide_options.get(spec.name))
    return out


def make_plan(spec: MLPSpec, options: PlanOptions = DEFAULT_OPTIONS, wide_options: WideOptions | None = None) -> Plan:
    """The plan of `spec`. `wide_options`: the wide design's kernel choices, tuning build or fixed
    segmentation, when the wide design is taken. SpecError when no design can run the spec."""
    if spec.precision == "fp32":
        return fused.Fp32Plan(spec)
    if spec.precision not in fused.ELEM_BYTES:
        raise SpecError(f"{spec.precision} has no CUDA plan")
    wide_options = wide_options or WideOptions()
    smem = options.smem_limit or fused.SMEM_LIMIT
    resident = fused.resident_plan(spec, smem, **options.resident.given())
    try:
        streamed, streamed_error = fused.streamed_plan(spec, smem, **options.streamed.given()), None
    except SpecError as e:
        streamed, streamed_error = None, e
    wide_why = (wide.wide_reason_refused(spec) or options.wide_unavailable
                or ("the wide design has no pool over rows" if spec.pool else None))
    forced = options.design
    fallback = resident if resident is not None else streamed   # the wgmma plan's kernel for other GPUs
    if forced == "wgmma" or (forced == "auto" and options.wgmma):
        plan = _wgmma(spec, fallback, smem, forced == "wgmma", options.wgmma_overrides.given())
        if plan is not None:
            return plan
    if forced == "resident" and resident is not None:
        return resident
    if forced == "streamed" and streamed is not None:
        return streamed
    if forced == "wide" and wide_why is None:
        return wide_plan(spec, wide_options, options, f"forced by {DESIGN_ENV}=wide")
    if resident is not None:
        return resident
    if streamed is None:
        if wide_why is not None:
            raise SpecError(f"{streamed_error}; the wide design cannot take it either: {wide_why}")
        return wide_plan(spec, wide_options, options,
                         f"chosen because the streamed kernel cannot hold it ({short_reason(streamed_error)})")
    if wide_why is not None:
        return streamed
    start = wide_options.tail_from
    if start is None:   # the cost model's split, searched once: the wide plan takes it as it is
        start, t_wide, tail = best_tail(spec, options)
    else:
        tail = tail_plan(spec, start, options) if start else None
        t_wide = cost.estimate_wide(spec, cost.NOMINAL_ROWS, start, tail)
    t_streamed = cost.estimate_streamed(spec, streamed)
    if t_wide * cost.WIDE_MARGIN < t_streamed:
        return _wide_layout(spec, wide_options, f"chosen by the cost model at {cost.NOMINAL_ROWS} rows: "
                                                f"~{_us(t_wide)} vs ~{_us(t_streamed)} streamed", start, tail,
                            options)
    return streamed


def block_refused(spec: MLPSpec, options: PlanOptions = DEFAULT_OPTIONS) -> str | None:
    """Why a library with CUDA kernels should keep the norm in front and the residual behind of the block
    `spec` as stock ops (library.block_refusal), or None: a fused kernel runs them. The precision is not
    known yet (automatic precision comes later), so
      * where the layers alone go to the wide design at fp16 (forced, or the cost model's choice), the wide
        design runs the norm (as its conversion pass) and the residual (as the last GEMM's source operand)
        too; where it cannot (a residual behind an activation, or after a narrow last layer), the layers
        stay wide unless one fused kernel with the block is estimated faster than the wide plan plus the
        norm and the Add as stock passes;
      * every precision must plan with them: tf32 must (the largest operands: fp16/bf16 plans need less
        shared memory, fp32 runs on CUDA cores); for a block the wide design runs, fp32 must (automatic
        precision skips tf32 there)."""
    if not options.cuda_blocks:
        return f"{CUDA_BLOCKS_ENV}=off keeps a block's norm and residual out of the CUDA kernels"
    fp16 = replace(spec, precision="fp16", act_math="packed")
    layers = replace(fp16, norm=None, residual=False)
    try:
        alone = make_plan(layers, options)
    except SpecError:
        alone = None   # the layers alone cannot run either: their own error comes when they are planned
    why_not_wide = wide.wide_reason_refused(fp16)   # None: the wide design runs the block, norm and residual
    if alone is not None and alone.design == "wide" and why_not_wide is not None:
        widths = " -> ".join(map(str, spec.widths))
        if options.design == "wide":
            return f"its layers {widths} run in the wide design ({DESIGN_ENV}=wide), and {why_not_wide}"
        t_wide = (cost.estimate_wide(layers, cost.NOMINAL_ROWS, alone.tail_from, alone.tail)
                  + cost.estimate_stock_block(fp16))
        try:
            fused_plan = make_plan(fp16, options)
        except SpecError:
            fused_plan = None
        # the block's kernel is streamed here: a resident one would have taken the layers alone too
        t_fused = (cost.estimate_streamed(fp16, fused_plan)
                   if fused_plan is not None and fused_plan.design == "streamed" else None)
        if t_fused is None or t_fused > t_wide:
            fused = f", vs ~{_us(t_fused)} in one streamed kernel" if t_fused is not None else ""
            stock = " and ".join(w for w, on in (("the norm", spec.norm is not None), ("the Add", spec.residual)) if on)
            return (f"the cost model runs its layers {widths} in the wide design (~{_us(t_wide)} at "
                    f"{cost.NOMINAL_ROWS} rows with {stock} as stock ops{fused}), and {why_not_wide}")
    try:
        make_plan(replace(spec, precision="tf32", act_math="packed"), options)
    except SpecError as e:
        if alone is None or alone.design != "wide" or why_not_wide is not None:
            return str(e)
        # a wide block: automatic precision skips tf32, which no CUDA design plans here (convert.plannable),
        # and goes from bf16 to fp32, which must plan it
        try:
            make_plan(replace(spec, precision="fp32", act_math="packed"), options)
        except SpecError as e32:
            return str(e32)
    return None


def skip_split(spec: MLPSpec) -> tuple[MLPSpec, MLPSpec]:
    """The two chains its last skip connection splits `spec` into: layers before that skip layer (with
    the skips before it), and from it on reading the Concat's K0 + N_{j-1} columns (no padding)."""
    j = spec.skip[-1]
    head = replace(spec, layers=spec.layers[:j], skip=spec.skip[:-1])
    first = replace(spec.layers[j], in_features=spec.layer_input(j) + spec.widths[0])
    return head, replace(spec, layers=(first,) + spec.layers[j + 1:], skip=())


def _estimate(spec: MLPSpec, plan: Plan) -> float | None:
    """The cost model's seconds of a streamed or wide plan at NOMINAL_ROWS, else None (not modelled)."""
    if plan.design == "streamed":
        return cost.estimate_streamed(spec, plan)
    if plan.design == "wide":
        return cost.estimate_wide(spec, cost.NOMINAL_ROWS, plan.tail_from, plan.tail)
    return None


def skip_refused(spec: MLPSpec, options: PlanOptions = DEFAULT_OPTIONS) -> str | None:
    """Why a library with CUDA kernels should end `spec` (fp16, with a skip connection) at its Concat, or
    None: one kernel runs it. SpecError where no design plans it (skip_refusal says so). Where the joined
    chain runs the streamed kernel and a part of the split goes to the wide design (DeepSDF's 512-wide
    layers), the split is kept unless the cost model puts the joined kernel ahead of the parts plus the
    Concat's traffic (it reads x and h and writes both); resident and wgmma plans of the joined chain take
    the skip (NeRF's trunk: 6.27 -> 4.56 ms through ORT, RESULTS.md forty-first run); a streamed joined
    chain whose split has a part in the wgmma kernel stays split (NeRF's trunk joined: 1.76 ms in wgmma,
    4.27 in the streamed kernel)."""
    joined = make_plan(spec, options)
    t_joined = _estimate(spec, joined)
    if t_joined is None:
        return None
    parts = [(s, make_plan(s, options)) for s in skip_split(spec)]
    if any(p.design == "wgmma" for _, p in parts):
        return ("a part of its split runs the Hopper wgmma kernel, the joined chain only the streamed one "
                f"({' + '.join(p.design for _, p in parts)} against streamed)")
    if not any(p.design == "wide" for _, p in parts):
        return None
    times = [_estimate(s, p) for s, p in parts]
    if any(t is None for t in times):
        return None
    io = 2 if spec.io_dtype == "f16" else 4
    concat = 2 * cost.NOMINAL_ROWS * parts[1][0].widths[0] * io / cost.HBM_BPS + cost.LAUNCH_S
    t_split = sum(times) + concat
    if t_joined <= t_split:
        return None
    return (f"its layers run faster split there (the cost model at {cost.NOMINAL_ROWS} rows: the streamed kernel "
            f"~{_us(t_joined)} joined, {' + '.join(p.design for _, p in parts)} ~{_us(t_split)} with the Concat)")


def wgmma_refused(spec: MLPSpec, options: PlanOptions = DEFAULT_OPTIONS) -> str | None:
    """Why the wgmma design cannot run `spec` (None: it can), for `inspect` and the tests."""
    if spec.precision not in fused.ELEM_BYTES:
        return f"{spec.precision} has no tensor-core kernel"
    return wgmma.wgmma_reason_refused(spec, options.smem_limit or fused.SMEM_LIMIT, options.wgmma_overrides.blocks)


def wgmma_note(spec: MLPSpec, plan: Plan) -> str:
    """Why a tensor-core plan of another design is not the wgmma one ("" for wgmma and fp32 plans, and
    for wide plans, whose own text says which CUTLASS kernels run on Hopper): for the report and `inspect`."""
    if plan.design in ("wgmma", "fp32", "wide"):
        return ""
    why = wgmma_refused(spec) or _wgmma_not_chosen(spec)
    return f"Hopper wgmma not used: {why or f'switched off ({WGMMA_ENV}=off; {DESIGN_ENV}=wgmma forces it)'}"


def _wgmma_not_chosen(spec: MLPSpec) -> str | None:
    """Why the cost model leaves a spec the wgmma design can run to mma.sync (None: it picks wgmma)."""
    if not cost.wgmma_wins(spec):
        return f"no hidden layer of >= {cost.WGMMA_MIN_WIDTH} outputs (mma.sync is as fast there)"
    return None


def _wgmma(spec: MLPSpec, fallback, smem: int, forced: bool, overrides: dict) -> wgmma.WgmmaPlan | None:
    """The wgmma plan where the design applies and (unless forced) the cost model prefers it."""
    if fallback is None or wgmma.wgmma_reason_refused(spec, smem, overrides.get("blocks")) is not None:
        return None
    if forced:
        reason = f"forced by {DESIGN_ENV}=wgmma"
    elif _wgmma_not_chosen(spec) is None:
        kind = "hidden or pooled" if spec.pool is not None else "hidden"
        reason = (f"chosen: {cost.wgmma_wide_layers(spec)} {kind} layer(s) of >= {cost.WGMMA_MIN_WIDTH} outputs, where wgmma "
                  "beat mma.sync on the H100")
    else:
        return None
    return wgmma.make_wgmma_plan(spec, fallback, reason, smem, **overrides)


def wide_plan(spec: MLPSpec, wide_options: WideOptions | None = None, options: PlanOptions = DEFAULT_OPTIONS,
              reason: str = "") -> wide.WidePlan:
    """The wide design's plan of `spec`, whatever the cost model would pick: the fused tail the cost
    model prefers unless `wide_options.tail_from` fixes it. SpecError where the design cannot take it."""
    wide_options = wide_options or WideOptions()
    why = wide.wide_reason_refused(spec)
    if why:
        raise SpecError(f"{spec.describe()}: no wide plan: {why}")
    start = wide_options.tail_from
    if start is None:
        start, _, tail = best_tail(spec, options)
    else:
        tail = tail_plan(spec, start, options) if start else None
    return _wide_layout(spec, wide_options, reason, start, tail, options)


def _wide_layout(spec: MLPSpec, w: WideOptions, reason: str, start: int, tail,
                 options: PlanOptions = DEFAULT_OPTIONS) -> wide.WidePlan:
    return wide.make_wide_plan(spec, reason, tail_from=start, tail=tail, choices=w.choices, tuning=w.tuning,
                               tuned_on=w.tuned_on, chain_block=w.chain_block,
                               gemv_rows=wide.GEMV_MAX_ROWS if options.wide_gemv else 0)


# ------------------------------------------------------------------------------------------ segments
def tail_spec(spec: MLPSpec, start: int) -> MLPSpec:
    """Layers [start:] as a chain of their own, fp16 in and out: the fused kernel that finishes a
    segmented plan reads the hidden tensor the last GEMM wrote and writes 16-bit rows."""
    return MLPSpec(spec.layers[start:], "fp16", "f16")


def tail_plan(spec: MLPSpec, start: int, options: PlanOptions = DEFAULT_OPTIONS):
    """The fused kernel (resident or streamed, never wide) for layers [start:], or None where a tail
    cannot start there: fp16 chains only (the hidden tensor is fp16), a hidden width that is a multiple
    of ALIGN (the GEMM writes rows of exactly that stride, the tail reads them contiguously). The tail
    takes the design heuristics' own choices; `options.design` may still force resident or streamed."""
    if spec.precision != "fp16" or not 0 < start < len(spec.layers) or spec.layers[start].in_features % ALIGN:
        return None
    t_spec = tail_spec(spec, start)
    resident = fused.resident_plan(t_spec)
    try:
        streamed = fused.streamed_plan(t_spec)
    except SpecError:
        streamed = None
    if options.design == "streamed" and streamed is not None:
        return streamed
    return resident if resident is not None else streamed


def best_tail(spec: MLPSpec, options: PlanOptions = DEFAULT_OPTIONS,
              rows: int = cost.NOMINAL_ROWS) -> tuple[int, float, Plan | None]:
    """The first layer of the fused tail the cost model prefers (0: every layer a GEMM), the wide
    design's estimate with it (seconds), and the tail's plan. A tail replaces the GEMMs of narrow
    trailing layers (DLRM's 256 -> 64 -> 1: two launches and a round trip of the 64-wide tensor) by one
    pass over the hidden rows. None searched where `options.wide_tail` is off."""
    best, best_t, best_plan = 0, cost.estimate_wide(spec, rows), None
    if not options.wide_tail or spec.residual:   # a tail has no source operand for the residual
        return best, best_t, best_plan
    for start in range(1, len(spec.layers)):
        plan = tail_plan(spec, start, options)
        if plan is not None and (t := cost.estimate_wide(spec, rows, start, plan)) < best_t:
            best, best_t, best_plan = start, t, plan
    return best, best_t, best_plan


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us"


def short_reason(err) -> str:
    """A planner's error without its leading spec description (the text after the first ': ')."""
    text = str(err)
    return text.split(": ", 1)[1] if ": " in text else text
