"""The wide CUDA design's plan (onnx2fused/plan/wide.py): which design the cost model picks and why,
the workspace layout (checked by a numpy emulation of the generated kernel's index math), the CUTLASS
header discovery, and the rendered source. No GPU or nvcc needed."""
from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx2fused import build, codegen, headers, library, targets, wide_params
from onnx2fused.cuda_params import act_params
from onnx2fused import expr as ex
from onnx2fused.errors import ConversionError
from onnx2fused.plan import choose, cost, fused, sm90, wide
from onnx2fused.plan.padding import NORM_ALIGN, round_up
from onnx2fused.plan.options import DESIGN_ENV, PlanOptions, WideOptions
from onnx2fused.spec import LayerSpec, MLPSpec, NormSpec, SpecError
from onnx2fused.wide_params import tail_symbol
from plan_support import cuda_source, expanded, render_cuda

# The untuned kernels' C++ names (plan/sm90.py's defaults)
DEFAULT_KERNEL = sm90.SM90_KERNELS[sm90.DEFAULT_CHOICE.kernel].name
DEFAULT_TF32_KERNEL = sm90.SM90_KERNELS[sm90.DEFAULT_TF32_CHOICE.kernel].name

WIDE = PlanOptions(design="wide")


def _spec(widths, act=ex.relu(), precision="fp16", io="f32", last=ex.identity(), gated=()):
    """Layers between `widths`, `act` on the hidden ones; the layers numbered in `gated` are gated
    (act(x Wg + bg) * (x Wu + bu), W [K, 2N])."""
    n = len(widths) - 1
    return MLPSpec(tuple(LayerSpec(a, b, True, act if i < n - 1 else last, gated=i in gated)
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, io)


# ------------------------------------------------------------------------------------------ decisions
def test_head_too_wide_for_streamed_goes_wide_and_says_why():
    plan = choose.make_plan(_spec([9216, 4096, 4096, 1000]))
    assert plan.design == "wide"
    assert "streamed kernel cannot hold it" in plan.reason and "16-row tile" in plan.reason
    text = plan.describe()
    assert text.startswith("wide: 3 tensor-core GEMMs") and "conversion pass" in text


def test_ffn_goes_wide_by_the_cost_model():
    spec = _spec([768, 3072, 768], ex.gelu_erf())
    plan = choose.make_plan(spec)
    assert plan.design == "wide"
    assert "cost model" in plan.reason and "streamed" in plan.reason
    assert cost.estimate_wide(spec) * cost.WIDE_MARGIN < cost.estimate_streamed(
        spec, fused.streamed_plan(spec))


def test_narrow_chains_keep_their_fused_designs():
    narrow = choose.make_plan(_spec([32, 128, 128, 16]), PlanOptions(wgmma=True))  # auto: wgmma, other GPUs: resident
    assert narrow.design == "wgmma" and narrow.fallback.design == "resident"
    assert choose.make_plan(_spec([32, 128, 128, 16]), PlanOptions(wgmma=False)).design == "resident"
    # 512 KB of weights: the wgmma kernel streams them (0.43 vs 0.61 ms for mma.sync on an H100, RESULTS.md);
    # without wgmma, a near tie with the wide design: the one fused kernel
    silu = choose.make_plan(_spec([256, 256, 256, 256, 256], ex.silu()))
    assert silu.design == "wgmma" and silu.streamed and silu.fallback.design == "streamed"
    assert choose.make_plan(_spec([256, 256, 256, 256, 256], ex.silu()), PlanOptions(wgmma=False)).design == "streamed"


def test_short_gemms_are_host_bound_in_the_estimate():
    """A chain of short GEMMs costs at least the host's launches (HOST_LAUNCH_S each, measured)."""
    in_place = _spec([32, 64, 64, 16], io="f16")          # fp16 rows read in place: 3 GEMMs, no conversion
    assert cost.estimate_wide(in_place, rows=256) == pytest.approx(3 * cost.HOST_LAUNCH_S)
    converted = _spec([30, 64, 64, 16])                     # fp32, rows TMA cannot load: conversion + 3 GEMMs
    assert cost.estimate_wide(converted, rows=256) == pytest.approx(4 * cost.HOST_LAUNCH_S)
    assert cost.estimate_wide(_spec([768, 3072, 768]), rows=16384) > 10 * 4 * cost.HOST_LAUNCH_S


def test_memory_bound_first_layer_reads_the_fp32_input_in_place():
    """DLRM's 512 -> 256 first layer: converting the fp32 input costs more than the GEMM, so the wide
    design's default first-layer kernel is a tf32 one reading x in place, and with it the wide design
    beats the streamed kernel (measured: 0.141 vs 0.177 ms through ORT at 65536 rows, RESULTS.md)."""
    spec = _spec([512, 256, 64, 1])
    assert cost.tf32_first_wins(spec)
    plan = choose.make_plan(spec)
    assert plan.design == "wide" and plan.tf32_first and "cost model" in plan.reason
    assert all(c == sm90.DEFAULT_TF32_CHOICE for c in plan.choices[0])
    assert all(c == sm90.DEFAULT_CHOICE for per in plan.choices[1:] for c in per)
    assert "reads the fp32 input in place (tf32)" in plan.describe()
    src = cuda_source(spec)
    assert "cudaError_t layer0_tf32(" in src and "pack_weights<Tf32><<<" in src
    tf32 = src[src.index("cudaError_t layer0_tf32("):]
    assert f"return o2f_inst_{DEFAULT_TF32_KERNEL}_f32_f16_a8_" in tf32[:tf32.index("\n}\n")]
    # the FFN's first layer is compute bound: fp16 after the conversion pass, no fp32 weight copy
    ffn = choose.wide_plan(_spec([768, 3072, 768], ex.gelu_erf()))
    assert not cost.tf32_first_wins(ffn.spec) and not ffn.tf32_first
    assert ffn.w0f_offset == ffn.workspace_bytes   # no region
    # a near tie (mnist's 784 -> 512: ~1.06x) keeps the fp16 instance: the tf32 one is another ~70 s of
    # nvcc in a cold convert; the kernel search still times it (tuning builds hold every tf32 kernel)
    mnist = _spec([784, 512, 512, 10])
    assert 1.0 < cost._first_layer_seconds(mnist, cost.NOMINAL_ROWS, False) / cost._first_layer_seconds(
        mnist, cost.NOMINAL_ROWS, True) < cost.TF32_FIRST_MARGIN
    assert not cost.tf32_first_wins(mnist) and not choose.wide_plan(mnist).tf32_first
    assert wide.with_kernels(choose.wide_plan(mnist), tuning=True).tf32_first
    # fp16 input, or rows TMA cannot load: never
    assert not choose.wide_plan(_spec([512, 256, 64, 1], io="f16")).tf32_first
    assert not choose.wide_plan(_spec([513, 256, 64, 1])).tf32_first


@pytest.mark.parametrize("widths,narrow", [([512, 256, 64, 1], True), ([1000, 520, 3], True),
                                           ([9216, 4096, 4096, 1000], False), ([768, 8], True), ([2048, 8], False)])
def test_narrow_last_layers_take_the_thread_per_row_kernel(widths, narrow):
    """<= 8 outputs (and weights that fit in shared memory as fp32): narrow_layer, never a tensor-core tile."""
    spec = _spec(widths)
    plan = choose.wide_plan(spec, WideOptions(tail_from=0))   # every layer a GEMM (no fused tail)
    last = plan.gemms[-1]
    assert last.last and last.narrow == narrow and not (last.narrow and last.sm90)
    assert all(not g.narrow for g in plan.gemms[:-1])
    src = cuda_source(spec, WIDE, WideOptions(tail_from=0))
    assert (f", io_t, {last.np_}, {last.kp}><<<" in src) == narrow


def test_segmented_plan_runs_narrow_trailing_layers_as_one_fused_kernel():
    """DLRM's 256 -> 64 -> 1 after the wide first layer: one pass of the fused kernel over the fp16 hidden
    rows beats two GEMM launches and the round trip of the 64-wide tensor, by the cost model; the
    FFN and the head have no such tail (their trailing layers are compute-bound GEMMs)."""
    spec = _spec([512, 256, 64, 1])
    t_tail = cost.estimate_wide(spec, cost.NOMINAL_ROWS, 1, choose.tail_plan(spec, 1))
    assert t_tail < cost.estimate_wide(spec)
    plan = choose.make_plan(spec)
    assert plan.design == "wide" and plan.tail_from == 1 == choose.best_tail(spec)[0]
    assert len(plan.gemms) == 1 and not plan.gemms[0].last and plan.gemms[0].dst == "h0"
    tail = choose.tail_plan(spec, 1)
    assert tail.design in ("resident", "streamed") and tail.spec.widths == (256, 64, 1) and tail.spec.io_dtype == "f16"
    assert "segmented: layers 1..2 in one fused kernel" in plan.describe() and tail.describe() in plan.describe()
    for widths in ([768, 3072, 768], [9216, 4096, 4096, 1000]):
        assert choose.wide_plan(_spec(widths)).tail_from == 0
    # where a tail cannot start: bf16 (the tail kernel reads fp16), a hidden width that is not a multiple
    # of 8 (the GEMM's padded rows would not be the tail's contiguous input)
    assert choose.tail_plan(_spec([512, 256, 64, 1], precision="bf16"), 1) is None
    assert choose.tail_plan(_spec([512, 260, 64, 1]), 1) is None
    assert choose.wide_plan(_spec([512, 260, 64, 1])).tail_from == 0
    with pytest.raises(SpecError, match="cannot run as one fused kernel"):
        choose.wide_plan(_spec([512, 260, 64, 1]), WideOptions(tail_from=1))


@pytest.mark.parametrize("io", ["f32", "f16"])
def test_segmented_source_calls_the_tail_it_renders(io):
    """The wide source packs and runs the tail under the tail's own symbol, which the rendered tail
    (the fused kernel's template, fp16 rows in and out) defines; the registry lists only the chain."""
    spec = _spec([512, 256, 64, 1], io=io)
    files = render_cuda([spec])
    sym = tail_symbol(spec)
    tail_src, wide_src = files[f"{sym}_cuda.cu"], files[f"{spec.name}_cuda.cu"]
    for fn in ("cuda_workspace_bytes", "cuda_pack", "cuda_run"):
        assert f'extern "C" int {sym}_{fn}(' in tail_src or f'extern "C" size_t {sym}_{fn}(' in tail_src
        assert f"{sym}_{fn}(" in wide_src
    assert f"{sym}_cuda_pack(w + 1, b + 1," in wide_src
    assert "using io_t = __half;" in tail_src or "io_t = __half" in tail_src
    assert ("widen_output<<<" in wide_src) == (io == "f32")
    assert sym not in files["registry.cc"]
    plan = choose.wide_plan(spec)
    # the region the plan reserves is exactly what the tail's own workspace function returns
    tail = choose.tail_plan(spec, 1)
    assert plan.tail_bytes == tail.weight_elems * 2 + tail.bias_elems * 4 == tail.workspace_bytes
    assert "kBiasOffsetBytes + kBiasElems * sizeof(float)" in tail_src


def test_a_tail_after_several_gemms_reads_the_last_ones_buffer():
    """Forced to start at layer 2: two GEMMs ping-pong h0 -> h1, the tail reads h1, and its regions
    follow the others in the workspace."""
    spec = _spec([1024, 2048, 512, 64, 1])
    plan = choose.wide_plan(spec, WideOptions(tail_from=2))
    assert [g.dst for g in plan.gemms] == ["h0", "h1"] and plan.h_width == 2048
    assert plan.tail_offset >= plan.sm90_offset + sm90.SM90_SCRATCH and plan.tail_offset % wide.REGION_ALIGN == 0
    assert plan.tail_out_offset + plan.row_block * 2 <= plan.workspace_bytes   # the fp16 output staged for y
    src = cuda_source(spec, wide=WideOptions(tail_from=2))
    assert f"{tail_symbol(spec)}_cuda_run(h1, tail_out, m, ws + {plan.tail_offset}, s)" in src
    assert f"{tail_symbol(spec)}_cuda_pack(w + 2, b + 2," in src


def test_tf32_kernels_only_for_an_in_place_first_layer():
    spec = _spec([512, 256, 64, 1])
    nb = len(choose.wide_plan(spec).buckets)
    tf32 = sm90.Sm90Choice(sm90.TF32_KERNELS[0])
    with pytest.raises(SpecError, match="kernel choices do not fit"):
        choose.wide_plan(spec, WideOptions(choices=[[sm90.DEFAULT_CHOICE] * nb, [tf32] * nb, [sm90.DEFAULT_CHOICE] * nb]))
    f16 = _spec([512, 256, 64, 1], io="f16")
    with pytest.raises(SpecError, match="kernel choices do not fit"):
        choose.wide_plan(f16, WideOptions(choices=[[tf32] * nb] + [[sm90.DEFAULT_CHOICE] * nb] * 2))


def test_forced_design():
    plan = choose.make_plan(_spec([512, 256, 64, 1]), WIDE)
    assert plan.design == "wide" and "forced" in plan.reason
    assert choose.make_plan(_spec([768, 3072, 768]), PlanOptions(design="streamed")).design == "streamed"
    with pytest.raises(ConversionError, match="expected auto, wide, streamed, resident or wgmma"):
        PlanOptions(design="fastest")


def test_options_come_from_the_environment_once():
    """The edge reads the environment into frozen options; planning itself never looks at it."""
    env = {DESIGN_ENV: " Wide ", "ONNX2FUSED_WIDE_TAIL": "off"}
    options = PlanOptions.from_env(env)
    assert options.design == "wide" and not options.wide_tail
    assert PlanOptions.from_env({}).design == "auto" and PlanOptions.from_env({}).wide_tail
    with pytest.raises(ConversionError, match="expected auto, wide, streamed, resident or wgmma"):
        PlanOptions.from_env({DESIGN_ENV: "fastest"})
    # no fused tail when the options say so: every layer a GEMM
    dlrm = _spec([512, 256, 64, 1])
    assert choose.make_plan(dlrm).tail_from == 1 and choose.make_plan(dlrm, options).tail_from == 0
    # a wide design the host cannot build (no CUTLASS headers) is never chosen
    no_cutlass = PlanOptions(wide_unavailable="no CUTLASS headers found")
    assert choose.make_plan(_spec([768, 3072, 768], ex.gelu_erf()), no_cutlass).design == "streamed"


def test_each_spec_is_planned_once_per_render(monkeypatch):
    """Rendering and the registry take the plans they are given: no planning inside codegen."""
    calls = []
    real = choose.make_plan
    monkeypatch.setattr(choose, "make_plan", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    spec = _spec([512, 256, 64, 1])
    plans = choose.make_plans([spec, spec])
    assert calls == [spec.name]
    from onnx2fused import codegen
    monkeypatch.setattr(choose, "make_plan", lambda *a, **k: pytest.fail("render planned"))
    files = codegen.render([spec], True, None, plans)
    assert set(files) >= {f"{spec.name}_cuda.cu", f"{tail_symbol(spec)}_cuda.cu", "registry.cc"}
    with pytest.raises(ConversionError, match="no CUDA plan was given"):
        codegen.render([spec], True)


def test_per_channel_activation_is_refused_with_reason():
    prelu = ex.Op("max", (ex.X, ex.Const(0.0))) + ex.Chan(tuple(range(4096))) * ex.Op("min", (ex.X, ex.Const(0.0)))
    spec = _spec([9216, 4096, 4096, 1000], prelu)
    assert "per-channel constants" in wide.wide_reason_refused(spec)
    with pytest.raises(SpecError, match="16-row tile.*wide design cannot take it.*per-channel"):
        choose.make_plan(spec)


def test_activation_not_finite_at_zero_is_refused():
    spec = _spec([768, 3072, 768], ex.Const(1.0) / ex.X)
    assert "not finite at 0" in wide.wide_reason_refused(spec)


# ------------------------------------------------------------------------------------------ layout
LAYOUTS = [([768, 3072, 768], "f32", False, ()), ([9216, 4096, 4096, 1000], "f32", False, ()),
           ([1001, 520, 999], "f16", False, ()), ([512, 256, 64, 1], "f32", False, ()),
           ([512, 256, 64, 1], "f32", True, ()), ([512, 256, 64, 1], "f16", False, ()),
           ([520, 1000], "f16", False, ()), ([768, 3072, 768], "f32", True, ()),
           # gated layers: LLaMA-7B's MLP, an odd SwiGLU (padded halves), two gated layers in a row
           ([4096, 11008, 4096], "f16", False, (0,)), ([1001, 2500, 999], "f32", False, (0,)),
           ([768, 3000, 1000, 768], "f32", True, (0, 1))]


@pytest.mark.parametrize("widths,io,tuning,gated", LAYOUTS)
def test_layout_regions_are_aligned_disjoint_and_within_the_workspace(widths, io, tuning, gated):
    plan = choose.wide_plan(_spec(widths, io=io, gated=gated), WideOptions(tuning=tuning))
    regions = []
    for g in plan.gemms:
        out_bytes = (2 if io == "f16" else 4) if g.last else 2
        regions += [(g.w_offset, g.np_ * g.kp * 2), (g.b_offset, g.np_ * out_bytes)]
        assert g.kp % 8 == 0 and g.np_ % g.align_out == 0
        assert g.last or g.np_ % 8 == 0
        # a gated GEMM: gate and up halves of NP columns each, into the gate buffer; the glu pass's NP
        # columns go on as the next K
        assert g.gated == (g.index in gated) and (g.np_ == 2 * g.half if g.gated else g.half == 0)
        assert not g.gated or (g.half == -(-g.n // 8) * 8 and g.half <= plan.h_width and g.np_ <= plan.hg_width)
    # stream-K reductions of the cooperative sm90a kernels: only where one can run (the tuning build, or a
    # choice of one); the ping-pong kernels (the untuned default) need none, and the region is empty
    cooperative = any(sm90.SM90_KERNELS[c.kernel].stream_k for per in plan.choices for c in per)
    scratch = sm90.SM90_SCRATCH if tuning or cooperative else 0
    assert (scratch > 0) == tuning   # (untuned choices: the default, a ping-pong kernel)
    regions.append((plan.sm90_offset, scratch))
    mb = plan.row_block
    if plan.convert_input:
        regions.append((plan.xc_offset, mb * plan.gemms[0].kp * 2))
    n_hidden = sum(not g.last for g in plan.gemms)   # a segmented plan's GEMMs all write hidden tensors
    for i in range(min(2, n_hidden)):
        regions.append((plan.h_offsets[i], mb * plan.h_width * 2))
    assert plan.hg_width == max((2 * g.half for g in plan.gemms if g.gated), default=0)
    if gated:
        regions.append((plan.hg_offset, mb * plan.hg_width * 2))
    if plan.tail_from:   # the fused tail's packed weights, and its fp16 output when y is fp32
        regions.append((plan.tail_offset, plan.tail_bytes))
        if io == "f32":
            regions.append((plan.tail_out_offset, mb * widths[-1] * 2))
    # DLRM's: the cost model's choice; never into a gated first layer
    assert plan.tf32_first == (io == "f32" and (tuning or widths[0] == 512) and 0 not in gated)
    if plan.tf32_first:  # layer 0's weights again, fp32 [np0][k0]
        regions.append((plan.w0f_offset, plan.gemms[0].np_ * widths[0] * 4))
    regions.sort()
    for (a, n), (b, _) in zip(regions, regions[1:]):
        assert a % wide.REGION_ALIGN == 0 and a + n <= b
    assert regions[-1][0] + regions[-1][1] <= plan.workspace_bytes
    if scratch:   # a choice of a cooperative kernel brings the region back in an untuned plan
        coop = next(i for i, k in enumerate(sm90.SM90_KERNELS) if k.stream_k and not k.tf32)
        chosen = wide.with_kernels(plan, tuple(tuple(sm90.Sm90Choice(coop, "stream_k") for _ in per)
                                               for per in plan.choices))
        assert chosen.h_offsets[0] - chosen.sm90_offset >= sm90.SM90_SCRATCH
    else:
        assert plan.xc_offset == plan.sm90_offset   # nothing between them
    per_row = ((plan.gemms[0].kp * 2 if plan.convert_input else 0) + min(2, n_hidden) * plan.h_width * 2
               + plan.hg_width * 2 + (widths[-1] * 2 if plan.tail_from and io == "f32" else 0))
    assert mb % wide.ROW_QUANTUM == 0 and (mb * per_row <= wide.SCRATCH_BUDGET or mb == wide.ROW_QUANTUM)
    # a K of a GEMM is the padded width the previous GEMM (or its glu pass) wrote
    for a, b in zip(plan.gemms, plan.gemms[1:]):
        assert b.kp == (a.half or a.np_) and b.src == a.dst


def test_fp16_input_with_aligned_rows_is_read_in_place():
    assert not choose.wide_plan(_spec([768, 3072, 768], io="f16")).convert_input
    assert choose.wide_plan(_spec([1001, 520, 999], io="f16")).convert_input
    assert choose.wide_plan(_spec([768, 3072, 768], precision="bf16", io="f16")).convert_input


def _pack_norm(plan: wide.WidePlan, view, norm_params) -> None:
    """cuda_pack's copy of a block's norm scale (and bias) into the workspace."""
    k0 = plan.spec.widths[0]
    ns, nb = norm_params
    view(plan.norm_offset, k0, np.float32)[:] = ns
    if nb is not None:
        view(plan.norm_offset + round_up(k0, NORM_ALIGN) * 4, k0, np.float32)[:] = nb


def _packed_norm(plan: wide.WidePlan, view) -> tuple[np.ndarray, np.ndarray | None]:
    """The norm's scale and bias as the norm pass reads them from the workspace."""
    k0 = plan.spec.widths[0]
    bias_at = plan.norm_offset + round_up(k0, NORM_ALIGN) * 4
    return (view(plan.norm_offset, k0, np.float32).copy(),
            view(bias_at, k0, np.float32).copy() if plan.spec.norm.has_bias else None)


def _normalise(spec: MLPSpec, x: np.ndarray, ns, nb) -> np.ndarray:
    """A block's norm of each row in fp32 (ORT's LayerNormalization / the exporters' RMSNorm)."""
    x = x.astype(np.float32)
    if spec.norm.kind == "layernorm":
        mean = x.mean(-1, keepdims=True)
        out = (x - mean) / np.sqrt((x * x).mean(-1, keepdims=True) - mean * mean + spec.norm.eps) * ns
        return out + nb if nb is not None else out
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.norm.eps) * ns


def _emulate(plan: wide.WidePlan, x: np.ndarray, ws_w, ws_b, norm_params=None, x_as_c: bool = False) -> np.ndarray:
    """The generated kernel's computation, with its index math, on a byte array as the workspace; a
    block's norm (the conversion pass normalises) and residual: the sm80 kernels' (y = x + b_last first,
    then the last GEMM adds its product to y in place), or with `x_as_c` a Hopper last layer's (its
    epilogue adds x's rows and the bias, in fp32)."""
    spec = plan.spec
    ws = np.zeros(plan.workspace_bytes, np.uint8)

    def view(off, count, dtype):
        return ws[off: off + count * np.dtype(dtype).itemsize].view(dtype)


    io_dt = np.float16 if spec.io_dtype == "f16" else np.float32
    for g, w, b in zip(plan.gemms, ws_w, ws_b):  # cuda_pack (pack_gated_layer: gate rows, then up rows at NP)
        packed = view(g.w_offset, g.np_ * g.kp, np.float16).reshape(g.np_, g.kp)
        packed[:] = 0
        bias = view(g.b_offset, g.np_, io_dt if g.last else np.float16)
        bias[:] = 0
        for part in range(2 if g.gated else 1):
            at = part * g.half
            packed[at: at + g.n, : g.k] = w[:, part * g.n: (part + 1) * g.n].T.astype(np.float16)
            bias[at: at + g.n] = b[part * g.n: (part + 1) * g.n]
    if spec.norm is not None:
        _pack_norm(plan, view, norm_params)
    rows, y = x.shape[0], np.full((x.shape[0], spec.widths[-1]), np.nan, np.float32)
    step = wide.pass_rows(rows, plan.row_block)
    for r0 in range(0, rows, step):  # cuda_run
        m = min(step, rows - r0)
        bufs = {"h0": plan.h_offsets[0], "h1": plan.h_offsets[1], "xc": plan.xc_offset}
        if plan.convert_input:
            xc = view(plan.xc_offset, m * plan.gemms[0].kp, np.float16).reshape(m, -1)
            xc[:] = 0
            xc[:, : spec.widths[0]] = (x[r0: r0 + m] if spec.norm is None
                                       else _normalise(spec, x[r0: r0 + m], *_packed_norm(plan, view)))
        if spec.residual and not x_as_c:   # init_residual: y = x + b_last in the io type
            b_last = view(plan.gemms[-1].b_offset, spec.widths[-1], io_dt).astype(np.float32)
            y[r0: r0 + m] = (x[r0: r0 + m].astype(np.float32) + b_last).astype(io_dt)
        for g, layer in zip(plan.gemms, spec.layers):
            if g.src == "x":
                a = x[r0: r0 + m].astype(np.float16)
            else:
                a = view(bufs[g.src], m * g.kp, np.float16).reshape(m, g.kp)
            wt = view(g.w_offset, g.np_ * g.kp, np.float16).reshape(g.np_, g.kp)
            bias = view(g.b_offset, g.np_, io_dt if g.last else np.float16).astype(np.float32)
            # the source operand C: the bias row, or for a block's last layer y's rows in place (sm80) or
            # x's rows and the bias (Hopper)
            source = bias
            if g.last and spec.residual:
                source = x[r0: r0 + m].astype(np.float32) + bias if x_as_c else y[r0: r0 + m]
            acc = a.astype(np.float32) @ wt.astype(np.float32).T + source
            if g.gated:   # identity epilogue into the gate buffer (16 bits), then the glu pass into dst
                hg = view(plan.hg_offset, m * g.np_, np.float16).reshape(m, g.np_)
                hg[:] = acc
                gate, up = hg[:, : g.half].astype(np.float32), hg[:, g.half:].astype(np.float32)
                view(bufs[g.dst], m * g.half, np.float16).reshape(m, g.half)[:] = ex.evaluate(layer.activation, gate) * up
                continue
            out = ex.evaluate(layer.activation, acc)
            if g.last:
                y[r0: r0 + m] = out.astype(io_dt)
            else:
                view(bufs[g.dst], m * g.np_, np.float16).reshape(m, g.np_)[:] = out
    return y


@pytest.mark.parametrize("rows,block,want", [(4096, 1792, 1408), (1793, 1792, 1024), (1792, 1792, 1792),
                                             (100, 1792, 128), (65536, 16384, 16384), (20000, 16384, 10112)])
def test_passes_are_even_and_never_more_than_the_block_allows(rows, block, want):
    step = wide.pass_rows(rows, block)
    assert step == want and step % wide.ROW_QUANTUM == 0 and step <= block
    assert -(-rows // step) == -(-rows // block)   # as few passes as before, of even size


def _chain_case(spec: MLPSpec, rows: int):
    """Random input rows, weights [K, cols] and biases of `spec`'s layers (a gated layer's gate columns
    first), and the fp32 reference output."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((l.in_features, l.weight_columns)).astype(np.float32) / np.sqrt(l.in_features)
          for l in spec.layers]
    bs = [rng.standard_normal(l.weight_columns).astype(np.float32) * 0.1 for l in spec.layers]
    x = rng.standard_normal((rows, spec.widths[0])).astype(np.float16 if spec.io_dtype == "f16" else np.float32)
    ref = x.astype(np.float32)
    for layer, w, b in zip(spec.layers, ws, bs):
        z = ref @ w + b
        n = layer.out_features
        ref = ex.evaluate(layer.activation, z[:, :n]) * z[:, n:] if layer.gated else ex.evaluate(layer.activation, z)
    return x, ws, bs, ref


def _block_case(spec: MLPSpec, rows: int, seed: int = 1):
    """_chain_case for a block: the norm's scale (and bias) too, and the reference with the norm in front
    and the residual behind."""
    x, ws, bs, _ = _chain_case(spec, rows)
    rng = np.random.default_rng(seed)
    k0 = spec.widths[0]
    ns = (1 + 0.2 * rng.standard_normal(k0)).astype(np.float32) if spec.norm else None
    nb = (0.1 * rng.standard_normal(k0)).astype(np.float32) if spec.norm and spec.norm.has_bias else None
    ref = _normalise(spec, x, ns, nb) if spec.norm else x.astype(np.float32)
    for layer, w, b in zip(spec.layers, ws, bs):
        z = ref @ w + b
        n = layer.out_features
        ref = ex.evaluate(layer.activation, z[:, :n]) * z[:, n:] if layer.gated else ex.evaluate(layer.activation, z)
    if spec.residual:
        ref = ref + x.astype(np.float32)
    return x, ws, bs, (ns, nb), ref


BLOCKS = [  # (widths, io, gated, norm kind or None, norm bias, residual)
    ([40, 24, 40], "f32", (), "layernorm", True, True), ([13, 30, 13], "f16", (), "rmsnorm", False, True),
    ([40, 21, 40], "f32", (0,), "layernorm", False, True), ([24, 40, 17], "f16", (), "layernorm", True, False),
    ([33, 48, 33], "f32", (), None, False, True),
]


def _block_spec(widths, io, gated, norm, norm_bias, residual, act=ex.sigmoid()):
    base = _spec(widths, act, io=io, gated=gated)
    return MLPSpec(base.layers, base.precision, base.io_dtype,
                   norm=NormSpec(norm, 1e-5, norm_bias) if norm else None, residual=residual)


@pytest.mark.parametrize("x_as_c", [False, True], ids=["sm80", "sm90"])
@pytest.mark.parametrize("widths,io,gated,norm,norm_bias,residual", BLOCKS)
def test_emulated_block_matches_fp32_reference(widths, io, gated, norm, norm_bias, residual, x_as_c, monkeypatch):
    """A transformer block in the wide design: the norm as the conversion pass, the residual as the last
    GEMM's source operand (y = x + b first, or x's rows in a Hopper epilogue); several passes and a
    partial last one."""
    monkeypatch.setattr(wide, "SCRATCH_BUDGET", 20000)
    spec = _block_spec(widths, io, gated, norm, norm_bias, residual)
    plan = choose.wide_plan(spec)
    assert plan.convert_input == (norm is not None or io == "f32") and not plan.tf32_first
    x, ws, bs, norm_params, ref = _block_case(spec, 300)
    got = _emulate(plan, x, ws, bs, norm_params, x_as_c)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 3e-3


@pytest.mark.parametrize("widths,io,gated,budget,rows,block", [
    ([40, 24, 17], "f32", (), 20000, 300, 128), ([13, 9, 30, 5], "f16", (), 20000, 300, 128),
    ([16, 64, 8], "f16", (), 20000, 300, 128), ([40, 21, 17], "f32", (0,), 20000, 300, 128),
    ([13, 9, 30, 5], "f16", (0, 1), 20000, 300, 128),
    ([40, 24, 17], "f32", (), 49152, 400, 384),   # 384-row blocks: two even passes of 256 and 144 rows
])
def test_emulated_kernel_matches_fp32_reference(widths, io, gated, budget, rows, block, monkeypatch):
    monkeypatch.setattr(wide, "SCRATCH_BUDGET", budget)  # several passes, a partial last one
    spec = _spec(widths, ex.sigmoid(), io=io, gated=gated)     # act(0) = 0.5: the padding must not leak
    plan = choose.wide_plan(spec)
    assert plan.row_block == block and wide.pass_rows(rows, block) < rows
    x, ws, bs, ref = _chain_case(spec, rows)
    got = _emulate(plan, x, ws, bs)
    assert np.isfinite(got).all() and np.abs(ref).max() > 0
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3


# ------------------------------------------------------------------------------------------ CUTLASS headers
def test_cutlass_dir_env(tmp_path, monkeypatch):
    (tmp_path / "cutlass" / "gemm" / "device").mkdir(parents=True)
    (tmp_path / "cutlass" / "gemm" / "device" / "gemm.h").write_text("")
    (tmp_path / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 1\n")
    monkeypatch.setenv("ONNX2FUSED_CUTLASS_DIR", str(tmp_path))
    found = headers.find_cutlass_headers()
    assert (found.path, found.version, found.source) == (tmp_path.resolve(), "4.2.1", "env")
    monkeypatch.setenv("ONNX2FUSED_CUTLASS_DIR", str(tmp_path / "nope"))
    with pytest.raises(ConversionError, match="pip install nvidia-cutlass"):
        headers.find_cutlass_headers()


def test_rendered_wide_source_names_the_abi_and_needs_cutlass():
    spec = _spec([9216, 4096, 4096, 1000])
    files = render_cuda([spec])
    src = files[f"{spec.name}_cuda.cu"]
    assert headers.needs_cutlass(files)
    for fn in ("_cuda_workspace_bytes()", "_cuda_pack(", "_cuda_run("):
        assert f'extern "C" ' in src and f"{spec.name}{fn}" in src
    plan = choose.make_plan(spec)
    assert f"return kWorkspaceBytes;" in src and f"kWorkspaceBytes = {plan.workspace_bytes};" in src
    assert src.count("struct Act") == 2  # the two ReLU layers share one functor
    # and one kernel instance each of the sm80 and the Hopper kernels; the last layer (identity, fp32
    # output) its own two: four instance units, each declared by the chain's unit and called by name
    insts = _instances(files)
    assert len(insts) == 4 and sum(f.startswith(f"o2f_inst_{DEFAULT_KERNEL}_f16_f16_a8_") for f in insts) == 1
    for f in insts:
        assert f"namespace {f[:-3]} {{" in src and f"{f[:-3]}::run(" in src
    assert "cutlass/gemm/device/gemm.h" not in src and "LayerGemm" not in src  # no GEMM in the chain's unit
    narrow = render_cuda([_spec([32, 64, 16])])
    assert not headers.needs_cutlass(narrow) and not _instances(narrow)


def test_gated_layer_renders_one_gemm_of_both_halves_and_the_glu_pass():
    """LLaMA-7B's MLP with fp16 rows: the gate and up products come from ONE GEMM of 2 x 11008 columns. On
    sm_90 with the light kernel (the untuned default) the glu runs in its epilogue (its own instance: the
    SiLU gate times the up product, h0 written directly, 11008 columns); any other kernel writes the gate
    buffer with an identity epilogue (the same instance as the down GEMM's) and the glu pass applies SiLU
    to the gate half and multiplies by the up half into the hidden buffer the down GEMM reads; packing
    splits W [K, 2N] into the two padded halves."""
    spec = MLPSpec((LayerSpec(4096, 11008, False, ex.silu(), gated=True), LayerSpec(11008, 4096, False, ex.identity())),
                   "fp16", "f16")
    plan = choose.make_plan(spec)
    files = render_cuda([spec])
    src = files[f"{spec.name}_cuda.cu"]
    assert plan.design == "wide" and plan.hg_width == 2 * 11008
    assert f"reinterpret_cast<elem_t*>(ws + {plan.hg_offset});" in src
    gated = src[src.index("cudaError_t gated0("):]
    gated = gated[: gated.index("\n}\n")]
    # the light kernel's choice: one launch, 11008 output columns over K 4096, straight into h
    glu_inst = next(f[:-3] for f in _instances(files) if f"{f[:-3]}::run(dev, c, m, 11008, 4096, a, w, bias, nullptr, d, 11008," in gated)
    assert f"c.kernel == {sm90.LIGHT_KERNEL} && dev.sm90" in gated
    # otherwise: the GEMM into the gate buffer, 2 NP wide, then the glu pass
    assert "layer0(dev, c, m, a, w, bias, hg, 22016, sm90_scratch, s);" in gated
    assert "return glu<Act0<float>, 11008>(dev, hg, d, m, s);" in gated
    assert "gated0(dev, c0, m, " in src and ", hg, h0," in src   # run_chain's call
    assert "pack_gated_layer<elem_t>(w[0], b[0], ws, 0," in src and "4096, 11008, 4096, 11008, s);" in src
    assert src.count("struct Act") == 2   # SiLU (the glu pass's) and the down layer's identity
    # the GEMMs without the glu run the identity epilogue: one sm80 and one Hopper instance for both layers
    identity = hashlib.sha256(wide_params.epilogue_text("v").encode()).hexdigest()[:12]
    insts = sorted(set(_instances(files)) - {glu_inst + ".cu"})
    assert len(insts) == 2 and all(f.endswith(f"_f16_f16_a8_{identity}.cu") for f in insts), insts
    assert insts[0].startswith(f"o2f_inst_{DEFAULT_KERNEL}_") and insts[1].startswith("o2f_inst_Sm80T")
    # the glu instance: the light kernel's unit with kGated and SiLU as its act
    glu_src = files[glu_inst + ".cu"]
    assert glu_inst.startswith(f"o2f_inst_{DEFAULT_KERNEL}_f16_f16_a8_") and "constexpr bool kGated = true;" in glu_src
    # the same SiLU code as the glu pass's functor: the two paths compute the same numbers
    code = act_params(spec, [g.np_ for g in plan.gemms])[0]["code"]
    assert "sigmoid" in code and f"act(float v) {{ return {code}; }}" in glu_src and f"return {code}; }}" in src


def _instances(files: dict[str, str]) -> dict[str, str]:
    """The kernel instance units among rendered files."""
    return {n: t for n, t in files.items() if n.startswith("o2f_inst_") and n.endswith(".cu")}


def test_kernel_instances_are_named_and_shaped_by_configuration_types_and_epilogue_only():
    """Two different chains with a layer of the same kernel configuration, types and activation render
    the same instance file, byte for byte, whose text names neither chain: build.py compiles it once."""
    a = _spec([9216, 4096, 4096, 1000])                      # ReLU hidden layers, fp16, fp32 io
    b = _spec([768, 2048, 1024, 512, 256], ex.relu(), last=ex.sigmoid())   # other widths, depth, last layer
    fa, fb = render_cuda([a]), render_cuda([b])
    shared = sorted(set(_instances(fa)) & set(_instances(fb)))
    relu = [n for n in shared if "_f16_f16_a8_" in n]
    assert {n.split("_")[2] for n in relu} == {DEFAULT_KERNEL, wide_params._sm80_config()}, shared
    for n in shared:
        assert fa[n] == fb[n]
        for spec in (a, b):
            assert spec.name not in fa[n] and str(spec.widths[0]) not in n
    # the name: configuration, operand and output types, alignment, the epilogue's hash
    code = act_params(a, [g.np_ for g in choose.wide_plan(a).gemms])[0]["code"]
    digest = hashlib.sha256(wide_params.epilogue_text(code).encode()).hexdigest()[:12]
    assert f"o2f_inst_{DEFAULT_KERNEL}_f16_f16_a8_{digest}.cu" in shared
    # another activation, output type or precision is another instance
    assert not set(_instances(render_cuda([_spec([9216, 4096, 4096, 1000], ex.gelu_erf())]))) & set(
        n for n in _instances(fa) if "_f16_f16_" in n)
    bf = _instances(render_cuda([_spec([9216, 4096, 4096, 1000], precision="bf16")]))
    assert all("_bf16_" in n for n in bf) and not set(bf) & set(_instances(fa))
    # one library of both: each shared instance once
    both = render_cuda([a, b])
    assert set(_instances(both)) == set(_instances(fa)) | set(_instances(fb))


def test_packed_hidden_layers_take_the_fp16x2_form_in_the_epilogue():
    """A hidden fp16 layer whose activation has a packed form (spec.packed_layers) evaluates that form in
    its GEMM epilogue, as the numerics model assumes: its instances say so and hash apart from the fp32
    form's; act_math "fp32", the last layer, bf16 and ReLU (no packed form) keep the fp32 code."""
    def hidden(spec):
        files = render_cuda([spec])
        return {n: files[n] for n in _instances(files) if "_f16_f16_" in n or "_bf16_bf16_" in n}

    packed = hidden(_spec([768, 3072, 768], ex.gelu_erf()))
    # the CUTLASS instances' Act on an Array, the light instance's PairAct on two columns
    forms = ("o2f_h2_gelu(__floats2half2_rn(a[i], a[i + 1]))", "o2f_h2_gelu(__floats2half2_rn(a, b))")
    assert packed and all(any(f in t for f in forms) for t in packed.values())
    assert {any(forms[1] in t for t in packed.values()), any(forms[0] in t for t in packed.values())} == {True}
    assert all("o2f_packed_act" in t for t in packed.values())   # its header, included or expanded
    fp32 = hidden(replace(_spec([768, 3072, 768], ex.gelu_erf()), act_math="fp32"))
    assert fp32 and not set(fp32) & set(packed)
    assert not any("o2f_h2_" in t for t in fp32.values())
    for other in (_spec([768, 3072, 768], ex.gelu_erf(), precision="bf16"), _spec([768, 3072, 768], ex.relu())):
        assert not any("o2f_h2_" in t for t in hidden(other).values())
    # the last layer (fp32 output) never packs
    last = render_cuda([_spec([768, 3072, 768], ex.gelu_erf(), last=ex.gelu_erf())])
    assert not any("o2f_h2_" in last[n] for n in _instances(last) if "_f16_f32_" in n)


# ------------------------------------------------------------------------------------------ Hopper (sm_90a)
@pytest.mark.parametrize("widths,io,want", [
    ([768, 3072, 768], "f32", [True, True]),      # 768 fp32 = 3072-byte rows
    ([9216, 4096, 4096, 1000], "f32", [True] * 3),
    ([1001, 517, 999], "f32", [True, False]),     # hidden padded to 520; 999 fp32 rows are not 16-byte multiples
    ([512, 256, 64, 1], "f32", [True, True, False]),
    ([520, 1004], "f16", [False]),                # 2008-byte rows
    ([520, 1000], "f16", [True]),
])
def test_sm90_kernels_only_for_tma_storable_outputs(widths, io, want):
    """The sm90a epilogue stores D with TMA (16-byte multiples of row bytes); other GEMMs keep the sm80 kernel."""
    plan = choose.wide_plan(_spec(widths, io=io), WideOptions(tail_from=0))
    assert [g.sm90 for g in plan.gemms] == want
    assert ("on sm_90: all as onnx2fused's" if all(want) else f"on sm_90: {sum(want)} of {len(want)} as") in plan.describe()
    for g in plan.gemms:
        out_bytes = (2 if io == "f16" else 4) if g.last else 2
        assert g.sm90 == (g.np_ * out_bytes % 16 == 0)
        if g.sm90:  # the fusion's bias/D alignment is a full 16-byte vector
            assert g.align_out * out_bytes == 16


def test_rendered_source_has_guarded_sm90_kernels_and_per_layer_choice():
    spec = _spec([1001, 517, 999], ex.gelu_erf())
    files = render_cuda([spec])
    src = files[f"{spec.name}_cuda.cu"]
    plan = choose.wide_plan(spec)
    insts = _instances(files)
    hopper = {n: t for n, t in insts.items() if targets.sm90a_only(t)}
    # the default kernel only, for layer 0 (hidden, 520 wide); layer 1 (999 fp32 columns) may not take it
    assert plan.sm90_kernels == (sm90.DEFAULT_CHOICE.kernel,) and len(hopper) == 1
    (h_name, h_text), = hopper.items()
    assert h_name.startswith(f"o2f_inst_{DEFAULT_KERNEL}_f16_f16_a8_")
    # the Hopper kernel exists only in the Hopper instance, compiled for sm_90a: the default is our own
    # (no CUTLASS in its unit); a CUTLASS 3.x instance (a tuned choice) holds CUTLASS's kernel instead
    assert "#if defined(ONNX2FUSED_WIDE_SM90A)" in h_text and h_text.rstrip().endswith("#endif  // ONNX2FUSED_WIDE_SM90A")
    assert DEFAULT_KERNEL == "Light128x128" and '#include "cutlass/' not in h_text
    for needle in ("namespace o2f_light", "o2f_light::run<Elem, Out, PairAct, kResidual, kGated>"):
        assert needle in h_text and needle not in src, needle
        assert all(needle not in t for n, t in insts.items() if n != h_name), needle
    cutlass_ping = sm90.Sm90Choice(sm90.kernel_index("Pingpong128x128"), "data_parallel")
    tuned = wide.with_kernels(plan, tuple(tuple(cutlass_ping for _ in per) for per in plan.choices))
    tuned_files = codegen.render([spec], True, plans={spec.name: tuned})
    cutlass_inst = next(expanded(tuned_files, n) for n in tuned_files if n.startswith("o2f_inst_Pingpong128x128_"))
    for needle in ("KernelTmaWarpSpecializedPingpong", "PersistentScheduler",
                   "LinCombPerColBiasEltAct", "cutlass::arch::Sm90", "cute::Int<128>, cute::Int<128>, cute::Int<64>",
                   '#include "cutlass/gemm/collective/collective_builder.hpp"'):
        assert needle in cutlass_inst and needle not in src, needle
    layer0 = src[src.index("cudaError_t layer0("):src.index("cudaError_t layer1(")]
    layer1 = src[src.index("cudaError_t layer1("):src.index("constexpr int kBuckets")]
    assert f"{h_name[:-3]}::run(dev, c, m, 520, 1008," in layer0 and "o2f_inst_Coop" not in layer1
    sm80_1 = f"o2f_inst_{wide_params._sm80_config()}_f16_f32_a1_"
    assert sm80_1 in layer1 and f"{sm80_1}" in "".join(insts) and "::run(dev, m, 999, 520," in layer1
    # one choice per layer and row bucket, the default everywhere
    nb = len(plan.buckets)
    default = sm90.DEFAULT_CHOICE
    assert f"constexpr Choice kChoices[2][kBuckets]" in src
    assert src.count(f"{{ {default.kernel}, {sm90.MODES.index(default.mode)}, 1, 1, 0 }}") >= 2 * nb   # swizzle 1, heuristic
    # the device check: compute capability 9.0 only, and the run-time override for comparisons
    assert "cc == 90" in src and f'getenv("{wide.SM80_ENV}")' in src and '"sm80"' in src
    assert f"{plan.sm90_offset}" in src and f"{sm90.SM90_SCRATCH}u" in cutlass_inst
    assert "_cuda_tune" not in src  # the timing entry is the tuning build's only
    # NDEBUG before the first include: no __assertfail calls to serialize wgmma
    assert src.index("#define NDEBUG") < src.index("#include")


def test_rendered_choices_instantiate_only_the_chosen_kernels():
    spec = _spec([9216, 4096, 4096, 1000])
    plan = choose.wide_plan(spec)
    nb = len(plan.buckets)
    split4 = sm90.Sm90Choice(1, "split_k", 4)
    choices = [[split4] + [sm90.DEFAULT_CHOICE] * (nb - 1)] + [[sm90.DEFAULT_CHOICE] * nb] * 2
    src = render_cuda([spec], wide={spec.name: WideOptions(choices=choices, tuned_on="H")})
    text = src[f"{spec.name}_cuda.cu"]
    hopper = sorted(n.split("_")[2] for n, t in _instances(src).items() if targets.sm90a_only(t))
    assert hopper == sorted(["Coop128x128", DEFAULT_KERNEL, DEFAULT_KERNEL])  # the default: the ReLU layers and the last
    assert "{ 1, 1, 4, 1, 0 }" in text  # kernel 1, split_k (MODES index 1), 4 splits, swizzle 1, heuristic order
    layer0 = text[text.index("cudaError_t layer0("):text.index("cudaError_t layer1(")]
    layer1 = text[text.index("cudaError_t layer1("):text.index("cudaError_t layer2(")]
    assert "case 1:" in layer0 and "case 1:" not in layer1
    assert "o2f_inst_Coop128x128_f16_f16_a8_" in layer0 and "o2f_inst_Coop128x128" not in layer1
    plan = choose.wide_plan(spec, WideOptions(choices=choices, tuned_on="H"))
    assert "tuned on H" in plan.describe() and f"{plan.buckets[0]} rows Coop128x128/split_kx4" in plan.choice_text()
    # the same choices without a GPU named are not called the defaults
    given = choose.wide_plan(spec, WideOptions(choices=choices)).describe()
    assert "kernels as given (not tuned here)" in given and "default kernels" not in given
    assert "default kernels (not tuned)" in choose.wide_plan(spec, WideOptions()).describe()


@pytest.mark.parametrize("io,precision,per_kernel", [("f16", "fp16", 1), ("f16", "bf16", 2), ("f32", "fp16", 2)])
def test_each_kernel_instance_appears_once(io, precision, per_kernel):
    """fp16 I/O of an fp16 kernel: io_t and elem_t are one C++ type, so a last layer with the hidden
    layers' activation runs the hidden layers' instances (one unit, one launcher declaration)."""
    import re
    spec = _spec([512, 2048, 512], ex.relu(), precision, io, last=ex.relu())
    files = render_cuda([spec], wide={spec.name: WideOptions(tuning=True)})
    src = files[f"{spec.name}_cuda.cu"]
    hopper = [n for n, t in _instances(files).items() if targets.sm90a_only(t)]
    sixteen_bit = len(sm90.SM90_KERNELS) - len(sm90.TF32_KERNELS)
    tf32 = len(sm90.TF32_KERNELS) if io == "f32" else 0   # the first layer's only
    assert len(hopper) == sixteen_bit * per_kernel + tf32
    declared = re.findall(r"^namespace (o2f_inst_\w+) \{", src, re.M)
    assert len(declared) == len(set(declared)) == len(_instances(files))


def test_tuning_build_holds_every_kernel_and_the_timing_entry():
    spec = _spec([768, 3072, 768], ex.gelu_erf())
    files = render_cuda([spec], wide={spec.name: WideOptions(tuning=True)})
    text = files[f"{spec.name}_cuda.cu"]
    hopper = {n.split("_")[2] for n, t in _instances(files).items() if targets.sm90a_only(t)}
    assert hopper == {k.name for k in sm90.SM90_KERNELS}   # the tf32 ones too: an fp32 input TMA can load
    assert f'__attribute__((visibility("default"))) int {spec.name}_cuda_tune(' in text
    table = text[text.index("constexpr Choice kCandidates[] = {"):]
    table = table[:table.index("};")]
    assert table.count("{ ") == len(sm90.sm90_candidates())


def test_tuning_build_of_a_gated_chain_times_the_hidden_rows_with_whole_weights():
    """A gated layer in the tuning build: its pseudo-random weights are [K, 2N] and its bias 2N (gate and up
    columns, as cuda_pack reads them: allocating K x N made the LLaMA tuning run read past them, CUDA
    error 700), and each candidate is timed as gatedN (GEMM + glu pass, or the light kernel's gated
    epilogue) on the N hidden columns."""
    spec = _spec([256, 1000, 250], ex.silu(), gated={0})
    text = render_cuda([spec], wide={spec.name: WideOptions(tuning=True)})[f"{spec.name}_cuda.cu"]
    assert "const int wcols[] = { 2000, 250 };" in text
    assert "cudaMalloc(&wf[i], kn * 4)" in text and "int64_t(widths[i]) * wcols[i]" in text
    assert "cudaMalloc(&bf[i], wcols[i] * 4)" in text
    tune = text[text.index("_cuda_tune(int reps"):]
    assert "return gated0(dev, c, m, tb.a," in tune and "tune_layer<elem_t>(launch, m, 1000, tb," in tune


@pytest.mark.parametrize("bad", [
    [[sm90.Sm90Choice(len(sm90.SM90_KERNELS))] * 4] * 2,      # no such kernel
    [[sm90.Sm90Choice(0, "fastest")] * 4] * 2,                      # no such mode
    [[sm90.DEFAULT_CHOICE] * 3] * 2,                                # a bucket short
])
def test_choices_that_do_not_fit_are_refused(bad):
    spec = _spec([768, 3072, 768])
    assert len(choose.wide_plan(spec).buckets) == 4
    with pytest.raises(SpecError, match="kernel choices do not fit"):
        choose.wide_plan(spec, WideOptions(choices=bad))


def test_row_buckets_stop_at_the_row_block():
    assert sm90.row_buckets(17408) == (32, 256, 2048, 16384)
    assert sm90.row_buckets(4096) == (32, 256, 2048, 4096)
    assert sm90.row_buckets(128) == (32, 128)


def test_fp32_input_with_rows_of_8_gets_the_vectorized_conversion():
    src = render_cuda([_spec([768, 3072, 768])])
    text = next(t for n, t in src.items() if n.endswith(".cu"))
    assert "convert_rows_vec8<<<" in text and "convert_rows<<<" in text  # vector path + unaligned fallback
    odd = next(t for n, t in render_cuda([_spec([1001, 520, 999])]).items() if n.endswith(".cu"))
    assert "convert_rows_vec8" not in odd and "convert_rows<<<" in odd


def test_wide_nvcc_flags_turn_sm90_into_sm90a_only():
    flags = ["-O3", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90", "-lineinfo"]
    wide = targets.wide_nvcc_flags(flags)
    assert wide == ["-O3", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
                    "-lineinfo", targets.WIDE_SM90A_DEFINE]
    assert flags[4] == "arch=compute_90,code=sm_90"  # the caller's list (other sources) is untouched
    only80 = ["-gencode", "arch=compute_80,code=sm_80"]
    assert targets.wide_nvcc_flags(only80) == only80  # no sm_90a: no Hopper kernels, no define
    assert targets.wide_nvcc_flags(["-gencode", "arch=compute_90a,code=sm_90a"])[-1] == targets.WIDE_SM90A_DEFINE


def test_instance_units_keep_line_info_on_request(monkeypatch):
    flags = ["-O3", "-lineinfo", "-gencode", "arch=compute_90a,code=sm_90a"]
    monkeypatch.delenv("ONNX2FUSED_LINEINFO", raising=False)
    assert targets.instance_nvcc_flags(flags) == ["-O3", "-gencode", "arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("ONNX2FUSED_LINEINFO", "1")
    assert targets.instance_nvcc_flags(flags) == flags


def _stub_build_env(monkeypatch):
    """nvcc and g++ on PATH (their --version enters the cache key), ONNX Runtime headers where offline
    tests find them, archs 80,90 and no tuning build."""
    import shutil
    from pathlib import Path
    if not (shutil.which("nvcc") and shutil.which("g++")):
        pytest.skip("needs nvcc and g++ on PATH (their --version enters the cache key)")
    deps = Path(__file__).resolve().parent.parent / ".deps" / "ort-headers"
    if (deps / "onnxruntime_cxx_api.h").is_file():
        monkeypatch.setenv("ONNXRUNTIME_INCLUDE_DIR", str(deps))
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80,90")
    monkeypatch.setenv("ONNX2FUSED_CUDA_PTX", "auto")
    monkeypatch.setenv("ONNX2FUSED_TUNE", "0")  # a GPU host would first build the tuning library


def _compiled_source(args) -> str:
    from pathlib import Path
    return Path(args[args.index("-c") + 1]).name


def _gencodes(args) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "-gencode"]


def test_build_compiles_only_the_wide_sources_for_sm90a(tmp_path, monkeypatch):
    """build_plugin's per-source nvcc lines (the compiler is stubbed: nothing is compiled): the wide
    design's unit and its sm80 kernel instances get sm_80 and sm_90a with the define, its Hopper kernel
    instances sm_90a alone, a fused-kernel source beside it keeps sm_90."""
    from onnx2fused.errors import BuildError
    _stub_build_env(monkeypatch)
    calls = []

    def fake_compile(args, cwd):
        calls.append(args)
        return 1, "stub"

    monkeypatch.setattr(build, "_compile", fake_compile)
    wide, narrow = _spec([9216, 4096, 4096, 1000]), _spec([32, 64, 16])
    try:
        with pytest.raises(BuildError):
            library.build_plugin([wide, narrow], with_cuda=True, cache_dir=tmp_path)
    except ConversionError as e:  # no ONNX Runtime headers to be found offline
        pytest.skip(str(e))
    by_source = {_compiled_source(a): a for a in calls if "-c" in a}
    assert len(by_source) == len([a for a in calls if "-c" in a])  # each unit once
    wide_cmd, narrow_cmd = by_source[f"{wide.name}_cuda.cu"], by_source[f"{narrow.name}_cuda.cu"]
    sm80_sm90a = ["arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a", "arch=compute_80,code=compute_80"]
    assert _gencodes(wide_cmd) == sm80_sm90a and targets.WIDE_SM90A_DEFINE in wide_cmd
    assert "arch=compute_90,code=sm_90" in narrow_cmd and targets.WIDE_SM90A_DEFINE not in narrow_cmd
    assert "--expt-relaxed-constexpr" in wide_cmd and "--expt-relaxed-constexpr" not in narrow_cmd
    insts = {n: a for n, a in by_source.items() if n.startswith("o2f_inst_")}
    hopper = {n for n in insts if n.split("_")[2] in {k.name for k in sm90.SM90_KERNELS}}
    assert len(insts) == 4 and len(hopper) == 2   # sm80 and Hopper: the ReLU layers', the last layer's
    for n, a in insts.items():
        # the light (default) Hopper instances include no CUTLASS: no CUTLASS flags
        cutlass_unit = not n.startswith("o2f_inst_Light")
        assert targets.WIDE_SM90A_DEFINE in a and ("--expt-relaxed-constexpr" in a) == cutlass_unit, n
        assert _gencodes(a) == (["arch=compute_90a,code=sm_90a"] if n in hopper else sm80_sm90a), n
        assert "-lineinfo" not in a, n   # instance_nvcc_flags: same SASS, 5 s less per Hopper instance
    assert "-lineinfo" in wide_cmd and "-lineinfo" in narrow_cmd   # our own kernels keep Nsight's source view
    # no parts: one command per unit
    assert not any(f.startswith("-DO2F_PART") for a in calls for f in a)


def test_kernel_instances_compile_once_across_libraries(tmp_path, monkeypatch):
    """Two models whose wide chains share kernel instances, built into one cache (the compiler is stubbed:
    it writes empty objects and libraries): the second build compiles only its new units, and the shared
    instances' objects are linked from the object cache."""
    from pathlib import Path
    _stub_build_env(monkeypatch)
    compiled = []

    def fake_compile(args, cwd):
        out = Path(args[args.index("-o") + 1])
        out.write_bytes(b"stub " + " ".join(args).encode())
        if "-c" in args:
            compiled.append(_compiled_source(args))
        return 0, ""

    monkeypatch.setattr(build, "_compile", fake_compile)
    mnist = _spec([784, 512, 512, 10])
    other = _spec([784, 512, 256, 10])          # other widths, same layer instances
    gelu = _spec([784, 512, 256, 10], ex.gelu_erf())  # another hidden activation: new hidden-layer instances
    lines = []
    try:
        first = library.build_plugin([mnist], with_cuda=True, cache_dir=tmp_path, progress=lines.append)
    except ConversionError as e:  # no ONNX Runtime headers to be found offline
        pytest.skip(str(e))
    insts = sorted(n for n in compiled if n.startswith("o2f_inst_"))
    # one 16-bit Hopper instance (the untuned first layer converts its fp32 rows: tf32 in place is a near
    # tie there, cost.TF32_FIRST_MARGIN), two sm80 (ReLU hidden, identity last)
    assert len(insts) == len(set(insts)) == 3 and not any("Tf32" in n for n in insts)
    assert {f"{mnist.name}_cuda.cu", "registry.cc", "plugin.cc"} <= set(compiled)
    assert set(_instances(_library_sources(first))) == set(insts)
    compiled.clear()
    second = library.build_plugin([other], with_cuda=True, cache_dir=tmp_path, progress=lines.append)
    assert second.key != first.key
    # every instance and the plugin from the cache: only the chain's own units and the registry compile
    assert sorted(compiled) == sorted([f"{other.name}_cuda.cu", f"{other.name}_cpu.cc", "registry.cc"])
    assert "compiling 3 of 7 translation units (with CUDA); 4 from the object cache" in lines
    assert set(_instances(_library_sources(second))) == set(insts)
    compiled.clear()
    library.build_plugin([gelu], with_cuda=True, cache_dir=tmp_path, progress=lines.append)
    new = sorted(n for n in compiled if n.startswith("o2f_inst_"))
    # the GELU layers' 16-bit Hopper and sm80 instances; the last layer's (identity) is shared
    assert len(new) == 2 and not set(new) & set(insts) and all("_f16_a8_" in n for n in new)
    assert "compiling 5 of 7 translation units (with CUDA); 2 from the object cache" in lines


def _library_sources(lib) -> dict[str, str]:
    return {p.name: p.read_text() for p in lib.sources_dir.iterdir()}


# ------------------------------------------------------------------------------------------ GEMV path
GEMV = PlanOptions(wide_gemv=True)
WIDE_GEMV = PlanOptions(design="wide", wide_gemv=True)
LLAMA = MLPSpec((LayerSpec(4096, 11008, False, ex.silu(), gated=True), LayerSpec(11008, 4096, False, ex.identity())),
                "fp16", "f16")


def test_gemv_path_is_on_by_default_and_off_from_the_environment():
    from onnx2fused.plan.options import WIDE_GEMV_ENV
    assert PlanOptions().wide_gemv and PlanOptions.from_env({}).wide_gemv
    assert PlanOptions.from_env({WIDE_GEMV_ENV: " On "}).wide_gemv
    assert not PlanOptions.from_env({WIDE_GEMV_ENV: " Off "}).wide_gemv
    spec = _spec([768, 3072, 768], ex.gelu_erf())
    off, on = choose.make_plan(spec, PlanOptions(wide_gemv=False)), choose.make_plan(spec)   # the cost model's wide plan
    assert off.design == on.design == "wide" and off.gemv_rows == 0 and on.gemv_rows == wide.GEMV_MAX_ROWS == 16
    assert "GEMV" not in off.describe() and ", passes of <= 16 rows as weight-streaming GEMV kernels" in on.describe()
    assert choose.wide_plan(spec, options=GEMV).gemv_rows == 16 == choose.make_plan(spec, WIDE_GEMV).gemv_rows
    # re-planning (the tuning build, tuned choices) keeps it; it changes no workspace region
    assert wide.with_kernels(on, tuning=True).gemv_rows == 16 and wide.with_kernels(off, tuning=True).gemv_rows == 0
    assert on.workspace_bytes == off.workspace_bytes and on.gemms == off.gemms
    with pytest.raises(SpecError, match="at most 16 rows"):
        wide.make_wide_plan(spec, gemv_rows=17)


def _gemv_branch(src: str) -> str:
    """run_chain's GEMV branch: from `if (gemv_pass) {` to the GEMMs' `} else {`."""
    start = src.index("    if (gemv_pass) {")
    return src[start: src.index("    } else {  // the GEMMs", start)]


@pytest.mark.parametrize("spec", [_spec([1001, 520, 999]), _spec([768, 3072, 768], io="f16"), LLAMA,
                                  _spec([768, 3000, 1000, 768], ex.silu(), gated=(0, 1)),
                                  _spec([512, 256, 64, 1]), _spec([768, 8])], ids=lambda s: s.name)
def test_gemv_path_renders_one_launch_per_layer_and_nothing_when_off(spec):
    """With the option (the default): a GEMV launch per GEMM layer before the GEMM path (layer 0 reads x
    itself, a gated layer writes its hidden buffer); without it, no trace of the GEMV kernels."""
    plan = choose.wide_plan(spec, options=GEMV)
    files = render_cuda([spec], WIDE_GEMV)
    src = files[f"{spec.name}_cuda.cu"]
    assert files == render_cuda([spec], WIDE)   # on by default
    no_gemv = PlanOptions(design="wide", wide_gemv=False)
    off = render_cuda([spec], no_gemv)
    raw_on, raw_off = _rendered(spec, WIDE_GEMV), _rendered(spec, no_gemv)
    assert "gemv" not in off[f"{spec.name}_cuda.cu"].lower() and "o2f_wide_gemv.cuh" not in raw_off
    assert "constexpr int kGemvRows = 16;" in src and "o2f_wide_gemv.cuh" in raw_on
    branch = _gemv_branch(src)
    gemv_pass = re.search(r"    const bool gemv_pass = .*\n", src).group(0)
    launches = [line.strip() for line in branch.splitlines() if "err = gemv<" in line]
    assert len(launches) == len(plan.gemms)   # a segmented plan: its GEMM layers; the tail follows as usual
    assert "glu<" not in branch and "hg" not in branch
    # layer 0 reads the conversion pass's rows (the same pass as the GEMMs'), or x in place where aligned
    assert ("convert_input(dev, " in branch) == plan.convert_input
    first = launches[0][: launches[0].index(", reinterpret_cast<const elem_t*>(ws + ")]
    kind = "true" if plan.gemms[0].gated else "false"
    if plan.convert_input:
        assert first == f"err = gemv<Act0, {kind}>(dev, m, xc, {plan.gemms[0].kp}"
        assert gemv_pass == "    const bool gemv_pass = m <= kGemvRows;\n"
    else:
        assert first == f"err = gemv<Act0, {kind}>(dev, m, reinterpret_cast<const elem_t*>(static_cast<const io_t*>(x) + r0 * kK0), kK0"
        assert gemv_pass == "    const bool gemv_pass = m <= kGemvRows && aligned16(x);\n"
    lines = branch.splitlines()
    for g, launch in zip(plan.gemms, launches):
        out_line = lines[next(i for i, line in enumerate(lines) if line.strip() == launch) + 1].strip()
        assert re.match(rf"err = gemv<Act\d+, {'true' if g.gated else 'false'}>\(dev, m, ", launch)   # functors are shared
        assert launch.endswith(f"reinterpret_cast<const elem_t*>(ws + {g.w_offset}), {g.kp}, {g.half},")
        if g.gated:     # gate and up column pairs straight into the hidden buffer, half columns wide
            assert out_line.endswith(f"{g.dst}, {g.half}, {g.half}, s);")
        elif g.last:
            assert out_line.endswith(f"static_cast<io_t*>(y) + r0 * {g.n}, {g.n}, {g.n}, s);")
        else:
            assert out_line.endswith(f"{g.dst}, {g.np_}, {g.np_}, s);")
        if g.index:
            assert f"(dev, m, {g.src}, {g.kp}, " in launch
    if plan.tail_from:
        run_chain = src[src.index("int run_chain("):]
        assert run_chain.index(f"{tail_symbol(spec)}_cuda_run(") > run_chain.index("    }  // the GEMMs\n")
    # the GEMM path is untouched: take the GEMV branch, its braces, include and plan text out, and the
    # source is the one without the option
    stripped = src.replace(branch, "").replace("    } else {  // the GEMMs (to the matching brace below)\n", "")
    stripped = stripped.replace(gemv_pass, "")
    stripped = stripped.replace("    }  // the GEMMs\n", "").replace(
        "constexpr int kGemvRows = 16;  // passes of at most this many rows run the GEMV kernels, not GEMMs\n", "")
    stripped = stripped.replace(expanded(raw_on, "o2f_wide_gemv.cuh"), "")
    assert stripped.replace(plan.describe(), choose.wide_plan(spec, options=PlanOptions(wide_gemv=False)).describe()) \
        == off[f"{spec.name}_cuda.cu"]


def _rendered(spec, options: PlanOptions) -> dict[str, str]:
    """codegen.render's files for `spec` planned with `options`: the sources and the static headers they
    include, as written for nvcc."""
    from onnx2fused import codegen
    return codegen.render([spec], True, {spec.name: False}, choose.make_plans([spec], options))


def test_block_renders_the_norm_pass_the_residual_pass_and_a_residual_epilogue():
    """A wide block: the conversion pass is the norm (norm_rows of o2f_block_norm.cuh, scale and bias
    copied into the workspace by cuda_pack), before each pass's layers (GEMV or GEMM). Only the last
    GEMM's instances take a source operand (kResidual): its Hopper kernels the block's input rows where
    residual_on_sm90 chose them for the pass (then nothing writes y first), else the sm80 kernel the
    output rows in place, which the norm pass wrote as y = x + b_last from the rows it reads (no
    init_residual pass). Without a norm, init_residual writes y where it is needed."""
    spec = _block_spec([768, 3072, 768], "f32", (), "layernorm", True, True, act=ex.gelu_erf())
    plan = choose.wide_plan(spec, options=GEMV)
    files = _rendered(spec, WIDE_GEMV)
    src = files[f"{spec.name}_cuda.cu"]
    assert "o2f_block_norm.cuh" in files and "convert_rows" not in src
    assert "norm_pass::normalise<true><<<" in src and f"reinterpret_cast<const float*>(ws + {plan.norm_offset})" in src
    assert f"cudaMemcpyAsync(ws + {plan.norm_offset}, w[2]," in src
    assert f"cudaMemcpyAsync(ws + {plan.norm_offset} + {round_up(768, NORM_ALIGN)} * sizeof(float), b[2]," in src
    run_chain = src[src.index("int run_chain("):]
    assert "init_residual<<<" not in src and "ResidualInit{bias, y, vec_y}" in src
    convert = src[src.index("cudaError_t convert_input("):src.index("int run_chain(")]
    assert f"bias = reinterpret_cast<const io_raw*>(ws + {plan.gemms[-1].b_offset});" in convert
    assert "if (y != nullptr)\n    norm_pass::normalise<true>" in convert and "normalise<false><<<" in convert
    # y first only where the last layer does not add x itself: never on a GEMV pass
    assert "const bool x_as_c = !gemv_pass && residual_on_sm90(dev, choices[1][bucket]," in run_chain
    assert "io_raw* y_first = x_as_c ? nullptr : static_cast<io_raw*>(y) + r0 * kK0;" in run_chain
    # both paths (GEMV, then GEMM) convert with y_first before their first layer; the last layer takes x
    assert run_chain.index("if (gemv_pass)") < run_chain.index("err = convert_input(") < run_chain.index("layer0(dev")
    assert run_chain.count("y_first, s);") == 2
    assert "sm90_scratch, s, x_as_c ? x_rows : nullptr);" in run_chain
    # the Hopper dispatch of the last layer runs only where the caller chose it, with x as the source
    layer1 = src[src.index("cudaError_t layer1("):src.index("int run_chain(")]
    assert "if (xres != nullptr) {" in layer1 and "bias, xres, d, ldd, sm90_scratch, s);" in layer1
    cases = wide_params.wide_params(plan)["gemms"][-1]["sm90_cases"]
    predicate = src[src.index("inline bool residual_on_sm90("):src.index("cudaError_t layer0(")]
    assert cases and all(f"case {c['kernel']}:" in predicate for c in cases)
    no_norm = _rendered(replace(spec, norm=None), WIDE_GEMV)   # the residual alone: its own y = x + b pass
    unit = next(text for name, text in no_norm.items() if name.startswith("FusedMLP_") and name.endswith("_cuda.cu"))
    chain = unit[unit.index("int run_chain("):]
    init = chain.index("init_residual<<<")
    assert chain.index("if (!x_as_c) {  // y = x + b_last") < init < chain.index("if (gemv_pass)") < chain.index("layer0(dev")
    assert f"reinterpret_cast<const io_raw*>(ws + {plan.gemms[-1].b_offset})" in chain[init:]
    launches = [line.strip() for line in _gemv_branch(src).splitlines() if "err = gemv<" in line]
    assert launches[0].startswith("err = gemv<Act0, false>(dev, m, xc, 768,") and ", false, true>(dev, m, h0, 3072," in launches[1]
    instances = {name: text for name, text in files.items() if name.startswith(wide_params.INSTANCE_PREFIX)}
    last = wide_params.wide_instances(plan)
    residual = {name for name, p in last.items() if p["residual"]}
    assert residual and residual < set(instances) and len(residual) < len(instances)
    for name, text in instances.items():
        assert ("constexpr bool kResidual = true;" in text) == (name in residual)
        sm90 = "onnx2fused-arch: sm90a" in text
        assert ("D = act(acc + C[m, n] + bias[n]), C = the block's input rows" in text) == (name in residual and sm90)
        assert ("D = act(acc + C[m, n]), C = D's rows in place" in text) == (name in residual and not sm90)
    plain = _rendered(replace(spec, norm=None, residual=False), WIDE_GEMV)   # the layers alone: none of it
    unit = next(text for name, text in plain.items() if name.startswith("FusedMLP_") and name.endswith("_cuda.cu"))
    assert "init_residual" not in unit and "norm_pass" not in unit and "convert_rows" in unit
    assert not any("kResidual = true" in text for text in plain.values())


GEMV_BUILDS = [_spec([1001, 520, 999]),                          # fp32 rows of odd K0: scalar loads
               _spec([768, 3072, 768], io="f16"),                 # fp16 rows read in place: 16-byte loads
               LLAMA,                                             # gated: gate and up pairs into h0
               _spec([768, 3072, 768], precision="bf16", io="f16"),  # fp16 rows rounded to bf16
               # a block: the norm pass, y = x + b, the GEMV path's last layer into y
               _block_spec([768, 3072, 768], "f32", (), "layernorm", True, True, act=ex.gelu_erf()),
               _block_spec([192, 768, 192], "f16", (), "layernorm", True, True, act=ex.gelu_erf())]  # fp16 y


@pytest.mark.cuda_build
@pytest.mark.parametrize("tuning", [False, True], ids=["build", "tuning"])
@pytest.mark.parametrize("spec", GEMV_BUILDS, ids=lambda s: s.name)
def test_gemv_path_chain_unit_compiles(spec, tuning, tmp_path):
    """The chain's unit with the GEMV kernels compiles for sm_80 and sm_90a (the tuning build, which runs on
    Hopper only, for sm_90a); the CUTLASS instance units are not compiled here (minutes each)."""
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    try:
        cutlass = headers.find_cutlass_headers()
    except Exception as e:  # noqa: BLE001 - no CUTLASS headers: nothing to compile against
        pytest.skip(str(e))
    plan = choose.wide_plan(spec, WideOptions(tuning=tuning), GEMV)
    from onnx2fused import codegen
    files = codegen.render([spec], True, {spec.name: False}, {spec.name: plan})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    unit = f"{spec.name}_cuda.cu"
    assert "err = gemv<" in files[unit] and "o2f_wide_gemv.cuh" in files
    archs = ["arch=compute_90a,code=sm_90a"] if tuning else ["arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a"]
    gencode = [f for a in archs for f in ("-gencode", a)]
    r = subprocess.run([nvcc, "-O1", "-std=c++17", "--expt-relaxed-constexpr", *gencode, targets.WIDE_SM90A_DEFINE,
                        "-I", str(cutlass.path), "-I", str(tmp_path), "-c", str(tmp_path / unit),
                        "-o", str(tmp_path / "chain.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def _gemv_constant(name: str) -> int:
    """A `constexpr int` of templates/o2f_wide_gemv.cuh: the emulation below takes the kernel's own sizes,
    so a change to the header that the emulation does not follow fails these tests."""
    text = (Path(__file__).resolve().parent.parent / "templates" / "o2f_wide_gemv.cuh").read_text()
    m = re.search(rf"constexpr int {name} = (\d+);", text)
    assert m, f"{name} not found in o2f_wide_gemv.cuh"
    return int(m.group(1))


GEMV_WARPS, GEMV_CHUNK, GEMV_TILE = (_gemv_constant(n) for n in ("kGemvWarps", "kGemvChunk", "kGemvTileCols"))
_LANE = np.arange(32)
_G, _Q = _LANE // 4, _LANE % 4                  # a lane's row/column group and k quarter


def _mma_m16n8k16(a_lo, a_hi, b) -> np.ndarray:
    """The two m16n8k16 steps of one chunk from the registers the kernel passes (each lane's three 16-byte
    loads as 8 values: a_lo row g, a_hi row g + 8, b weight column g), placed by PTX's fragment layout
    (A: a0 (g, 2q..), a1 (g + 8, 2q..), a2 (g, 2q + 8..), a3 (g + 8, 2q + 8..); B: b0 (2q.., n g), b1
    (2q + 8.., n g)): the 16 x 8 product the tensor cores add, so a register wired to the wrong operand
    slot shows as a wrong sum."""
    out = np.zeros((16, 8), np.float32)
    for step in range(2):            # registers .x .y (step 0), .z .w (step 1): two values each
        A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
        for j in range(2):            # the step's first register (a0/a1, b0) and second (a2/a3, b1)
            vals = slice(4 * step + 2 * j, 4 * step + 2 * j + 2)
            for e in range(2):
                k = 2 * _Q + 8 * j + e
                A[_G, k] = a_lo[:, vals][:, e]
                A[_G + 8, k] = a_hi[:, vals][:, e]
                B[k, _G] = b[:, vals][:, e]
        out += A @ B
    return out


def _emulate_gemv(plan: wide.WidePlan, x: np.ndarray, ws_w, ws_b, norm_params=None) -> np.ndarray:
    """run_chain's GEMV branch on one pass of m <= GEMV_MAX_ROWS rows with the kernel's index math, on a
    byte array as the workspace: the conversion pass (or x in place), then per layer and block the two
    8-column tiles (gated: gate columns and their up columns at + second), each warp's K chunks and each
    lane's loads (predicated on k < kp, the row < m and the column < columns), the fragment layout of
    the MMAs (_mma_m16n8k16), the warps' sum and each output thread's row and column; a block's norm
    (the conversion pass) and residual (y = x + b_last, then the last layer adds its product to y)."""
    spec = plan.spec
    ws = np.zeros(plan.workspace_bytes, np.uint8)

    def view(off, count, dtype):
        return ws[off: off + count * np.dtype(dtype).itemsize].view(dtype)

    io_dt = np.float16 if spec.io_dtype == "f16" else np.float32
    for g, w, b in zip(plan.gemms, ws_w, ws_b):  # cuda_pack, as in _emulate
        packed = view(g.w_offset, g.np_ * g.kp, np.float16).reshape(g.np_, g.kp)
        bias = view(g.b_offset, g.np_, io_dt if g.last else np.float16)
        for part in range(2 if g.gated else 1):
            packed[part * g.half: part * g.half + g.n, : g.k] = w[:, part * g.n: (part + 1) * g.n].T
            bias[part * g.half: part * g.half + g.n] = b[part * g.n: (part + 1) * g.n]
    if spec.norm is not None:
        _pack_norm(plan, view, norm_params)
    m, k0 = x.shape
    assert m <= plan.gemv_rows
    y = np.full((m, spec.widths[-1]), np.nan, np.float32)
    bufs = {"h0": plan.h_offsets[0], "h1": plan.h_offsets[1], "xc": plan.xc_offset}
    if plan.convert_input:
        xc = view(plan.xc_offset, m * plan.gemms[0].kp, np.float16).reshape(m, -1)
        xc[:] = 0
        xc[:, :k0] = x if spec.norm is None else _normalise(spec, x, *_packed_norm(plan, view))
    if spec.residual:   # init_residual
        y[:] = (x.astype(np.float32) + view(plan.gemms[-1].b_offset, k0, io_dt).astype(np.float32)).astype(io_dt)
    for g, layer in zip(plan.gemms, spec.layers):
        if g.src == "x":
            src, lda = x.astype(np.float16).reshape(-1), k0
        else:
            src, lda = view(bufs[g.src], m * g.kp, np.float16), g.kp
        weights = view(g.w_offset, g.np_ * g.kp, np.float16)
        bias = view(g.b_offset, g.np_, io_dt if g.last else np.float16).astype(np.float32)
        columns, second = (g.half, g.half) if g.gated else (g.np_, 0)
        if g.gated:
            out_rows, ldd = view(bufs[g.dst], m * g.half, np.float16), g.half
        elif g.last:
            out_rows, ldd = y.reshape(-1), g.n
        else:
            out_rows, ldd = view(bufs[g.dst], m * g.np_, np.float16), g.np_

        def load(flat, start, ok):   # [32, 8] values of each lane's 16-byte load, zero where not ok
            idx = np.where(ok, start, 0)[:, None] + np.arange(8)
            return np.where(ok[:, None], flat[np.minimum(idx, flat.size - 1)], 0).astype(np.float32)

        per_block = GEMV_TILE if g.gated else 2 * GEMV_TILE
        chunks = -(-g.kp // GEMV_CHUNK)
        for block in range(-(-columns // per_block)):
            base = block * per_block
            tile_col = [base, base if g.gated else base + GEMV_TILE]
            wrow = [np.where(tile_col[t] + _G < columns, tile_col[t] + _G + (t * second if g.gated else 0), 0)
                    for t in range(2)]
            wok = [tile_col[t] + _G < columns for t in range(2)]
            frag = np.zeros((GEMV_WARPS, 2, 4, 32), np.float32)   # partial[warp][tile][i][lane]
            for warp in range(GEMV_WARPS):
                for chunk in range(warp, chunks, GEMV_WARPS):
                    k = chunk * GEMV_CHUNK + 8 * _Q
                    kok = k < g.kp
                    a_lo = load(src, _G * lda + k, kok & (_G < m))
                    a_hi = load(src, (_G + 8) * lda + k, kok & (_G + 8 < m))
                    for t in range(2):
                        d = _mma_m16n8k16(a_lo, a_hi, load(weights, wrow[t] * g.kp + k, kok & wok[t]))
                        for i in range(4):   # C fragment: c_i of lane l is (l/4 + 8 (i/2), 2 (l%4) + i%2)
                            frag[warp, t, i] += d[_G + 8 * (i // 2), 2 * _Q + i % 2]
            for e in range(2 * 4 * 32):   # the output threads
                t, i, lane = e // 128, (e // 32) % 4, e % 32
                if g.gated and t == 1:
                    continue
                row, col = lane // 4 + 8 * (i // 2), tile_col[t] + 2 * (lane % 4) + i % 2
                if row >= m or col >= columns:
                    continue
                total = frag[:, t, i, lane].sum()
                if g.gated:
                    gate = np.float32(np.float16(total + bias[col]))
                    up = np.float32(np.float16(frag[:, 1, i, lane].sum() + bias[second + col]))
                    value = ex.evaluate(layer.activation, np.array([gate]))[0] * up
                else:   # kIntoOutput (a block's last layer): the output row holds x + b already
                    source = out_rows[row * ldd + col] if g.last and spec.residual else bias[col]
                    value = ex.evaluate(layer.activation, np.array([total + source]))[0]
                out_rows[row * ldd + col] = value
    return y


@pytest.mark.parametrize("widths,io,gated,rows", [
    ([40, 24, 17], "f32", (), 1), ([13, 9, 30, 5], "f16", (), 16), ([41, 300, 17], "f32", (0,), 5),
    ([13, 21, 30, 5], "f16", (0, 1), 16), ([16, 64, 8], "f16", (), 3),
    ([600, 40, 17], "f32", (), 9),   # 19 K chunks: a warp takes chunks w, w + 8, w + 16
])
def test_emulated_gemv_path_matches_fp32_reference(widths, io, gated, rows):
    spec = _spec(widths, ex.sigmoid(), io=io, gated=gated)     # act(0) = 0.5: the padding must not leak
    plan = choose.wide_plan(spec, options=GEMV)
    x, ws, bs, ref = _chain_case(spec, rows)
    got = _emulate_gemv(plan, x, ws, bs)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 3e-3


@pytest.mark.parametrize("widths,io,gated,norm,norm_bias,residual", BLOCKS)
@pytest.mark.parametrize("rows", [1, 16])
def test_emulated_gemv_path_of_a_block_matches_fp32_reference(widths, io, gated, norm, norm_bias, residual, rows):
    spec = _block_spec(widths, io, gated, norm, norm_bias, residual)
    plan = choose.wide_plan(spec, options=GEMV)
    x, ws, bs, norm_params, ref = _block_case(spec, rows)
    got = _emulate_gemv(plan, x, ws, bs, norm_params)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 3e-3


def test_inspect_skips_a_precision_no_design_plans(tmp_path, monkeypatch):
    """Automatic precision on a wide chain given tf32 (which no wide GEMM computes): inspect shows what
    convert would build, fp32 on CUDA cores, and says that tf32 was skipped and why."""
    import importlib
    import onnx
    import onnx2fused
    from onnx2fused.precision import PrecisionChoice
    from onnx_builders import G
    g = G(opset=17, seed=2)
    h = g.op("Relu", [g.linear("x", 768, 3072)])
    g.op("Identity", [g.linear(h, 3072, 768)], outputs=["y"])
    path = tmp_path / "ffn.onnx"
    onnx.save(g.model([("x", ["B", 768])], [("y", ["B", 768])]), str(path))
    conv = importlib.import_module("onnx2fused.convert")   # the module: the package rebinds the name `convert`
    monkeypatch.setattr(conv, "initial_precisions",
                        lambda model, chains, *a: [PrecisionChoice("tf32", "the numerics model (test)") for _ in chains])
    (chain,) = onnx2fused.inspect(str(path), plan_options=PlanOptions(wide_unavailable="", design="wide"),
                                  with_cuda=True).chains
    assert chain.precision == "fp32" and chain.precision_why.startswith("tf32 has no CUDA plan (")
    assert chain.precision_why.endswith("; the numerics model (test)") and chain.cuda_plan.startswith("GPU: CUDA cores, fp32")
    (cpu,) = onnx2fused.inspect(str(path), with_cuda=False).chains   # a CPU-only library has no CUDA plan to need
    assert cpu.precision == "tf32"


def test_the_default_kernel_can_be_named_at_convert_time(monkeypatch):
    """ONNX2FUSED_WIDE_DEFAULT_KERNEL picks the untuned choices' kernel (CUTLASS's Pingpong128x128 in place
    of our Light128x128: the way back, and A/B comparisons); a name that is no 16-bit kernel is refused
    with the list of names."""
    spec = _spec([768, 3072, 768], ex.gelu_erf())
    light = choose.wide_plan(spec)
    assert {c.kernel for per in light.choices for c in per} == {sm90.LIGHT_KERNEL}
    monkeypatch.setenv(sm90.DEFAULT_KERNEL_ENV, "Pingpong128x128")
    ping = choose.wide_plan(spec)
    assert {sm90.SM90_KERNELS[c.kernel].name for per in ping.choices for c in per} == {"Pingpong128x128"}
    assert "default kernels (not tuned)" in ping.describe() and "as CUTLASS 3.x wgmma/TMA kernels" in ping.describe()
    assert "as onnx2fused's wgmma/TMA kernels" in light.describe()
    hopper = [n for n, t in render_cuda([spec]).items() if n.startswith("o2f_inst_") and targets.sm90a_only(t)]
    assert hopper and all(n.startswith("o2f_inst_Pingpong128x128_") for n in hopper)
    for bad in ("Tf32Coop128x256", "Light64x64"):
        monkeypatch.setenv(sm90.DEFAULT_KERNEL_ENV, bad)
        with pytest.raises(ConversionError, match="expected one of .*Light128x128"):
            choose.wide_plan(spec)


def test_our_tf32_kernel_is_searched_and_named_at_convert_time(monkeypatch):
    """Tf32Light128x128 (our kernel on fp32 operands) is among the candidates the search times for a first
    layer read in place, and runs it untuned where ONNX2FUSED_WIDE_DEFAULT_TF32_KERNEL names it: its
    instance unit is ours (no CUTLASS), the chain's layer0_tf32 dispatches to it. The untuned default stays
    CUTLASS's Tf32Pingpong128x128 (faster through ORT); a name that is no tf32 kernel is refused with the
    list of names."""
    spec = _spec([512, 256, 64, 1])      # DLRM's: the tf32 first layer wins in the cost model
    ours = sm90.kernel_index("Tf32Light128x128")
    assert sm90.SM90_KERNELS[ours].tf32 and sm90.SM90_KERNELS[ours].light
    assert sm90.Sm90Choice(ours, "data_parallel") in sm90.sm90_candidates()
    assert sm90.SM90_KERNELS[sm90.DEFAULT_TF32_CHOICE.kernel].name == "Tf32Pingpong128x128"
    assert all(c == sm90.DEFAULT_TF32_CHOICE for c in choose.make_plan(spec).choices[0])
    monkeypatch.setenv(sm90.DEFAULT_TF32_KERNEL_ENV, "Tf32Light128x128")
    plan = choose.make_plan(spec)
    assert plan.design == "wide" and plan.tf32_first
    assert all(c == sm90.Sm90Choice(ours, "data_parallel") for c in plan.choices[0])
    assert all(c == sm90.default_choice() for per in plan.choices[1:] for c in per)
    assert "default kernels (not tuned)" in plan.describe()
    files = render_cuda([spec])
    unit = next(t for n, t in files.items() if n.startswith("o2f_inst_Tf32Light128x128_f32_f16_"))
    assert "using Elem = float;" in unit and '#include "cutlass/' not in unit and targets.sm90a_only(unit)
    # every Hopper unit of the untuned build is ours: no CUTLASS 3.x instance to compile
    hopper = [n for n, t in files.items() if n.startswith("o2f_inst_") and targets.sm90a_only(t)]
    assert hopper and all(n.startswith(("o2f_inst_Tf32Light128x128_", "o2f_inst_Light128x128_")) for n in hopper)
    src = cuda_source(spec)
    tf32 = src[src.index("cudaError_t layer0_tf32("):]
    assert "return o2f_inst_Tf32Light128x128_f32_f16_a8_" in tf32[:tf32.index("\n}\n")]
    for bad in ("Light128x128", "Tf32Light64x64"):   # a 16-bit kernel, or none, is refused with the names
        monkeypatch.setenv(sm90.DEFAULT_TF32_KERNEL_ENV, bad)
        with pytest.raises(ConversionError, match="expected one of .*Tf32Light128x128"):
            choose.make_plan(spec)
