"""The frozen description of one fused MLP chain.

`MLPSpec.name` is at once the custom op's type in the converted model, the C symbol prefix of the
generated kernels, the build-cache key component and the test id: two chains with equal specs share
one kernel. It reads like `FusedMLP_32x64x64x16_relu2_id_fp16_f32_1a2b3c4d`: the widths, the
activation of each layer (runs of equal activations are written `nameN`, `id` is none), the compute precision, the
input/output element type, and a hash of everything (activations' full expressions included).

A gated layer (SwiGLU, GeGLU: `act(x Wg + bg) * (x Wu + bu)`, H outputs) is written `g` + its gate's
activation (`gsilu`, `ggelu_erf`); its weight is one [K, 2H] matrix, gate columns first, and its bias 2H
long. Only gated layers add to `key_text`, so every non-gated spec keeps its name.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import expr as ex

PRECISIONS = ("fp16", "bf16", "tf32", "fp32")
IO_DTYPES = ("f32", "f16")
DOMAIN = "onnx2fused"
OP_PREFIX = "FusedMLP"
MAX_NAME = 96     # longer names (deep chains of many activations) are shortened to widths + layer count + hash
SPEC_VERSION = 1  # bump when the meaning of a spec (and so of every generated kernel) changes


# Why a library with CUDA kernels does not fuse gated layers (library.gated_refusal decides; plan.choose
# refuses a gated spec with it too).
GATED_NO_CUDA = "gated layer: no CUDA kernel yet (CPU-only libraries fuse it)"


class SpecError(ValueError):
    """A chain that cannot be described or built as asked; the message names the way out."""


@dataclass(frozen=True)
class LayerSpec:
    in_features: int
    out_features: int
    has_bias: bool
    activation: ex.Expr  # applied to (x @ W + b) elementwise, in fp32; gated: to the gate half only
    gated: bool = False  # y = act(x @ W[:, :N] + b[:N]) * (x @ W[:, N:] + b[N:]), W [K, 2N]

    @property
    def weight_columns(self) -> int:
        """Columns of the layer's weight matrix (and length of its bias): 2N for a gated layer."""
        return 2 * self.out_features if self.gated else self.out_features


@dataclass(frozen=True)
class MLPSpec:
    layers: tuple[LayerSpec, ...]
    precision: str = "fp16"
    io_dtype: str = "f32"

    def __post_init__(self):
        if not self.layers:
            raise SpecError("a fused MLP needs at least one linear layer")
        if self.precision not in PRECISIONS:
            raise SpecError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.io_dtype not in IO_DTYPES:
            raise SpecError(f"unsupported input/output element type {self.io_dtype!r}")
        for i, (a, b) in enumerate(zip(self.layers, self.layers[1:])):
            if a.out_features != b.in_features:
                raise SpecError(f"layer {i} gives {a.out_features} features but layer {i + 1} takes {b.in_features}")
        for i, layer in enumerate(self.layers):
            if layer.in_features < 1 or layer.out_features < 1:
                raise SpecError(f"layer {i} has an empty dimension ({layer.in_features} -> {layer.out_features})")

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.layers[0].in_features,) + tuple(l.out_features for l in self.layers)

    @property
    def activation_names(self) -> tuple[str, ...]:
        return tuple(("g" if l.gated else "") + ex.short_name(l.activation) for l in self.layers)

    @property
    def has_gated(self) -> bool:
        return any(l.gated for l in self.layers)

    @property
    def flops_per_row(self) -> int:
        return sum(2 * l.in_features * l.weight_columns for l in self.layers)

    @property
    def num_parameters(self) -> int:
        return sum(l.in_features * l.weight_columns + (l.weight_columns if l.has_bias else 0) for l in self.layers)

    def describe(self) -> str:
        acts = ", ".join(self.activation_names)
        return f"{' -> '.join(map(str, self.widths))} [{acts}] {self.precision}"

    def key_text(self) -> str:
        """Everything that shapes the generated code, as canonical text."""
        parts = [f"v{SPEC_VERSION}", self.precision, self.io_dtype]
        for l in self.layers:
            parts.append(f"{l.in_features}x{l.out_features}:{int(l.has_bias)}:{ex.to_text(l.activation)}"
                         + (":gated" if l.gated else ""))
        return "|".join(parts)

    @property
    def name(self) -> str:
        widths = "x".join(map(str, self.widths))
        runs: list[list] = []
        for a in self.activation_names:
            if runs and runs[-1][0] == a:
                runs[-1][1] += 1
            else:
                runs.append([a, 1])
        acts = "_".join(a if n == 1 else f"{a}{n}" for a, n in runs)
        if not all(l.has_bias for l in self.layers):
            acts += "_nobias" if not any(l.has_bias for l in self.layers) else "_somebias"
        digest = hashlib.sha256(self.key_text().encode()).hexdigest()[:8]
        name = f"{OP_PREFIX}_{widths}_{acts}_{self.precision}_{self.io_dtype}_{digest}"
        if len(name) > MAX_NAME:  # deep chains: the name is also file names (`<name>_cuda.cu`, nvcc's temps)
            name = (f"{OP_PREFIX}_{self.widths[0]}to{self.widths[-1]}_{len(self.layers)}layers_"
                    f"{self.precision}_{self.io_dtype}_{digest}")
        assert name.isidentifier(), name  # it is a C symbol prefix
        return name
