"""The generated tensor-core kernel compiles for sm_80 and sm_90 and really uses mma.sync/ldmatrix
(checked in the PTX, so it runs in CI without a GPU)."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.plan import choose, sm90
from onnx2fused.plan.options import PlanOptions, WideOptions
from onnx2fused.spec import LayerSpec, MLPSpec
from onnx2fused.wide_params import tail_symbol

pytestmark = pytest.mark.cuda_build
NVCC = shutil.which("nvcc")


def _spec(widths, precision, act, last=None):
    layers = tuple(LayerSpec(a, b, True, act(b) if callable(act) else act) if i < len(widths) - 2 else
                   LayerSpec(a, b, True, last(b) if last else ex.identity())
                   for i, (a, b) in enumerate(zip(widths, widths[1:])))
    return MLPSpec(layers, precision, "f32")


def _prelu(n):
    """PRelu with a slope per channel (a constant array in the generated code)."""
    slope = ex.Chan(tuple(np.linspace(0.01, 0.3, n)))
    return ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * slope, ex.X))


MMA_SYNC = PlanOptions(wgmma=False)   # the mma.sync designs (auto picks wgmma for some of these chains on Hopper)


def _write_cuda(spec, tmp_path, options=MMA_SYNC, wide=None):
    """Renders `spec` with CUDA into tmp_path (its sources and the headers they include); returns the
    text of its own `<name>_cuda.cu` and that file's path."""
    plans = choose.make_plans([spec], options, {spec.name: wide} if wide else None)
    files = codegen.render([spec], True, {spec.name: False}, plans)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    name = f"{spec.name}_cuda.cu"
    return files[name], tmp_path / name


def _affine(n):
    return ex.X * ex.Chan(tuple(np.linspace(-1, 1, n))) + ex.Chan(tuple(np.arange(n) % 3))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("spec", [
    _spec([32, 64, 64, 16], "fp16", ex.relu()),          # resident design
    _spec([256, 256, 256, 256, 16], "bf16", ex.gelu_erf()),  # streamed design, bf16
    _spec([32, 50, 50, 7], "fp16", _prelu, _affine),     # per-channel, resident, odd last width
    _spec([300, 520, 9], "bf16", _prelu, _affine),       # per-channel, streamed (520 padded to 576 columns)
    _spec([32, 64, 64, 16], "tf32", ex.gelu_erf()),      # tf32 (m16n8k8), resident with shared-memory tiles
    _spec([256, 256, 256], "tf32", ex.silu()),           # tf32, streamed
    _spec([32, 64, 64, 16], "fp16", ex.silu()),          # packed fp16x2 silu (tanh.approx.f16x2), registers
    _spec([32, 64, 64, 16], "fp16", ex.quick_gelu()),    # packed fp16x2 QuickGELU (CLIP)
    replace(_spec([32, 64, 64, 16], "fp16", ex.silu()), act_math="fp32"),   # the same in fp32 (fp16a32)
], ids=lambda s: s.name if isinstance(s, MLPSpec) else s)
def test_ptx_uses_tensor_cores(spec, arch, tmp_path):
    _check_ptx(spec, arch, tmp_path)


# Streamed FFN-shaped pairs (a wide hidden layer built in blocks straight into the next layer), forced
# to the streamed design: the cost model may give these chains to the wide design.
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("spec", [
    _spec([256, 4096, 256], "fp16", ex.gelu_erf()),      # FFN: 64-column blocks, 128-row tiles
    _spec([64, 1000, 48], "bf16", _prelu, _affine),       # per-channel slopes on the hidden blocks; 1000 wide
    _spec([64, 1000, 48], "tf32", _prelu),                # tf32 (m16n8k8, 2xTF32 activations)
    _spec([64, 320, 512, 64], "bf16", ex.relu()),         # two wide layers: only the second pairs
    _spec([64, 512, 64, 520, 9], "fp16", ex.silu()),      # two pairs sharing H; the last one into the output
], ids=lambda s: s.name if isinstance(s, MLPSpec) else s)
def test_streamed_pair_ptx_uses_tensor_cores(spec, arch, tmp_path):
    streamed = PlanOptions(design="streamed", wgmma=False)
    assert choose.make_plan(spec, streamed).pairs
    _check_ptx(spec, arch, tmp_path, streamed)


def _check_ptx(spec, arch, tmp_path, options=MMA_SYNC):
    src, cu = _write_cuda(spec, tmp_path, options)
    plan = choose.make_plan(spec, options)
    for i, layer in enumerate(spec.layers):  # per-channel arrays cover the padded columns the kernel computes
        for c, arr in ex.chan_arrays(layer.activation, f"kChan{i}_").items():
            assert f"__device__ const float {arr}[{plan.layers[i].np_}] = {{ {ex.c_array_values(c, plan.layers[i].np_)} }};" in src
    ptx = tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "-ptx", "-std=c++17", f"-arch=compute_{arch}", str(cu), "-o", str(ptx)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    text = ptx.read_text()
    shape, dtype = {"fp16": ("m16n8k16", "f16"), "bf16": ("m16n8k16", "bf16"), "tf32": ("m16n8k8", "tf32")}[spec.precision]
    assert f"mma.sync.aligned.{shape}.row.col.f32.{dtype}.{dtype}.f32" in text
    if spec.precision == "tf32":
        assert "cvt.rna.tf32.f32" in text  # operands rounded to tf32, not truncated by the tensor core
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "cp.async" in text
    # fp16 hidden layers with packed forms run them in fp16x2 arithmetic (act_math "packed"); act32 never
    forms = {ex.packed_form(spec.layers[i].activation).device for i in spec.packed_layers}
    assert ("tanh.approx.f16x2" in text) == bool(forms)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_fp32_kernel_with_per_channel_constants_compiles(tmp_path):
    """The CUDA-core (fp32) kernel: per-channel arrays of the true width, read at the row's column."""
    spec = _spec([13, 37, 5], "fp32", _prelu, _affine)
    src, cu = _write_cuda(spec, tmp_path)
    assert "__device__ const float kChan0_0[37]" in src and "__device__ const float kChan1_1[5]" in src
    r = subprocess.run([NVCC, "-ptx", "-std=c++17", "-arch=compute_80", str(cu), "-o", str(tmp_path / "k.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    # The arrays are global-memory data holding the float32 bytes of the values.
    decls = [line for line in ptx.splitlines() if line.startswith(".global") and "kChan" in line]
    assert len(decls) == 3 and "kChan1_0E[20] = {0, 0, 128, 191, 0, 0, 0, 191," in decls[1]  # -1.0f, -0.5f


# ---- wide design (CUTLASS GEMMs per layer): one PTX compile per case, one arch each (CUTLASS is slow) ----
def _cutlass_include():
    from onnx2fused.headers import find_cutlass_headers
    from onnx2fused.errors import ConversionError
    try:
        return find_cutlass_headers().path
    except ConversionError:
        return None


# arch "90a": what build.py compiles for Hopper (wide_nvcc_flags: the CUTLASS 2.x kernel instances for
# sm_90a; sm90a_nvcc_flags: the CUTLASS 3.x wgmma + TMA instances for sm_90a alone); "80": the 2.x instance
# with the same define. The GEMMs are in the kernel instance units (o2f_inst_*.cu): each case compiles its
# first layer's (the sm80 one, and for 90a the Hopper one). One sm_90a case runs in CI (~1.5 min on 2
# cores); the second one is `slow`.
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec,arch", [
    (_spec([768, 3072, 768], "fp16", ex.gelu_erf()), "90a"),               # FFN: wide by the cost model
    (_spec([9216, 4096, 4096, 1000], "bf16", ex.relu()), "80"),            # head: too wide for streamed; bf16
    pytest.param(MLPSpec((LayerSpec(1001, 520, True, ex.silu()), LayerSpec(520, 999, False, ex.identity())),
                         "fp16", "f16"), "90a", marks=pytest.mark.slow),  # odd widths, fp16 io, forced wide
], ids=lambda v: v.name if isinstance(v, MLPSpec) else v)
def test_wide_ptx_uses_tensor_cores(spec, arch, tmp_path):
    from onnx2fused.targets import WIDE_SM90A_DEFINE, sm90a_only
    include = _cutlass_include()
    if include is None:
        pytest.skip("no CUTLASS headers (pip install nvidia-cutlass or set ONNX2FUSED_CUTLASS_DIR)")
    src, cu = _write_cuda(spec, tmp_path, PlanOptions(design="wide"))
    dtype = "bf16" if spec.precision == "bf16" else "f16"
    layer0 = src[src.index("cudaError_t layer0("):src.index("cudaError_t layer1(")]
    insts = {p.name[:-3]: p for p in tmp_path.glob("o2f_inst_*.cu")}
    called = [name for name in insts if f"{name}::run(" in layer0]   # layer 0's instances
    sm80 = [insts[n] for n in called if not sm90a_only(insts[n].read_text())]
    hopper = [insts[n] for n in called if sm90a_only(insts[n].read_text())]
    assert len(sm80) == 1 and len(hopper) == 1 and f"_{dtype}_{dtype}_a8_" in sm80[0].name
    assert '#include "cutlass/gemm/device/gemm.h"' in sm80[0].read_text() and '#include "cutlass/' not in \
        src.replace('#include "cutlass/cutlass.h"', "").replace('#include "cutlass/numeric_types.h"', "").replace(
            '#include "cutlass/array.h"', "")  # the chain's unit: CUTLASS's types only, no GEMM
    text = ""
    for unit in sm80 + (hopper if arch == "90a" else []):
        ptx = tmp_path / (unit.name + ".ptx")
        r = subprocess.run([NVCC, "-ptx", "-std=c++17", "--expt-relaxed-constexpr", f"-arch=compute_{arch}",
                            WIDE_SM90A_DEFINE, "-I", str(include), str(unit), "-o", str(ptx)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        text += ptx.read_text()
    # the CUTLASS 2.x kernels are in every arch's code (other GPUs, untileable outputs, the sm80 override)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in text
    assert "ldmatrix.sync.aligned" in text and "cp.async.cg.shared.global" in text
    if arch == "90a":  # Hopper kernels: wgmma fed by TMA, TMA stores from the epilogue
        from onnx2fused.plan import sm90
        tile_n = sm90.SM90_KERNELS[sm90.DEFAULT_CHOICE.kernel].tile_mn[1]   # the untuned kernel's CTA tile
        assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k16.f32.{dtype}.{dtype}" in text
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in text or "cp.async.bulk.tensor.3d" in text
        assert "cp.async.bulk.tensor" in text and ".global.shared::cta" in text
    else:
        assert "wgmma" not in text
    # no call (an assert left in) in the kernels: ptxas would serialize the wgmma pipeline around it
    assert "__assertfail" not in text
    # every exported entry point of the ABI is there
    for fn in ("cuda_workspace_bytes", "cuda_pack", "cuda_run"):
        assert f"{spec.name}_{fn}" in src


def test_register_design_chosen_where_fragments_fit():
    """16-bit layers up to 128 wide keep hidden activations in registers; wider ones, and tf32 (whose A
    and C fragment layouts differ), keep them in shared memory."""
    assert choose.make_plan(_spec([32, 64, 64, 16], "fp16", ex.relu()), MMA_SYNC).register_activations
    assert choose.make_plan(_spec([64, 128, 128, 64], "bf16", ex.gelu_erf()), MMA_SYNC).register_activations
    assert not choose.make_plan(_spec([64, 200, 64], "fp16", ex.relu()), MMA_SYNC).register_activations
    assert not choose.make_plan(_spec([32, 64, 64, 16], "tf32", ex.relu()), MMA_SYNC).register_activations


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("tuning", [False, True])
def test_wide_source_main_unit_compiles_with_a_tf32_first_layer(tmp_path, tuning):
    """The wide design's chain unit (the launchers, the conversion pass, the tf32 in-place first layer,
    and in the tuning build the timing entries) compiles for sm_90a; the CUTLASS kernel instances are
    their own units, not compiled here but one small one (minutes of nvcc each for the Hopper ones:
    the GPU tests build them)."""
    from onnx2fused import targets
    from onnx2fused.headers import find_cutlass_headers
    try:
        cutlass = find_cutlass_headers()
    except Exception as e:  # noqa: BLE001 - no CUTLASS headers: nothing to compile against
        pytest.skip(str(e))
    spec = _spec([512, 256, 64, 1], "fp16", ex.relu())   # DLRM: the cost model reads x in place (tf32)
    plan = choose.wide_plan(spec, WideOptions(tuning=tuning))
    assert plan.tf32_first and plan.tail_from == 1      # and runs 256 -> 64 -> 1 as one fused tail kernel
    _, path = _write_cuda(spec, tmp_path, wide=WideOptions(tuning=tuning))
    flags = targets.wide_nvcc_flags(["-O1", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90"])
    r = subprocess.run([NVCC, *flags, "-I", str(cutlass.path), "--expt-relaxed-constexpr",
                        "-c", str(path), "-o", str(tmp_path / "wide.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    # the tail is its own unit (the fused kernel's template): it defines what the wide unit calls
    tail = tmp_path / f"{tail_symbol(spec)}_cuda.cu"
    r = subprocess.run([NVCC, "-O1", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90", "-c", str(tail),
                        "-o", str(tmp_path / "tail.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    nm = shutil.which("nm")
    if nm:
        def symbols(obj, kind):
            out = subprocess.run([nm, str(tmp_path / obj)], capture_output=True, text=True).stdout
            return {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == [kind]}
        wanted = {s for s in symbols("wide.o", "U") if s.startswith(tail_symbol(spec))}
        assert len(wanted) == 3 and wanted <= symbols("tail.o", "T")
        # the kernel instances it calls: one launcher each, named after a rendered instance unit
        insts = sorted(f.name[:-3] for f in tmp_path.glob("o2f_inst_*.cu"))
        calls = {s for s in symbols("wide.o", "U") if "o2f_inst_" in s}
        assert len(insts) == (len(sm90.SM90_KERNELS) + 1 if tuning else 2)  # every kernel / the tf32 default; sm80
        assert sorted(next(i for i in insts if i in s) for s in calls) == insts
        if not tuning:  # one real instance unit (the sm80 one, for sm_80 only: the cheapest) defines its launcher
            sm80 = next(i for i in insts if "_Sm80" in i)
            r = subprocess.run([NVCC, "-O1", "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
                                *targets.wide_nvcc_flags([]), "-I", str(cutlass.path), "--expt-relaxed-constexpr",
                                "-c", str(tmp_path / f"{sm80}.cu"), "-o", str(tmp_path / "inst.o")],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-3000:]
            assert {s for s in calls if sm80 in s} <= symbols("inst.o", "T")


# ---- gated layers (SwiGLU/GeGLU, issue 16): one GEMM of 2*NP columns, gate and up interleaved in 8s ----
def _gated_spec(widths, precision, gated_at, act=ex.silu(), io="f32"):
    """A chain whose layers `gated_at` are gated (act(x Wg) * (x Wu)); other hidden layers ReLU, the last
    identity unless gated."""
    last = len(widths) - 2
    layers = tuple(LayerSpec(a, b, True, act if i in gated_at else (ex.relu() if i < last else ex.identity()),
                             gated=i in gated_at)
                   for i, (a, b) in enumerate(zip(widths, widths[1:])))
    return MLPSpec(layers, precision, io)


GATED_CASES = [
    (_gated_spec([64, 100, 64], "fp16", {0}), "resident"),                  # SwiGLU FFN, registers
    (_gated_spec([64, 100, 64], "bf16", {0}, ex.gelu_erf()), "resident"),   # GeGLU, bf16
    (_gated_spec([32, 37, 37, 5], "fp16", {0, 1}), "resident"),            # odd widths, two gated layers
    (_gated_spec([32, 48, 37], "bf16", {1}), "resident"),                   # the last layer gated
    (_gated_spec([48, 120, 48], "fp16", {0}), "resident"),                  # 256 GEMM columns: shared memory
    (_gated_spec([32, 37, 37, 5], "tf32", {0}), "resident"),                # tf32 (m16n8k8)
    (_gated_spec([256, 1000, 256], "fp16", {0}, io="f16"), "streamed"),     # FFN too big to keep: streamed
    (_gated_spec([64, 100, 64], "bf16", {0}), "streamed"),                  # forced streamed, odd width
    (_gated_spec([64, 300, 37], "fp16", {0, 1}), "streamed"),               # the last layer gated, odd
    (_gated_spec([64, 100, 64], "tf32", {0}), "streamed"),                  # tf32 streamed
]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("spec,design", GATED_CASES, ids=lambda s: s.name if isinstance(s, MLPSpec) else s)
def test_gated_ptx_uses_tensor_cores(spec, design, arch, tmp_path):
    options = PlanOptions(design=design, wgmma=False)
    plan = choose.make_plan(spec, options)
    assert plan.design == design
    for l in plan.layers:
        if l.gated:
            assert l.cols == 2 * l.np_ and l.nc % 32 == 0 and l.n_nchunks * l.nc == l.cols
    src, _ = _write_cuda(spec, tmp_path, options)
    assert "pack_weights_gated<<<" in src and "pack_bias_gated<<<" in src
    assert ("store_output_gated<" in src) == spec.layers[-1].gated
    _check_ptx(spec, arch, tmp_path, options)


def test_gated_plans_are_fused_or_wide():
    """Auto planning: gated chains get the resident mma.sync design where it holds them and wgmma does not
    win (it says why); the wgmma design where it wins (a layer of >= 128 outputs; measured on the H100); past that, the cost model chooses between the streamed kernel and the wide design's
    gate-and-up GEMM, as for plain chains (SwiGLU 256 -> 1024 -> 256 at 2^18 rows on the H100: wide 1.864 ms,
    streamed 2.942, RESULTS.md); no plan without the wide design where no fused kernel holds them."""
    small = _gated_spec([64, 100, 64], "fp16", {0})
    assert choose.make_plan(small, PlanOptions(wgmma=True)).design == "resident"
    assert "no hidden layer of >= 128 outputs (mma.sync is as fast there)" in choose.wgmma_note(small, choose.make_plan(small))
    big = _gated_spec([256, 1000, 256], "fp16", {0}, io="f16")
    plan = choose.make_plan(big)
    assert plan.design == "wide" and "cost model" in plan.reason
    assert choose.make_plan(big, PlanOptions(design="streamed")).design == "streamed"
    assert [g.gated for g in choose.wide_plan(big).gemms] == [True, False]
    mid = _gated_spec([64, 256, 64], "fp16", {0})   # the zoo's swiglu block: wgmma (mma.sync without it)
    assert choose.make_plan(mid).design == "wgmma"
    assert choose.make_plan(mid, PlanOptions(wgmma=False)).design in ("resident", "streamed")
    huge = _gated_spec([1024, 4096, 1024], "bf16", {0}, io="f16")   # no fused kernel holds it
    plan = choose.make_plan(huge, PlanOptions(wide_unavailable=""))
    assert plan.design == "wide" and "glu pass" in plan.describe()
    with pytest.raises(Exception, match="16-row tile needs .* the wide design cannot take it either: no CUTLASS"):
        choose.make_plan(huge, PlanOptions(wide_unavailable="no CUTLASS headers"))
    assert choose.make_plan(_gated_spec([32, 37, 5], "fp32", {0})).design == "fp32"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_fp32_kernel_with_a_gated_layer_compiles(tmp_path):
    spec = _gated_spec([13, 37, 5], "fp32", {0})
    src, cu = _write_cuda(spec, tmp_path)
    assert "act(gate) * up" in src
    r = subprocess.run([NVCC, "-ptx", "-std=c++17", "-arch=compute_80", str(cu), "-o", str(tmp_path / "k.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
