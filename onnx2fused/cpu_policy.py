"""Whether a chain's generated CPU kernel is registered, or the node falls back to its stock-op body.

Where the kernel is not registered, ONNX Runtime runs the node's model-local function (the original
stock ops) on the CPU EP, so the CPU is never slower than the original model. The kernel is registered
only where a small cost model says it is at least as fast as stock ONNX Runtime (MLAS GEMMs plus one
pass over memory per elementwise op):

1. Weights: the fused kernel runs a block of rows through every layer before the next block, so each
   block streams all of the chain's weights. While they stay in a core's L2/L3 (<= MAX_WEIGHT_BYTES)
   that is cheap and fusion saves stock ORT's round trips of every intermediate tensor through memory;
   above it, MLAS's blocked GEMMs, which reuse each weight panel over many more rows, win.
   A transformer block's norm in front and residual behind (spec.norm, spec.residual) are one pass
   each over rows the kernel holds in cache anyway (stock ORT: a LayerNormalization or 7 RMSNorm ops
   and an Add, each a round trip through memory); they add their K0-long parameters to the bytes and
   never decline the kernel.
2. A lone linear layer with no activation (a transformer's qkv and output projections, a classifier
   head): there is nothing to fuse, and the generated kernel's GEMM reaches ~90 % of MLAS's single-thread
   rate (192 -> 576 at 197 and 1576 rows, 1 thread: 0.90x stock; its stock body in the plugin 0.98-1.00x;
   at 8 rows the kernel 1.04x, the body 0.94x; RESULTS.md "lone linear layers on the CPU").
3. Activations: the kernel's epilogue is vectorised only for activations built from ops with a
   vectorisable form in the generated code (arithmetic, compare/select, min/max, abs, sqrt, and the
   template's own exp, log, log1p, erf, tanh, hence sigmoid, softplus, GELU, SiLU, Mish, ELU). An op in
   SCALAR_OPS is one libm call per element, which costs more than the whole GEMM of a narrow layer;
   stock ORT has vectorised kernels for those activations.

Measured with `onnx2fused bench --cpu` on the 2-core AMD EPYC (Zen 3, AVX2) development host, 2 threads
(benchmarks/RESULTS.md; this host is shared, ratios vary by ~15% between runs):
  registered:  32->64x4->16 ReLU (60 KiB of weights) 1.7-2.8x stock; 64->128x4->64 GELU (256 KiB)
               1.7-2.1x; 3->128x4->1 Tanh (194 KiB) 1.5x; 64->256->64 GELU (128 KiB) 1.5-2.1x;
               16->32x3->8 ReLU (11 KiB) 3.0x; 256->256x3->256 SiLU (1 MiB) 1.1-1.2x; 256x5 Tanh
               (1 MiB) 1.3-1.8x; 64x5 and 128x5 Softplus 2.3-2.7x (0.5-0.7x while log1pf was libm's
               scalar call); 128x5 Mish 2.1x.
  not:         784->512x2->10 ReLU (2.6 MiB) 0.84-0.86x with the kernel forced on; 64x5 Sin (scalar
               sinf) 0.75x.
"""
from __future__ import annotations

from . import expr as ex
from .spec import MLPSpec

MAX_WEIGHT_BYTES = 1 << 20  # fp32 weight matrices of the whole chain (biases are negligible)
# op -> the libm call it renders to. floorf/ceilf/rintf are not here: with -march=native they compile
# to vector round instructions (checked: no call in the built kernel), and sign is compares and selects.
SCALAR_OPS = {"pow": "powf", "sin": "sinf", "cos": "cosf", "tan": "tanf", "sinh": "sinhf", "cosh": "coshf",
              "asin": "asinf", "acos": "acosf", "atan": "atanf", "asinh": "asinhf", "acosh": "acoshf",
              "atanh": "atanhf"}


def weight_bytes(spec: MLPSpec) -> int:
    """fp32 weight bytes the kernel streams per row block: a gated layer's GEMM is 2N wide (gate and up);
    a norm in front adds its scale (and bias)."""
    norm = 0 if spec.norm is None else 4 * spec.widths[0] * len(spec.norm.input_names)
    return norm + sum(4 * l.in_features * l.weight_columns for l in spec.layers)


def scalar_ops(e: ex.Expr) -> list[str]:
    """The ops of `e` that the generated CPU code evaluates with a scalar libm call, in first-visit order."""
    found: dict[str, None] = {}

    def walk(n: ex.Expr):
        if isinstance(n, ex.Op):
            if n.name in SCALAR_OPS:
                found.setdefault(n.name)
            for a in n.args:
                walk(a)
    walk(e)
    return list(found)


def lone_linear(spec: MLPSpec) -> bool:
    """One linear layer, no activation, no norm or residual, not gated: nothing to fuse on the CPU."""
    (layer, *rest) = spec.layers
    return (not rest and isinstance(layer.activation, ex.Var) and not layer.gated and spec.norm is None
            and not spec.residual)


def stock_faster(spec: MLPSpec) -> str | None:
    """Why stock ORT beats the fused CPU kernel on this chain (one clause), or None where the kernel wins."""
    if lone_linear(spec):
        return "one linear layer, nothing to fuse with it: MLAS's GEMM is faster from a few rows on"
    wb = weight_bytes(spec)
    if wb > MAX_WEIGHT_BYTES:
        return (f"weights {wb / 2**20:.1f} MiB > {MAX_WEIGHT_BYTES / 2**20:g} MiB: MLAS's blocked GEMMs are "
                "faster there")
    for i, layer in enumerate(spec.layers):
        slow = scalar_ops(layer.activation)
        if slow:
            calls = ", ".join(SCALAR_OPS[s] for s in slow)
            return (f"layer {i}'s activation needs scalar {calls} per element in the fused kernel; stock ORT "
                    "vectorises it")
    return None


def cpu_kernel_wins(spec: MLPSpec) -> tuple[bool, str]:
    """(register the fused CPU kernel?, the reason, as `inspect` and the convert report print it)."""
    why = stock_faster(spec)
    if why is not None:
        return False, f"stock ops on the CPU ({why})"
    wb = weight_bytes(spec)
    block = ((f", {spec.norm.label} in front" if spec.norm is not None else "")
             + (", residual behind" if spec.residual else ""))
    return True, (f"fused CPU kernel (weights {wb / 1024:.0f} KiB <= {MAX_WEIGHT_BYTES / 2**20:g} MiB, "
                  f"vectorised activations{block})")
