"""Recognise gated layers (GLU family: SwiGLU, GeGLU, ...) as one layer of H outputs.

    Mul(f(x Wg + bg), x Wu + bu)                        two linear layers on the same x   (LLaMA's FFN)
    Mul(f(a), b), (a, b) = Split(x W + b, 2, axis=-1)    one linear layer of 2H outputs    (timm's GluMlp,
                           or a pair of Slices [0:H], [H:2H] of the last axis           torch `chunk`)
        ->  gated layer: y = f(x W'[:, :H] + b'[:H]) * (x W'[:, H:] + b'[H:]),  W' = [Wg | Wu]  [K, 2H]

f is any activation `activations.match_activation` accepts, on either operand (either half: the gate's
columns are put first); with none it is the bilinear GLU, f = x. The Mul's operands may be in either order.
What follows the product (more layers, activations, gated layers) is the chain's business (chains.py).

`find_gated` returns the matches and, for each Mul or split that looks like a gated layer and is not one,
a one-line reason for the layers that feed it (the two linear layers read different inputs, the halves
are unequal, an activation on both operands, a value that other nodes also read, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import expr as ex
from .activations import Activation, describe_expr, match_activation
from .constants import GraphIndex, default_opset
from .linear import LinearLayer

# Integer ops the exporters use to compute a chunk's Slice bounds from the tensor's shape
# (dynamo=False: Shape -> Gather -> Add -> Div -> Mul); evaluated statically by `_static_ints`.
_SHAPE_OPS = ("Shape", "Gather", "Add", "Sub", "Mul", "Div", "Unsqueeze", "Squeeze", "Concat", "Cast", "Identity")
MIN_OPSET = 10  # the fallback body slices the 2H-wide product with Slice(x, starts, ends, axes) inputs


class GatedRefusal(Exception):
    """A Mul/split shaped like a gated layer that is not one; the message is the reason."""


@dataclass
class GatedMatch:
    layers: list[int]        # starts of the linear layers it takes in (two, or one of 2H outputs)
    linear: LinearLayer      # weight [K, 2H], gate columns first; bias [2H] or None
    activation: Activation   # f on the gate; node_indices: every node but the linear layers'; output: the product
    entries: list[int]       # the nodes that read the input x (what a previous layer must feed, and only them)
    mul: int                 # the Mul node


def fed_node(ix: GraphIndex, t: str) -> int:
    """The node a gated layer's part `t` feeds, for reasons: the Mul, Split or Slice among its users."""
    users = ix.users(t)
    return next((u for u in users if ix.node(u).op_type in ("Mul", "Split", "Slice")), users[0])


def _is_identity(a: Activation) -> bool:
    return a.expr == ex.identity()


def _only_user(ix: GraphIndex, t: str, mul: int, role: str) -> None:
    users = ix.users(t)
    if t in ix.graph_outputs:
        raise GatedRefusal(f"the {role} '{t}' is also a graph output")
    if users != [mul]:
        others = ", ".join(ix.describe(u) for u in users if u != mul)
        raise GatedRefusal(f"the {role} '{t}' also feeds {others}")


def _merge(gate: LinearLayer, up: LinearLayer, nodes: list[int], keys: list[str]) -> LinearLayer:
    """[Wg | Wu] and [bg | bu] (a missing bias is zeros; none at all stays None)."""
    w = np.ascontiguousarray(np.concatenate([gate.weight, up.weight], axis=1), dtype=np.float32)
    bias = None
    if gate.bias is not None or up.bias is not None:
        h = gate.out_features
        bias = np.concatenate([gate.bias if gate.bias is not None else np.zeros(h, np.float32),
                               up.bias if up.bias is not None else np.zeros(h, np.float32)]).astype(np.float32)
    return LinearLayer(w, bias, keys, gate.input, "", gate.op, nodes)


def _pick_gate(a0: Activation, a1: Activation, names: tuple[str, str]) -> int:
    """0 or 1: the operand that carries the activation (0 when neither: the bilinear GLU)."""
    if not _is_identity(a0) and not _is_identity(a1):
        raise GatedRefusal(f"both operands have an activation ({describe_expr(a0.expr)} on '{names[0]}', "
                           f"{describe_expr(a1.expr)} on '{names[1]}'); a gated layer activates one")
    return 1 if not _is_identity(a1) else 0


def _product(ix: GraphIndex, mul: int, gate_act: Activation, inner: list[int], width: int) -> Activation:
    """The gated layer's activation record: f of the gate, every non-linear node (`inner`, the Mul, and
    Identity/Dropout/no-op Casts after the product, which change nothing), the output."""
    out = ix.node(mul).output[0]
    post = match_activation(ix, out, width)
    nodes = set(inner) | {mul}
    rejected = {}
    if post.node_indices and _is_identity(post):
        nodes |= set(post.node_indices)
        out, rejected = post.output, post.rejected
    elif post.node_indices:
        first = min(post.node_indices)
        rejected = {first: f"{ix.describe(first)}: an activation after a gated layer's product is not fused yet"}
    else:
        rejected = post.rejected
    order = sorted(nodes)
    return Activation(gate_act.expr, order, [ix.keys[i] for i in order], out, rejected)


# -- form (a): two linear layers ---------------------------------------------------------------------

def _two_linears(ix: GraphIndex, mul: int, l0, l1) -> GatedMatch:
    """l0, l1: the layers (with .linear, .act, .start, .entries) whose activation outputs are the Mul's
    operands."""
    a0, a1 = l0.act, l1.act
    for a in (a0, a1):
        _only_user(ix, a.output, mul, "operand")
    if l0.linear.input != l1.linear.input:
        raise GatedRefusal(f"the two linear layers read different inputs ('{l0.linear.input}' and "
                           f"'{l1.linear.input}')")
    if l0.linear.out_features != l1.linear.out_features:
        raise GatedRefusal(f"the two linear layers have different widths ({l0.linear.out_features} and "
                           f"{l1.linear.out_features})")
    g = _pick_gate(a0, a1, (a0.output, a1.output))
    gate, up = (l0, l1) if g == 0 else (l1, l0)
    idx = sorted(gate.linear.node_indices + up.linear.node_indices)
    linear = _merge(gate.linear, up.linear, idx, [ix.keys[i] for i in idx])
    inner = list(gate.act.node_indices) + list(up.act.node_indices)
    act = _product(ix, mul, gate.act, inner, gate.linear.out_features)
    linear.output = act.output
    # (a layer with a LoRA branch folded in has its input read by the branch too: chains' entries)
    return GatedMatch([l0.start, l1.start], linear, act, sorted(set(l0.entries) | set(l1.entries)), mul)


# -- form (b): one linear layer of 2H outputs, cut in two --------------------------------------------

@dataclass
class _Cut:
    halves: tuple[str, str]       # [0:H0] and [H0:H0+H1] of the last axis
    sizes: tuple[int, int]
    nodes: list[int]              # the Split, or the two Slices and the shape arithmetic of their bounds
    problem: str = ""             # why it is not an even cut of the last axis ('' = it is)


def _static_ints(ix: GraphIndex, name: str, depth: int = 0) -> tuple[np.ndarray | None, list[int]]:
    """(value of an integer tensor as an object array, unknown entries None; the nodes computed).
    Constants, Shape of a tensor whose shape is (partly) known, and the arithmetic of _SHAPE_OPS."""
    c = ix.const(name)
    if c is not None:
        return np.asarray(c).astype(object), []
    p = ix.producer.get(name)
    if p is None or depth > 12:
        return None, []
    n = ix.node(p)
    if n.domain not in ("", "ai.onnx") or n.op_type not in _SHAPE_OPS:
        return None, []
    if n.op_type == "Shape":
        shape = ix.shapes.get(n.input[0])
        if shape is None:
            return None, []
        dims = [d if isinstance(d, int) and d > 0 else None for d in shape]
        start, end = ix.attr(p, "start", 0), ix.attr(p, "end", None)
        return np.array(dims[start:end], dtype=object), [p]
    vals, nodes = [], [p]
    for i in n.input:
        if not i:
            vals.append(None)
            continue
        v, sub = _static_ints(ix, i, depth + 1)
        if v is None:
            return None, []
        vals.append(v)
        nodes += sub
    x = vals[0]
    op = n.op_type
    try:
        if op in ("Identity", "Cast"):
            return x, nodes
        if op == "Gather":
            return np.take(x, np.asarray(vals[1], dtype=np.int64), axis=int(ix.attr(p, "axis", 0))), nodes
        if op in ("Unsqueeze", "Squeeze"):
            axes = ix.attr(p, "axes") or ([int(a) for a in vals[1]] if len(vals) > 1 and vals[1] is not None else [])
            if op == "Squeeze":
                return (np.squeeze(x, axis=tuple(axes)) if axes else np.squeeze(x)), nodes
            for a in sorted(int(a) % (x.ndim + len(axes)) for a in axes):
                x = np.expand_dims(x, a)
            return x, nodes
        if op == "Concat":
            return np.concatenate([np.atleast_1d(v) for v in vals], axis=int(ix.attr(p, "axis", 0))), nodes
        fn = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
              "Div": lambda a, b: int(a / b) if b else None}[op]
        both = np.frompyfunc(lambda a, b: None if a is None or b is None else fn(a, b), 2, 1)
        return np.asarray(both(x, vals[1]), dtype=object), nodes
    except Exception:  # noqa: BLE001 - anything unexpected: not a static bound
        return None, []



def _split_cut(ix: GraphIndex, t: str, s: int, width: int) -> _Cut | None:
    n = ix.node(s)
    outs = list(n.output)
    if len(outs) != 2 or not all(outs):
        return None
    cut = _Cut((outs[0], outs[1]), (0, 0), [s])
    axis = int(ix.attr(s, "axis", 0))
    if not ix.last_axis(t, axis):
        cut.problem = f"{ix.describe(s)} cuts axis {axis}, not the last (feature) axis"
        return cut
    sizes = None
    if len(n.input) > 1 and n.input[1]:
        c = ix.const(n.input[1])
        if c is None:
            cut.problem = f"{ix.describe(s)} has split sizes that are not constant"
            return cut
        sizes = [int(v) for v in np.asarray(c).reshape(-1)]
    elif ix.attr(s, "split") is not None:
        sizes = [int(v) for v in ix.attr(s, "split")]
    else:
        sizes = [(width + 1) // 2, width - (width + 1) // 2]   # equal parts (num_outputs=2: the last smaller)
    cut.sizes = (sizes[0], sizes[1])
    return cut


def _slice_cut(ix: GraphIndex, t: str, slices: list[int], width: int) -> _Cut | None:
    """Two Slices of the last axis of t ([0:H0], [H0:...]) with static bounds, or None."""
    ranges, nodes = [], set(slices)
    for s in slices:
        n = ix.node(s)
        if len(n.input) < 4 or n.input[0] != t:  # opset >= 10 form with explicit axes
            return None
        params = []
        for name in list(n.input[1:4]) + ([n.input[4]] if len(n.input) > 4 and n.input[4] else []):
            v, sub = _static_ints(ix, name)
            if v is None or any(e is None for e in np.asarray(v).reshape(-1)):
                return None
            params.append([int(e) for e in np.asarray(v).reshape(-1)])
            nodes |= set(sub)
        starts, ends, axes = params[:3]
        steps = params[3] if len(params) > 3 else [1]
        if len(axes) != 1 or not ix.last_axis(t, axes[0]) or steps != [1]:
            return None
        lo = min(max(starts[0] + width if starts[0] < 0 else starts[0], 0), width)
        hi = min(max(ends[0] + width if ends[0] < 0 else ends[0], 0), width)
        ranges.append((lo, hi, n.output[0]))
    ranges.sort()
    (lo0, hi0, h0), (lo1, hi1, h1) = ranges
    if lo0 != 0 or hi0 != lo1 or hi1 != width:
        return None
    # The bound arithmetic (Shape of t, ...) goes with the layer: nothing else may read it.
    inner = nodes - set(slices)
    for i in inner:
        for o in ix.node(i).output:
            if o in ix.graph_outputs or any(u not in nodes for u in ix.users(o)):
                return _Cut((h0, h1), (hi0, hi1 - lo1), sorted(nodes),
                            f"the slice bounds are computed by {ix.describe(i)}, which other nodes read too")
    return _Cut((h0, h1), (hi0, hi1 - lo1), sorted(nodes))


def _cut_of(ix: GraphIndex, t: str, width: int) -> _Cut | None:
    """How the layer output t (width columns) is cut in two, if it is: one Split, or two Slices (plus
    Shape nodes reading t for their bounds)."""
    users = ix.users(t)
    ops = [ix.node(u).op_type for u in users]
    if ops == ["Split"]:
        return _split_cut(ix, t, users[0], width)
    slices = [u for u, op in zip(users, ops) if op == "Slice"]
    if len(slices) == 2 and all(op in ("Slice", "Shape") for op in ops):
        cut = _slice_cut(ix, t, slices, width)
        if cut is not None and set(users) <= set(cut.nodes):
            return cut
    return None


def _split_form(ix: GraphIndex, layer) -> GatedMatch | None:
    """The gated layer of `layer`'s output cut in two, or None when its output is not cut in two halves
    that a Mul joins."""
    lin, act = layer.linear, layer.act
    width = lin.out_features
    cut = _cut_of(ix, act.output, width)
    if cut is None:
        return None
    h0, h1 = cut.halves
    a0, a1 = match_activation(ix, h0, cut.sizes[0] or None), match_activation(ix, h1, cut.sizes[1] or None)
    mul = _joining_mul(ix, a0.output, a1.output)
    if mul is None:
        return None
    # From here on it is meant as a gated layer: every refusal says why it is not one.
    if not _is_identity(act):
        raise GatedRefusal(f"the layer's activation ({describe_expr(act.expr)}) comes before the cut; "
                           "a gated layer cuts the linear output")
    if cut.problem:
        raise GatedRefusal(cut.problem)
    if cut.sizes[0] != cut.sizes[1]:
        raise GatedRefusal(f"the halves are unequal ({cut.sizes[0]} and {cut.sizes[1]} of {width} columns)")
    for a in (a0, a1):
        _only_user(ix, a.output, mul, "operand")
    g = _pick_gate(a0, a1, (h0, h1))
    h = width // 2
    w, b = lin.weight, lin.bias
    if g == 1:  # the gate's columns first
        w = np.ascontiguousarray(np.concatenate([w[:, h:], w[:, :h]], axis=1))
        b = None if b is None else np.concatenate([b[h:], b[:h]])
    gate_act = a1 if g == 1 else a0
    inner = cut.nodes + list(a0.node_indices) + list(a1.node_indices) + list(act.node_indices)
    prod = _product(ix, mul, gate_act, inner, h)
    linear = LinearLayer(w, b, list(lin.nodes), lin.input, prod.output, lin.op, list(lin.node_indices))
    return GatedMatch([layer.start], linear, prod, [layer.start], mul)


def _joining_mul(ix: GraphIndex, t0: str, t1: str) -> int | None:
    """The Mul whose operands are t0 and t1 (in either order), if one is."""
    for u in ix.users(t0):
        n = ix.node(u)
        if (n.op_type == "Mul" and n.domain in ("", "ai.onnx") and len(n.input) == 2
                and set(n.input) == {t0, t1} and t0 != t1):
            return u
    return None


# -- both --------------------------------------------------------------------------------------------

def find_gated(ix: GraphIndex, layers: dict) -> tuple[list[GatedMatch], dict[int, str]]:
    """Gated layers over `layers` ({start node: layer with .start, .linear, .act, .entries}, as chains.py found
    them): (matches, {layer start: why its output's Mul or cut is not a gated layer, as a chain end's
    reason}). A layer is in at most one match."""
    matches: list[GatedMatch] = []
    reasons: dict[int, str] = {}
    taken: set[int] = set()
    opset = default_opset(ix.model, MIN_OPSET)
    for start in sorted(layers):
        layer = layers[start]
        try:
            m = _split_form(ix, layer)
        except GatedRefusal as r:
            reasons[start] = f"feeds {ix.describe(fed_node(ix, layer.act.output))}, not a gated layer: {r}"
            continue
        if m is not None:
            matches.append(m)
            taken.add(start)
    by_output = {l.act.output: s for s, l in layers.items() if s not in taken}
    for i, node in enumerate(ix.graph.node):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        s0, s1 = by_output.get(node.input[0]), by_output.get(node.input[1])
        if s0 is None or s1 is None or s0 == s1 or s0 in taken or s1 in taken:
            continue
        try:
            m = _two_linears(ix, i, layers[s0], layers[s1])
        except GatedRefusal as r:
            for s in (s0, s1):
                reasons[s] = f"feeds {ix.describe(i)}, not a gated layer: {r}"
            continue
        matches.append(m)
        taken |= {s0, s1}
    if opset < MIN_OPSET:
        for m in matches:
            for s in m.layers:
                reasons[s] = (f"feeds {ix.describe(fed_node(ix, layers[s].act.output))}, not a gated layer: "
                              f"the model's opset {opset} has no Slice with input bounds, which the stock body "
                              f"of a gated layer needs (opset >= {MIN_OPSET})")
        matches = []
    return matches, reasons


__all__ = ["GatedMatch", "GatedRefusal", "fed_node", "find_gated"]
