"""A small linear head beside a chain, concatenated with the chain's output, rides the chain:

    y = Concat(chain(u), a)        a = p W_a + b_a,   p: a part of the chain's first layer's input u

NeRF's density: `alpha = alpha_linear(h)` reads the trunk's output h, which the view head's first layer also
reads (as part of Concat(h, views), once feature_linear folds in), and the model's output is
`cat([rgb, alpha])`. As its own one-layer chain the head read h again (1 GB of fp32 at 2^20 rows) and a
stock Concat joined the two outputs. Here the head's columns join the chain's layers, so that the chain
writes y itself:

  - every layer without activation (or a chain of one layer): the head's Nh columns are carried through as
    they are: layer 0 computes a beside its outputs, each later layer passes them on by an identity block,
    the last one writes them where the Concat puts them;
  - a first layer with ReLU, later layers ReLU or without activation, the last without: layer 0 computes
    [a, -a] (2 Nh columns; ReLU keeps max(a, 0) and max(-a, 0)), the layers between pass both on (ReLU
    leaves them as they are), and the last writes max(a, 0) - max(-a, 0) = a.

The last layer may have an activation of its own (kwea123's nerf_pl ends its rgb head in a Sigmoid): it
becomes select(own column, f(v), v), so the head's columns come out as they went in. The head's rows in layer
0 are its own weight at the part's rows, zeros elsewhere. The chain's tensor
cores take the carried values as 16-bit operands like every hidden value: the head's outputs come out
rounded to fp16 (2^-11 relative), which the chain's numerics model sees, as it sees every layer. A head
with an activation of its own (nerfstudio's density: exp of a linear layer) gets it on its columns of the
last layer: select(own column, f(v), g(v)). Only heads of at most HEAD_MAX outputs (two columns each
through every layer), not gated, whose output (after its activation) only that Concat (last axis, two
inputs) reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import expr as ex
from .constants import GraphIndex
from .linear import LinearLayer

HEAD_MAX = 16   # outputs of a head that rides a chain (NeRF's density: 1)
CARRY_SHARE = 4  # the columns a head adds to a layer it rides through: at most a quarter of the layer's own
                 # (NeRF: 2 beside 128), so that carrying it costs less than the head's own pass over its input


@dataclass(frozen=True)
class HeadCandidate:
    start: int        # the head layer (find_chains' key: its first node)
    concat: int       # the Concat that joins its output with another tensor
    other: str        # that tensor (a chain's output, if the head rides it)
    first: bool       # the head's output is the Concat's first input
    activation: ex.Expr = ex.X          # the head's own activation (identity: none)
    node_indices: tuple[int, ...] = ()  # its linear layer's and its activation's nodes


@dataclass(frozen=True)
class HeadFold:
    head: LinearLayer
    concat: int       # the Concat, whose output becomes the chain's
    output: str
    offset: int       # the head's input: columns offset..offset+K of the chain's first layer's input
    first: bool       # the head's columns come first in the output
    paired: bool      # [a, -a] through ReLU layers, else a as it is
    activation: ex.Expr = ex.X          # the head's own activation, on its columns of the last layer
    node_indices: tuple[int, ...] = ()  # the head's nodes (linear layer and activation)


def head_candidate(ix: GraphIndex, start: int, linear: LinearLayer, act, plain: bool) -> HeadCandidate | None:
    """The layer `linear` (starting at node `start`) with its activation `act` (activations.Activation) as
    a head, or None: `plain` says it is a chain of one layer by itself (not gated, no LoRA branch)."""
    if not plain or linear.out_features > HEAD_MAX or linear.low_rank or ex.chan_leaves(act.expr):
        return None
    out = act.output
    users = ix.users(out)
    if len(users) != 1 or out in ix.graph_outputs:
        return None
    n = ix.node(users[0])
    if n.op_type != "Concat" or len(n.input) != 2 or n.input[0] == n.input[1]:
        return None
    if not ix.last_axis(out, ix.attr(users[0], "axis", 0)):
        return None
    first = n.input[0] == out
    return HeadCandidate(start, users[0], n.input[1] if first else n.input[0], first, act.expr,
                         tuple(linear.node_indices) + tuple(act.node_indices))


def input_parts(ix: GraphIndex, tensor: str, width: int, replaced: tuple[int, str, int] | None = None
                ) -> list[tuple[str, int]]:
    """(tensor, offset) of what a first layer's input `tensor` ([..., width]) is made of: itself, and the
    inputs of the last-axis Concat that writes it (`replaced`: (position, tensor, width) read in place of
    that Concat's input, a folded layer's input: concat_fold)."""
    parts = [(tensor, 0)]
    node = ix.producer.get(tensor)
    if node is None or ix.node(node).op_type != "Concat" or not ix.last_axis(tensor, ix.attr(node, "axis", 0)):
        return parts
    offset = 0
    for p, name in enumerate(ix.node(node).input):
        w = (ix.shapes.get(name) or [None])[-1]
        if replaced is not None and p == replaced[0]:
            name, w = replaced[1], replaced[2]
        if not isinstance(w, int):
            return parts
        parts.append((name, offset))
        offset += w
    return parts if offset == width else parts[:1]


def carry_mode(activations: list[ex.Expr]) -> bool | None:
    """How a head rides layers with these activations: False (a as it is), True ([a, -a]), None (it cannot).
    The last one's own activation is masked off the head's columns (last_activation), so only the layers
    before it count: none or all without activation, or ReLU first and ReLU or none after it."""
    relu, ident = ex.relu(), ex.identity()
    if ex.chan_leaves(activations[-1]):   # (per-channel constants of the chain's own width)
        return None
    hidden = activations[:-1]
    if all(a == ident for a in hidden):
        return False
    if hidden[0] == relu and all(a in (relu, ident) for a in hidden[1:]):
        return True
    return None


def last_activation(f: ex.Expr, own: int, head: int, first: bool, g: ex.Expr = ex.X) -> ex.Expr:
    """The last layer's activation once the head's columns join it: f on its own columns, the head's own
    activation g (none by default) on the head's."""
    if f == g:
        return f
    mask = [0.0] * head + [1.0] * own if first else [1.0] * own + [0.0] * head
    return ex.Op("select", (ex.Chan(tuple(mask)), f, g))


def carry_fits(hidden_widths: list[int], head: int, paired: bool) -> bool:
    """Whether a head of `head` outputs rides layers of these output widths (all but the last) cheaply:
    its carried columns at most 1/CARRY_SHARE of each."""
    carried = head * (2 if paired else 1)
    return all(carried * CARRY_SHARE <= n for n in hidden_widths)


def apply_head(linears: list[LinearLayer], fold: HeadFold) -> None:
    """The chain's layers (their weights and biases) with the head's columns carried through, in place."""
    h = fold.head
    nh = h.out_features
    w_h = np.zeros((linears[0].in_features, nh), np.float32)
    w_h[fold.offset:fold.offset + h.in_features] = h.weight
    b_h = np.zeros(nh, np.float32) if h.bias is None else h.bias.astype(np.float32)
    if len(linears) == 1:
        _add_columns(linears[0], w_h, b_h, fold.first)
        return
    sign = (1.0, -1.0) if fold.paired else (1.0,)
    carried = nh * len(sign)
    _add_columns(linears[0], np.concatenate([s * w_h for s in sign], axis=1),
                 np.concatenate([s * b_h for s in sign]), False)
    for lin in linears[1:-1]:
        _add_rows(lin, carried)
        _add_columns(lin, np.concatenate([np.zeros((lin.in_features - carried, carried), np.float32),
                                          np.eye(carried, dtype=np.float32)]), np.zeros(carried, np.float32), False)
    last = linears[-1]
    _add_rows(last, carried)
    out = np.zeros((last.in_features, nh), np.float32)
    for k, s in enumerate(sign):   # the last layer writes a (or max(a, 0) - max(-a, 0))
        out[last.in_features - carried + k * nh:last.in_features - carried + (k + 1) * nh] = s * np.eye(nh)
    _add_columns(last, out, np.zeros(nh, np.float32), fold.first)


def _add_rows(lin: LinearLayer, n: int) -> None:
    """`lin` reading n more inputs (zero rows after its own)."""
    lin.weight = np.ascontiguousarray(np.concatenate([lin.weight, np.zeros((n, lin.out_features), np.float32)]))


def _add_columns(lin: LinearLayer, w: np.ndarray, b: np.ndarray, first: bool) -> None:
    """`lin` with columns w (bias b) before (first) or after its own."""
    parts = (w, lin.weight) if first else (lin.weight, w)
    lin.weight = np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)
    if lin.bias is None and not b.any():
        return
    own = np.zeros(lin.out_features - b.size, np.float32) if lin.bias is None else lin.bias
    lin.bias = np.ascontiguousarray(np.concatenate((b, own) if first else (own, b)), dtype=np.float32)
