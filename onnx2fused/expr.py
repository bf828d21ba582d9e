"""Expression IR for the elementwise activation that follows a linear layer.

An activation is a pure function f(x, col) -> float of one tensor element x in output column col,
written as a small tree:

    Var()                       the pre-activation value x (accumulator + bias, in fp32)
    Const(v)                    a float constant
    Chan((v_0, ..., v_{N-1}))   a per-channel constant: v_col for the element of output column col
                                (PRelu slopes, per-channel scales and shifts)
    Op(name, (a, b, ...))       a primitive from PRIMITIVES

The same tree is rendered to C/CUDA source (`render_c`, identical text for the host compiler and nvcc:
only C99 float math functions are used; a Chan reads a constant array, declared by the template, at
the column index) and evaluated with numpy (`evaluate`, the column is the last axis) as the executable
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
class Chan(Expr):
    """values[col] for output column col. The generated code bakes the values into a constant array."""
    values: tuple

    def __post_init__(self):
        vals = tuple(float(np.float32(v)) for v in np.asarray(self.values, dtype=np.float64).reshape(-1))
        if not vals:
            raise ValueError("a per-channel constant needs at least one value")
        object.__setattr__(self, "values", vals)

    @property
    def width(self) -> int:
        return len(self.values)

    def digest(self) -> str:
        """A hash of the float32 values (64 bits): names long vectors in texts and cache keys."""
        return hashlib.sha256(np.asarray(self.values, dtype=np.float32).tobytes()).hexdigest()[:16]


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


ERF_ONE_FROM = 4.5   # |x| from which erf(x) is +-1 in float32 (1 - erf(4.5) = 2e-10, below half an fp32 ulp)


def _erf_np(x):
    """erf in float64, rounded to float32 (numpy has no erf, and math.erf one element at a time took
    minutes on a ViT's GELU inputs). The series erf(x) = 2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (2n+1)!!
    has only positive terms, so it keeps double precision (within 3e-15 of math.erf); it runs to |x| < 4.5,
    where at most ~80 terms are needed, and erf is +-1 in float32 beyond. NaN stays NaN."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    nan = np.isnan(a)
    r = np.ones_like(a)
    # bands of |x|: the series needs ~25 terms below 1 and ~80 near 4.5, and most inputs are small
    for lo, hi in ((0.0, 1.0), (1.0, 2.5), (2.5, ERF_ONE_FROM)):
        band = (a >= lo) & (a < hi)
        s = a[band]
        x2 = s * s
        term, total = s.copy(), s.copy()
        for n in range(1, 200):
            term *= 2.0 * x2 / (2 * n + 1)
            total += term
            if np.all(term <= 1e-17 * total):
                break
        r[band] = np.minimum((2.0 / math.sqrt(math.pi)) * np.exp(-x2) * total, 1.0)
    return np.where(nan, np.nan, np.copysign(r, x)).astype(np.float32)


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
    "sinh": Primitive(1, lambda a: f"sinhf({a})", np.sinh),
    "cosh": Primitive(1, lambda a: f"coshf({a})", np.cosh),
    "tan": Primitive(1, lambda a: f"tanf({a})", np.tan),
    "asin": Primitive(1, lambda a: f"asinf({a})", np.arcsin),
    "acos": Primitive(1, lambda a: f"acosf({a})", np.arccos),
    "atan": Primitive(1, lambda a: f"atanf({a})", np.arctan),
    "asinh": Primitive(1, lambda a: f"asinhf({a})", np.arcsinh),
    "acosh": Primitive(1, lambda a: f"acoshf({a})", np.arccosh),
    "atanh": Primitive(1, lambda a: f"atanhf({a})", np.arctanh),
    "floor": Primitive(1, lambda a: f"floorf({a})", np.floor),
    "ceil": Primitive(1, lambda a: f"ceilf({a})", np.ceil),
    # ONNX Round rounds halves to even (ORT: std::nearbyint); rintf does in the default rounding mode,
    # on the host and on the GPU (cvt.rni), where C's roundf would round them away from zero.
    "round": Primitive(1, lambda a: f"rintf({a})", np.rint),
    "sign": Primitive(1, lambda a: f"o2f_sign({a})", np.sign),
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
// max/min that propagate NaN like ONNX's Max/Min/Relu (C's fmaxf drops it); sm_80+ has an instruction.
O2F_HD float o2f_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return (a != a || b != b) ? (a + b) : (a > b ? a : b);
#endif
}
O2F_HD float o2f_min(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return (a != a || b != b) ? (a + b) : (a < b ? a : b);
#endif
}
// ONNX Sign as ORT computes it: NaN stays NaN, -0 and +0 give +0 (numpy's sign agrees).
O2F_HD float o2f_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? x : 0.0f)); }
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
// GELU (erf form) for hidden layers without the special-function unit: x * (1/2 + z Q(z^2)) with
// z = x/sqrt(2) clamped to [-3, 3] and z Q(z^2) ~ erf(z)/2 an odd polynomial of degree 17 (a weighted
// least-squares fit to minimax; erf(3) = 1 - 2.2e-5, so the clamp costs no more than the fit):
// |gelu error| <= 1.2e-5 |x|, a fortieth of fp16's relative step. The exp and divide of o2f_erf_fast
// are two MUFU operations per element, and MUFU throughput (16/clk/SM) bounds GELU-heavy kernels;
// this is 14 FMA-pipe instructions.
__device__ __forceinline__ float o2f_gelu_fast(float x) {
  const float z = fminf(fmaxf(x * 0.70710678118654752f, -3.0f), 3.0f), u = z * z;
  float q = fmaf(u, 2.037283408640178e-08f, -9.724752771944623e-07f);
  q = fmaf(u, q, 2.0531200789264403e-05f);
  q = fmaf(u, q, -0.00025552569422870874f);
  q = fmaf(u, q, 0.0021177453454583883f);
  q = fmaf(u, q, -0.012551507912576199f);
  q = fmaf(u, q, 0.05553976818919182f);
  q = fmaf(u, q, -0.18765749037265778f);
  q = fmaf(u, q, 0.5641342401504517f);
  return x * fmaf(z, q, 0.5f);
}
__device__ __forceinline__ float o2f_sigmoid_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
// sin and cos: x reduced to r in [-pi, pi] by two FMAs against 2 pi in two float parts (x - k 2pi_hi, then
// - k 2pi_lo; each product exact inside its FMA), then the special-function unit's sine or cosine (absolute
// error <= 2^-21.4 on [-pi, pi]): within 1e-6 absolute for |x| < 1e5, where sinf's reduction carries a
// local-memory slow path for huge arguments and ~25 instructions a value. Fourier features and SIREN's layers
// evaluate one per hidden value: with sinf the Fourier-feature MLP's wgmma kernel held 255 registers and
// spilled 316 bytes (160 bytes of stack).
__device__ __forceinline__ float o2f_reduce_2pi(float x) {
  const float k = rintf(x * 0.159154943091895336f);
  return fmaf(-k, -1.74845553e-07f, fmaf(-k, 6.28318548f, x));
}
__device__ __forceinline__ float o2f_sin_fast(float x) { return __sinf(o2f_reduce_2pi(x)); }
__device__ __forceinline__ float o2f_cos_fast(float x) { return __cosf(o2f_reduce_2pi(x)); }
// bf16-grade forms (render_c's fast="bf16": hidden layers of bf16 chains, rounded to bf16 right after, whose
// half step is 2^-9 to 2^-8 relative): the hardware tanh, one MUFU operation, relative error ~2^-11 (PTX
// ISA), a quarter of the smallest half step (where 1 + tanh cancels, for negative x, ~2^-12 absolute, as in
// the fp16 kernels' packed forms); sigmoid as 1/2 + tanh(x/2)/2 (one MUFU where o2f_sigmoid_fast takes ex2 and rcp) and
// both GELUs in the tanh form (within 4.7e-4 absolute of the erf form: the fp16 kernels' packed GELU is the
// same form), 5 FMA-pipe instructions and one MUFU a value where o2f_gelu_fast takes 14 (bf16 gelu 64 ->
// 128x4 -> 64 on an H100: RESULTS.md, thirty-second run).
__device__ __forceinline__ float o2f_tanh_approx(float x) {
  float r;
  asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float o2f_sigmoid_approx(float x) { return fmaf(0.5f, o2f_tanh_approx(0.5f * x), 0.5f); }
__device__ __forceinline__ float o2f_gelu_approx(float x) {
  const float h = 0.5f * x, u = x * fmaf(0.0356774081f, x * x, 0.7978845608f);   // sqrt(2/pi) (x + 0.044715 x^3)
  return fmaf(h, o2f_tanh_approx(u), h);
}
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
    "sin": lambda a: f"o2f_sin_fast({a})",
    "cos": lambda a: f"o2f_cos_fast({a})",
}


def _fast_div(e: Op, args: list[str]) -> str:
    """a / b where the result is rounded to 16 bits right after: times the float32 reciprocal of a
    constant b (within 1.5 ulp of float32), else __fdividef (2 ulp). The IEEE division is a branchy
    instruction sequence that serialises an epilogue: a GEMM's GELU as x / 1.4140625 (the fp16 exports'
    sqrt 2) took 68 us per ViT-tiny FFN on an H200 where stock ORT's GEMM and GELU took 27."""
    divisor = e.args[1]
    if isinstance(divisor, Const):
        inv = np.float32(1.0) / np.float32(divisor.value)
        if np.isfinite(inv) and inv != 0.0:   # not for 0, NaN, an infinite or a subnormal-overflowing divisor
            return f"({args[0]} * {_f(float(inv))})"
    return f"__fdividef({args[0]}, {args[1]})"


# Whole activations with a dedicated fast form (filled below, once the named constructors exist).
FAST_WHOLE: dict = {}
# fast="bf16": the hardware approximations where a bf16 rounding follows (C_PRELUDE's *_approx forms), on
# top of FAST_C / FAST_WHOLE.
FAST_C_BF16 = {
    "tanh": lambda a: f"o2f_tanh_approx({a})",
    "sigmoid": lambda a: f"o2f_sigmoid_approx({a})",
}
FAST_WHOLE_BF16: dict = {}


def render_c(e: Expr, var: str = "v", fast: bool | str = False, col: str = "col",
             arrays: dict | None = None, load: str = "{array}[{col}]") -> str:
    """C expression text computing `e` with the input value named `var`. `fast` picks CUDA intrinsic
    forms (FAST_C, FAST_WHOLE) for use where the result is rounded to a 16-bit type right after (errors far
    below fp16's step); "bf16" also the hardware approximations (FAST_C_BF16, FAST_WHOLE_BF16) where it is
    rounded to bf16, whose step is 8 times fp16's. A per-channel constant reads `load` of its array name
    (`arrays[chan]`, see `chan_arrays`) at the column `col`."""
    if fast == "bf16" and e in FAST_WHOLE_BF16:
        return FAST_WHOLE_BF16[e](var)
    if fast and e in FAST_WHOLE:
        return FAST_WHOLE[e](var)
    if isinstance(e, Var):
        return var
    if isinstance(e, Const):
        return _f(e.value)
    if isinstance(e, Chan):
        if not arrays or e not in arrays:
            raise ValueError("a per-channel constant needs an array name to render (see chan_arrays)")
        return load.format(array=arrays[e], col=col)
    if isinstance(e, Op):
        args = [render_c(a, var, fast, col, arrays, load) for a in e.args]
        if fast and e.name == "div":
            return _fast_div(e, args)
        if fast == "bf16" and e.name in FAST_C_BF16:
            return FAST_C_BF16[e.name](*args)
        if fast and e.name in FAST_C:
            return FAST_C[e.name](*args)
        return PRIMITIVES[e.name].c(*args)
    raise TypeError(f"not an expression: {e!r}")


def _one_constant(e: Expr) -> tuple[Expr, Expr, bool] | None:
    """(inner, c, c_first) for e = add / sub / mul / div of one constant c (Const or Chan) and one
    non-constant `inner` (c_first: c is the left operand), else None."""
    if not (isinstance(e, Op) and e.name in ("add", "sub", "mul", "div") and len(e.args) == 2):
        return None
    a, b = e.args
    const_a, const_b = isinstance(a, (Const, Chan)), isinstance(b, (Const, Chan))
    if const_a == const_b:
        return None
    return (b, a, True) if const_a else (a, b, False)


def affine_in_x(e: Expr) -> tuple | None:
    """(s, t) with e = x * s + t, s and t floats or per-channel tuples, when e is built from x by adding,
    subtracting, multiplying or dividing by constants (and negating); else None."""
    if isinstance(e, Var):
        return 1.0, 0.0
    if isinstance(e, Op) and e.name == "neg" and len(e.args) == 1:
        a = affine_in_x(e.args[0])
        return None if a is None else (_times(a[0], -1.0), _times(a[1], -1.0))
    split = _one_constant(e)
    inner = None if split is None else affine_in_x(split[0])
    if inner is None:
        return None
    (s, t), c, c_first = inner, _const_value(split[1]), split[2]
    if e.name == "add":
        return s, _plus(t, c)
    if e.name == "sub":
        return (_times(s, -1.0), _plus(c, _times(t, -1.0))) if c_first else (s, _plus(t, _times(c, -1.0)))
    if e.name == "mul":
        return _times(s, c), _times(t, c)
    if c_first:   # c / (x s + t) is not affine
        return None
    return _times(s, _inverse(c)), _times(t, _inverse(c))


def _const_value(c: Expr):
    return c.value if isinstance(c, Const) else c.values


def _elementwise(f, a, b):
    if isinstance(a, tuple) or isinstance(b, tuple):
        n = len(a) if isinstance(a, tuple) else len(b)
        av = a if isinstance(a, tuple) else (a,) * n
        bv = b if isinstance(b, tuple) else (b,) * n
        return tuple(f(x, y) for x, y in zip(av, bv))
    return f(a, b)


def _f32(v: float) -> float:
    with np.errstate(all="ignore"):
        return float(np.float32(v))


def _plus(a, b): return _elementwise(lambda x, y: _f32(np.float32(x) + np.float32(y)), a, b)
def _times(a, b): return _elementwise(lambda x, y: _f32(np.float32(x) * np.float32(y)), a, b)
def _inverse(a): return _elementwise(lambda _, x: _f32(np.float32(1) / np.float32(x)) if x != 0 else _f32(np.inf), 1.0, a)


def leading_affine(e: Expr) -> tuple[Expr, object, object] | None:
    """(g, s, t) when e(x) = g(x * s + t) with a per-channel s or t (tuples; the other may be a float),
    every x in e being inside one such affine subtree (a scale and shift after a linear layer, such as
    an inference BatchNorm or a LayerScale: they fold into the layer's weights and bias), else None.
    Scalar-only maps (x * 30 in a SIREN, logits / T) stay in e: folding them gains little and would
    change how a gain is rounded."""
    candidates: dict[Expr, int] = {}

    def collect(n: Expr) -> None:
        if isinstance(n, Op):
            if chan_leaves(n) and affine_in_x(n) is not None:
                candidates.setdefault(n, len(to_text(n)))
            for a in n.args:
                collect(a)

    def replace(n: Expr, c: Expr) -> Expr | None:   # None: an x outside every copy of c
        if n == c:
            return X
        if isinstance(n, Var):
            return None
        if isinstance(n, Op):
            args = tuple(replace(a, c) for a in n.args)
            return None if any(a is None for a in args) else Op(n.name, args)
        return n

    collect(e)
    # the widest first (a BatchNorm's x * s + t whole), then narrower ones: in gelu(x + c) the x + c
    # is inside 0.5 (x + c) and (x + c) / sqrt(2), which are affine but not the same subtree
    for c in sorted(candidates, key=lambda k: -candidates[k]):
        g = replace(e, c)
        if g is not None:
            s, t = affine_in_x(c)
            return g, s, t
    return None


def _peel_affine(e: Expr) -> tuple[Expr, Expr]:
    """(u, A) with e = A(u): A the adds, subtracts, multiplies and divides by constants (and negations) at
    the top of e, as a function of X standing for u; (e, X) when there are none."""
    if isinstance(e, Op) and e.name == "neg" and len(e.args) == 1:
        u, a = _peel_affine(e.args[0])
        return u, Op("neg", (a,))
    split = _one_constant(e)
    if split is None or (split[2] and e.name == "div"):   # c / f(x) is not an affine map of f(x)
        return e, X
    u, a = _peel_affine(split[0])
    return u, Op(e.name, (split[1], a) if split[2] else (a, split[1]))


def trailing_affine(e: Expr) -> tuple[Expr, object, object] | None:
    """(g, s, t) when e(x) = g(x) * s + t with a per-channel s or t and g not x itself (a BatchNorm or a
    scale after an activation: it folds into the next layer's weights and bias), else None."""
    g, a = _peel_affine(e)
    if isinstance(a, Var) or isinstance(g, Var) or not chan_leaves(a):
        return None
    s, t = affine_in_x(a)
    return g, s, t


def chan_leaves(e: Expr) -> tuple[Chan, ...]:
    """The distinct per-channel constants of `e`, in first-visit order (deterministic)."""
    found: dict[Chan, None] = {}

    def walk(n: Expr):
        if isinstance(n, Chan):
            found.setdefault(n)
        elif isinstance(n, Op):
            for a in n.args:
                walk(a)
    walk(e)
    return tuple(found)


def chan_arrays(e: Expr, prefix: str) -> dict[Chan, str]:
    """One C array name per per-channel constant of `e`: prefix0, prefix1, ..."""
    return {c: f"{prefix}{k}" for k, c in enumerate(chan_leaves(e))}


def c_array_values(c: Chan, size: int) -> str:
    """The initialiser list of c's array with `size` entries. Entries past the true width (the padded
    columns a kernel computes and then discards) are 0: they exist only so no read is out of bounds."""
    if size < c.width:
        raise ValueError(f"array of {size} entries for a per-channel constant of width {c.width}")
    return ", ".join([_f(v) for v in c.values] + ["0.0f"] * (size - c.width))


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
    if isinstance(e, Chan):
        if x.ndim == 0 or x.shape[-1] != e.width:
            raise ValueError(f"a per-channel constant of width {e.width} applied to shape {list(x.shape)}")
        return np.broadcast_to(np.asarray(e.values, dtype=np.float32), x.shape).copy()
    if isinstance(e, Op):
        out = PRIMITIVES[e.name].np(*(_eval(a, x) for a in e.args))
        return np.asarray(out, dtype=np.float32)
    raise TypeError(f"not an expression: {e!r}")


CHAN_TEXT_MAX = 4  # per-channel constants with more values are written as their width and hash


def to_text(e: Expr) -> str:
    """Canonical, human-readable text of the tree: `mul(x, sigmoid(x))`. It determines the tree (and so
    the generated code) up to the 64-bit hash that stands for long per-channel vectors:
    `chan(0.5, 2.0)` or `chan[64:1a2b3c4d5e6f7a8b]`."""
    if isinstance(e, Var):
        return "x"
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Chan):
        if e.width <= CHAN_TEXT_MAX:
            return f"chan({', '.join(repr(v) for v in e.values)})"
        return f"chan[{e.width}:{e.digest()}]"
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
def swish(alpha: float = 1.0) -> Expr: return X * Op("sigmoid", (Const(alpha) * X,))
def quick_gelu() -> Expr: return swish(1.702)   # OpenAI CLIP's QuickGELU (and ORT's QuickGelu op)
def shrink(lambd: float = 0.5, bias: float = 0.0) -> Expr:
    # ONNX Shrink: x + bias below -lambd, x - bias above lambd, else 0 (NaN too, like ORT).
    above = Op("select", (Op("gt", (X, Const(lambd))), X - Const(bias), Const(0.0)))
    return Op("select", (Op("lt", (X, Const(-lambd))), X + Const(bias), above))


def _named() -> dict[Expr, str]:
    return {
        identity(): "id", relu(): "relu", sigmoid(): "sigmoid", tanh(): "tanh", gelu_erf(): "gelu",
        gelu_tanh(): "gelutanh", silu(): "silu", softplus(): "softplus", mish(): "mish", sin(): "sin",
        hard_swish(): "hardswish", clip(0.0, 6.0): "relu6", quick_gelu(): "quickgelu",
    }


NAMED = _named()
FAST_WHOLE[gelu_erf()] = lambda a: f"o2f_gelu_fast({a})"
FAST_WHOLE_BF16[gelu_erf()] = FAST_WHOLE_BF16[gelu_tanh()] = lambda a: f"o2f_gelu_approx({a})"


# ------------------------------------------------------------------------------ packed fp16x2 forms
@dataclass(frozen=True)
class PackedForm:
    """An activation evaluated on a pair of fp16 values in fp16x2 arithmetic (templates/o2f_packed_act.cuh):
    the tensor-core kernels' hidden layers of fp16 chains with act_math "packed". `device` names the CUDA
    function of a __half2; `model` computes the same on float16 arrays op by op (each step rounded to fp16
    as the hardware's HMUL2/HFMA2 round), for the numerics model in precision.py.

    `prescale`, `scaled_device`, `scaled_model`: the same activation as a function of h = prescale * x,
    for kernels that pack the producing layer's weights and bias times `prescale` (the wgmma and mma.sync
    kernels, MLPSpec.prescale; the wide design's GEMM epilogues keep `device`): the accumulators then hold
    h, and the multiply by prescale the form would begin with is gone. prescale is a power of two, so
    round(prescale * acc) = prescale * round(acc) and every later step is the same value scaled (the
    coefficients too): the model above holds, except where h or h^2 is an fp16 subnormal."""
    device: str
    model: Callable[[np.ndarray], np.ndarray]
    prescale: float = 1.0
    scaled_device: str = ""
    scaled_model: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def prescaled_device(self) -> str:
        return self.scaled_device or self.device


def _h16(v: float) -> np.float16:
    return np.float16(v)


def _tanh16(u: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.tanh(u.astype(np.float32)).astype(np.float16)


def _sigmoid16(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (_tanh16(x * _h16(0.5)) * _h16(0.5) + _h16(0.5)).astype(np.float16)


def _silu16(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        hx = x * _h16(0.5)
        return hx * _tanh16(hx) + hx


def _sigmoid16_h(h: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (_tanh16(h) * _h16(0.5) + _h16(0.5)).astype(np.float16)


def _silu16_h(h: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return h * _tanh16(h) + h


def _quickgelu16_h(h: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return h * _tanh16(h * _h16(1.702)) + h


def _quickgelu16(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _quickgelu16_h(x * _h16(0.5))


def _gelu16_h(h: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        u = (h * h * _h16(8.0 * 0.7978845608 * 0.044715) + _h16(2.0 * 0.7978845608)) * h
        return h * _tanh16(u) + h


def _gelu16(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        x2 = x * x
        u = (x2 * _h16(0.7978845608 * 0.044715) + _h16(0.7978845608)) * x
        hx = x * _h16(0.5)
        return hx * _tanh16(u) + hx


# Not ReLU: it is exact either way, and the packed form (convert, then max.NaN.f16x2) measured 4% slower
# than fp32 max + convert on nerf's resident kernel (benchmarks/RESULTS.md, eighth run).
PACKED_FORMS: dict[Expr, PackedForm] = {
    tanh(): PackedForm("o2f_h2_tanh", _tanh16),
    sigmoid(): PackedForm("o2f_h2_sigmoid", _sigmoid16, 0.5, "o2f_h2_sigmoid_h", _sigmoid16_h),
    silu(): PackedForm("o2f_h2_silu", _silu16, 0.5, "o2f_h2_silu_h", _silu16_h),
    quick_gelu(): PackedForm("o2f_h2_quickgelu", _quickgelu16, 0.5, "o2f_h2_quickgelu_h", _quickgelu16_h),
    gelu_erf(): PackedForm("o2f_h2_gelu", _gelu16, 0.5, "o2f_h2_gelu_h", _gelu16_h),
    gelu_tanh(): PackedForm("o2f_h2_gelu", _gelu16, 0.5, "o2f_h2_gelu_h", _gelu16_h),
}


def packed_form(e: Expr) -> PackedForm | None:
    """The fp16x2 form of activation `e`, or None (the fp32 forms then)."""
    return PACKED_FORMS.get(e)


@dataclass(frozen=True, eq=True)
class _Slot(Expr):
    """Stands for any per-channel constant in the shapes of PER_CHANNEL_NAMED."""


def _skeleton(e: Expr) -> Expr:
    if isinstance(e, Chan):
        return _Slot()
    if isinstance(e, Op):
        return Op(e.name, tuple(_skeleton(a) for a in e.args))
    return e


def _per_channel_named() -> dict[Expr, str]:
    s = _Slot()
    return {
        Op("select", (Op("lt", (X, Const(0.0))), X * s, X)): "prelu",
        X * s: "scale", s * X: "scale", X + s: "shift", s + X: "shift",
        X * s + s: "affine", s * X + s: "affine",
    }


PER_CHANNEL_NAMED = _per_channel_named()


def short_name(e: Expr) -> str:
    """A short C-identifier-safe name: the activation's name when known (`prelu`, `scale`, ... for the
    common per-channel forms: the spec name's hash tells their values apart), else `e<fingerprint>`."""
    if e in NAMED:
        return NAMED[e]
    if chan_leaves(e):
        return PER_CHANNEL_NAMED.get(_skeleton(e), "e" + fingerprint(e))
    return "e" + fingerprint(e)
