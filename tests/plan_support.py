"""Plans and rendered sources for the planning and codegen tests: plan first, then render."""
from __future__ import annotations

from onnx2fused import codegen
from onnx2fused.plan.choose import make_plans
from onnx2fused.plan.options import PlanOptions, WideOptions


def render_cuda(specs, options: PlanOptions = PlanOptions(), wide: dict[str, WideOptions] | None = None,
                cpu_enabled: dict[str, bool] | None = None) -> dict[str, str]:
    """codegen.render with CUDA of `specs`, each planned with `options` (and its `wide` options)."""
    return codegen.render(list(specs), True, cpu_enabled, make_plans(specs, options, wide))


def cuda_source(spec, options: PlanOptions = PlanOptions(), wide: WideOptions | None = None) -> str:
    """The spec's own `<name>_cuda.cu`."""
    return render_cuda([spec], options, {spec.name: wide} if wide else None)[f"{spec.name}_cuda.cu"]
