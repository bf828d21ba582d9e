"""Canonicalise linear layers into one form, `y = x @ W + b` with W float32 [K, N] and b float32 [N].

    Gemm(x, B, C; alpha, beta, transB)  ->  W = alpha * (B^T if transB else B),   b = beta * C
    MatMul(x, W)                          ->  W,                                  b = None
    Add(MatMul(x, W), c) / Add(c, MatMul(x, W))  ->  W,                           b = broadcast(c, [N])

where B, W, c are constants (initializers or folded constant producers) and C / c are [N], [1, N] or
scalars. Gemm is 2-D only (transA=1 is refused); MatMul takes inputs of any rank >= 2 (the fused op
flattens the leading dimensions). Weights of type float16 / bfloat16 / float32 become float32.
Anything else raises `LinearRefusal` with a one-line reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .constants import GraphIndex

LINEAR_OPS = ("Gemm", "MatMul")
_WEIGHT_DTYPES = (np.float32, np.float16)


class LinearRefusal(Exception):
    """A Gemm/MatMul that cannot be a fused linear layer; the message is the one-line reason."""


@dataclass
class LinearLayer:
    weight: np.ndarray            # float32 [K, N]: y = x @ W
    bias: np.ndarray | None       # float32 [N] or None
    nodes: list[str]              # node keys consumed (the MatMul/Gemm, then the bias Add if any)
    input: str
    output: str
    op: str = "MatMul"            # source op type, for messages
    node_indices: list[int] = field(default_factory=list, repr=False)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def has_bias(self) -> bool:
        return self.bias is not None


def _as_f32(arr: np.ndarray, what: str, name: str) -> np.ndarray:
    dt = str(arr.dtype)
    if arr.dtype in _WEIGHT_DTYPES or dt == "bfloat16":
        return np.ascontiguousarray(arr.astype(np.float32))
    raise LinearRefusal(f"{what} '{name}' has element type {dt}; only float16/bfloat16/float32 are fused")


def _shape(a: np.ndarray) -> str:
    return "[" + ", ".join(map(str, a.shape)) + "]"


def _bias_vector(c: np.ndarray, n: int, max_rank: int | None) -> np.ndarray | None:
    """c as a float32 [n] vector when it broadcasts over rows exactly like a per-column bias, else None."""
    if c.size == 1:
        if max_rank is not None and c.ndim > max_rank:
            return None
        return np.full((n,), c.reshape(()), dtype=np.float32)
    if c.ndim == 0 or c.shape[-1] != n or any(d != 1 for d in c.shape[:-1]):
        return None
    if max_rank is not None and c.ndim > max_rank:
        return None
    return c.reshape(n).astype(np.float32)


def match_linear(ix: GraphIndex, i: int) -> LinearLayer:
    """The linear layer starting at node i (a Gemm or MatMul), or raise LinearRefusal."""
    node = ix.node(i)
    what = ix.describe(i)
    if node.domain not in ("", "ai.onnx") or node.op_type not in LINEAR_OPS:
        raise LinearRefusal(f"{what}: not a Gemm or MatMul")
    try:
        if node.op_type == "Gemm":
            return _match_gemm(ix, i, what)
        return _match_matmul(ix, i, what)
    except LinearRefusal as r:
        if str(r).startswith(what):
            raise
        raise LinearRefusal(f"{what}: {r}") from None


def _weight(ix: GraphIndex, name: str, what: str) -> np.ndarray:
    w = ix.const(name)
    if w is None:
        why = ix.not_const.get(name)
        raise LinearRefusal(f"{what}: weight '{name}' is not a constant" + (f" ({why})" if why else ""))
    return w


def _match_gemm(ix: GraphIndex, i: int, what: str) -> LinearLayer:
    node = ix.node(i)
    alpha = float(ix.attr(i, "alpha", 1.0))
    beta = float(ix.attr(i, "beta", 1.0))
    if ix.attr(i, "transA", 0):
        raise LinearRefusal(f"{what}: transA=1 (transposed input) is not supported")
    a, b = node.input[0], node.input[1]
    if ix.const(a) is not None and ix.const(b) is None:
        raise LinearRefusal(f"{what}: the input '{a}' is the constant and the weight '{b}' is not")
    w = _weight(ix, b, what)
    if w.ndim != 2:
        raise LinearRefusal(f"{what}: weight '{b}' has shape {_shape(w)}, not 2-D")
    w = _as_f32(w, "weight", b)
    if ix.attr(i, "transB", 0):
        w = w.T
    w = np.ascontiguousarray(w * np.float32(alpha)) if alpha != 1.0 else np.ascontiguousarray(w)
    n = w.shape[1]
    bias = None
    c_name = node.input[2] if len(node.input) > 2 else ""
    if c_name:
        c = ix.const(c_name)
        if c is None:
            raise LinearRefusal(f"{what}: bias '{c_name}' is not a constant")
        c = _as_f32(c, "bias", c_name)
        vec = _bias_vector(c, n, 2)
        if vec is None:
            raise LinearRefusal(f"{what}: bias '{c_name}' of shape {_shape(c)} does not broadcast to [{n}]")
        if beta != 0.0:
            bias = (vec * np.float32(beta)).astype(np.float32) if beta != 1.0 else vec
    r = ix.rank(a)
    if r is not None and r != 2:
        raise LinearRefusal(f"{what}: input '{a}' has rank {r}; Gemm takes 2-D input")
    return LinearLayer(w, bias, [ix.keys[i]], a, node.output[0], "Gemm", [i])


def _match_matmul(ix: GraphIndex, i: int, what: str) -> LinearLayer:
    node = ix.node(i)
    a, b = node.input[0], node.input[1]
    if ix.const(b) is None and ix.const(a) is not None:
        raise LinearRefusal(f"{what}: the constant '{a}' is the left operand (c @ x is not a linear layer on x)")
    w = _weight(ix, b, what)
    if w.ndim != 2:
        raise LinearRefusal(f"{what}: weight '{b}' has shape {_shape(w)}, not 2-D")
    w = _as_f32(w, "weight", b)
    r = ix.rank(a)
    if r is not None and r < 2:
        raise LinearRefusal(f"{what}: input '{a}' has rank {r}; a linear layer needs rank >= 2")
    n = w.shape[1]
    out = node.output[0]
    layer = LinearLayer(w, None, [ix.keys[i]], a, out, "MatMul", [i])
    users = ix.users(out)
    if out in ix.graph_outputs or len(users) != 1:
        return layer
    j = users[0]
    add = ix.node(j)
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return layer
    other = add.input[1] if add.input[0] == out else add.input[0]
    if other == out:
        return layer
    c = ix.const(other)
    if c is None:
        return layer
    try:
        c = _as_f32(c, "bias", other)
    except LinearRefusal:
        return layer
    out_rank = r if r is not None else 2
    vec = _bias_vector(c, n, out_rank)
    if vec is None:
        return layer
    return LinearLayer(w, vec, [ix.keys[i], ix.keys[j]], a, add.output[0], "MatMul", [i, j])
