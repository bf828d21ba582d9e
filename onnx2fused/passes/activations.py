"""Recognise the elementwise subgraph after a linear layer as one activation expression f.

Given the layer's output tensor v, the activation is the largest set A of elementwise nodes such that

    every input of a node in A is v, the output of a node in A, or a constant that is a scalar or a
    per-channel vector (shape [N], [1, N], ... with N the layer's width and rank <= rank(v));
    every tensor of A except its final output t (v included) is consumed only by nodes of A and is
    not a graph output;

and then t = f(v) elementwise, with f an `expr.Expr` built node by node:

    Relu(a) -> max(a, 0)        Sigmoid(a) -> sigmoid(a)      Mul(a, b) -> a * b      ...
    Gelu(a) -> gelu_erf[x := a] Mish(a) -> mish[x := a]       Clip(a, lo, hi) -> min(max(a, lo), hi)
    Shrink(a) -> shrink[x := a] Swish(a) -> swish[x := a]     Round(a) -> round(a) (half to even)
    Identity / Dropout (inference) / Cast between float types -> a  (not a Cast that rounds a float32
                                                                      value to float16/bfloat16)
    Or / And / Xor / Not of conditions -> max / min / |a - b| / 1 - a (a bool is 1.0 / 0.0); Cast of a
                                          bool to bool -> a
    Flatten (axis 1) / Reshape to [-1, N] of a rank-2 value -> a (torch's nn.Flatten between Linears)
    Reshape whose output keeps the N features as its last dimension -> a: the same rows regrouped
                                          (HF Conv1D's `addmm(b, x.view(-1, n), W).view(size)`, GPT-2's
                                          MLP); the activation's output must have the layer output's shape
                                          again, and the nodes that only compute such a Reshape's shape
                                          input (Shape -> Gather -> Concat) go with the activation
    ONNX Runtime's contrib activations (domain com.microsoft, in models saved by its graph optimiser):
    Gelu(a) -> gelu_erf[x := a]   QuickGelu(a) -> swish(alpha)[x := a]   FastGelu(a[, b]) ->
    gelu_tanh[x := a (+ b)]      BiasGelu(a, b) -> gelu_erf[x := a + b]
    CastLike(a, t) with t of a float type -> a, by the same rule (onnx's function bodies, such as the
                                          expanded Elu, cast each constant like the input)
    a constant c of shape [1, ..., 1, N] -> Chan(c) (c[col] for output column col), or Const when all
    its values are equal; a bool constant (a Where condition) -> 1.0 / 0.0
    BatchNormalization in inference mode on a rank-2 value (its channel axis 1 is then the layer's
    features; torch's BatchNorm1d after a Linear, which the TorchScript exporter leaves unfolded)
                                       -> a * s + t with s = scale / sqrt(var + eps), t = B - mean * s
                                          per channel, in float32 as ORT's CPU kernel folds them

With no such nodes, f = x (`expr.identity()`). The tree is finally normalised to a named constructor of
`expr` (relu, silu, gelu_erf, ...) when it is numerically the same function on a probe set that covers
small, large (up to 1e30: near FLT_MAX the order of multiplications decides overflow), infinite and
signed values, so kernel names read well.

Each consumer that could not join A is recorded with a one-line reason (`Activation.rejected`); for a
known op that is not elementwise (LayerNormalization, Softmax, Split, ...) the reason says what it does.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import onnx

from .. import expr as ex
from ..expr import Const, Expr, Op, Var
from .constants import FLOAT_TYPES, ORT_DOMAIN, GraphIndex, elem_name
from .regroup import ends_in, shape_feeders, shape_reader

NOT_PER_CHANNEL = "does not broadcast per channel"
ORT_ACTIVATIONS = ("Gelu", "QuickGelu", "FastGelu", "BiasGelu")   # ONNX Runtime's contrib ops


class ActivationRefusal(Exception):
    """An elementwise node that cannot be part of an activation; the message is the reason."""


@dataclass
class Activation:
    expr: Expr
    node_indices: list[int]
    nodes: list[str]
    output: str
    rejected: dict[int, str] = field(default_factory=dict)


def subst(e: Expr, x: Expr) -> Expr:
    """e with its variable replaced by x."""
    if isinstance(e, Var):
        return x
    if isinstance(e, Op):
        return Op(e.name, tuple(subst(a, x) for a in e.args))
    return e


# -- one node -> Expr ------------------------------------------------------------------------------

_UNARY = {"Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Sin": "sin", "Cos": "cos", "Exp": "exp",
          "Log": "log", "Abs": "abs", "Neg": "neg", "Sqrt": "sqrt", "Reciprocal": "reciprocal",
          "Softplus": "softplus", "Sinh": "sinh", "Cosh": "cosh", "Tan": "tan", "Asin": "asin", "Acos": "acos",
          "Atan": "atan", "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Floor": "floor", "Ceil": "ceil",
          "Round": "round", "Sign": "sign"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow",
           "Greater": "gt", "Less": "lt", "GreaterOrEqual": "ge", "LessOrEqual": "le"}
_VARIADIC = {"Max": "max", "Min": "min", "Sum": "add"}
# Logic on bool tensors (a condition as torch's TorchScript export of Hardshrink writes it:
# Where(Or(x > l, x < -l), x, 0)): a bool is 1.0 / 0.0 here, so Or is max, And min, Xor |a - b|, Not 1 - a
_LOGIC = ("Or", "And", "Xor", "Not")
ELEMENTWISE_OPS = (set(_UNARY) | set(_BINARY) | set(_VARIADIC) | set(_LOGIC) |
                   {"Relu", "LeakyRelu", "Gelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Mish",
                    "Clip", "Where", "Softsign", "ThresholdedRelu", "Identity", "Dropout", "Cast", "PRelu",
                    "Shrink", "Swish", "CastLike", "BatchNormalization"})

# Ops that are not elementwise, with why (after the op's name), for the reason a chain ends at one.
_ROW_NORMS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
              "SkipSimplifiedLayerNormalization", "GroupNormalization", "InstanceNormalization",
              "MeanVarianceNormalization", "LpNormalization")
_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "TopK", "CumSum")
_LAYOUT = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Tile", "Pad")
_NOT_ELEMENTWISE = {
    **{op: "is a normalisation across the row, not elementwise" for op in _ROW_NORMS},
    **{op: "normalises across the row, not elementwise" for op in ("Softmax", "LogSoftmax", "Hardmax")},
    **{op: "is a reduction across elements, not elementwise" for op in _REDUCTIONS},
    **{op: "changes the tensor's shape or layout, not elementwise" for op in _LAYOUT},
    **{op: "selects part of the tensor, not elementwise" for op in ("Slice", "Gather", "GatherElements", "GatherND")},
    "Split": "cuts the row into pieces (torch chunk/split), not elementwise",
    "Concat": "joins the value with other tensors, not elementwise",
}


def unsupported(node: onnx.NodeProto) -> str:
    """Why `node`, an op the recogniser does not know, cannot join an activation."""
    if node.domain in ("", "ai.onnx", ORT_DOMAIN) and node.op_type in _NOT_ELEMENTWISE:
        return f"{node.op_type} {_NOT_ELEMENTWISE[node.op_type]}"
    if node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} of domain '{node.domain}' is not a supported elementwise op"
    return f"{node.op_type} is not a supported elementwise op"


_NARROW_FLOATS = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


class _Ctx:
    def __init__(self, ix: GraphIndex, env: dict[str, Expr], rank: int | None, width: int | None,
                 value_type: int | None):
        self.ix, self.env, self.rank, self.width, self.value_type = ix, env, rank, width, value_type

    def operand(self, name: str, what: str) -> Expr:
        if name in self.env:
            return self.env[name]
        c = self.ix.const(name)
        if c is None:
            raise ActivationRefusal(f"{what}: input '{name}' is neither derived from the layer output nor a constant")
        return self.constant(c, name, what)

    def scalar_operand(self, name: str, what: str, role: str) -> Expr:
        e = self.operand(name, what)
        if isinstance(e, ex.Chan):
            raise ActivationRefusal(f"{what}: the {role} '{name}' is a vector; ONNX takes a scalar there")
        return e

    def constant(self, c: np.ndarray, name: str, what: str) -> Expr:
        """Const for a scalar (or a vector of equal values), Chan for a per-channel vector."""
        max_rank = self.rank if self.rank is not None else 2
        if c.ndim > max_rank:
            raise ActivationRefusal(f"{what}: constant '{name}' of rank {c.ndim} would broadcast the value to a higher rank")
        if c.dtype.kind not in "fiub" and str(c.dtype) != "bfloat16":
            raise ActivationRefusal(f"{what}: constant '{name}' has element type {c.dtype}")
        flat = c.astype(np.float32).reshape(-1)  # bool (a Where condition) -> 1.0 / 0.0
        if flat.size == 0:
            raise ActivationRefusal(f"{what}: constant '{name}' is empty")
        if flat.size == 1:
            return Const(float(flat[0]))
        shape = "[" + ", ".join(map(str, c.shape)) + "]"
        if any(d != 1 for d in c.shape[:-1]) or c.shape[-1] != self.width:
            # Anything else would broadcast the value to a new shape (or it is not a per-column vector).
            width = "unknown" if self.width is None else str(self.width)
            raise ActivationRefusal(f"{what}: constant '{name}' of shape {shape} {NOT_PER_CHANNEL} "
                                    f"(the layer's width is {width})")
        if np.all(flat == flat[0]):
            return Const(float(flat[0]))
        return ex.Chan(tuple(flat))


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def attr_activation(op: str, attr) -> Expr | None:
    """f(x) of the one-input activation op `op` (ai.onnx), its attributes read by attr(name, default);
    None when `op` is not one. Shared by the node walk and the activation attribute of ORT's FusedGemm."""
    x = ex.X
    if op in _UNARY:
        return Op(_UNARY[op], (x,))
    if op == "Relu":
        return ex.relu()
    if op == "LeakyRelu":
        return ex.leaky_relu(float(attr("alpha", 0.01)))
    if op == "Gelu":
        approx = attr("approximate", "none")
        approx = approx.decode("utf-8", "replace") if isinstance(approx, bytes) else approx  # any bytes
        return ex.gelu_tanh() if approx == "tanh" else ex.gelu_erf()
    if op == "Elu":
        return ex.elu(float(attr("alpha", 1.0)))
    if op == "Selu":
        alpha = float(attr("alpha", 1.67326319217681884765625))
        gamma = float(attr("gamma", 1.05070102214813232421875))
        neg = Const(gamma) * (Const(alpha) * Op("exp", (x,)) - Const(alpha))
        return Op("select", (Op("le", (x, Const(0.0))), neg, Const(gamma) * x))
    if op == "Celu":
        alpha = float(attr("alpha", 1.0))
        neg = Const(alpha) * (Op("exp", (x / Const(alpha),)) - Const(1.0))
        return Op("add", (Op("max", (Const(0.0), x)), Op("min", (Const(0.0), neg))))
    if op == "HardSigmoid":
        return ex.hard_sigmoid(float(attr("alpha", 0.2)), float(attr("beta", 0.5)))
    if op == "HardSwish":
        return ex.hard_swish()
    if op == "Mish":
        return ex.mish()
    if op == "Swish":
        return ex.swish(float(attr("alpha", 1.0)))
    if op == "Shrink":
        return ex.shrink(float(attr("lambd", 0.5)), float(attr("bias", 0.0)))
    if op == "Softsign":
        return x / (Const(1.0) + Op("abs", (x,)))
    if op == "ThresholdedRelu":
        alpha = float(attr("alpha", 1.0))
        return Op("select", (Op("gt", (x, Const(alpha))), x, Const(0.0)))
    return None


def _check_float_cast(ctx: _Ctx, what: str, src_name: str, to: int | None, cast: str) -> None:
    """Raise unless casting `src_name` to element type `to` leaves the chain's fp32 value unchanged."""
    src = ctx.ix.types.get(src_name)
    if to not in FLOAT_TYPES:
        raise ActivationRefusal(f"{what}: {cast} to {elem_name(to)} (only casts to float types are elementwise no-ops)")
    if src is not None and src not in FLOAT_TYPES and src != onnx.TensorProto.BOOL:
        raise ActivationRefusal(f"{what}: {cast} from {elem_name(src)}")
    if to in _NARROW_FLOATS and ctx.value_type not in _NARROW_FLOATS and src not in _NARROW_FLOATS:
        # In a float32 chain this rounds to 16 bits: the kernels (fp32 epilogue) would not round.
        raise ActivationRefusal(f"{what}: {cast} to {elem_name(to)} rounds the float32 value")


def _keeps_rank2_shape(ctx: _Ctx, node: onnx.NodeProto) -> bool:
    """A Flatten (axis 1) or Reshape (to [-1 or 0, width]) of a rank-2 value of `width` features: the
    identity (torch's nn.Flatten between two Linears, as the TorchScript exporter keeps it)."""
    if ctx.rank != 2 or ctx.width is None:
        return False
    if node.op_type == "Flatten":
        return int(_attr(node, "axis", 1)) in (1, -1)
    shape = ctx.ix.const(node.input[1]) if len(node.input) > 1 else None
    if shape is None or int(_attr(node, "allowzero", 0)):
        return False
    dims = [int(d) for d in np.asarray(shape).reshape(-1)]
    return len(dims) == 2 and dims[0] in (-1, 0) and dims[1] == ctx.width


def node_expr(ctx: _Ctx, i: int) -> Expr:
    """The expression of node i's (first) output in terms of its operands, or raise ActivationRefusal."""
    ix = ctx.ix
    node = ix.node(i)
    what = ix.describe(i)
    op = node.op_type
    if node.domain == ORT_DOMAIN and op in ORT_ACTIVATIONS:
        return _ort_activation(ctx, node, what)
    if node.domain in ("", "ai.onnx") and op in ("Flatten", "Reshape") and _keeps_rank2_shape(ctx, node):
        return ctx.operand(node.input[0], what)
    if node.domain not in ("", "ai.onnx") or op not in ELEMENTWISE_OPS:
        raise ActivationRefusal(f"{what}: {unsupported(node)}")
    ins = list(node.input)
    extra_outs = [o for o in node.output[1:] if o]
    if op == "BatchNormalization":
        return _batch_norm(ctx, node, what, extra_outs)
    if op == "Dropout":
        if any(ix.users(o) or o in ix.graph_outputs for o in extra_outs):
            raise ActivationRefusal(f"{what}: its mask output is used")
        if len(ins) > 2 and ins[2]:
            tm = ix.const(ins[2])
            if tm is None or bool(np.asarray(tm).reshape(-1)[0]):
                raise ActivationRefusal(f"{what}: training_mode is not a constant false")
        return ctx.operand(ins[0], what)
    if extra_outs:
        raise ActivationRefusal(f"{what}: has more than one output")
    if op == "Identity":
        return ctx.operand(ins[0], what)
    if op == "Cast":
        if _attr(node, "to") == onnx.TensorProto.BOOL and ix.types.get(ins[0]) == onnx.TensorProto.BOOL:
            return ctx.operand(ins[0], what)   # bool to bool (the TorchScript exporter's, before an Or)
        _check_float_cast(ctx, what, ins[0], _attr(node, "to"), "Cast")
        return ctx.operand(ins[0], what)
    if op == "CastLike":
        # Only the target's element type matters (onnx's function bodies cast their constants to the
        # input's type this way): a CastLike to the chain's own type is the identity.
        if len(ins) < 2 or not ins[1]:
            raise ActivationRefusal(f"{what}: CastLike without a target input")
        _check_float_cast(ctx, what, ins[0], ix.types.get(ins[1]), "CastLike")
        return ctx.operand(ins[0], what)
    if op in _UNARY:
        return Op(_UNARY[op], (ctx.operand(ins[0], what),))
    if op in _BINARY:
        a, b = ctx.operand(ins[0], what), ctx.operand(ins[1], what)
        return Op(_BINARY[op], (a, b))
    if op in _LOGIC:
        args = [ctx.operand(n, what) for n in ins[:2] if n]
        if op == "Not":
            return Op("sub", (Const(1.0), args[0]))
        if op == "Xor":
            return Op("abs", (Op("sub", tuple(args)),))
        return Op("max" if op == "Or" else "min", tuple(args))
    if op in _VARIADIC:
        args = [ctx.operand(n, what) for n in ins if n]
        e = args[0]
        for b in args[1:]:
            e = Op(_VARIADIC[op], (e, b))
        return e
    x = ctx.operand(ins[0], what)
    if op == "PRelu":
        slope = ctx.operand(ins[1], what)
        return Op("select", (Op("lt", (x, Const(0.0))), Op("mul", (x, slope)), x))
    f = attr_activation(op, lambda name, default: _attr(node, name, default))
    if f is not None:
        return subst(f, x)
    if op == "Clip":
        lo = hi = None
        if len(ins) > 1 and ins[1]:
            lo = ctx.scalar_operand(ins[1], what, "min")
        if len(ins) > 2 and ins[2]:
            hi = ctx.scalar_operand(ins[2], what, "max")
        if lo is None and _attr(node, "min") is not None:
            lo = Const(float(_attr(node, "min")))
        if hi is None and _attr(node, "max") is not None:
            hi = Const(float(_attr(node, "max")))
        e = x
        if lo is not None:
            e = Op("max", (e, lo))
        if hi is not None:
            e = Op("min", (e, hi))
        return e
    if op == "Where":
        c, a, b = ctx.operand(ins[0], what), ctx.operand(ins[1], what), ctx.operand(ins[2], what)
        return Op("select", (c, a, b))
    raise ActivationRefusal(f"{what}: {op} is not a supported elementwise op")  # pragma: no cover


def _ort_activation(ctx: _Ctx, node: onnx.NodeProto, what: str) -> Expr:
    """ONNX Runtime's own activation ops (domain com.microsoft), which a model saved by ORT's graph
    optimiser contains: Gelu (erf form), QuickGelu x sigmoid(alpha x), FastGelu (tanh form) of x or of
    x + bias, BiasGelu: the erf form of a + b."""
    op, ins = node.op_type, [n for n in node.input]
    if any(o for o in node.output[1:]):
        raise ActivationRefusal(f"{what}: has more than one output")
    x = ctx.operand(ins[0], what)
    if op == "Gelu":
        return subst(ex.gelu_erf(), x)
    if op == "QuickGelu":
        return subst(ex.swish(float(_attr(node, "alpha", 1.702))), x)
    if len(ins) > 1 and ins[1]:
        x = Op("add", (x, ctx.operand(ins[1], what)))
    elif op == "BiasGelu":
        raise ActivationRefusal(f"{what}: BiasGelu without its bias input")
    return subst(ex.gelu_tanh() if op == "FastGelu" else ex.gelu_erf(), x)


def _batch_norm(ctx: _Ctx, node: onnx.NodeProto, what: str, extra_outs: list[str]) -> Expr:
    """BatchNormalization in inference mode as the per-channel affine map it is there."""
    if _attr(node, "training_mode", 0) or extra_outs:
        raise ActivationRefusal(f"{what}: BatchNormalization in training mode (it updates its statistics)")
    if ctx.rank != 2:
        rank = "unknown" if ctx.rank is None else str(ctx.rank)
        raise ActivationRefusal(f"{what}: BatchNormalization normalises axis 1, which is the layer's features "
                                f"only for a rank-2 value (this one's rank is {rank})")
    ins = list(node.input)
    params = []
    for role, name in zip(("scale", "B", "mean", "var"), ins[1:5]):
        c = ctx.ix.const(name) if name else None
        if c is None:
            raise ActivationRefusal(f"{what}: its {role} '{name}' is not a constant")
        params.append(np.asarray(c, dtype=np.float32).reshape(-1))
    scale, bias, mean, var = params
    if len({p.size for p in params}) != 1:
        raise ActivationRefusal(f"{what}: its scale, B, mean and var differ in length")
    eps = np.float32(_attr(node, "epsilon", 1e-5))
    with np.errstate(all="ignore"):   # var + eps <= 0 gives NaN or inf here as in ORT
        s = (scale * (np.float32(1) / np.sqrt(var + eps))).astype(np.float32)
        t = (bias - mean * s).astype(np.float32)
    x = ctx.operand(ins[0], what)
    return Op("add", (Op("mul", (x, _per_channel(ctx, s, ins[1], what))), _per_channel(ctx, t, ins[2], what)))


def _per_channel(ctx: _Ctx, v: np.ndarray, name: str, what: str) -> Expr:
    """v as Chan even where its values are equal (an untrained BatchNorm's): it stays a per-channel map
    that chains.py folds into the layer, as scalar gains are not."""
    e = ctx.constant(v, name, what)
    return ex.Chan(tuple(v)) if isinstance(e, Const) and v.size > 1 else e


# -- normalisation ---------------------------------------------------------------------------------

def _probe() -> np.ndarray:
    mags = np.array([1e-30, 1e-6, 1e-3, 0.1, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 10, 15, 20, 30, 50, 88, 100,
                     1e3, 1e4, 1e6, 1e10, 1e20, 1e30, np.inf], dtype=np.float32)
    return np.concatenate([np.linspace(-12, 12, 2401, dtype=np.float32), mags, -mags, [0.0]]).astype(np.float32)


_PROBE = _probe()
_NAMED_VALUES = None


# How close a function must come to a named one to be it, on the probe set: float32 rounding of the
# constants (|a - b| <= ATOL + RTOL |b|), and in a 16-bit graph its constants' 16-bit rounding, which
# leaves the graph's own function a little off the named one: a GELU whose sqrt(2) is stored as fp16
# 1.4140625 differs from the erf GELU by at most 3.1e-5, a thirtieth of the error of the fp16 arithmetic
# that evaluates it in the graph (erf alone rounds to +-4.9e-4 there). Half an fp16 step relative
# (2^-12) plus 6e-5 admits that and no more: a hard-swish whose 1/6 is fp16 (0.16663) stays as written.
ATOL, RTOL = 1e-6, 2e-6
ATOL_16, RTOL_16 = 6e-5, 2.0 ** -12


def _same(a: np.ndarray, b: np.ndarray, atol: float = ATOL, rtol: float = RTOL) -> bool:
    both_nan = np.isnan(a) & np.isnan(b)
    fin = np.isfinite(a) & np.isfinite(b)
    with np.errstate(all="ignore"):
        ok = both_nan | (a == b) | (fin & (np.abs(a - b) <= atol + rtol * np.abs(b)))
    return bool(np.all(ok))


def normalise(e: Expr, half: bool = False) -> Expr:
    """The named constructor equal to e as a function (on the probe set), else e itself. `half`: e is
    a 16-bit graph's activation, whose constants are rounded to 16 bits (ATOL_16, RTOL_16)."""
    global _NAMED_VALUES
    if e in ex.NAMED or ex.chan_leaves(e):  # per-channel trees take their names from expr.short_name
        return e
    if _NAMED_VALUES is None:
        _NAMED_VALUES = [(n, ex.evaluate(n, _PROBE)) for n in ex.NAMED]
    v = ex.evaluate(e, _PROBE)
    atol, rtol = (ATOL_16, RTOL_16) if half else (ATOL, RTOL)
    for named, nv in _NAMED_VALUES:
        if _same(v, nv, atol, rtol):
            return named
    return e


def affine_step(ix: GraphIndex, i: int, width: int) -> tuple[str, object, object] | None:
    """Node i as y = x * s + t of its one non-constant input x (s, t: floats or per-channel tuples of
    `width` values), read as an activation node is (a Mul, Add, Sub or Div by a constant, an inference
    BatchNorm on a rank-2 x, Identity, a Cast between float types that does not round); None when it is
    not such a map."""
    node = ix.node(i)
    xs = [a for a in node.input if a and ix.const(a) is None]
    if len(xs) != 1:
        return None
    ctx = _Ctx(ix, {xs[0]: ex.X}, ix.rank(xs[0]), width, ix.types.get(xs[0]))
    try:
        e = node_expr(ctx, i)
    except ActivationRefusal:
        return None
    affine = ex.affine_in_x(e)
    return None if affine is None else (xs[0], *affine)


def scalar_gain(ix: GraphIndex, i: int, width: int | None) -> tuple[str, float] | None:
    """Node i, a Mul or Div, as y = x * s of its one non-constant input x, s a finite scalar: (x, s); else
    None (a per-channel factor, a constant divided by x, a shift). A LoRA branch's scaling, the 1/sqrt(2)
    after NeuS's skip Concat."""
    node = ix.node(i)
    if node.op_type not in ("Mul", "Div") or node.domain not in ("", "ai.onnx"):
        return None
    step = affine_step(ix, i, width)
    if step is None or isinstance(step[1], tuple) or step[2] != 0.0 or not np.isfinite(step[1]):
        return None
    return step[0], float(step[1])


# -- the region walk -------------------------------------------------------------------------------

def match_activation(ix: GraphIndex, value: str, width: int | None = None, strict: bool = False) -> Activation:
    """The activation applied to tensor `value` (a linear layer's output of `width` features; None:
    its inferred shape's last dimension, if known). Its tensors may be read by Shape nodes whose results
    only ever become Reshape shapes (regroup.shape_reader), which the chain must then take with it or find
    chains checks it cannot (regroup.reads_removed); `strict`: only by those computing the activation's
    own Reshapes' shapes."""
    if width is None:
        shape = ix.shapes.get(value)
        width = shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None
    env: dict[str, Expr] = {value: ex.X}
    ctx = _Ctx(ix, env, ix.rank(value), width, ix.types.get(value))
    layout: dict[str, bool] = {value: True}   # tensor -> has the layer output's shape (else: rows regrouped)
    region: list[int] = []
    rejected: dict[int, str] = {}
    heap = list(ix.users(value))
    heapq.heapify(heap)
    seen: set[int] = set()
    while heap:
        i = heapq.heappop(heap)
        if i in seen:
            continue
        seen.add(i)
        try:
            e, same_shape = _region_node(ctx, i, value, layout)
        except ActivationRefusal as r:
            rejected[i] = str(r)
            continue
        region.append(i)
        out = ix.node(i).output[0]
        env[out], layout[out] = e, same_shape
        for u in ix.users(out):
            heapq.heappush(heap, u)
    # Choose the latest tensor t of the layer output's shape whose ancestor set within the region is
    # closed (the nodes computing its Reshapes' shapes taken with it).
    in_region = set(region)
    candidates = [value] + [ix.node(i).output[0] for i in region]
    for t in reversed(candidates):
        if not layout[t]:
            continue
        anc = _ancestors(ix, t, value, in_region)
        shape_nodes = shape_feeders(ix, anc)
        if _closed(ix, t, value, anc, shape_nodes, strict):
            anc |= shape_nodes
            order = sorted(anc)
            expr = normalise(env[t], ctx.value_type in _NARROW_FLOATS) if order else ex.identity()
            rej = {i: r for i, r in rejected.items() if any(x == t for x in ix.node(i).input)}
            # Region nodes that were left out (outside the closed set) and consume t explain the end too.
            for j in region:
                if j not in anc and t in ix.node(j).input:
                    rej.setdefault(j, f"{ix.describe(j)}: " + (
                        "the value is also used outside the activation" if layout[ix.node(j).output[0]] else
                        f"regroups the rows into shape {ix.shapes.get(ix.node(j).output[0])}, and no Reshape "
                        "back to the layer's shape follows within the activation"))
            return Activation(expr, order, [ix.keys[i] for i in order], t, rej)
    raise AssertionError("unreachable: the empty activation is always closed")  # pragma: no cover


def _ancestors(ix: GraphIndex, t: str, value: str, region: set[int]) -> set[int]:
    anc: set[int] = set()
    stack = [t]
    while stack:
        name = stack.pop()
        if name == value:
            continue
        p = ix.producer.get(name)
        if p is None or p not in region or p in anc:
            continue
        anc.add(p)
        stack.extend(n for n in ix.node(p).input if n)
    return anc


def _closed(ix: GraphIndex, t: str, value: str, anc: set[int], shape_nodes: set[int], strict: bool) -> bool:
    """Whether the tensors of `anc` other than t are read only by `anc` and by Shape nodes (which read
    no values) among `shape_nodes` or, unless `strict`, computing other Reshapes' shapes, and are not
    graph outputs."""
    if not anc:
        return t == value
    if value not in {n for i in anc for n in ix.node(i).input}:
        return False
    tensors = {value} | {o for i in anc for o in ix.node(i).output if o}
    for u in tensors - {t}:
        if u in ix.graph_outputs:
            return False
        for j in ix.users(u):
            if j not in anc and not ((j in shape_nodes and ix.node(j).op_type == "Shape")
                                     or (not strict and shape_reader(ix, j))):
                return False
    return True


def _region_node(ctx: _Ctx, i: int, value: str, layout: dict[str, bool]) -> tuple[Expr, bool]:
    """Node i's expression (node_expr, or a Reshape that regroups the rows) and whether its output has
    the layer output's shape; raise ActivationRefusal where it cannot join the activation, or where it
    combines the value in two shapes."""
    ix, node = ctx.ix, ctx.ix.node(i)
    what = ix.describe(i)
    if (node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and len(node.input) > 1
            and node.input[0] in layout and node.input[1] not in layout):   # (a shape from the values: no)
        src = node.input[0]
        if layout[src] and _keeps_rank2_shape(ctx, node):
            return ctx.operand(src, what), True
        return ctx.operand(src, what), _regrouped_shape(ctx, node, value, what, layout[src])
    e = node_expr(ctx, i)
    shapes = {layout[n] for n in node.input if n in layout}
    if len(shapes) > 1:
        raise ActivationRefusal(f"{what}: combines the value with a reshaped copy of it")
    return e, shapes.pop() if shapes else True


def _regrouped_shape(ctx: _Ctx, node: onnx.NodeProto, value: str, what: str, from_own: bool) -> bool:
    """For a Reshape of the value whose (inferred) output keeps the layer's N features as its last
    dimension: the same elements in the same order, so an elementwise map of it is one of the value;
    whether the output has the value's own shape: every dimension known and equal, or, for a rank-2
    value, rank 2 from a regrouped copy (`from_own` false: it has the value's M x N elements, so
    [M, N]). Raise for any other Reshape."""
    if not ends_in(ctx.ix, node.output[0], ctx.width):
        raise ActivationRefusal(f"{what}: {unsupported(node)}")
    out, own = ctx.ix.shapes[node.output[0]], ctx.ix.shapes.get(value)
    if own is None or len(own) != len(out):
        return False
    return (len(out) == 2 and not from_own) or (all(d not in (None, "") for d in out) and out == own)


def describe_expr(e: Expr) -> str:
    """Short name when known (per-channel forms: `prelu[64]`; a last layer's activation masked off a riding
    head's columns, head_fold.last_activation: `sigmoid[3 of 4]`), else the full text."""
    if (isinstance(e, ex.Op) and e.name == "select" and isinstance(e.args[0], ex.Chan)
            and set(e.args[0].values) <= {0.0, 1.0} and not ex.chan_leaves(e.args[1]) and not ex.chan_leaves(e.args[2])):
        mask, n = e.args[0].values, len(e.args[0].values)
        own = f"{describe_expr(e.args[1])}[{int(sum(mask))} of {n}]"
        return own if e.args[2] == ex.X else f"{own}, {describe_expr(e.args[2])}[{n - int(sum(mask))} of {n}]"
    leaves = ex.chan_leaves(e)
    if leaves and ex.short_name(e) in ex.PER_CHANNEL_NAMED.values():
        return f"{ex.short_name(e)}[{leaves[0].width}]"
    return ex.NAMED.get(e) or ex.to_text(e)


__all__ = ["Activation", "ActivationRefusal", "match_activation", "node_expr", "normalise", "subst", "attr_activation",
           "ORT_ACTIVATIONS",
           "ELEMENTWISE_OPS", "NOT_PER_CHANNEL", "describe_expr"]
