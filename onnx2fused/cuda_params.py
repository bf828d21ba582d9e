"""The flat parameter dicts of the fused CUDA kernels' templates (resident, streamed, fp32), from a plan.

Every number and string a template prints is computed here (or in the plan); the templates only place
them. Nothing here plans: the plan comes in (plan/choose.py made it).
"""
from __future__ import annotations

from . import expr as ex
from .block_params import block_params
from .plan.fused import ELEM_BYTES, Fp32Plan, FusedPlan, elem_bytes, row_pad
from .spec import MLPSpec


def act_params(spec: MLPSpec, padded_widths: list[int], prescaled: bool = False) -> list[dict]:
    """Each layer's activation code, and its per-channel constant arrays sized to the columns the kernel
    computes (`padded_widths`). Hidden layers of the tensor-core kernel round their activations to
    fp16/bf16/tf32 at once: they use the fast intrinsic forms, and those of bf16 chains the hardware
    approximations too (expr.render_c's fast="bf16"; every design that renders activations from here: the
    fused kernels, and the wide design's GEMM epilogues, GEMV and FFN unit). The last layer (written in the io type) and
    fp32 keep libm's. `packed`: the fp16x2 function of a hidden layer whose pair of outputs is computed in
    packed fp16 arithmetic (spec.packed_layers), else ""; `prescaled`: its form of prescaled accumulators
    (expr.PackedForm.prescale: the kernel packs such a layer's weights and bias scaled)."""
    out = []
    packed = spec.packed_layers
    for i, (l, size) in enumerate(zip(spec.layers, padded_widths)):
        arrays = ex.chan_arrays(l.activation, f"kChan{i}_")
        fast = spec.precision in ELEM_BYTES and i < len(spec.layers) - 1
        fast = "bf16" if fast and spec.precision == "bf16" else fast   # (hardware approximations: ex.FAST_C_BF16)
        chans = [{"name": name, "size": size, "init": ex.c_array_values(c, size)} for c, name in arrays.items()]
        out.append({"index": i, "chans": chans,
                    "code": ex.render_c(l.activation, "v", fast=fast, col="col", arrays=arrays,
                                        load="__ldg(&{array}[{col}])"),
                    "packed": _packed_device(l.activation, prescaled) if i in packed else ""})
    return out


def _packed_device(activation: ex.Expr, prescaled: bool) -> str:
    form = ex.packed_form(activation)
    return form.prescaled_device if prescaled else form.device


def spec_params(spec: MLPSpec) -> dict:
    """What every CUDA template prints about the chain itself."""
    return {
        "sym": spec.name,
        "io_half": spec.io_dtype == "f16",
        "num_layers": len(spec.layers),
        "prelude": ex.C_PRELUDE,
        "widths": list(spec.widths),
        "describe": spec.describe(),
        "tensor_cores": spec.precision in ELEM_BYTES,
        "precision": spec.precision,
        "bf16": spec.precision == "bf16",
        "acts": act_params(spec, [l.out_features for l in spec.layers]),
        "any_gated": spec.has_gated,
        # gated: W [k, 2n] (gate columns, then up), bias 2n; wcols the weight's columns
        "fp32_layers": [{"index": i, "k": l.in_features, "n": l.out_features, "last": i == len(spec.layers) - 1,
                         "gated": l.gated, "wcols": l.weight_columns,
                         "offset": "0" if i == 0 else f"kW{i - 1} + kWsz{i - 1}"}   # its weights follow the layer before
                        for i, l in enumerate(spec.layers)],
        "max_width": spec.widest_row,
        "skip": list(spec.skip), "skip_width": spec.skip_width,   # these layers read [x padded, the layer before's output]
        "pool": spec.pool is not None,   # the last layer's output pooled over each group's rows (o2f_pool.cuh)
        "pool_op": spec.pool_code,   # kPoolOp: 0 max, 1 sum, 2 mean
        "pool_name": spec.pool_op or "",
        **block_params(spec),   # a transformer block's norm in front and residual behind
    }


def fp32_params(plan: Fp32Plan) -> dict:
    return {**spec_params(plan.spec), "plan_text": plan.describe()}


def _layer_params(plan: FusedPlan) -> list[dict]:
    k_step = 32 // elem_bytes(plan.spec)  # features per mma.sync: m16n8k16 (fp16/bf16), m16n8k8 (tf32)
    pad = row_pad(plan.spec)
    out = []
    for l in plan.layers:
        # A pair's first layer writes H instead of dst; its second reads H instead of src.
        src = "H" if l.index - 1 in plan.pairs else "A" if (plan.resident or l.index % 2 == 0) else "B"
        if plan.spec.skip and not plan.resident and l.index == 0:
            src = "X"   # the input tile in a buffer of its own, which the skip layer reads again
        dst = "H" if l.index in plan.pairs else "A" if (plan.resident or l.index % 2 == 1) else "B"
        out.append({
            "index": l.index, "k": l.k, "n": l.n, "kc": l.kc, "nc": l.nc, "kp": l.kp, "np": l.np_,
            "n_kchunks": l.n_kchunks, "n_nchunks": l.n_nchunks, "n_chunks": l.n_chunks,
            "chunk_elems": l.chunk_elems, "chunk_first": l.chunk_first, "chunk_end": l.chunk_first + l.n_chunks,
            "w_offset": l.w_offset, "b_offset": l.b_offset, "src": src, "dst": dst,
            "scale": f"{plan.spec.prescale(l.index)!r}f",   # weights and bias packed times (prescaled forms)
            "last": l.index == len(plan.layers) - 1,
            "pair_first": l.index in plan.pairs, "pair_second": l.index - 1 in plan.pairs,
            "prev": l.index - 1,
            "k_steps": l.kc // k_step,        # mma steps per chunk
            "ldw": l.kc + pad,                # row stride of a packed chunk
            # n8 tiles (of the GEMM: a gated layer's gate and up interleaved), A fragments out, A fragments in
            "n8": l.cols // 8, "n16": l.np_ // 16, "k16": l.kp // 16,
            # the skip layer: its first k-chunks read x's columns of the input tile, its A fragments hold the rest
            "skip_chunks": l.skip // l.kc, "k16_h": (l.kp - l.skip) // 16,
            "gated": l.gated, "cols": l.cols,
            # a pair's first layer: the next layer's k-chunks per hidden block
            "block_kchunks": l.nc // plan.layers[l.index + 1].kc if l.index in plan.pairs else 0,
        })
    return out


def _tiling_params(t) -> dict:
    return {"wm": t.wm, "wn": t.wn, "mt": t.mt, "nt8": t.nt8,
            "warps": t.wm * t.wn, "rows": 16 * t.mt, "cols": 8 * t.nt8}   # busy warps, each rows x cols


def _smem_limit_text(limit: int) -> str:
    """The plan's shared-memory bound as the kernel's static_assert writes it."""
    return f"{limit // 1024} * 1024" if limit % 1024 == 0 else str(limit)


def fused_params(plan: FusedPlan) -> dict:
    """The resident or the streamed template's parameters."""
    spec = plan.spec
    params = spec_params(spec)
    params.update({
        "plan_text": plan.describe(),
        "resident": plan.resident,
        "pad": row_pad(spec),
        "k_step": 32 // elem_bytes(spec),  # features per mma.sync: m16n8k16 (fp16/bf16), m16n8k8 (tf32)
        "weight_elems": plan.weight_elems,
        "bias_elems": plan.bias_elems,
        "slot_elems": plan.slot_elems,
        "total_chunks": plan.total_chunks,
        "layers": _layer_params(plan),
        # padded columns run the activation too; packed ones from prescaled accumulators (MLPSpec.prescale)
        "acts": act_params(spec, [l.np_ for l in plan.layers], prescaled=True),
        "warps": plan.warps, "mt": plan.mt, "act_ld": plan.act_ld, "smem_bytes": plan.smem_bytes,
        "smem_limit": _smem_limit_text(plan.smem_limit),
        "prefetch_vectors": plan.prefetch_vectors,
        "register_activations": plan.register_activations,
        "width_a": plan.width_a, "width_b": plan.width_b, "hidden_ld": plan.hidden_ld, "width_x": plan.width_x,
        # a block's norm scale (and bias) in the bias array, after the layers' biases
        "norm_offset": plan.norm_offset, "norm_bias_at": plan.norm_offset + params["norm_bias_offset"],
        "variants": [
            {"name": v.name, "bm": v.bm, "warps": v.warps, "stages": v.stages, "smem_bytes": v.smem_bytes,
             "tilings": [_tiling_params(t) for t in v.tilings]}
            for v in plan.variants
        ],
    })
    return params
