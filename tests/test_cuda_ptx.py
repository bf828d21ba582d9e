"""The generated tensor-core kernel compiles for sm_80 and sm_90 and really uses mma.sync/ldmatrix
(checked in the PTX, so it runs in CI without a GPU)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.spec import LayerSpec, MLPSpec

pytestmark = pytest.mark.cuda_build
NVCC = shutil.which("nvcc")


def _spec(widths, precision, act):
    layers = tuple(LayerSpec(a, b, True, act if i < len(widths) - 2 else ex.identity())
                   for i, (a, b) in enumerate(zip(widths, widths[1:])))
    return MLPSpec(layers, precision, "f32")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("spec", [
    _spec([32, 64, 64, 16], "fp16", ex.relu()),          # resident design
    _spec([784, 512, 10], "bf16", ex.gelu_erf()),        # streamed design, bf16
], ids=lambda s: s.name if isinstance(s, MLPSpec) else s)
def test_ptx_uses_tensor_cores(spec, arch, tmp_path):
    src = next(text for name, text in codegen.render([spec], with_cuda=True).items() if name.endswith(".cu"))
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    ptx = tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "-ptx", "-std=c++17", f"-arch=compute_{arch}", str(cu), "-o", str(ptx)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    text = ptx.read_text()
    dtype = "bf16" if spec.precision == "bf16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in text
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "cp.async" in text
