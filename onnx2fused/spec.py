"""The frozen description of one fused MLP chain.

`MLPSpec.name` is at once the custom op's type in the converted model, the C symbol prefix of the
generated kernels, the build-cache key component and the test id: two chains with equal specs share
one kernel. It reads like `FusedMLP_32x64x64x16_relu2_id_fp16_f32_1a2b3c4d`: the widths, the
activation of each layer (runs of equal activations are written `nameN`, `id` is none), the compute precision, the
input/output element type, and a hash of everything (activations' full expressions included).

A gated layer (SwiGLU, GeGLU: `act(x Wg + bg) * (x Wu + bu)`, H outputs) is written `g` + its gate's
activation (`gsilu`, `ggelu_erf`); its weight is one [K, 2H] matrix, gate columns first, and its bias 2H
long. Only gated layers add to `key_text`, so every non-gated spec keeps its name.

A transformer FFN block adds a prologue and an epilogue around the layers (issue 16, second stage):
`norm` (a `NormSpec`: LayerNormalization or RMSNorm of each input row, before the first layer) and
`residual` (the block's input row added to the last layer's output). The name then reads
`FusedMLP_64x256x64_ln_gelu_id_res_...` (`ln` / `rms` before the activations, `res` after them); both
add to `key_text` only when present, so every other spec keeps its name and sources.

A skip connection (`skip` holds j > 0: NeRF's and DeepSDF's `cat([x, h])` into layer j) makes layer j read the
chain's input row beside layer j-1's output: its input is [x zero-padded to `skip_width` (K0 rounded up to
16, one k-step of the tensor cores), layer j-1's output], so its weight is [skip_width + N_{j-1}, N_j]
with zero rows K0..skip_width (the pass lays the model's weight out so, whichever order its Concat had;
rows of x a layer does not read are zero too: NeRF's view layer reads the view directions of the x its trunk
reads). Several layers may; the name reads `..._skipJ` (`_skipJ_K`) after the activations; it adds to
`key_text` only when present.

`pool` "max" (PointNet's max pool over its points, passes/pool.py): the op's output is the maximum over the rows
that share all but the last input dimension, [..., M, K0] -> [..., N_last] (ReduceMax over axis -2 of the
chain's output); "maxk" the same with the pooled axis kept, [..., 1, N_last] (keepdims=1: torch.max(x, 2,
keepdim=True)); "sum" / "mean" (and "sumk" / "meank") the sum or the mean over those rows (ReduceSum /
ReduceMean: Deep Sets' sum over a set's elements, a global average pool); the name reads `..._poolmax` /
`..._poolmaxk` / `..._poolsum` ... and it adds to `key_text` only when present.

`act_math` says how an fp16 chain's hidden activations are computed on the GPU: "packed" (the default:
the pre-activations rounded to fp16 and the activation evaluated in fp16x2 arithmetic, two elements an
instruction, where expr.PACKED_FORMS has a form for it; the wgmma kernel rounds the accumulators and adds
the bias in fp16, plan.wgmma.BIAS16), "packed_b32" (the same with the bias added in fp32 before rounding:
what validation falls back to where the fp16 bias add costs too much accuracy) or "fp32" (evaluated in
fp32, then rounded). A gated hidden layer's glu, act(g) * u, follows act_math in the one-kernel FFN only
(`packable_glu_layers`). A spec with act_math "packed_b32" or "fp32" and packable layers of either kind
is written `fp16b32` / `fp16a32` and hashes differently; every other spec keeps its name.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import expr as ex

PRECISIONS = ("fp16", "bf16", "tf32", "fp32")
# How fp16 chains' hidden activations are computed: "packed" (fp16x2 arithmetic on the rounded
# pre-activations, expr.PACKED_FORMS, where the activation has such a form) or "fp32" (then rounded).
ACT_MATHS = ("packed", "packed_b32", "fp32")
ACT_MATH_TAGS = {"packed": "", "packed_b32": "b32", "fp32": "a32"}   # in names and reports: fp16, fp16b32, fp16a32
PACKED_MATHS = ("packed", "packed_b32")   # the act_maths whose hidden activations use the packed forms
IO_DTYPES = ("f32", "f16")
DOMAIN = "onnx2fused"
PLUGIN_KEY = "onnx2fused.plugin"   # the fused model's metadata entry: its plugin library, a file beside it
OP_PREFIX = "FusedMLP"
MAX_NAME = 96     # longer names (deep chains of many activations) are shortened to widths + layer count + hash
SKIP_LAYERS_MAX = 64   # the plugin's registry holds a chain's skip layers as one 64-bit mask
SKIP_ALIGN = 16   # a skip layer's x part: K0 rounded up to a k-step of the tensor cores (fp16/bf16 16, tf32 8)
POOL_OPS = ("max", "sum", "mean")   # what a chain's output may be reduced by over axis -2 (pool.py)
POOLS = tuple(p + k for p in POOL_OPS for k in ("", "k"))   # "...k": keepdims=1, the pooled axis kept as 1
SPEC_VERSION = 1  # bump when the meaning of a spec (and so of every generated kernel) changes


def holds_fused_nodes(model) -> bool:
    """Whether an onnx.ModelProto's graph holds fused nodes (op domain DOMAIN)."""
    return any(n.domain == DOMAIN for n in model.graph.node)


# Why a library with CUDA kernels does not fuse a model's gated layers (library.gated_refusal decides): a
# gated chain no CUDA design (resident, streamed, wide) plans at fp16; `{why}` is the planner's reason.
GATED_NO_CUDA = "gated layer: no CUDA kernel holds its chain ({why}) (CPU-only libraries fuse it)"
# The same for a transformer block's prologue and epilogue (library.block_refusal): a block no fused CUDA
# kernel (resident, streamed, fp32) takes, or whose layers the cost model gives to the wide design; `{what}`
# names the norm or the residual, `{why}` is the planner's reason.
BLOCK_NO_CUDA = "{what}: no fused CUDA kernel takes it: {why} (CPU-only libraries fuse it)"
# The same for a skip Concat (library.skip_refusal): a chain with a skip no tensor-core design plans at fp16.
SKIP_NO_CUDA = "no CUDA kernel takes the chain with its skip connection ({why}) (CPU-only libraries fuse it)"
SKIP_SLOWER = "the skip connection stays a stock Concat: {why} (CPU-only libraries fuse it)"
NORM_KINDS = {"layernorm": ("ln", "layer norm"), "rmsnorm": ("rms", "RMS norm")}  # kind -> (name tag, label)


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
class NormSpec:
    """A normalisation of each input row (the last axis, K0 wide), in fp32, before the first layer:
        layernorm: (x - mean) / sqrt(mean((x - mean)^2) + eps) * scale + bias   (as ORT's LayerNormalization)
        rmsnorm:   x * (1 / sqrt(mean(x^2) + eps)) * scale
    Its scale and bias are the fused op's inputs NS, NB ([K0] each; NB zeros without a bias)."""
    kind: str           # "layernorm" or "rmsnorm"
    eps: float          # as the model stores it (float32)
    has_bias: bool = False  # layernorm's beta; never for rmsnorm

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            raise SpecError(f"unknown normalisation {self.kind!r}; choose one of {', '.join(NORM_KINDS)}")
        if self.kind == "rmsnorm" and self.has_bias:
            raise SpecError("an RMS norm has no bias")

    @property
    def input_names(self) -> tuple[str, ...]:
        """The fused op's inputs after the layers' W_i, B_i: the scale NS [K0], and for a layer norm its
        bias NB [K0] too (zeros without one: LayerNormalization in the stock body takes it as it is)."""
        return ("NS", "NB") if self.kind == "layernorm" else ("NS",)

    @property
    def tag(self) -> str:
        return NORM_KINDS[self.kind][0]

    @property
    def label(self) -> str:
        return NORM_KINDS[self.kind][1]

    def key_text(self) -> str:
        return f"norm:{self.kind}:{float(self.eps).hex()}:{int(self.has_bias)}"


@dataclass(frozen=True)
class MLPSpec:
    layers: tuple[LayerSpec, ...]
    precision: str = "fp16"
    io_dtype: str = "f32"
    norm: NormSpec | None = None  # normalise each input row before the first layer
    residual: bool = False        # add the input row to the last layer's output (needs K0 == N_last)
    act_math: str = "packed"      # fp16 hidden layers: "packed" fp16x2 forms where one exists, or "fp32"
    skip: tuple[int, ...] = ()    # each layer j > 0 here reads [x padded to skip_width, layer j-1's output]
                                  # (an int j is taken as (j,), 0 as none)
    pool: str | None = None       # "max", "sum", "mean" (+ "k": axis kept): the output is that pool over axis
                                  # -2 of the last layer's (POOLS)

    @property
    def pool_op(self) -> str | None:
        """The pool's reduction ("max", "sum", "mean"; POOL_OPS) without its keepdims mark, None unpooled."""
        return None if self.pool is None else self.pool.removesuffix("k")

    @property
    def pool_code(self) -> int:
        """The pool as the generated code knows it (KernelEntry::pool_op, kPoolOp): its index in POOL_OPS
        (0 max, 1 sum, 2 mean), 0 unpooled."""
        return 0 if self.pool is None else POOL_OPS.index(self.pool_op)

    @property
    def pool_keeps_axis(self) -> bool:
        """Whether the pooled axis stays as 1 (keepdims=1: "maxk", "sumk", "meank")."""
        return self.pool is not None and self.pool.endswith("k")

    def __post_init__(self):
        skip = (self.skip,) if isinstance(self.skip, int) else tuple(self.skip)
        object.__setattr__(self, "skip", tuple(sorted(set(j for j in skip if j))))
        if self.act_math not in ACT_MATHS:
            raise SpecError(f"unknown activation arithmetic {self.act_math!r}; choose one of {', '.join(ACT_MATHS)}")
        if not self.layers:
            raise SpecError("a fused MLP needs at least one linear layer")
        if self.precision not in PRECISIONS:
            raise SpecError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.io_dtype not in IO_DTYPES:
            raise SpecError(f"unsupported input/output element type {self.io_dtype!r}")
        for j in self.skip:
            if not 0 < j < min(len(self.layers), SKIP_LAYERS_MAX):
                raise SpecError(f"skip layer {j} of a chain of {len(self.layers)} layers"
                                + (f" (skip layers below {SKIP_LAYERS_MAX})" if j >= SKIP_LAYERS_MAX else ""))
        for i, (a, b) in enumerate(zip(self.layers, self.layers[1:])):
            extra = self.skip_part(i + 1)
            if a.out_features + extra != b.in_features:
                what = f"{a.out_features} features" + (f" (+ the input's {extra})" if extra else "")
                raise SpecError(f"layer {i} gives {what} but layer {i + 1} takes {b.in_features}")
        if self.skip and (self.norm is not None or self.residual or self.has_gated):
            raise SpecError("a skip connection in a chain with a norm, a residual or a gated layer is not supported")
        for i, layer in enumerate(self.layers):
            if layer.in_features < 1 or layer.out_features < 1:
                raise SpecError(f"layer {i} has an empty dimension ({layer.in_features} -> {layer.out_features})")
        if self.pool is not None and self.pool not in POOLS:
            raise SpecError(f"unknown pool {self.pool!r}; choose one of {', '.join(POOLS)}")
        if self.pool is not None and (self.residual or self.layers[-1].gated):
            raise SpecError("a pool after a residual or a gated last layer is not supported")
        if self.residual and self.widths[0] != self.widths[-1]:
            raise SpecError(f"a residual adds the input row to the output: widths {self.widths[0]} and "
                            f"{self.widths[-1]} differ")

    @property
    def skip_width(self) -> int:
        """Columns of a skip layer's input that hold x (K0 zero-padded to SKIP_ALIGN); 0 without a skip."""
        return -(-self.layers[0].in_features // SKIP_ALIGN) * SKIP_ALIGN if self.skip else 0

    def skip_part(self, i: int) -> int:
        """Columns of layer i's input that hold x: skip_width for a skip layer, else 0."""
        return self.skip_width if i in self.skip else 0

    def layer_input(self, i: int) -> int:
        """Features layer i reads from the layer before it (or x): in_features less the skip's x part."""
        return self.layers[i].in_features - self.skip_part(i)

    @property
    def widest_row(self) -> int:
        """The widest row any layer reads or writes (a skip layer's input is wider than the widths)."""
        return max(self.widths + tuple(l.in_features for l in self.layers))

    @property
    def packable_layers(self) -> frozenset[int]:
        """Hidden layers of an fp16 chain whose activation has a packed fp16x2 form (expr.PACKED_FORMS):
        with act_math "packed" the tensor-core kernels evaluate them on pairs of fp16 values."""
        return self._packable(gated=False)

    def _packable(self, gated: bool) -> frozenset[int]:
        """Hidden layers (gated or not, as asked) of an fp16 chain whose activation has a packed form."""
        if self.precision != "fp16":
            return frozenset()
        return frozenset(i for i, l in enumerate(self.layers[:-1])
                         if l.gated == gated and ex.packed_form(l.activation) is not None)

    @property
    def packed_layers(self) -> frozenset[int]:
        return self.packable_layers if self.act_math in PACKED_MATHS else frozenset()

    @property
    def packable_glu_layers(self) -> frozenset[int]:
        """Gated hidden layers of an fp16 chain whose activation has a packed form: with act_math "packed" or
        "packed_b32" the one-kernel FFN (plan/ffn.py) computes act(g) * u on pairs of fp16 values (g and u
        rounded after their fp32 bias, then the form and one HMUL2). The other kernels keep that glu in fp32;
        the numerics model follows the FFN kernel, so it is a little pessimistic for them."""
        return self._packable(gated=True)

    @property
    def packed_glu_layers(self) -> frozenset[int]:
        return self.packable_glu_layers if self.act_math in PACKED_MATHS else frozenset()

    @property
    def has_packable(self) -> bool:
        """Whether act_math changes this chain's CUDA code: it has packable layers of either kind."""
        return bool(self.packable_layers or self.packable_glu_layers)

    @property
    def bias16(self) -> bool:
        """Whether the packed layers may add their bias in fp16 after rounding (act_math "packed"; the
        wgmma kernel does, plan.wgmma.BIAS16)."""
        return self.act_math == "packed" and bool(self.packed_layers)

    def prescale(self, i: int) -> float:
        """What the tensor-core kernels pack layer i's weights and bias times: its packed form's prescale
        (expr.PackedForm: the form then starts from the accumulators, one HMUL2 a pair fewer), else 1."""
        return ex.packed_form(self.layers[i].activation).prescale if i in self.packed_layers else 1.0

    @property
    def has_block(self) -> bool:
        """A norm in front or a residual behind (a transformer FFN block): the CPU kernel and the fused
        CUDA kernels (resident, streamed, fp32) compute them; the wide and wgmma designs refuse them."""
        return self.norm is not None or self.residual

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
        norm = 0 if self.norm is None else self.widths[0] * (2 if self.norm.has_bias else 1)
        return norm + sum(l.in_features * l.weight_columns + (l.weight_columns if l.has_bias else 0)
                          for l in self.layers)

    def describe(self) -> str:
        acts = ", ".join(self.activation_names)
        text = f"{' -> '.join(map(str, self.widths))} [{acts}] {self.precision}"
        if self.norm is not None:
            text = f"{self.norm.label} -> " + text
        if self.skip:
            text += f", x into layer{'s' if len(self.skip) > 1 else ''} {', '.join(map(str, self.skip))} (skip)"
        return text + (" + residual" if self.residual else "") + (f", {self.pool_op} over rows{' (kept axis)' if self.pool_keeps_axis else ''}" if self.pool else "")

    def key_text(self) -> str:
        """Everything that shapes the generated code, as canonical text."""
        parts = [f"v{SPEC_VERSION}", self.precision, self.io_dtype]
        for l in self.layers:
            parts.append(f"{l.in_features}x{l.out_features}:{int(l.has_bias)}:{ex.to_text(l.activation)}"
                         + (":gated" if l.gated else ""))
        if self.norm is not None:
            parts.append(self.norm.key_text())
        if self.residual:
            parts.append("residual")
        if self.skip:
            parts.append(f"skip:{','.join(map(str, self.skip))}")
        if self.act_math != "packed" and self.has_packable:
            parts.append(f"act:{self.act_math}")
        if self.pool:
            parts.append(f"pool:{self.pool}")
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
        if self.norm is not None:
            acts = f"{self.norm.tag}_{acts}"
        if self.residual:
            acts += "_res"
        if self.skip:
            acts += "_skip" + "_".join(map(str, self.skip))
        if self.pool:
            acts += f"_pool{self.pool}"
        digest = hashlib.sha256(self.key_text().encode()).hexdigest()[:8]
        math = ACT_MATH_TAGS[self.act_math] if self.has_packable else ""
        name = f"{OP_PREFIX}_{widths}_{acts}_{self.precision}{math}_{self.io_dtype}_{digest}"
        if len(name) > MAX_NAME:  # deep chains: the name is also file names (`<name>_cuda.cu`, nvcc's temps)
            name = (f"{OP_PREFIX}_{self.widths[0]}to{self.widths[-1]}_{len(self.layers)}layers_"
                    f"{self.precision}{math}_{self.io_dtype}_{digest}")
        assert name.isidentifier(), name  # it is a C symbol prefix
        return name
