"""Transformer FFN blocks: a normalisation in front of a chain and a residual Add behind it.

    y = Add(x, L_n(... L_1(norm(x))))   ->   one fused op (MLPSpec.norm, MLPSpec.residual)

where norm normalises the last (feature) axis of x, K0 wide, and is one of

    LayerNormalization(x, scale[, bias]; axis=-1, epsilon)     both torch exporters' nn.LayerNorm (opset 17+)
    RMSNormalization(x, scale; axis=-1, epsilon)               opset 23
    SimplifiedLayerNormalization(x, scale; axis=-1, epsilon)   ONNX Runtime's RMSNorm
    [Add(., beta)] of [Mul(., gamma)] of Div(d, s) or Mul(d, r),  LayerNorm as both torch exporters write it
        d = Sub(x, ReduceMean(x; axes=[-1])), s as below of d    below opset 17 (nn.LayerNorm)
    [Mul(., w)] of Mul(x, r) or Div(x, s)                      a hand-written (LLaMA) RMSNorm:
        s = Sqrt(Add(ReduceMean(Pow(x, 2) | Mul(x, x); axes=[-1]), eps)),
        r = Reciprocal(s) (dynamo exporter) | Div(1, s) (legacy exporter),  w a constant [K0] (optional),
        with a Cast to the same type allowed between the scaling and Mul(., w) (HF LLaMA / Qwen2 / Mistral)
        or after Mul(., w) (Gemma); in a float16 / bfloat16 model that Cast rounds the float32 norm of
        x' = Cast(x, to=float) back to x's type, and x' and its Cast go with the norm (which reads x)

and the residual Add reads the last layer's output and the block's input (x; without a norm, the first
layer's input), in either order, of the same shape. Either may come without the other.

`find_block` returns what a chain takes in, and a one-line reason for each near miss: a norm of another
axis, a normalised tensor (or a norm's intermediate) that other nodes read too, non-constant parameters,
a residual that adds another tensor or has another width. A norm or residual Add that a library with
CUDA kernels cannot fuse for this chain (`refused`, library.block_refusal: its layers run in the wide
design, or no fused kernel plans it) stays a stock op, with that reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..spec import NORM_KINDS
from .casts import NARROW, rounding_cast, same_type_cast, upcast_source
from .constants import GraphIndex
from .regroup import shape_reader

NORM_OPS = {"LayerNormalization": "layernorm", "RMSNormalization": "rmsnorm",
            "SimplifiedLayerNormalization": "rmsnorm"}
DEFAULT_EPS = 1e-5  # the ONNX default of each norm op's epsilon attribute


class BlockRefusal(Exception):
    """A norm or residual Add that looks like part of a transformer block and cannot be fused; the
    message is the reason. `norm_input`, `label`: the tensor a refused norm reads and its kind, so that
    a residual Add of that tensor can say why it is not the chain's either."""

    def __init__(self, reason: str, norm_input: str = "", label: str = ""):
        super().__init__(reason)
        self.norm_input, self.label = norm_input, label


@dataclass
class NormMatch:
    kind: str                    # "layernorm" or "rmsnorm" (spec.NORM_KINDS)
    eps: float
    scale: np.ndarray            # float32 [K0]
    bias: np.ndarray | None      # float32 [K0] (layernorm only) or None
    input: str                   # x, the tensor normalised
    output: str                  # what the first layer reads
    node_indices: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return NORM_KINDS[self.kind][1]


@dataclass
class Block:
    """What a chain takes in around its layers, and why it takes no more."""
    norm: NormMatch | None = None
    residual: int | None = None  # the Add node
    output: str = ""             # the Add's output ('' without a residual)
    start_reason: str = ""       # why the norm in front is not taken ('' = none or taken)
    end_reason: str = ""         # why the Add behind is not taken ('' = none, or not residual-shaped)



def _vector(ix: GraphIndex, name: str, width: int, what: str, node: int) -> np.ndarray:
    """A norm parameter as float32 [width]: a constant of `width` elements (any leading 1s) or one."""
    c = ix.const(name)
    if c is None:
        raise BlockRefusal(f"{ix.describe(node)}: its {what} '{name}' is not a constant")
    if c.dtype.kind != "f" and str(c.dtype) != "bfloat16":
        raise BlockRefusal(f"{ix.describe(node)}: its {what} '{name}' has element type {c.dtype}")
    if c.size == 1:
        return np.full(width, c.reshape(()), np.float32)
    if c.size != width or c.shape[-1] != width:
        raise BlockRefusal(f"{ix.describe(node)}: its {what} '{name}' has shape {list(c.shape)}, not [{width}]")
    return np.ascontiguousarray(c.reshape(width).astype(np.float32))


def _only_into(ix: GraphIndex, t: str, user: int) -> None:
    """A norm's intermediate value must feed only the next node of the norm."""
    others = [u for u in ix.users(t) if u != user]
    if t in ix.graph_outputs:
        raise BlockRefusal(f"the RMS norm's intermediate '{t}' is also a graph output")
    if others:
        raise BlockRefusal(f"the RMS norm's intermediate '{t}' also feeds {ix.describe(others[0])}")


# -- the norm in front --------------------------------------------------------------------------------

def _norm_op(ix: GraphIndex, p: int, width: int) -> NormMatch:
    try:
        return _norm_op_checked(ix, p, width)
    except BlockRefusal as r:
        kind = NORM_OPS[ix.node(p).op_type]
        raise BlockRefusal(str(r), ix.node(p).input[0], NORM_KINDS[kind][1]) from None


def _norm_op_checked(ix: GraphIndex, p: int, width: int) -> NormMatch:
    n = ix.node(p)
    kind = NORM_OPS[n.op_type]
    x = n.input[0]
    axis = int(ix.attr(p, "axis", -1))
    if not ix.last_axis(x, axis):
        raise BlockRefusal(f"{ix.describe(p)} normalises from axis {axis}, not the last (feature) axis alone")
    for o in n.output[1:]:
        if o and (ix.users(o) or o in ix.graph_outputs):
            raise BlockRefusal(f"{ix.describe(p)} also gives its statistics '{o}', which other nodes read")
    if len(n.input) < 2 or not n.input[1]:
        raise BlockRefusal(f"{ix.describe(p)} has no scale input")
    scale = _vector(ix, n.input[1], width, "scale", p)
    bias = None
    if kind == "layernorm" and len(n.input) > 2 and n.input[2]:
        bias = _vector(ix, n.input[2], width, "bias", p)
    eps = float(np.float32(ix.attr(p, "epsilon", DEFAULT_EPS)))
    return NormMatch(kind, eps, scale, bias, x, n.output[0], [p])


def _producer(ix: GraphIndex, t: str, ops: tuple[str, ...]) -> int | None:
    p = ix.producer.get(t)
    if p is None:
        return None
    n = ix.node(p)
    return p if n.op_type in ops and n.domain in ("", "ai.onnx") else None


def _inv_sqrt(ix: GraphIndex, t: str) -> tuple[int, list[int]] | None:
    """t = 1 / s with s = Sqrt(.): (the Sqrt, the nodes [Reciprocal or Div]) or None."""
    p = _producer(ix, t, ("Reciprocal", "Div"))
    if p is None:
        return None
    n = ix.node(p)
    if n.op_type == "Div":
        one = ix.const(n.input[0])
        if one is None or one.size != 1 or float(one.reshape(())) != 1.0:
            return None
    s = _producer(ix, n.input[-1], ("Sqrt",))
    return None if s is None else (s, [p])


def _rms_scaling(ix: GraphIndex, i: int) -> tuple[str, int, list[int]] | None:
    """Node i as x * (1 / s) or x / s with s a Sqrt: (x, the Sqrt, the nodes) or None."""
    n = ix.node(i)
    if n.domain not in ("", "ai.onnx") or len(n.input) != 2:
        return None
    if n.op_type == "Div":
        s = _producer(ix, n.input[1], ("Sqrt",))
        return None if s is None else (n.input[0], s, [i])
    if n.op_type != "Mul":
        return None
    for k in (0, 1):
        inv = _inv_sqrt(ix, n.input[1 - k])
        if inv is not None:
            return n.input[k], inv[0], [i] + inv[1]
    return None


def _check_row_mean(ix: GraphIndex, mean: int) -> None:
    """A ReduceMean of a norm must average the last axis alone and keep it (to broadcast over the row)."""
    m = ix.node(mean)
    axes = ix.attr(mean, "axes")
    if axes is None and len(m.input) > 1 and m.input[1]:
        c = ix.const(m.input[1])
        axes = None if c is None else [int(v) for v in np.asarray(c).reshape(-1)]
    if axes is None or len(axes) != 1 or not ix.last_axis(m.input[0], int(axes[0])):
        raise BlockRefusal(f"{ix.describe(mean)} averages over axes {axes if axes is not None else 'all'}, "
                           "not the last (feature) axis alone")
    if not ix.attr(mean, "keepdims", 1):
        raise BlockRefusal(f"{ix.describe(mean)} has keepdims=0: its mean does not broadcast over the row")


def _const_operand(ix: GraphIndex, i: int) -> tuple[str, str] | None:
    """(the non-constant operand, the constant one) of binary node i with exactly one constant operand."""
    n = ix.node(i)
    if len(n.input) != 2:
        return None
    consts = [ix.const(t) is not None for t in n.input]
    if consts.count(True) != 1:
        return None
    k = consts.index(True)
    return n.input[1 - k], n.input[k]


def _decomposed_layernorm(ix: GraphIndex, p: int, width: int) -> NormMatch | None:
    """The LayerNorm that both torch exporters write below opset 17, ending at node p, or None:
    [Add(., beta)] of [Mul(., gamma)] of d / s (or d * (1 / s)), d = Sub(x, ReduceMean(x)) and
    s = Sqrt(ReduceMean(Pow(d, 2) | Mul(d, d)) + eps): the RMS norm of the deviations d."""
    q, ends, gamma, beta = p, [], None, None
    for op in ("Add", "Mul"):   # beta, then gamma, each optional
        n = ix.node(q)
        split = _const_operand(ix, q) if n.op_type == op and n.domain in ("", "ai.onnx") else None
        if split is None:
            continue
        inner = _producer(ix, split[0], ("Mul", "Div") if op == "Mul" else ("Add", "Mul", "Div"))
        if inner is None:
            return None
        ends.append(q)
        beta, gamma = (split[1], gamma) if op == "Add" else (beta, split[1])
        q = inner
    scaling = _rms_scaling(ix, q)
    if scaling is None:
        return None
    d, _, scale_nodes = scaling
    sub = _producer(ix, d, ("Sub",))
    mean = None if sub is None else _producer(ix, ix.node(sub).input[1], ("ReduceMean",))
    x = None if sub is None else ix.node(sub).input[0]
    if mean is None or ix.node(mean).input[0] != x:
        return None
    try:   # from here on it is a layer norm: every refusal says why it is not one we fuse
        rms = _rms_of(ix, q, width, None, scaling)
        if rms is None:
            return None
        _check_row_mean(ix, mean)
        _only_into(ix, ix.node(mean).output[0], sub)
        square = min(rms.node_indices)   # Pow(d, 2) or Mul(d, d), the first of the variance's nodes
        others = [u for u in ix.users(d) if u not in (square, scale_nodes[0])]
        if d in ix.graph_outputs or others:
            raise BlockRefusal(f"the layer norm's deviations '{d}' also feed "
                               f"{ix.describe(others[0]) if others else 'the graph outputs'}")
        for a, b in zip([scale_nodes[0]] + ends[::-1], ends[::-1]):
            _only_into(ix, ix.node(a).output[0], b)
        scale = np.ones(width, np.float32) if gamma is None else _vector(ix, gamma, width, "weight", p)
        bias = None if beta is None else _vector(ix, beta, width, "bias", p)
    except BlockRefusal as r:
        raise BlockRefusal(str(r), x, NORM_KINDS["layernorm"][1]) from None
    return NormMatch("layernorm", rms.eps, scale, bias, x, ix.node(p).output[0],
                     sorted(rms.node_indices + [mean, sub] + ends))


def _norm_cast(ix: GraphIndex, t: str) -> int | None:
    """The Cast producing t that an RMS norm may hold (HF's LLaMA-family code, `h.to(input_dtype)`): a copy
    to t's own type (a float32 TorchScript export keeps them), or a rounding of float32 to 16 bits."""
    cast = same_type_cast(ix, t)
    return cast if cast is not None else rounding_cast(ix, t)


def _decomposed_rms(ix: GraphIndex, p: int, width: int, trailing: int | None = None) -> NormMatch | None:
    """The hand-written RMSNorm ending at node p (see the module docstring), or None when p is not one.
    `trailing`: a same-type or rounding Cast of p's output that ends the norm (Gemma's `.type_as(x)`)."""
    n = ix.node(p)
    weight, scaling, cast = None, _rms_scaling(ix, p), None
    split = _const_operand(ix, p) if scaling is None and n.op_type == "Mul" else None
    scaled = None if split is None else split[0]
    if scaled is not None and (cast := _norm_cast(ix, scaled)) is not None:
        scaled = ix.node(cast).input[0]
    q = None if scaled is None else _producer(ix, scaled, ("Mul", "Div"))
    if q is not None and (s := _rms_scaling(ix, q)) is not None:
        weight, scaling = split[1], s
    if scaling is None or (trailing is not None and cast is not None and weight is not None):
        return None
    try:
        if trailing is not None:
            return _rms_of(ix, p, width, weight, scaling, trailing, trailing=True)
        return _rms_of(ix, p, width, weight, scaling, cast if weight is not None else None)
    except BlockRefusal as r:
        raise BlockRefusal(str(r), scaling[0], NORM_KINDS["rmsnorm"][1]) from None


def _rms_of(ix: GraphIndex, p: int, width: int, weight: str | None, scaling, cast: int | None = None,
            trailing: bool = False) -> NormMatch | None:
    """`cast`: a same-type Cast between the scaling and the weight's Mul (p), or (`trailing`) after p, which
    goes with the norm; or one rounding the float32 value to 16 bits, which needs x to be a float32 copy of a
    16-bit tensor (that tensor and the Cast making the copy go with the norm too)."""
    n = ix.node(p)
    x, sqrt, nodes = scaling
    upcast = None
    if cast is not None and ix.types.get(ix.node(cast).output[0]) in NARROW:
        narrow = ix.types[ix.node(cast).output[0]]
        upcast = upcast_source(ix, x, narrow)
        if upcast is None:
            return None
    add = _producer(ix, ix.node(sqrt).input[0], ("Add",))
    if add is None:
        return None
    a = ix.node(add)
    mean = next((m for m in (_producer(ix, t, ("ReduceMean",)) for t in a.input) if m is not None), None)
    if mean is None:
        return None
    # From here on it is an RMS norm: every refusal says why it is not one we fuse.
    eps_name = next(t for t in a.input if t != ix.node(mean).output[0])
    eps = ix.const(eps_name)
    if eps is None or eps.size != 1:
        raise BlockRefusal(f"the RMS norm's epsilon '{eps_name}' ({ix.describe(add)}) is not a scalar constant")
    m = ix.node(mean)
    _check_row_mean(ix, mean)
    sq = _producer(ix, m.input[0], ("Pow", "Mul"))
    if sq is None:
        raise BlockRefusal(f"{ix.describe(mean)} averages '{m.input[0]}', not the square of '{x}'")
    q = ix.node(sq)
    if q.op_type == "Pow":
        e = ix.const(q.input[1])
        if q.input[0] != x or e is None or e.size != 1 or float(e.reshape(())) != 2.0:
            raise BlockRefusal(f"{ix.describe(sq)} is not the square of '{x}' that the norm scales")
    elif list(q.input) != [x, x]:
        raise BlockRefusal(f"{ix.describe(sq)} is not the square of '{x}' that the norm scales")
    chain = [sq, mean, add, sqrt] + nodes[::-1]  # producer before user
    for a_, b_ in zip(chain, chain[1:]):
        _only_into(ix, ix.node(a_).output[0], b_)
    if upcast is not None:
        others = [u for u in ix.users(x) if u not in (sq, nodes[0])]
        if x in ix.graph_outputs or others:
            raise BlockRefusal(f"the RMS norm's float32 copy '{x}' also feeds "
                               f"{ix.describe(others[0]) if others else 'the graph outputs'}")
        chain.insert(0, upcast[0])
        x = upcast[1]
    if weight is not None:
        if cast is not None and not trailing:
            _only_into(ix, ix.node(nodes[0]).output[0], cast)
            chain.append(cast)
        _only_into(ix, ix.node(chain[-1]).output[0], p)
        scale = _vector(ix, weight, width, "weight", p)
        chain.append(p)
    else:
        scale = np.ones(width, np.float32)
    out = n.output[0]
    if trailing:
        _only_into(ix, out, cast)
        chain.append(cast)
        out = ix.node(cast).output[0]
    return NormMatch("rmsnorm", float(np.float32(eps.reshape(()))), scale, None, x, out, sorted(chain))


def match_norm(ix: GraphIndex, t: str, width: int) -> NormMatch | None:
    """The normalisation producing t (the first layer's input, `width` features), None when t is not a
    norm's output; BlockRefusal for a norm that cannot be fused as it stands."""
    p = ix.producer.get(t)
    if p is None:
        return None
    n = ix.node(p)
    if n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type in NORM_OPS:
        return _norm_op(ix, p, width)
    layernorm = _decomposed_layernorm(ix, p, width) if n.op_type in ("Add", "Mul", "Div") else None
    if layernorm is not None:
        return layernorm
    if n.op_type in ("Mul", "Div"):
        return _decomposed_rms(ix, p, width)
    cast = _norm_cast(ix, t)
    q = None if cast is None else _producer(ix, n.input[0], ("Mul", "Div"))
    return None if q is None else _decomposed_rms(ix, q, width, trailing=cast)


def _norm_feeds_only(ix: GraphIndex, norm: NormMatch, entries: set[int], shape_readers: bool) -> None:
    """The normalised tensor feeds the chain alone (and, with `shape_readers`, Shape nodes whose results
    only become Reshape shapes: the caller checks that those go with the chain)."""
    t = norm.output
    if t in ix.graph_outputs:
        raise BlockRefusal(f"the normalised tensor '{t}' is also a graph output")
    others = [u for u in ix.users(t) if u not in entries
              and not (shape_readers and shape_reader(ix, u))]
    if others:
        names = ", ".join(ix.describe(u) for u in others[:3]) + (", ..." if len(others) > 3 else "")
        raise BlockRefusal(f"the normalised tensor '{t}' also feeds {names}")


# -- the residual behind ------------------------------------------------------------------------------

def _residual_add(ix: GraphIndex, out: str) -> tuple[int, str] | None:
    """(the Add, its other operand) when out's only reader is an Add of out and a non-constant tensor."""
    users = ix.users(out)
    if out in ix.graph_outputs or len(users) != 1:
        return None
    a = users[0]
    n = ix.node(a)
    if n.op_type != "Add" or n.domain not in ("", "ai.onnx") or len(n.input) != 2 or n.input[0] == n.input[1]:
        return None
    other = n.input[1] if n.input[0] == out else n.input[0]
    return None if ix.const(other) is not None else (a, other)


def _same_shape(ix: GraphIndex, a: str, b: str) -> bool:
    """Whether the shapes of a and b may be equal: the same rank, no two known sizes that differ. Two
    symbolic sizes of different names may be equal: a chain keeps its input's leading dims (regroup
    ends check theirs), and shape inference names fresh 'unk__N' dims behind a Split (Phi-3's chunked
    gated layer, TorchScript exporter) that are its input's again."""
    sa, sb = ix.shapes.get(a), ix.shapes.get(b)
    if sa is None or sb is None:
        return True  # unknown: the widths were checked; ORT checks the rest at run time
    return len(sa) == len(sb) and all(not isinstance(u, int) or not isinstance(v, int) or u == v
                                      for u, v in zip(sa, sb))


def _check_residual(ix: GraphIndex, add: int, other: str, out: str, block_in: str, skipped: BlockRefusal | None,
                    k0: int, n_last: int) -> None:
    what = f"feeds {ix.describe(add)}, not a residual of the block"
    if other != block_in:
        if skipped is not None and other == skipped.norm_input:
            raise BlockRefusal(f"{what}: it adds '{other}', the input of the {skipped.label} in front, "
                               "which is not fused with the chain")
        raise BlockRefusal(f"{what}: it adds '{other}', not the block's input '{block_in}'")
    if k0 != n_last:
        raise BlockRefusal(f"{what}: the block's input '{block_in}' has {k0} features and its output {n_last} "
                           "(in != out width)")
    if not _same_shape(ix, out, block_in):
        raise BlockRefusal(f"{what}: shapes differ ({ix.shapes.get(out)} and {ix.shapes.get(block_in)}), "
                           "the Add broadcasts")


# -- both ---------------------------------------------------------------------------------------------

def find_block(ix: GraphIndex, first_input: str, entries: set[int], out: str, k0: int, n_last: int,
               refused: str | None = None, shape_readers: bool = False) -> Block:
    """The norm in front of a chain (whose first layer's input is `first_input`, read by the nodes
    `entries`) and the residual Add behind it (its output `out`). `refused`: the reason, with `{what}`
    for the norm or the residual (spec.BLOCK_NO_CUDA, library.block_refusal), when the library cannot fuse
    this chain's (they stay stock ops and say so). `shape_readers`: the normalised tensor may also be
    read by Shape nodes computing Reshape shapes (the caller checks they go with the chain)."""
    block = Block()
    skipped = None  # the refusal of a norm that is there and not taken
    try:
        norm = match_norm(ix, first_input, k0)
        if norm is not None and refused is not None:
            raise BlockRefusal(refused.format(what=f"{norm.label} in front"), norm.input, norm.label)
        if norm is not None:
            try:
                _norm_feeds_only(ix, norm, entries, shape_readers)
            except BlockRefusal as r:
                raise BlockRefusal(str(r), norm.input, norm.label) from None
        block.norm = norm
    except BlockRefusal as r:
        skipped = r
        p = ix.producer[first_input]
        block.start_reason = f"input '{first_input}' comes from {ix.describe(p)}: {r}"
    block_in = block.norm.input if block.norm is not None else first_input
    found = _residual_add(ix, out)
    if found is None:
        _take_input_cast(ix, block)
        return block
    add, other = found
    cast = None if block.norm is None else same_type_cast(ix, block_in)
    if cast is not None and other == ix.node(cast).input[0]:
        other = block_in   # x.to(x's own type) normalised, x added: the same values
    if refused is not None and other in (block_in, skipped.norm_input if skipped is not None else block_in):
        block.end_reason = f"feeds {ix.describe(add)}: " + refused.format(what="residual Add behind")
        return block
    try:
        _check_residual(ix, add, other, out, block_in, skipped, k0, n_last)
    except BlockRefusal as r:
        block.end_reason = str(r)
        return block
    block.residual, block.output = add, ix.node(add).output[0]
    _take_input_cast(ix, block)
    return block


def residual_of_input(ix: GraphIndex, out: str, x: str, k0: int, n_last: int) -> tuple[int, str] | None:
    """(the Add, its output) where out's only reader adds x, the tensor a chain reads with a per-channel
    scale and shift of it folded into its first layer (input_affine): x + L_n(... L_1(BN(x))), the
    residual block of ResNet-style tabular MLPs (RTDL's ResNet). The fused op's residual adds the row it
    reads, which is x. None where out feeds anything else or the Add would broadcast."""
    found = _residual_add(ix, out)
    if found is None or found[1] != x:
        return None
    try:
        _check_residual(ix, found[0], x, out, x, None, k0, n_last)
    except BlockRefusal:
        return None
    return found[0], ix.node(found[0]).output[0]


def _take_input_cast(ix: GraphIndex, block: Block) -> None:
    """HF's LLaMA-family RMSNorm starts with x.to(float32), a Cast to x's own type in a float32 model that
    the TorchScript exporter keeps and the residual then reads too: the block takes it and reads x."""
    norm = block.norm
    cast = None if norm is None else same_type_cast(ix, norm.input)
    if cast is None or norm.input in ix.graph_outputs:
        return
    inside = set(norm.node_indices) | ({block.residual} if block.residual is not None else set())
    if set(ix.users(norm.input)) <= inside:
        norm.input = ix.node(cast).input[0]
        norm.node_indices = sorted(norm.node_indices + [cast])


__all__ = ["Block", "BlockRefusal", "NormMatch", "find_block", "match_norm", "residual_of_input"]
