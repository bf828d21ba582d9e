"""Canonicalise linear layers into one form, `y = x @ W + b` with W float32 [K, N] and b float32 [N].

    Gemm(x, B, C; alpha, beta, transB)  ->  W = alpha * (B^T if transB else B),   b = beta * C
    MatMul(x, W)                          ->  W,                                  b = None
    Add(MatMul(x, W), c) / Add(c, MatMul(x, W))  ->  W,                           b = broadcast(c, [N])

ONNX Runtime's own linear ops (domain com.microsoft, in models saved by its graph optimiser) too:

    FusedGemm(x, B, C; Gemm's attributes, activation, activation_alpha/beta/gamma)
                                          ->  as Gemm, and `activation` f: the layer's output is f(x W + b)
    FusedMatMul(x, W; alpha, transB)      ->  W = alpha * (W^T if transB), then as MatMul (a bias Add too)

and an Einsum that is a matrix product of its first input with a constant matrix (torch.einsum as both
exporters keep it):

    Einsum(x, W; "bk,kn->bn")             ->  W            ("...k,kn->...n", "bsk,kn->bsn", implicit output)
    Einsum(x, W; "bk,nk->bn")             ->  W^T          (then a bias Add, as for MatMul)

where B, W, c are constants (initializers or folded constant producers) and C / c are [N], [1, N] or
scalars. Gemm is 2-D only (transA=1 is refused); MatMul takes inputs of any rank >= 2 (the fused op
flattens the leading dimensions). Weights of type float16 / bfloat16 / float32 become float32.
Anything else raises `LinearRefusal` with a one-line reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import expr as ex
from .activations import attr_activation, scalar_gain
from .constants import ORT_DOMAIN, GraphIndex

LINEAR_OPS = ("Gemm", "MatMul")
ORT_LINEAR_OPS = ("FusedGemm", "FusedMatMul")
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
    activation: ex.Expr | None = None   # FusedGemm's own activation: output = f(x @ W + b)
    low_rank: list[int] = field(default_factory=list, repr=False)   # a LoRA branch's nodes (fold_low_rank)

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


def is_linear_node(node) -> bool:
    """A Gemm or MatMul (or a two-input Einsum, which may be one), or ONNX Runtime's FusedGemm or FusedMatMul."""
    return ((node.domain in ("", "ai.onnx")
             and (node.op_type in LINEAR_OPS or (node.op_type == "Einsum" and len(node.input) == 2)))
            or (node.domain == ORT_DOMAIN and node.op_type in ORT_LINEAR_OPS))


def _einsum_terms(equation: str) -> tuple[str, str, str] | None:
    """(x's term, W's term, the output's) of a two-operand einsum equation, '...' as one character '.';
    the implicit output (no '->') is the letters that appear once, in alphabetical order."""
    eq = equation.replace(" ", "").replace("...", ".")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    if not arrow:
        letters = "".join(terms)
        out = ("." if "." in letters else "") + "".join(sorted(c for c in set(letters) if c != "."
                                                               and letters.count(c) == 1))
    return terms[0], terms[1], out


def einsum_weight_transposed(equation: str) -> bool | None:
    """Whether a two-operand einsum is x @ W (False) or x @ W^T (True) for x [..., K] and a 2-D W, with
    x's leading axes kept in order; None when it is not such a product."""
    terms = _einsum_terms(equation)
    if terms is None:
        return None
    xt, wt, out = terms
    if len(wt) != 2 or not xt or len(set(xt)) != len(xt) or "." in wt or "." in xt[1:]:
        return None
    lead, k = xt[:-1], xt[-1]
    if k == "." or k not in wt:
        return None
    n = wt[1] if wt[0] == k else wt[0]
    if n == k or n in lead or out != lead + n:
        return None
    return wt[0] != k


def match_linear(ix: GraphIndex, i: int, low_rank: bool = True) -> LinearLayer:
    """The linear layer starting at node i (a Gemm or MatMul, or ORT's FusedGemm or FusedMatMul), or
    raise LinearRefusal. `low_rank`: take in a LoRA branch added to its output (fold_low_rank)."""
    node = ix.node(i)
    what = ix.describe(i)
    if not is_linear_node(node):
        raise LinearRefusal(f"{what}: not a Gemm or MatMul")
    try:
        if node.op_type in ("Gemm", "FusedGemm"):
            layer = _match_gemm(ix, i, what)
        else:
            layer = _match_matmul(ix, i, what)
    except LinearRefusal as r:
        if str(r).startswith(what):
            raise
        raise LinearRefusal(f"{what}: {r}") from None
    return fold_low_rank(ix, layer) if low_rank and layer.activation is None else layer


def _plain_linear_to(ix: GraphIndex, t: str) -> LinearLayer | None:
    """The linear layer (no LoRA branch, no activation of its own) whose output is t, or None."""
    p = ix.producer.get(t)
    if p is None:
        return None
    cands = [p]
    n = ix.node(p)
    if n.op_type == "Add" and n.domain in ("", "ai.onnx"):   # a bias Add: the linear node feeds it
        cands = [ix.producer[x] for x in n.input if x in ix.producer]
    for j in cands:
        if is_linear_node(ix.node(j)):
            try:
                lin = match_linear(ix, j, low_rank=False)
            except LinearRefusal:
                continue
            if lin.output == t and lin.activation is None:
                return lin
    return None


def fold_low_rank(ix: GraphIndex, layer: LinearLayer) -> LinearLayer:
    """A LoRA adapter left unmerged (peft's Linear: base(x) + lora_B(lora_A(dropout(x))) * scaling, as both
    torch exporters write it in eval mode): where the layer's output only feeds an Add of
    s * L_B(L_A(x)), with L_A and L_B linear layers on constants with no activation between them, each
    tensor read once, and s a scalar constant (or none), the layer becomes x @ (W + s A B) + (b + s (a B + c))
    and takes those nodes; else it is returned as it is. Its input x is then read by two nodes (the layer's
    and L_A's: `low_rank` holds L_A's first)."""
    users = ix.users(layer.output)
    if layer.output in ix.graph_outputs or len(users) != 1:
        return layer
    add = ix.node(users[0])
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return layer
    t = add.input[1] if add.input[0] == layer.output else add.input[0]
    if t == layer.output or ix.const(t) is not None or len(ix.users(t)) != 1 or t in ix.graph_outputs:
        return layer
    scale, nodes = 1.0, []
    p = ix.producer.get(t)
    if p is not None and ix.node(p).op_type in ("Mul", "Div") and ix.node(p).domain in ("", "ai.onnx"):
        gain = scalar_gain(ix, p, layer.out_features)
        if gain is None:
            return layer
        t, scale = gain
        nodes.append(p)
        if len(ix.users(t)) != 1 or t in ix.graph_outputs:
            return layer
    second = _plain_linear_to(ix, t)
    if second is None or len(ix.users(second.input)) != 1 or second.input in ix.graph_outputs:
        return layer
    first = _plain_linear_to(ix, second.input)
    if first is None or first.input != layer.input or first.weight.shape[1] != second.weight.shape[0]:
        return layer
    ab = first.weight.astype(np.float64) @ second.weight.astype(np.float64)
    if ab.shape != layer.weight.shape:
        return layer
    shift = (0.0 if first.bias is None else first.bias.astype(np.float64) @ second.weight.astype(np.float64)) \
        + (0.0 if second.bias is None else second.bias.astype(np.float64))
    weight = (layer.weight.astype(np.float64) + scale * ab).astype(np.float32)
    bias = None
    if layer.bias is not None or first.bias is not None or second.bias is not None:
        base = 0.0 if layer.bias is None else layer.bias.astype(np.float64)
        bias = np.broadcast_to(base + scale * np.asarray(shift), (weight.shape[1],)).astype(np.float32)
    branch = first.node_indices + second.node_indices + nodes + [users[0]]
    return LinearLayer(weight, bias, layer.nodes + [ix.keys[j] for j in branch], layer.input, add.output[0],
                       layer.op, layer.node_indices + branch, None, [min(first.node_indices)] + branch)


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
            # a whole [rows, N] tensor as C: ORT's optimiser folds a residual Add into the Gemm before it
            # (MatMulAddFusion); the model as exported keeps the Add, which a chain takes as its residual
            hint = (" (a tensor added to every row, such as a residual Add that ONNX Runtime's optimiser "
                    "folded into the Gemm: convert the model as exported)") if ix.rank(c_name) == 2 else ""
            raise LinearRefusal(f"{what}: bias '{c_name}' is not a constant{hint}")
        c = _as_f32(c, "bias", c_name)
        vec = _bias_vector(c, n, 2)
        if vec is None:
            raise LinearRefusal(f"{what}: bias '{c_name}' of shape {_shape(c)} does not broadcast to [{n}]")
        if beta != 0.0:
            bias = (vec * np.float32(beta)).astype(np.float32) if beta != 1.0 else vec
    r = ix.rank(a)
    if r is not None and r != 2:
        raise LinearRefusal(f"{what}: input '{a}' has rank {r}; Gemm takes 2-D input")
    return LinearLayer(w, bias, [ix.keys[i]], a, node.output[0], node.op_type, [i], _fused_activation(ix, i, what))


def _fused_activation(ix: GraphIndex, i: int, what: str) -> ex.Expr | None:
    """FusedGemm's `activation` (an ONNX op name, its attributes prefixed `activation_`), else None."""
    if ix.node(i).op_type != "FusedGemm":
        return None
    name = ix.attr(i, "activation", b"")
    name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
    if not name:
        return None
    f = attr_activation(name, lambda a, default: ix.attr(i, "activation_" + a, default))
    if f is None:
        raise LinearRefusal(f"{what}: its activation '{name}' is not one onnx2fused knows")
    return f


def _match_matmul(ix: GraphIndex, i: int, what: str) -> LinearLayer:
    node = ix.node(i)
    a, b = node.input[0], node.input[1]
    transposed = False
    if node.op_type == "Einsum":
        equation = ix.attr(i, "equation", b"")
        equation = equation.decode("utf-8", "replace") if isinstance(equation, bytes) else str(equation)
        transposed = einsum_weight_transposed(equation)
        if transposed is None:
            raise LinearRefusal(f"{what}: equation '{equation}' is not a product x @ W of its first input "
                                "with a matrix")
    if ix.const(b) is None and ix.const(a) is not None:
        raise LinearRefusal(f"{what}: the constant '{a}' is the left operand (c @ x is not a linear layer on x)")
    w = _weight(ix, b, what)
    if w.ndim != 2:
        raise LinearRefusal(f"{what}: weight '{b}' has shape {_shape(w)}, not 2-D")
    w = _as_f32(w, "weight", b)
    if transposed:
        w = np.ascontiguousarray(w.T)
    if node.op_type == "FusedMatMul":
        for t in ("transA", "transBatchA", "transBatchB"):
            if ix.attr(i, t, 0):
                raise LinearRefusal(f"{what}: {t}=1 (a transposed input) is not supported")
        if ix.attr(i, "transB", 0):
            w = np.ascontiguousarray(w.T)
        alpha = float(ix.attr(i, "alpha", 1.0))
        if alpha != 1.0:
            w = np.ascontiguousarray(w * np.float32(alpha))
    r = ix.rank(a)
    if r is not None and r < 2:
        raise LinearRefusal(f"{what}: input '{a}' has rank {r}; a linear layer needs rank >= 2")
    n = w.shape[1]
    out = node.output[0]
    layer = LinearLayer(w, None, [ix.keys[i]], a, out, node.op_type, [i])
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
    return LinearLayer(w, vec, [ix.keys[i], ix.keys[j]], a, add.output[0], node.op_type, [i, j])
