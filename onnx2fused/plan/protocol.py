"""What every plan offers its users (codegen, the registry, the reports), whatever its design."""
from __future__ import annotations

from typing import Protocol

from ..spec import MLPSpec


class Plan(Protocol):
    """The CUDA kernel plan of one spec. Designs: "resident" and "streamed" (fused.FusedPlan), "fp32"
    (fused.Fp32Plan), "wide" (wide.WidePlan), "wgmma" (wgmma.WgmmaPlan); each has its own template."""

    @property
    def spec(self) -> MLPSpec: ...

    @property
    def design(self) -> str: ...

    @property
    def uses_scratch(self) -> bool:
        """cuda_run writes its workspace (not only the packed weights): the plugin orders runs of the
        kernel that come on different streams."""
        ...

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the device workspace the kernel's pack and run entries use."""
        ...

    def describe(self) -> str:
        """One line for the report and `inspect`."""
        ...
