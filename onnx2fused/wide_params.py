"""The flat parameter dicts of the wide design's templates, from a wide plan: every number, name and launch
expression the templates print.

    wide_params(plan)      cuda_wide.cu.j2 / cuda_wide_tune.cu.j2: the chain's unit (<chain>_cuda.cu)
    wide_instances(plan)   cuda_wide_instance.cu.j2: one unit per CUTLASS kernel instance the chain runs

A kernel instance is a GEMM kernel configuration (a Hopper one of plan.sm90.SM90_KERNELS, or the CUTLASS
2.x sm80 kernels over plan.wide.TILE_TABLE), its element types and its epilogue (bias + the activation's
code), and nothing of a chain: its file name, namespace and text are made from those only
(`o2f_inst_<config>_<operand>_<output>_a<alignment>_<sha256 of the epilogue>[:12]`), so layers and
libraries that run the same instance render the same file, and build.py compiles it once.
"""
from __future__ import annotations

import hashlib

from . import expr as ex
from .cuda_params import act_params, spec_params
from .plan.ffn import FFN_ENV, HC, MIN_ROWS_PER_SM
from .plan.sm90 import MODES, default_choice, RASTERS, SM90_KERNELS, SM90_SCRATCH, Sm90Choice, sm90_candidates
from .plan.wide import LAUNCH_CACHE_ENV, ROW_QUANTUM, SM80_ENV, TILE_TABLE, WidePlan, sm80_tiles
from .spec import MLPSpec


INSTANCE_TEMPLATE = "cuda_wide_instance.cu.j2"
LIGHT_TEMPLATE = "cuda_wide_light.cu.j2"   # plan.sm90's light kernel: no CUTLASS in its unit
INSTANCE_PREFIX = "o2f_inst_"
# the C++ element types and their tokens in instance names
_TYPE_TOKEN = {"cutlass::half_t": "f16", "cutlass::bfloat16_t": "bf16", "float": "f32"}
# and their raw CUDA types (the light kernel's unit includes no CUTLASS)
_RAW_TYPE = {"cutlass::half_t": "__half", "cutlass::bfloat16_t": "__nv_bfloat16", "float": "float"}


def _elem_type(spec: MLPSpec) -> str:
    return "cutlass::bfloat16_t" if spec.precision == "bf16" else "cutlass::half_t"


def _out_type(spec: MLPSpec, last: bool) -> str:
    return ("cutlass::half_t" if spec.io_dtype == "f16" else "float") if last else _elem_type(spec)


def _sm80_config() -> str:
    """The sm80 kernels' configuration name: the tile table's tiles (the launcher picks among them at run time)."""
    table = ";".join(f"{arch}:{t.name}" for arch in sorted(TILE_TABLE) for t in TILE_TABLE[arch])
    return "Sm80T" + hashlib.sha256(table.encode()).hexdigest()[:6]


def epilogue_text(act_code: str, residual: bool = False, packed: str = "", sm90: bool = False,
                  gated: bool = False) -> str:
    """What an instance's epilogue computes (its name's hash is of this): D = act(acc + bias[n]) in fp32,
    bias always present (zeros where the layer has none), act the activation's CUDA code of `v`; with
    `residual` (a block's last layer), a Hopper (`sm90`) kernel adds the block's input rows as its source
    operand, D = act(acc + C[m, n] + bias[n]); a CUTLASS 2.x one computes D = act(acc + C[m, n]) with C
    the output rows themselves, which hold x + bias when it runs. `packed`: the fp16x2 function that
    computes act instead, on pairs of pre-activations rounded to fp16 (a hidden layer of spec.packed_layers).
    `gated`: the glu in the epilogue (a gated layer's light kernel, W = n gate rows then n up rows): D[m, j] =
    act(g) * u, g and u the two products plus bias, each rounded to D's type first, the product in fp32."""
    act = f"act(v) = {packed}(fp16x2 pairs)" if packed else f"act(v) = {act_code}"
    if gated:
        return (f"D[m, j] = act(g) * u, g = out(acc[m, j] + bias[j]), u = out(acc[m, n + j] + bias[n + j]), "
                f"fp32 product; {act}")
    if residual and sm90:
        return f"D = act(acc + C[m, n] + bias[n]), C = the block's input rows, fp32; {act}"
    if residual:
        return f"D = act(acc + C[m, n]), C = D's rows in place (x + bias), fp32; {act}"
    return f"D = act(acc + bias[n]), fp32; {act}"


def instance_params(config: str, elem: str, out: str, align: int, act_code: str, residual: bool = False,
                    packed: str = "", gated: bool = False) -> dict:
    """One kernel instance's parameters (cuda_wide_instance.cu.j2): `config` a Hopper kernel's name
    (plan.sm90.Sm90Kernel.name) or the sm80 kernels' (_sm80_config), `elem` the 16-bit operand type (a
    tf32 kernel's operands are fp32), `out` the output and bias type, `align` the epilogue's elements
    per access, `act_code` the activation (expr.render_c of `v`), `residual`: the epilogue adds the
    block's input rows (epilogue_text), `packed`: the activation's fp16x2 function where
    the layer's activations are packed (templates/o2f_packed_act.cuh), else ""; `gated`: a gated layer's
    glu in the epilogue (the light kernel only)."""
    kernel = next((k for k in SM90_KERNELS if k.name == config), None)
    sm90 = kernel is not None
    if gated and not (sm90 and kernel.light and not kernel.tf32 and not residual and not packed and out == elem):
        raise ValueError(f"{config}: only the 16-bit light kernel has a gated epilogue (hidden, fp32 activation)")
    operand = "float" if sm90 and kernel.tf32 else elem
    epi = epilogue_text(act_code, residual, packed, sm90, gated)
    name = (f"{INSTANCE_PREFIX}{config}_{_TYPE_TOKEN[operand]}_{_TYPE_TOKEN[out]}_a{align}_"
            f"{hashlib.sha256(epi.encode()).hexdigest()[:12]}")
    light = sm90 and kernel.light
    family = ("onnx2fused's sm_90a GEMM, no CUTLASS" if light else "CUTLASS 3.x sm_90a" if sm90
              else "CUTLASS 2.x sm80 mma.sync")
    params = {
        "template": LIGHT_TEMPLATE if light else INSTANCE_TEMPLATE, "name": name, "file": f"{name}.cu", "sm90": sm90,
        "light": light, "config": config,
        "elem": elem, "out": out, "align": align, "act_code": act_code, "prelude": ex.C_PRELUDE,
        "residual": residual, "packed": packed, "gated": gated,
        "describe": (f"{config} ({family}), {_TYPE_TOKEN[operand]} operands, {_TYPE_TOKEN[out]} output, "
                     f"alignment {align}, epilogue {epi}"),
    }
    if light:
        params.update({"light_elem": _RAW_TYPE[operand], "light_out": _RAW_TYPE[out]})
    elif sm90:
        params.update({"tf32": kernel.tf32, "coop": kernel.stream_k, "bm": kernel.tile[0], "bn": kernel.tile[1],
                       "bk": kernel.tile[2], "cm": kernel.cluster[0], "cn": kernel.cluster[1],
                       "sm90_scratch": SM90_SCRATCH})
    else:
        params.update({
            "tiles": [{"name": t.name, "bm": t.bm, "bn": t.bn, "bk": t.bk, "wm": t.wm, "wn": t.wn, "wk": t.wk,
                       "stages": t.stages} for t in sm80_tiles()],
            # arch major -> tile names; the launcher takes the entry of the largest arch <= the device's
            "arch_tiles": [{"major": arch // 10, "large": TILE_TABLE[arch][0].name, "small": TILE_TABLE[arch][1].name}
                           for arch in sorted(TILE_TABLE, reverse=True)],
        })
    return params


# A gated layer's GEMM writes the gate and up products as they are (its activation is the glu pass's)
IDENTITY_CODE = ex.render_c(ex.X, "v")


def _gemm_instances(plan: WidePlan) -> list[dict]:
    """Per GEMM: its sm80 instance (None for a narrow layer), and (kernel index, instance) of each Hopper
    kernel its dispatch holds (16-bit ones; for layer 0, the tf32 ones of layer0_tf32 as well). A gated
    layer's light kernel is its `glu` instance (the glu in the epilogue: gatedN in cuda_wide.cu.j2), not
    one of its dispatch's (which write the gate and up products for the glu pass)."""
    spec = plan.spec
    acts = act_params(spec, [g.np_ for g in plan.gemms])
    elem = _elem_type(spec)
    out = []
    for g, per in zip(plan.gemms, plan.choices):
        o, code = _out_type(spec, g.last), IDENTITY_CODE if g.gated else acts[g.index]["code"]
        # a packed hidden layer's epilogue evaluates the fp16x2 form the numerics model judged (precision.py)
        packed = "" if g.gated else acts[g.index]["packed"]
        res = g.last and spec.residual   # the block's residual: the last GEMM's source operand

        def instance(config: str) -> dict:   # this GEMM's types and epilogue in kernel configuration `config`
            return instance_params(config, elem, o, g.align_out, code, res, packed)

        chosen = [i for i in plan.sm90_kernels if plan.tuning or any(c.kernel == i for c in per)]
        glu = [(i, instance_params(SM90_KERNELS[i].name, elem, o, g.align_out, acts[g.index]["code"], gated=True))
               for i in chosen if g.gated and g.sm90 and SM90_KERNELS[i].light and not SM90_KERNELS[i].tf32]
        sm90 = [(i, instance(SM90_KERNELS[i].name)) for i in chosen
                if g.sm90 and not SM90_KERNELS[i].tf32 and i not in dict(glu)]
        tf32 = [(i, instance(SM90_KERNELS[i].name))
                for i in plan.sm90_kernels if SM90_KERNELS[i].tf32 and g.index == 0 and plan.tf32_first and g.sm90]
        out.append({"sm80": None if g.narrow else instance(_sm80_config()), "sm90": sm90, "tf32": tf32,
                    "glu": glu[0] if glu else None})
    return out


def wide_instances(plan: WidePlan) -> dict[str, dict]:
    """The kernel instances the chain's unit calls: {file name: instance_params}, each once."""
    found: dict[str, dict] = {}
    for per in _gemm_instances(plan):
        for p in ([per["sm80"]] if per["sm80"] else []) + [p for _, p in per["sm90"] + per["tf32"]] + \
                ([per["glu"][1]] if per["glu"] else []):
            found.setdefault(p["file"], p)
    return dict(sorted(found.items()))


def wide_params(plan: WidePlan) -> dict:
    """The wide template's parameters. Layers with the same activation code share one functor (the
    narrow last layer's); the GEMMs run kernel instances (wide_instances), one per (configuration,
    types, epilogue), declared here and rendered on their own."""
    spec = plan.spec
    acts = act_params(spec, [g.np_ for g in plan.gemms])
    functors: dict[str, str] = {}
    for a in acts:
        functors.setdefault(a["code"], f"Act{len(functors)}")
    act_of = [functors[a["code"]] for a in acts]
    insts = _gemm_instances(plan)
    return {
        **spec_params(spec),
        "plan_text": plan.describe(),
        "k0": spec.widths[0],
        "kp0": plan.gemms[0].kp,
        "row_block": plan.row_block,
        "row_quantum": ROW_QUANTUM,
        "chain_block": plan.chain_block,
        "convert_input": plan.convert_input,
        "xc_offset": plan.xc_offset,
        "sm90_offset": plan.sm90_offset, "sm90_scratch": SM90_SCRATCH,
        **_sm90_params(plan),
        "instances": list(wide_instances(plan).values()),
        "sm80_env": SM80_ENV,
        "launch_cache_env": LAUNCH_CACHE_ENV,
        "h0_offset": plan.h_offsets[0], "h1_offset": plan.h_offsets[1],
        "h_width": plan.h_width,
        "hg_offset": plan.hg_offset,
        "any_gated": plan.hg_width > 0,
        "gemv_rows": plan.gemv_rows,
        "norm_offset": plan.norm_offset,
        "workspace_bytes": plan.workspace_bytes,
        "act_functors": [{"name": name, "code": code} for code, name in functors.items()],
        "gemms": [{"index": g.index, "act": act_of[g.index], "k": g.k, "n": g.n, "kp": g.kp, "np": g.np_, "last": g.last,
                   "align": g.align_out, "w_offset": g.w_offset, "b_offset": g.b_offset,
                   "src": g.src, "dst": g.dst, "sm90": g.sm90, "narrow": g.narrow, "gated": g.gated, "half": g.half,
                   "choices": [_choice_param(c) for c in per],
                   # the launch arguments after the input (run_chain's names: ws, y, r0)
                   "w_expr": f"reinterpret_cast<const elem_t*>(ws + {g.w_offset})",
                   "tail_expr": (f"reinterpret_cast<const {'io_t' if g.last else 'elem_t'}*>(ws + {g.b_offset}), "
                                 + (f"static_cast<io_t*>(y) + r0 * {g.n}, {g.n}" if g.last
                                    else f"hg, {g.np_}" if g.gated else f"{g.dst}, {g.np_}")),
                   # the GEMV path's arguments (o2f_wide_gemv.cuh's gemv): the input rows and their
                   # stride (layer 0: the converted rows, or x in place), and bias, output rows and columns
                   # (a gated layer writes act(gate) * up straight into its hidden buffer: no gate buffer)
                   "gemv_src": ("reinterpret_cast<const elem_t*>(static_cast<const io_t*>(x) + r0 * kK0), kK0"
                                if g.src == "x" else f"{g.src}, {g.kp}"),
                   "gemv_dst": (f"reinterpret_cast<const {'io_t' if g.last else 'elem_t'}*>(ws + {g.b_offset}), "
                                + (f"static_cast<io_t*>(y) + r0 * {g.n}, {g.n}, {g.np_}" if g.last
                                   else f"{g.dst}, {g.half}, {g.half}" if g.gated else f"{g.dst}, {g.np_}, {g.np_}")),
                   # its sm80 instance, and the 16-bit Hopper kernels its dispatch switch holds (tf32 ones
                   # go to layer0_tf32)
                   "sm80_inst": ins["sm80"]["name"] if ins["sm80"] else None,
                   "sm90_cases": [{"kernel": i, "inst": p["name"]} for i, p in ins["sm90"]],
                   # a gated layer's light kernel with the glu in its epilogue (None: GEMM + glu pass only)
                   "glu_case": {"kernel": ins["glu"][0], "inst": ins["glu"][1]["name"]} if ins["glu"] else None}
                  for g, per, ins in zip(plan.gemms, plan.choices, insts)],
        "tail": _tail_params(plan),
        "tf32_first": plan.tf32_first,
        "w0f_offset": plan.w0f_offset,
        "tf32_cases": [{"kernel": i, "inst": p["name"]} for i, p in insts[0]["tf32"]],
        "is_tf32": [int(k.tf32) for k in SM90_KERNELS],
        "ffn": ({"name": ffn_symbol(spec), "min_rows_per_sm": MIN_ROWS_PER_SM, "env": FFN_ENV}
                if plan.ffn else None),
    }


FFN_TEMPLATE = "cuda_wide_ffn.cu.j2"


def ffn_symbol(spec: MLPSpec) -> str:
    """The namespace of a wide plan's one-kernel FFN (its own unit, `<symbol>_cuda.cu`)."""
    return f"{spec.name}_ffn"


def _ffn_packed(spec: MLPSpec, gated: bool) -> tuple[str, float]:
    """The FFN's hidden activation in fp16x2 arithmetic, or ("", 1.0): the prescaled form's function
    (expr.PackedForm: pack_image scales the columns it reads, the gate's alone when gated, by `prescale`,
    and the form starts from the accumulators, one HMUL2 a pair fewer) and that scale, for a packed layer
    (spec.packed_layers) or a packed glu (spec.packed_glu_layers)."""
    if 0 not in (spec.packed_glu_layers if gated else spec.packed_layers):
        return "", 1.0
    form = ex.packed_form(spec.layers[0].activation)
    return form.prescaled_device, form.prescale


def ffn_unit(plan: WidePlan) -> tuple[str, dict] | None:
    """The one-kernel FFN's unit (templates/cuda_wide_ffn.cu.j2): (file name, parameters), or None."""
    f = plan.ffn
    if f is None:
        return None
    spec = plan.spec
    acts = act_params(spec, [2 * f.hp if f.gated else f.hp, f.np_])
    packed, prescale = _ffn_packed(spec, f.gated)
    return f"{ffn_symbol(spec)}_cuda.cu", {
        "template": FFN_TEMPLATE, "name": ffn_symbol(spec), "describe": spec.describe(), "prelude": ex.C_PRELUDE,
        "io_half": spec.io_dtype == "f16", "bf16": spec.precision == "bf16", "k0": f.k0, "kp0": f.kp0, "h": f.h, "hp": f.hp, "n": f.n, "np": f.np_,
        "gated": f.gated, "hc": HC, "stages": f.stages, "slot_bytes": f.slot_bytes, "x_reg_steps": f.x_reg_steps,
        "image_offset": f.image_offset, "bias_offset": f.bias_offset, "min_rows_per_sm": MIN_ROWS_PER_SM,
        "act_code": acts[0]["code"], "packed": packed, "prescale": f"{prescale!r}f", "out_code": acts[1]["code"],
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


def _sm90_params(plan: WidePlan) -> dict:
    """The Hopper kernel choices' parameters (row buckets, modes, candidates)."""
    b = plan.buckets
    return {
        "buckets": list(b),
        # a call of m rows takes the first bucket whose upper bound (geometric mean with the next) >= m
        "bucket_bounds": [int((lo * hi) ** 0.5) for lo, hi in zip(b, b[1:])],
        "modes": list(MODES),
        "sm90_names": [k.name for k in SM90_KERNELS],
        "tuning": plan.tuning,
        "default_choice": _choice_param(default_choice()),
        "candidates": [_choice_param(c) for c in sm90_candidates()],
    }


def _choice_param(c: Sm90Choice) -> dict:
    return {"kernel": c.kernel, "mode": MODES.index(c.mode), "splits": c.splits, "swizzle": c.swizzle,
            "raster": RASTERS.index(c.raster)}
