"""The flat parameter dict of the wide design's templates (cuda_wide.cu.j2, cuda_wide_tune.cu.j2), from
a wide plan: every number, name and launch expression the templates print.
"""
from __future__ import annotations

from .cuda_params import act_params, spec_params
from .plan.sm90 import DEFAULT_CHOICE, MODES, SM90_KERNELS, SM90_SCRATCH, Sm90Choice, sm90_candidates
from .plan.wide import LAUNCH_CACHE_ENV, SM80_ENV, TILE_TABLE, WidePlan
from .spec import MLPSpec


def wide_params(plan: WidePlan) -> dict:
    """The wide template's parameters. Layers with the same activation code share one functor, hence
    one GEMM instantiation per (functor, output type, alignment, tile): less to compile."""
    spec = plan.spec
    acts = act_params(spec, [g.np_ for g in plan.gemms])
    functors: dict[str, str] = {}
    for a in acts:
        functors.setdefault(a["code"], f"Act{len(functors)}")
    act_of = [functors[a["code"]] for a in acts]
    large = {arch: TILE_TABLE[arch][0].name for arch in TILE_TABLE}
    small = {arch: TILE_TABLE[arch][1].name for arch in TILE_TABLE}
    return {
        **spec_params(spec),
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
    """The C symbol prefix of a segmented plan's fused tail (its own translation unit, codegen.render):
    the registry never lists it, the wide source calls it."""
    return f"{spec.name}_tail"


def _tail_params(plan: WidePlan) -> dict | None:
    if not plan.tail_from:
        return None
    last_gemm = plan.gemms[-1]
    return {"sym": tail_symbol(plan.spec), "start": plan.tail_from, "after": plan.tail_from - 1, "src": last_gemm.dst,
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
        "units": len(kernels) + 1,   # translation units: part 0 and one per kernel
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
