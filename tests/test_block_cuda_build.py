"""Transformer blocks (a norm in front, a residual behind; issue 16) in the CUDA kernels, without a GPU:
the resident, streamed and fp32 sources of block specs render and compile (nvcc, PTX for sm_80 and
sm_90), normalise the rows as they load them (norm_rows) and add the residual in the last epilogue
(store_output's Residual), keep the norm's parameters after the layers' biases (plan and kernel agree), and
plain specs render none of it. A converted block with CUDA kernels is one fused op (the library's CPU
kernel validates it on this host). The numbers: tests/test_gpu_block.py on a GPU host.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.plan import choose
from onnx2fused.plan.options import PlanOptions, WgmmaOptions
from onnx2fused.plan.padding import norm_floats
from onnx2fused.spec import DOMAIN, LayerSpec, MLPSpec, NormSpec

pytestmark = pytest.mark.cuda_build
NVCC = shutil.which("nvcc")
MODELS = Path(__file__).resolve().parent.parent / "models"
LN = NormSpec("layernorm", 1e-5, True)
LN_NOBIAS = NormSpec("layernorm", 1e-3, False)
RMS = NormSpec("rmsnorm", 1e-6)


def block_spec(widths, precision="fp16", norm=LN, residual=True, io="f32", gated=(), act=ex.gelu_erf()):
    """A chain of `widths` (hidden layers `act`, or SiLU-gated where in `gated`; the last identity unless
    gated) with a norm in front and a residual behind."""
    last = len(widths) - 2
    layers = tuple(LayerSpec(a, b, True, ex.silu() if i in gated else act if i < last else ex.identity(),
                             gated=i in gated)
                   for i, (a, b) in enumerate(zip(widths, widths[1:])))
    return MLPSpec(layers, precision, io, norm=norm, residual=residual)


PRELN = block_spec([64, 256, 64])                                     # models/preln: LayerNorm, GELU FFN
LLAMA = block_spec([64, 128, 64], norm=RMS, gated={0})                # models/llama: RMSNorm, SwiGLU
CASES = [
    (PRELN, "resident"), (PRELN, "streamed"),
    (replace(PRELN, precision="bf16"), "resident"),
    (replace(PRELN, precision="tf32"), "resident"), (replace(PRELN, precision="tf32"), "streamed"),
    (LLAMA, "resident"), (LLAMA, "streamed"), (replace(LLAMA, precision="tf32"), "streamed"),
    (block_spec([40, 100, 40], norm=LN_NOBIAS), "resident"),            # K0 40: pieces over 8 lanes, 8 padded features
    (block_spec([72, 300, 72], "bf16", norm=RMS), "streamed"),         # K0 72: 18 pieces over 16 lanes
    (block_spec([72, 200, 72], io="f16"), "resident"),                # fp16 I/O: the layer norm rounded to fp16
    (block_spec([30, 37, 30], norm=RMS, residual=False), "resident"),  # K0 30: scalar loads; no residual
    (block_spec([37, 64, 37], norm=None), "streamed"),                 # a residual alone, odd width
    (block_spec([64, 100, 37], "bf16", residual=False, gated={1}), "streamed"),   # a gated last layer, norm only
    (block_spec([48, 96, 48], residual=True, gated={1}, norm=None), "resident"),  # a gated last layer + residual
]


def _render(spec, design):
    options = PlanOptions(design=design, wgmma=False)
    plan = choose.make_plan(spec, options)
    assert plan.design == (design if spec.precision != "fp32" else "fp32"), plan.describe()
    files = codegen.render([spec], True, {spec.name: False}, {spec.name: plan})
    return plan, files


def _ptx(files, spec, arch, tmp_path) -> str:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cu, ptx = tmp_path / f"{spec.name}_cuda.cu", tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "-ptx", "-std=c++17", f"-arch=compute_{arch}", str(cu), "-o", str(ptx)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return ptx.read_text()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("spec,design", CASES, ids=lambda v: v.name if isinstance(v, MLPSpec) else v)
def test_block_kernel_compiles_with_prologue_and_epilogue(spec, design, arch, tmp_path):
    plan, files = _render(spec, design)
    src = files[f"{spec.name}_cuda.cu"]
    k0 = spec.widths[0]
    # the norm's parameters follow the layers' biases in the one fp32 array the kernel copies to shared memory
    assert plan.bias_elems == plan.norm_offset + norm_floats(spec)
    assert f"constexpr int kBiasElems = {plan.bias_elems};" in src
    assert plan.workspace_bytes == plan.weight_elems * (4 if spec.precision == "tf32" else 2) + plan.bias_elems * 4
    if spec.norm is not None:
        assert plan.prefetch_vectors == 0   # the rows are read by norm_rows' lane groups
        assert "norm_rows<" in src and "load_rows<" not in src.split("norm_rows<")[1]
        assert f"constexpr int kNormK0 = {k0}, kNormKP0 = {plan.layers[0].kp};" in src
        assert f"constexpr int kNormOffset = {plan.norm_offset}," in src
        assert f"pack_bias<<<" in src and f"(w[{len(spec.layers)}], bdst + {plan.norm_offset}, {k0}," in src
        assert (f"(b[{len(spec.layers)}], bdst + " in src) == spec.norm.has_bias
        assert files["o2f_block_norm.cuh"].startswith("// o2f_block_norm.cuh")
        assert ("kNormRoundHalf = true" in src) == (spec.io_dtype == "f16" and spec.norm.kind == "layernorm")
    else:
        assert "norm_rows" not in src and "o2f_block_norm.cuh" not in files
    # the last layer's store adds x's rows: a Residual<N> over x as its last argument
    residual_stores = re.findall(r"store_output(_gated)?<\d+, (\d+)>\((?:acc\d?|acc2), \w+, y, rows, [^;]*, lane, "
                                 r"Residual<(\d+)>\{x\}\);", src)
    assert bool(residual_stores) == spec.residual
    assert ("o2f_block_residual.cuh" in files) == spec.residual
    if spec.residual:
        assert all(n == width == str(spec.widths[-1]) for _, n, width in residual_stores)
        assert all((gated == "_gated") == spec.layers[-1].gated for gated, _, _ in residual_stores)
    text = _ptx(files, spec, arch, tmp_path)
    shape, dtype = {"fp16": ("m16n8k16", "f16"), "bf16": ("m16n8k16", "bf16"), "tf32": ("m16n8k8", "tf32")}[spec.precision]
    assert f"mma.sync.aligned.{shape}.row.col.f32.{dtype}.{dtype}.f32" in text
    if spec.norm is not None:
        assert "sqrt.rn.f32" in text   # IEEE sqrt and division, as the CPU kernel's
        assert ("shfl.sync.bfly" in text) == (k0 > 4)   # a row's sums over its lane group (K0 <= 4: one lane)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec", [replace(PRELN, precision="fp32"), replace(LLAMA, precision="fp32"),
                                  block_spec([40, 37, 40], "fp32", norm=LN_NOBIAS, io="f16"),
                                  block_spec([13, 20, 13], "fp32", norm=None)],
                         ids=lambda s: s.name)
def test_fp32_block_kernel_compiles(spec, tmp_path):
    plan, files = _render(spec, "auto")
    src = files[f"{spec.name}_cuda.cu"]
    assert plan.workspace_bytes == (sum(l.in_features * l.weight_columns + l.weight_columns for l in spec.layers)
                                    + norm_floats(spec)) * 4
    assert ("normalise_row(h, p + kTotal);" in src) == (spec.norm is not None)
    assert ("(kTotal + kNormFloats) * sizeof(float)" in src) == (spec.norm is not None)
    assert ("+ o2f_load(x + row * " in src) == spec.residual
    text = _ptx(files, spec, "80", tmp_path)
    assert "fp32_kernel" in text


def test_plain_specs_render_no_block_code():
    """A chain without a norm or residual renders exactly as before: none of the block's code or headers."""
    spec = replace(PRELN, norm=None, residual=False)
    for design in ("resident", "streamed"):
        _, files = _render(spec, design)
        src = files[f"{spec.name}_cuda.cu"]
        assert "norm" not in src.lower() and "_res<" not in src and not any("o2f_block" in f for f in files)


def test_block_plans_skip_wgmma_and_take_wide_where_forced():
    """The wgmma design takes blocks (plan.wgmma.BLOCKS; without, planning takes resident or streamed and
    says why); the wide design takes the block (its norm pass and residual epilogue) where forced."""
    spec = block_spec([128, 256, 128])   # its layers alone: wgmma on Hopper (layers of >= 128 outputs)
    assert choose.make_plan(replace(spec, norm=None, residual=False)).design == "wgmma"
    assert choose.make_plan(spec).design == "wgmma" and choose.wgmma_refused(spec) is None
    off = PlanOptions(wgmma_overrides=WgmmaOptions(blocks=False))
    assert choose.make_plan(spec, off).design == "resident"
    assert "transformer block" in choose.wgmma_refused(spec, off)
    forced = choose.make_plan(spec, PlanOptions(design="wide"))
    assert forced.design == "wide" and forced.convert_input and forced.norm_offset >= forced.gemms[-1].b_offset


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("name", ["preln", "llama"])
def test_zoo_block_converts_with_cuda_kernels(name, tmp_path, monkeypatch):
    """A library WITH CUDA kernels fuses the whole block into one op (before: norm and Add kept stock); on
    this host validation runs its CPU kernel, on a GPU host the CUDA one (test_gpu_block.py)."""
    import onnx
    import onnx2fused
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80")   # one architecture: a quicker build
    src = MODELS / f"{name}.opset17.onnx"
    res = onnx2fused.convert(src, tmp_path / "m.fused.onnx", precision="fp16", cache_dir=tmp_path / "cache",
                             with_cuda=True)
    (chain,) = res.chains
    assert res.with_cuda and res.validation.passed and res.refusals == []
    assert ("_ln_" if name == "preln" else "_rms_") in chain.name and "_res_" in chain.name
    assert "GPU: wgmma (sm_90a)" in chain.cuda_plan and "other GPUs: resident" in chain.cuda_plan
    fused = onnx.load(res.output_path)
    assert [n.domain for n in fused.graph.node] == [DOMAIN]
    node = fused.graph.node[0]
    assert len(node.input) == 1 + 2 * len(chain.widths[1:]) + (2 if name == "preln" else 1)   # X, W_i, B_i, NS[, NB]
    x = (np.random.default_rng(2).standard_normal((33, 64)) * 2 + 0.5).astype(np.float32)
    y = onnx2fused.InferenceSession(res.output_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
