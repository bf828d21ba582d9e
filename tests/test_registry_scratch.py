"""KernelEntry::cuda_uses_scratch in the generated registry.cc: 1 only for the wide CUDA design, whose
cuda_run writes scratch in the workspace (the plugin then orders runs on different streams), 0 for the
fused kernels that only read the packed weights and for builds without CUDA. Pure text rendering: no
GPU or nvcc needed (CUTLASS headers found, as in test_wide_plan.py)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.plan.choose import make_plan, make_plans
from onnx2fused.plan.options import PlanOptions
from onnx2fused.resources import ort_plugin_dir
from onnx2fused.spec import LayerSpec, MLPSpec


def _spec(widths, precision="fp16"):
    n = len(widths) - 1
    return MLPSpec(tuple(LayerSpec(a, b, True, ex.relu() if i < n - 1 else ex.identity())
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, "f32")


def _registry(specs, with_cuda=True, options=PlanOptions()) -> str:
    """The rendered registry.cc alone (what render() writes; the kernels' sources are not needed)."""
    plans = make_plans(specs, options)
    return codegen._render(codegen.REGISTRY_TEMPLATE, codegen.registry_params(specs, with_cuda, {}, plans))


def _uses_scratch(registry: str, spec: MLPSpec) -> int:
    """The last initializer of the spec's KernelEntry: `{"<name>", ..., &<name>_cuda_run, N},`."""
    entry = registry.split(f'{{"{spec.name}"', 1)[1].split("},", 1)[0]
    return int(entry.rsplit(",", 1)[1].strip())


WIDE, NARROW, FP32 = _spec([9216, 4096, 4096, 1000]), _spec([32, 64, 16]), _spec([768, 3072, 768], "fp32")


def test_wide_entry_uses_scratch_and_the_fused_ones_do_not():
    assert make_plan(WIDE).design == "wide" and make_plan(NARROW).design == "resident"
    registry = _registry([WIDE, NARROW, FP32])
    assert _uses_scratch(registry, WIDE) == 1
    assert _uses_scratch(registry, NARROW) == 0
    assert _uses_scratch(registry, FP32) == 0  # CUDA-core kernel: no tensor-core plan at all


def test_forced_wide_design_uses_scratch():
    spec = _spec([256, 256, 256, 256, 256])  # the streamed kernel by the cost model
    assert _uses_scratch(_registry([spec]), spec) == 0
    assert _uses_scratch(_registry([spec], options=PlanOptions(design="wide")), spec) == 1


def test_without_cuda_nothing_uses_scratch():
    registry = _registry([WIDE, NARROW], with_cuda=False)
    assert _uses_scratch(registry, WIDE) == 0 and _uses_scratch(registry, NARROW) == 0


def test_registry_initializers_match_the_header(tmp_path):
    """Every KernelEntry field is initialized, none too many: the template and the header agree."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    for with_cuda in (True, False):
        src = tmp_path / f"registry_{with_cuda}.cc"
        src.write_text(_registry([WIDE, NARROW], with_cuda))
        proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Werror=missing-field-initializers",
                               f"-I{ort_plugin_dir()}", str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
