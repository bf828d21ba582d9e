"""Expression IR for the elementwise activation that follows a linear layer.

An activation is a pure function f: float -> float of one tensor element, written as a small tree:

    Var()                       the pre-activation value x (accumulator + bias, in fp32)
    Const(v)                    a float constant
    Op(name, (a, b, ...))       a primitive from PRIMITIVES

The same tree is rendered to C/CUDA source (`render_c`, identical text for the host compiler and nvcc:
only C99 float math functions are used) and evaluated with numpy (`evaluate`) as the executable
definition that tests compare the generated kernels against.

Trees are frozen dataclasses, so they hash and compare structurally; `fingerprint` is a stable hash
used in kernel names and cache keys.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


class Expr:
    """Base class of expression nodes."""

    def __add__(self, other): return Op("add", (self, as_expr(other)))
    def __radd__(self, other): return Op("add", (as_expr(other), self))
    def __sub__(self, other): return Op("sub", (self, as_expr(other)))
    def __rsub__(self, other): return Op("sub", (as_expr(other), self))
    def __mul__(self, other): return Op("mul", (self, as_expr(other)))
    def __rmul__(self, other): return Op("mul", (as_expr(other), self))
    def __truediv__(self, other): return Op("div", (self, as_expr(other)))
    def __rtruediv__(self, other): return Op("div", (as_expr(other), self))
    def __neg__(self): return Op("neg", (self,))


@dataclass(frozen=True, eq=True)
class Var(Expr):
    """The value the activation is applied to."""


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: float

    def __post_init__(self):
        object.__setattr__(self, "value", float(np.float32(self.value)))


@dataclass(frozen=True, eq=True)
class Op(Expr):
    name: str
    args: tuple

    def __post_init__(self):
        if self.name not in PRIMITIVES:
            raise ValueError(f"unknown expression primitive {self.name!r}")
        arity = PRIMITIVES[self.name].arity
        if len(self.args) != arity:
            raise ValueError(f"{self.name} takes {arity} argument(s), got {len(self.args)}")


def as_expr(v) -> Expr:
    return v if isinstance(v, Expr) else Const(v)


X = Var()


@dataclass(frozen=True)
class Primitive:
    arity: int
    c: Callable[..., str]          # argument C strings -> C string
    np: Callable[..., np.ndarray]  # float32 arrays -> float32 array


def _f(v: float) -> str:
    """A C float literal that round-trips the float32 value exactly."""
    v = float(np.float32(v))
    if math.isnan(v):
        return "__builtin_nanf(\"\")"
    if math.isinf(v):
        return "__builtin_inff()" if v > 0 else "(-__builtin_inff())"
    return f"{v!r}f" if "e" in repr(v) or "." in repr(v) else f"{v!r}.0f"


def _sigmoid_np(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _softplus_np(x):
    # The stable form used by the generated code: max(x,0) + log1p(exp(-|x|)).
    with np.errstate(over="ignore"):
        return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(np.float32)


def _erf_np(x):
    # numpy has no erf; math.erf is exact to double precision.
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(np.float32)


def _fmax_np(a, b):
    # C's fmaxf returns the non-NaN operand; ONNX Max/Relu propagate NaN. The generated code uses
    # o2f_max, which propagates NaN like ONNX does.
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.maximum(a, b)).astype(np.float32)


def _fmin_np(a, b):
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.minimum(a, b)).astype(np.float32)


PRIMITIVES: dict[str, Primitive] = {
    "add": Primitive(2, lambda a, b: f"({a} + {b})", lambda a, b: a + b),
    "sub": Primitive(2, lambda a, b: f"({a} - {b})", lambda a, b: a - b),
    "mul": Primitive(2, lambda a, b: f"({a} * {b})", lambda a, b: a * b),
    "div": Primitive(2, lambda a, b: f"({a} / {b})", lambda a, b: a / b),
    "max": Primitive(2, lambda a, b: f"o2f_max({a}, {b})", _fmax_np),
    "min": Primitive(2, lambda a, b: f"o2f_min({a}, {b})", _fmin_np),
    "pow": Primitive(2, lambda a, b: f"powf({a}, {b})", lambda a, b: np.power(a, b)),
    "neg": Primitive(1, lambda a: f"(-{a})", lambda a: -a),
    "abs": Primitive(1, lambda a: f"fabsf({a})", np.abs),
    "exp": Primitive(1, lambda a: f"expf({a})", np.exp),
    "log": Primitive(1, lambda a: f"logf({a})", np.log),
    "sqrt": Primitive(1, lambda a: f"sqrtf({a})", np.sqrt),
    "tanh": Primitive(1, lambda a: f"tanhf({a})", np.tanh),
    "erf": Primitive(1, lambda a: f"erff({a})", _erf_np),
    "sin": Primitive(1, lambda a: f"sinf({a})", np.sin),
    "cos": Primitive(1, lambda a: f"cosf({a})", np.cos),
    "sigmoid": Primitive(1, lambda a: f"o2f_sigmoid({a})", _sigmoid_np),
    "softplus": Primitive(1, lambda a: f"o2f_softplus({a})", _softplus_np),
    "reciprocal": Primitive(1, lambda a: f"(1.0f / {a})", lambda a: np.float32(1) / a),
    # Comparisons give 1.0 or 0.0; `select(c, a, b)` is c != 0 ? a : b (ONNX Where).
    "gt": Primitive(2, lambda a, b: f"(({a} > {b}) ? 1.0f : 0.0f)", lambda a, b: (a > b).astype(np.float32)),
    "lt": Primitive(2, lambda a, b: f"(({a} < {b}) ? 1.0f : 0.0f)", lambda a, b: (a < b).astype(np.float32)),
    "ge": Primitive(2, lambda a, b: f"(({a} >= {b}) ? 1.0f : 0.0f)", lambda a, b: (a >= b).astype(np.float32)),
    "le": Primitive(2, lambda a, b: f"(({a} <= {b}) ? 1.0f : 0.0f)", lambda a, b: (a <= b).astype(np.float32)),
    "select": Primitive(3, lambda c, a, b: f"(({c} != 0.0f) ? {a} : {b})",
                        lambda c, a, b: np.where(c != 0, a, b).astype(np.float32)),
}

# C helpers every generated translation unit defines before using rendered expressions. They are
# written for both the host compiler and nvcc (O2F_HD expands to __host__ __device__ under nvcc).
C_PRELUDE = r"""
#ifdef __CUDACC__
#define O2F_HD __host__ __device__ __forceinline__
#else
#define O2F_HD static inline
#endif
O2F_HD float o2f_max(float a, float b) { return (a != a || b != b) ? (a + b) : (a > b ? a : b); }
O2F_HD float o2f_min(float a, float b) { return (a != a || b != b) ? (a + b) : (a < b ? a : b); }
O2F_HD float o2f_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
O2F_HD float o2f_softplus(float x) { return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x))); }
#ifdef __CUDACC__
// Fast forms for activations whose results are rounded to fp16/bf16 right after (hidden layers of the
// tensor-core kernel): absolute error <= 2e-7 on erf and a few ulp on exp/log, far below the 4.9e-4
// relative step of fp16, at a third of the instructions of the libm versions.
__device__ __forceinline__ float o2f_erf_fast(float x) {
  const float a = fabsf(x), t = __fdividef(1.0f, fmaf(0.3275911f, a, 1.0f));  // Abramowitz & Stegun 7.1.26
  const float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
  return copysignf(1.0f - p * __expf(-a * a), x);
}
__device__ __forceinline__ float o2f_sigmoid_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float o2f_softplus_fast(float x) { return (x > 0.0f ? x : 0.0f) + __logf(1.0f + __expf(-fabsf(x))); }
#endif
"""


# CUDA device-only replacements used by render_c(..., fast=True).
FAST_C = {
    "exp": lambda a: f"__expf({a})",
    "log": lambda a: f"__logf({a})",
    "erf": lambda a: f"o2f_erf_fast({a})",
    "sigmoid": lambda a: f"o2f_sigmoid_fast({a})",
    "softplus": lambda a: f"o2f_softplus_fast({a})",
}


def render_c(e: Expr, var: str = "v", fast: bool = False) -> str:
    """C expression text computing `e` with the input value named `var`. `fast` picks CUDA intrinsic
    forms (FAST_C) for use where the result is rounded to a 16-bit type right after."""
    if isinstance(e, Var):
        return var
    if isinstance(e, Const):
        return _f(e.value)
    if isinstance(e, Op):
        args = [render_c(a, var, fast) for a in e.args]
        if fast and e.name in FAST_C:
            return FAST_C[e.name](*args)
        return PRIMITIVES[e.name].c(*args)
    raise TypeError(f"not an expression: {e!r}")


def evaluate(e: Expr, x: np.ndarray) -> np.ndarray:
    """Reference semantics: evaluate `e` elementwise on a float32 array."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):
        return _eval(e, x)


def _eval(e: Expr, x: np.ndarray) -> np.ndarray:
    if isinstance(e, Var):
        return x
    if isinstance(e, Const):
        return np.full_like(x, e.value)
    if isinstance(e, Op):
        out = PRIMITIVES[e.name].np(*(_eval(a, x) for a in e.args))
        return np.asarray(out, dtype=np.float32)
    raise TypeError(f"not an expression: {e!r}")


def to_text(e: Expr) -> str:
    """Canonical, human-readable text of the tree: `mul(x, sigmoid(x))`."""
    if isinstance(e, Var):
        return "x"
    if isinstance(e, Const):
        return repr(e.value)
    return f"{e.name}({', '.join(to_text(a) for a in e.args)})"


def fingerprint(e: Expr) -> str:
    return hashlib.sha256(to_text(e).encode()).hexdigest()[:8]


# Named activations. Each is the expression the recogniser produces for the matching ONNX pattern,
# so a structural comparison with these gives the short, readable name used in kernel names.
def relu() -> Expr: return Op("max", (X, Const(0.0)))
def identity() -> Expr: return X
def leaky_relu(alpha: float = 0.01) -> Expr:
    return Op("select", (Op("lt", (X, Const(0.0))), X * Const(alpha), X))
def sigmoid() -> Expr: return Op("sigmoid", (X,))
def tanh() -> Expr: return Op("tanh", (X,))
def gelu_erf() -> Expr: return Const(0.5) * X * (Const(1.0) + Op("erf", (X * Const(1 / math.sqrt(2)),)))
def gelu_tanh() -> Expr:
    inner = Const(math.sqrt(2 / math.pi)) * (X + Const(0.044715) * X * X * X)
    return Const(0.5) * X * (Const(1.0) + Op("tanh", (inner,)))
def silu() -> Expr: return X * Op("sigmoid", (X,))
def softplus() -> Expr: return Op("softplus", (X,))
def elu(alpha: float = 1.0) -> Expr:
    return Op("select", (Op("lt", (X, Const(0.0))), Const(alpha) * (Op("exp", (X,)) - Const(1.0)), X))
def hard_sigmoid(alpha: float = 0.2, beta: float = 0.5) -> Expr:
    return Op("max", (Const(0.0), Op("min", (Const(1.0), Const(alpha) * X + Const(beta)))))
def hard_swish() -> Expr: return X * hard_sigmoid(1 / 6, 0.5)
def mish() -> Expr: return X * Op("tanh", (Op("softplus", (X,)),))
def sin() -> Expr: return Op("sin", (X,))
def clip(lo: float, hi: float) -> Expr: return Op("min", (Op("max", (X, Const(lo))), Const(hi)))


def _named() -> dict[Expr, str]:
    return {
        identity(): "id", relu(): "relu", sigmoid(): "sigmoid", tanh(): "tanh", gelu_erf(): "gelu",
        gelu_tanh(): "gelutanh", silu(): "silu", softplus(): "softplus", mish(): "mish", sin(): "sin",
        hard_swish(): "hardswish", clip(0.0, 6.0): "relu6",
    }


NAMED = _named()


def short_name(e: Expr) -> str:
    """A short C-identifier-safe name: the activation's name when known, else `e<fingerprint>`."""
    return NAMED.get(e, "e" + fingerprint(e))
