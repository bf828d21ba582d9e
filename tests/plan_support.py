"""Plans and rendered sources for the planning and codegen tests: plan first, then render."""
from __future__ import annotations

import re

from onnx2fused import codegen
from onnx2fused.plan.choose import make_plans
from onnx2fused.plan.options import PlanOptions, WideOptions

_INCLUDE = re.compile(r'^#include "(o2f_\w+\.cuh)"\n', re.M)


def expanded(files: dict[str, str], name: str) -> str:
    """Source `name` as the compiler reads it: each static header it includes (templates/o2f_*.cuh, which
    render returns beside the sources) in place of its #include line."""
    return _INCLUDE.sub(lambda m: expanded(files, m.group(1)), files[name])


def render_cuda(specs, options: PlanOptions = PlanOptions(), wide: dict[str, WideOptions] | None = None,
                cpu_enabled: dict[str, bool] | None = None) -> dict[str, str]:
    """codegen.render with CUDA of `specs`, each planned with `options` (and its `wide` options); the
    .cu sources with their headers expanded."""
    files = codegen.render(list(specs), True, cpu_enabled, make_plans(specs, options, wide))
    return {name: expanded(files, name) if name.endswith(".cu") else text for name, text in files.items()}


def cuda_source(spec, options: PlanOptions = PlanOptions(), wide: WideOptions | None = None) -> str:
    """The spec's own `<name>_cuda.cu`, headers expanded."""
    return render_cuda([spec], options, {spec.name: wide} if wide else None)[f"{spec.name}_cuda.cu"]
