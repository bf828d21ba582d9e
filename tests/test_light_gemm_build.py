"""The wide design's own Hopper GEMM (Light128x128, templates/o2f_light_gemm.cuh) compiles as build.py
compiles its instance units (sm_90a alone, ONNX2FUSED_WIDE_SM90A, no CUTLASS), with every output type and
epilogue it takes: wgmma m64n128k16 from shared memory on the operand type, TMA loads, TMA stores where D
is staged, the residual by TMA; ptxas spills nothing and serializes no wgmma. One nvcc compile per case;
no GPU needed. Numerical checks: tests/test_gpu_wide.py and tests/test_gpu_block.py (the GPU host)."""
from __future__ import annotations

import shutil

import pytest
from nvcc_support import compile_kept, ptxas_entry

from onnx2fused import codegen, targets
from onnx2fused import expr as ex
from onnx2fused.wide_params import instance_params

pytestmark = pytest.mark.cuda_build
NVCC = shutil.which("nvcc")
F16, BF16, F32 = "cutlass::half_t", "cutlass::bfloat16_t", "float"
GELU = ex.render_c(ex.gelu_erf(), "v")
RELU = ex.render_c(ex.relu(), "v")
SILU = ex.render_c(ex.silu(), "v")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("config,elem,out,residual,packed,gated", [
    ("Light128x128", F16, F16, False, "o2f_h2_gelu", False),   # a hidden fp16 layer, packed GELU: D staged, TMA stores
    ("Light128x128", F16, F32, False, "", False),              # an fp32 last layer: D one m64 half at a time, no C
    ("Light128x128", F16, F32, True, "", False),               # a block's last layer, fp32 rows: C and D by halves
    ("Light128x128", BF16, BF16, True, "", False),             # bf16 operands and output, the residual staged whole
    ("Tf32Light128x128", F16, F16, False, "", False),          # a first layer on the fp32 input in place (tf32), ReLU
    ("Light128x128", F16, F16, False, "", True),               # a gated layer (SwiGLU): the glu in the epilogue
    ("Light128x128", BF16, BF16, False, "", True),             # the same on bf16
], ids=["f16_packed", "f32_out", "f32_residual", "bf16_residual", "tf32_first", "f16_gated", "bf16_gated"])
def test_light_instance_compiles_to_wgmma_without_spills(config, elem, out, residual, packed, gated, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80,90")
    act = RELU if config.startswith("Tf32") else SILU if gated else GELU
    params = instance_params(config, elem, out, 8, act, residual, packed, gated)
    assert params["light"] and params["file"].startswith(f"o2f_inst_{config}_")
    files = codegen._with_headers({params["file"]: codegen._render(params["template"], params)})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    src = files[params["file"]]
    assert targets.sm90a_only(src) and '#include "cutlass/' not in src
    # the flags build.py gives such a unit: sm_90a alone, the define, no line info
    flags = targets.instance_nvcc_flags(targets.sm90a_nvcc_flags(targets.nvcc_flags()))
    assert targets.WIDE_SM90A_DEFINE in flags and "-lineinfo" not in flags
    log, keep = compile_kept(NVCC, flags, tmp_path, src)
    ptxas_entry(log, "light_gemm")
    ptx = next(keep.glob("*.ptx")).read_text()
    # 4 k-steps (k16, k8 for tf32: 32 bytes of each row) x 2 m64 halves per k-block, the operand type's
    shape = "m64n128k8.f32.tf32.tf32" if config.startswith("Tf32") else (
        "m64n128k16.f32.bf16.bf16" if elem == BF16 else "m64n128k16.f32.f16.f16")
    assert ptx.count(f"wgmma.mma_async.sync.aligned.{shape}") >= 8
    # a k-block's TMA loads: A and W (gated: W's gate box and its up box), and C's boxes where it is read
    tma_loads = ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes")
    assert tma_loads > 2 if residual else tma_loads == 2 + gated, tma_loads
    assert ("constexpr bool kGated = true;" in src) == gated
    # every D leaves through the staging boxes and TMA stores; none by global stores from registers
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx
    assert "st.global" not in ptx
    assert ("setmaxnreg.inc.sync.aligned.u32 232" in ptx) and "__assertfail" not in ptx
    assert ("tanh.approx.f16x2" in ptx) == bool(packed)   # o2f_h2_gelu's tanh on fp16 pairs
